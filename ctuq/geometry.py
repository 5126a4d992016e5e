"""Scan geometries in physical units, and the one coordinate convention every backend follows.

Lengths are in the unit of the scanner description (mm for walnut data); angles in radians.

Coordinate convention (all of ctuq)
-----------------------------------
World coordinates are right-handed ``(x, y, z)`` in mm; the rotation axis of circular scans is ``z``.

A ``VolumeGeometry`` is an axis-aligned grid of square/cubic pixels centred at ``center``. A 2D image is the
array ``(rows, cols) = (n_y, n_x)`` and a 3D volume ``(slices, rows, cols) = (n_z, n_y, n_x)``; **every index
increases with its coordinate**: pixel ``[i, j]`` has its centre at ``x = x_min + (j + ½)·h``,
``y = y_min + (i + ½)·h`` (3D: ``[k, i, j]`` with ``z = z_min + (k + ½)·h``). So a 2D slice is exactly the
corresponding ``[k]`` slice of a 3D volume (what the walnut ground truth needs). ASTRA's 3D volumes use this
convention; ASTRA's *2D* volumes count rows from the top (``y = y_max − (i + ½)·h``), so 2D ASTRA backends
mirror the geometry in ``y`` (:func:`astra_geometries`) — users never see the difference.

A ``ProjectionGeometry`` is one of ASTRA's kinds (their vector conventions are ASTRA's):

* ``parallel``       2D, ``angles``, ``det_count``, ``det_spacing``
* ``fanflat``        2D, plus ``source_origin`` and ``origin_det`` distances
* ``parallel_vec``   2D, ``vectors`` ``(n_angles, 6)``: ray direction xy, detector centre xy, pixel step u xy
* ``fanflat_vec``    2D, ``vectors`` ``(n_angles, 6)``: source xy, detector centre xy, pixel step u xy
* ``cone_vec``       3D, ``vectors`` ``(n_angles, 12)``: source xyz, detector centre xyz, u step, v step;
                     ``det_shape = (n_rows, n_cols)``; u steps along a row (columns), v from row to row
* ``parallel3d_vec`` 3D, ``vectors`` ``(n_angles, 12)``: ray direction xyz, detector centre, u, v
* ``cone``, ``parallel3d``: ASTRA's angle-based 3D kinds (converted to vectors with :meth:`to_vectors`)

Detector pixel ``k`` (2D) has its centre at ``d + (k − (n_det − 1)/2)·u``; pixel ``(r, k)`` (3D) at
``d + (k − (n_cols − 1)/2)·u + (r − (n_rows − 1)/2)·v``. Sinograms are angle-major: ``(n_angles, n_det)`` or
``(n_angles, n_rows, n_cols)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import astra
import numpy as np

__all__ = ["VolumeGeometry", "ProjectionGeometry", "VEC_COLUMNS", "astra_geometries"]

VEC_COLUMNS = {"fanflat_vec": 6, "cone_vec": 12, "parallel3d_vec": 12, "parallel_vec": 6}
_2D_KINDS = {"parallel", "fanflat", "fanflat_vec", "parallel_vec"}
_3D_KINDS = {"cone_vec", "parallel3d_vec", "cone", "parallel3d"}


@dataclasses.dataclass(frozen=True)
class VolumeGeometry:
    """Pixel/voxel grid.

    Parameters
    ----------
    shape : tuple[int, ...]
        ``(n_y, n_x)`` or ``(n_z, n_y, n_x)``.
    voxel_size : float
        Edge length of one pixel/voxel (mm).
    center : tuple[float, ...]
        World coordinates of the grid centre, ordered like ``shape`` reversed: ``(x, y)`` or ``(x, y, z)`` (mm).
    """

    shape: tuple[int, ...]
    voxel_size: float
    center: tuple[float, ...] | None = None

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if len(shape) not in (2, 3) or min(shape) < 1:
            raise ValueError(f"VolumeGeometry.shape must be 2 or 3 positive ints, got {self.shape}")
        if not (self.voxel_size > 0 and math.isfinite(self.voxel_size)):
            raise ValueError(f"VolumeGeometry.voxel_size must be positive and finite, got {self.voxel_size}")
        center = (0.0,) * len(shape) if self.center is None else tuple(float(c) for c in self.center)
        if len(center) != len(shape):
            raise ValueError(f"VolumeGeometry.center has {len(center)} entries; shape {shape} needs {len(shape)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "center", center)
        object.__setattr__(self, "voxel_size", float(self.voxel_size))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def extent(self) -> list[tuple[float, float]]:
        """``[(min_x, max_x), (min_y, max_y)(, (min_z, max_z))]`` in mm."""
        sizes = self.shape[::-1]  # x, y, (z)
        return [(c - n * self.voxel_size / 2.0, c + n * self.voxel_size / 2.0) for c, n in zip(self.center, sizes)]

    def pixel_centers(self) -> tuple[np.ndarray, ...]:
        """1D arrays of pixel-centre coordinates (mm) per array axis: ``(y, x)`` or ``(z, y, x)``.

        ``np.meshgrid(*self.pixel_centers(), indexing="ij")`` gives the coordinates of every pixel.
        """
        ext = self.extent()[::-1]  # array-axis order: (z,) y, x
        return tuple(lo + (np.arange(n) + 0.5) * self.voxel_size for (lo, _), n in zip(ext, self.shape))

    def to_astra(self) -> dict:
        """ASTRA volume geometry dict in ASTRA's own convention (see :func:`astra_geometries` for ctuq's)."""
        ext = self.extent()
        if self.ndim == 2:
            (x0, x1), (y0, y1) = ext
            return astra.create_vol_geom(self.shape[0], self.shape[1], x0, x1, y0, y1)
        (x0, x1), (y0, y1), (z0, z1) = ext
        nz, ny, nx = self.shape
        return astra.create_vol_geom(ny, nx, nz, x0, x1, y0, y1, z0, z1)

    def coarsened(self, shape: Sequence[int]) -> VolumeGeometry:
        """Same field of view sampled on a coarser (or finer) square grid ``shape``.

        The field of view of a square grid is kept; ``shape`` must keep the aspect ratio.
        """
        shape = tuple(int(s) for s in shape)
        if len(shape) != self.ndim:
            raise ValueError(f"coarsened: shape {shape} has {len(shape)} axes, volume has {self.ndim}")
        factors = {self.shape[i] / shape[i] for i in range(self.ndim)}
        if max(factors) - min(factors) > 1e-9:
            raise ValueError(f"coarsened: shape {shape} changes the aspect ratio of {self.shape}")
        return VolumeGeometry(shape, self.voxel_size * factors.pop(), self.center)


@dataclasses.dataclass(frozen=True)
class ProjectionGeometry:
    """Acquisition geometry; see the module docstring for the kinds.

    ``det_shape`` is ``(n_det,)`` in 2D and ``(n_rows, n_cols)`` in 3D.
    """

    kind: str
    det_shape: tuple[int, ...]
    angles: np.ndarray | None = None
    det_spacing: float | tuple[float, float] | None = None
    source_origin: float | None = None
    origin_det: float | None = None
    vectors: np.ndarray | None = None

    def __post_init__(self):
        if self.kind not in _2D_KINDS | _3D_KINDS:
            raise ValueError(f"ProjectionGeometry.kind {self.kind!r} unknown; valid: {sorted(_2D_KINDS | _3D_KINDS)}")
        det_shape = tuple(int(s) for s in np.atleast_1d(self.det_shape))
        want = 1 if self.kind in _2D_KINDS else 2
        if len(det_shape) != want or min(det_shape) < 1:
            raise ValueError(
                f"ProjectionGeometry({self.kind}).det_shape must have {want} positive entries, got {det_shape}"
            )
        object.__setattr__(self, "det_shape", det_shape)
        if self.kind in VEC_COLUMNS:
            if self.vectors is None:
                raise ValueError(f"ProjectionGeometry({self.kind}) needs vectors")
            vec = np.asarray(self.vectors, dtype=np.float64)
            if vec.ndim != 2 or vec.shape[1] != VEC_COLUMNS[self.kind] or vec.shape[0] < 1:
                raise ValueError(
                    f"ProjectionGeometry({self.kind}).vectors must be (n_angles, {VEC_COLUMNS[self.kind]}), "
                    f"got {vec.shape}"
                )
            if not np.all(np.isfinite(vec)):
                raise ValueError(f"ProjectionGeometry({self.kind}).vectors contain NaN or Inf")
            object.__setattr__(self, "vectors", vec)
            if self.angles is None:
                object.__setattr__(self, "angles", _vector_angles(self.kind, vec))
        if self.angles is None:
            raise ValueError(f"ProjectionGeometry({self.kind}) needs angles")
        ang = np.asarray(self.angles, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(ang)):
            raise ValueError(f"ProjectionGeometry({self.kind}).angles contain NaN or Inf")
        object.__setattr__(self, "angles", ang)
        if self.kind in ("fanflat", "cone") and (self.source_origin is None or self.origin_det is None):
            raise ValueError(f"ProjectionGeometry({self.kind}) needs source_origin and origin_det (mm)")
        if self.kind not in VEC_COLUMNS and self.det_spacing is None:
            raise ValueError(f"ProjectionGeometry({self.kind}) needs det_spacing (mm)")

    @property
    def ndim(self) -> int:
        return 2 if self.kind in _2D_KINDS else 3

    @property
    def n_angles(self) -> int:
        return int(len(self.angles))

    @property
    def measurement_shape(self) -> tuple[int, ...]:
        """Angle-major sinogram shape: ``(n_angles, n_det)`` or ``(n_angles, n_rows, n_cols)``."""
        return (self.n_angles, *self.det_shape)

    def subset(self, angle_indices: Sequence[int]) -> ProjectionGeometry:
        """The same geometry restricted to (and reordered by) ``angle_indices``."""
        idx = np.asarray(angle_indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            raise ValueError("subset: empty list of angle indices")
        if idx.min() < -self.n_angles or idx.max() >= self.n_angles:
            raise IndexError(f"subset: angle index out of range for {self.n_angles} angles: {idx.min()}..{idx.max()}")
        return dataclasses.replace(
            self,
            angles=self.angles[idx],
            vectors=None if self.vectors is None else self.vectors[idx],
        )

    @property
    def is_vector(self) -> bool:
        """Whether the geometry is given by per-angle vectors."""
        return self.kind in VEC_COLUMNS

    @property
    def is_parallel(self) -> bool:
        """Parallel-beam (rays share a direction per angle) rather than divergent (fan/cone) beam."""
        return self.kind in ("parallel", "parallel_vec", "parallel3d", "parallel3d_vec")

    def to_vectors(self) -> ProjectionGeometry:
        """The same geometry as a vector kind (``parallel_vec``, ``fanflat_vec``, ``cone_vec``,
        ``parallel3d_vec``), by ASTRA's own conversion (``astra.geom_2vec``); vector kinds return ``self``."""
        if self.is_vector:
            return self
        vec = np.asarray(astra.geom_2vec(self.to_astra())["Vectors"], dtype=np.float64)
        kind = {
            "parallel": "parallel_vec",
            "fanflat": "fanflat_vec",
            "cone": "cone_vec",
            "parallel3d": "parallel3d_vec",
        }[self.kind]
        return ProjectionGeometry(kind, self.det_shape, angles=self.angles, vectors=vec)

    def detector_centers(self) -> np.ndarray:
        """World coordinates (mm) of every detector pixel centre: ``(n_angles, n_det, 2)`` in 2D,
        ``(n_angles, n_rows, n_cols, 3)`` in 3D."""
        vec = self.to_vectors().vectors
        if self.ndim == 2:
            d, u = vec[:, 2:4], vec[:, 4:6]
            k = np.arange(self.det_shape[0]) - (self.det_shape[0] - 1) / 2.0
            return d[:, None, :] + k[None, :, None] * u[:, None, :]
        d, u, v = vec[:, 3:6], vec[:, 6:9], vec[:, 9:12]
        r = np.arange(self.det_shape[0]) - (self.det_shape[0] - 1) / 2.0
        k = np.arange(self.det_shape[1]) - (self.det_shape[1] - 1) / 2.0
        return (
            d[:, None, None, :]
            + k[None, None, :, None] * u[:, None, None, :]
            + r[None, :, None, None] * v[:, None, None, :]
        )

    def sources(self) -> np.ndarray:
        """Source positions ``(n_angles, ndim)`` (mm) of a fan/cone geometry."""
        if self.is_parallel:
            raise ValueError(f"ProjectionGeometry({self.kind}) is parallel-beam: it has ray directions, not sources")
        return self.to_vectors().vectors[:, : self.ndim].copy()

    def ray_directions(self) -> np.ndarray:
        """Ray direction per angle ``(n_angles, ndim)`` of a parallel-beam geometry (ASTRA's, not normalised)."""
        if not self.is_parallel:
            raise ValueError(f"ProjectionGeometry({self.kind}) is divergent-beam: rays differ per pixel")
        return self.to_vectors().vectors[:, : self.ndim].copy()

    def to_astra(self) -> dict:
        """ASTRA projection geometry dict in ASTRA's own convention (see :func:`astra_geometries`)."""
        k = self.kind
        if k == "parallel":
            return astra.create_proj_geom("parallel", float(self.det_spacing), self.det_shape[0], self.angles)
        if k == "fanflat":
            return astra.create_proj_geom(
                "fanflat",
                float(self.det_spacing),
                self.det_shape[0],
                self.angles,
                float(self.source_origin),
                float(self.origin_det),
            )
        if k in ("fanflat_vec", "parallel_vec"):
            return astra.create_proj_geom(k, self.det_shape[0], self.vectors)
        if k in ("cone_vec", "parallel3d_vec"):
            return astra.create_proj_geom(k, self.det_shape[0], self.det_shape[1], self.vectors)
        if k == "cone":
            sv, su = _pair(self.det_spacing)
            return astra.create_proj_geom(
                "cone",
                su,
                sv,
                self.det_shape[0],
                self.det_shape[1],
                self.angles,
                float(self.source_origin),
                float(self.origin_det),
            )
        sv, su = _pair(self.det_spacing)
        return astra.create_proj_geom("parallel3d", su, sv, self.det_shape[0], self.det_shape[1], self.angles)


def astra_geometries(volume: VolumeGeometry, geometry: ProjectionGeometry) -> tuple[dict, dict]:
    """ASTRA ``(vol_geom, proj_geom)`` dicts that realise ctuq's coordinate convention (module docstring).

    3D: passed through. 2D: ASTRA counts image rows from the top, so the world is mirrored in ``y`` (the volume
    centre and every vector's ``y`` component are negated; line integrals are unchanged by a reflection) and
    the geometry is given in vector form. An array in ctuq's convention can then be handed to ASTRA unchanged.
    """
    if volume.ndim != geometry.ndim:
        raise ValueError(
            f"volume is {volume.ndim}D (shape {volume.shape}) but the projection geometry {geometry.kind!r} is "
            f"{geometry.ndim}D"
        )
    if volume.ndim == 3:
        return volume.to_astra(), geometry.to_astra()
    cx, cy = volume.center
    mirrored_vol = VolumeGeometry(volume.shape, volume.voxel_size, (cx, -cy))
    vec = geometry.to_vectors().vectors.copy()
    vec[:, 1::2] *= -1.0  # y components of (source|ray, detector centre, u)
    kind = geometry.to_vectors().kind
    return mirrored_vol.to_astra(), astra.create_proj_geom(kind, geometry.det_shape[0], vec)


def _pair(v) -> tuple[float, float]:
    a = np.atleast_1d(np.asarray(v, dtype=np.float64))
    return (float(a[0]), float(a[-1]))


def _vector_angles(kind: str, vec: np.ndarray) -> np.ndarray:
    """Angle of the source (or ray direction) about the z axis, unwrapped, for plotting and logs."""
    if kind == "parallel3d_vec" or kind == "parallel_vec":
        x, y = vec[:, 0], vec[:, 1]
    else:
        # source minus detector centre points from the detector towards the source
        x, y = (
            vec[:, 0] - vec[:, 2 if kind == "fanflat_vec" else 3],
            vec[:, 1] - vec[:, 3 if kind == "fanflat_vec" else 4],
        )
    return np.unwrap(np.arctan2(y, x))
