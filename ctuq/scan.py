"""A CT scan as a Python object: :class:`Scan` (``ctuq.Scan``) and :func:`load_scan` (``ctuq.load_scan``).

A :class:`Scan` is an opened scan of any registered format (a walnut folder, a ``scan.yaml``, an NXtomo file: what
``--data`` reads) or a user's arrays with their ASTRA geometry (:meth:`Scan.from_astra`, or CIL's
``AcquisitionData`` with :meth:`Scan.from_cil`). It knows its geometry, its angles, its ground truth where there is
one and which angles a run holds out (:meth:`Scan.subset`); :func:`ctuq.reconstruct` reconstructs it.

Arrays given to :meth:`Scan.from_astra` are written once, as they are, into a private ``scan.yaml`` folder (line
integrals as ``.npy``, the ASTRA vectors as text with every digit) and read back through the ``scan.yaml`` reader:
so a scan given as arrays and the same scan saved with :meth:`Scan.save` and read by ``ctuq reconstruct --data``
are one scan, bit for bit.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ctuq.data.astra_geometry import AstraGeometryError, from_astra, save_astra_vectors
from ctuq.data.formats import open_scan
from ctuq.data.loader import load_slice, load_volume
from ctuq.data.scan_file import LENGTH_FACTORS, write_scan_file
from ctuq.data.source import ScanSource, SubsetSource
from ctuq.errors import DataError, OutDirError
from ctuq.geometry import ProjectionGeometry
from ctuq.options import LengthUnit, MeasurementKind, ScanGeometry, values

__all__ = ["Scan", "load_scan"]

_SCAN_FILE = "scan.yaml"
_KINDS_2D = {"parallel": "parallel_vec", "fanflat": "fanflat_vec", "parallel_vec": None, "fanflat_vec": None}
_KINDS_3D = {"parallel3d": "parallel3d_vec", "cone": "cone_vec", "parallel3d_vec": None, "cone_vec": None}


def load_scan(path: str | Path, *, orbit: int = 2) -> Scan:
    """The scan at ``path``: a walnut-layout folder, a ``scan.yaml`` (or a folder holding one), an NXtomo file, or
    any registered format (:data:`ctuq.registry.DATA_FORMATS`), as ``ctuq reconstruct --data PATH`` reads it.
    ``orbit`` (1, 2, 3) picks the walnut data set's source height; other formats hold one orbit. Only the
    geometry and the headers are read; pixels are read when a run loads the scan. Raises the format's one-line
    error naming the file at fault, ``FileNotFoundError`` naming ``path`` when there is nothing there."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"load_scan: {str(path)!r}: no such scan folder or file")
    _fmt, source = open_scan(path, orbit)
    return Scan(source, origin=str(path))


class Scan:
    """A CT scan: measurements, geometry, angles, and the ground truth where there is one (module docstring).

    Make one with :func:`load_scan` (a file or folder), :meth:`from_astra` (arrays and ASTRA geometry dicts) or
    :meth:`from_cil`; pick the measured angles with :meth:`subset`; reconstruct it with :func:`ctuq.reconstruct`.

    Attributes
    ----------
    source : ScanSource
        The opened scan (``ctuq.data.ScanSource``): what the loader reads.
    origin : str
        Where it came from (a path, or ``"arrays (Scan.from_astra)"``).
    """

    def __init__(self, source: ScanSource, *, origin: str, folder: Path | None = None, parent: Scan | None = None):
        self.source = source
        self.origin = origin
        self._folder = folder  # the scan.yaml folder behind a scan given as arrays (removed with the last user)
        self._parent = parent  # a subset keeps its scan (and so that folder) alive

    # ------------------------------------------------------------------------------------------ makers
    @classmethod
    def from_astra(
        cls,
        projections,
        proj_geom: dict,
        vol_geom: dict,
        ground_truth=None,
        *,
        units: str = "mm",
        voxel_size: float | None = None,
        variances=None,
    ) -> Scan:
        """A scan from a sinogram and its ASTRA geometry (numpy arrays or torch tensors, ASTRA's axis order).

        Parameters
        ----------
        projections : array
            Line integrals (dimensionless, ``−log(I/I₀)``): 2D geometries ``(n_angles, n_det)``; 3D ones
            ``(n_rows, n_angles, n_cols)`` (ASTRA's ``data3d`` order).
        proj_geom : dict
            ASTRA projection geometry: ``parallel``, ``fanflat``, ``parallel_vec``, ``fanflat_vec`` (2D) or
            ``parallel3d``, ``cone``, ``parallel3d_vec``, ``cone_vec`` (3D), as ``astra.create_proj_geom`` makes it.
        vol_geom : dict
            ASTRA volume geometry (``astra.create_vol_geom``), centred on the origin; its voxels must be cubic.
        ground_truth : array, optional
            The true image on ``vol_geom``'s grid (``(rows, cols)`` or ``(slices, rows, cols)``), in attenuation per
            the geometry's length unit; converted to mm⁻¹. A run's images (``Run.images``, ``Run.std``) come in
            this array order (ASTRA's: a 2D image's row 0 at the top). :attr:`angles` says how ctuq's angles
            relate to the geometry's.
        units : {"mm", "cm", "m", "um"}
            The length unit of the ASTRA geometry (ASTRA has none). Default mm: a geometry in pixel units then has
            1 mm pixels.
        voxel_size : float, optional
            Instead of ``units``: the voxel edge of ``vol_geom`` in mm (the geometry is scaled so that it is).
        variances : array, optional
            Per-ray variances of ``projections`` (same shape; data units²): enables ``uq.noise = per_ray``.

        Raises
        ------
        DataError
            One line naming the argument: an unknown geometry type, a shape that does not match the geometry,
            non-finite values, an off-centre or non-cubic volume, a bad unit.
        """
        arrays = _AstraArrays.check(projections, proj_geom, vol_geom, ground_truth, units, voxel_size, variances)
        folder = Path(tempfile.mkdtemp(prefix="ctuq-scan-"))
        try:
            arrays.write(folder)
            source = _open_written(folder / _SCAN_FILE)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        scan = cls(source, origin="arrays (Scan.from_astra)", folder=folder)
        weakref.finalize(scan, shutil.rmtree, folder, True)
        return scan

    @classmethod
    def from_cil(cls, data, ground_truth=None, *, voxel_size: float | None = None) -> Scan:
        """A scan from CIL's ``AcquisitionData`` (line integrals) through CIL's ASTRA plugin geometry conversion;
        ``ground_truth`` an ``ImageData`` or array on the plugin's volume grid. CIL's lengths are taken as mm unless
        ``voxel_size`` (mm) is given. Needs ``cil`` with its ASTRA plugin (``ImportError`` otherwise)."""
        try:
            from cil.plugins.astra.utilities import convert_geometry_to_astra
        except ImportError as exc:
            raise ImportError(f"Scan.from_cil needs CIL with its ASTRA plugin ({exc})") from None
        geometry = data.geometry
        vol_geom, proj_geom = convert_geometry_to_astra(geometry.get_ImageGeometry(), geometry)
        arr = data.copy()
        arr.reorder("astra")
        truth = None if ground_truth is None else np.asarray(getattr(ground_truth, "as_array", lambda: ground_truth)())
        return cls.from_astra(arr.as_array(), proj_geom, vol_geom, truth, voxel_size=voxel_size)

    # ------------------------------------------------------------------------------------------ facts
    @property
    def geometry_type(self) -> str:
        """``"parallel"``, ``"fan"`` or ``"cone"``."""
        return str(self.source.geometry_type)

    @property
    def detector_shape(self) -> tuple[int, int]:
        """``(rows, columns)`` of the detector."""
        return tuple(int(n) for n in self.source.det_shape)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """The reconstruction grid ``(n_z, n_y, n_x)`` (one slice for a one-row detector: ``n_z = 1``)."""
        return tuple(int(n) for n in self.source.gt_shape)

    @property
    def voxel_size(self) -> float:
        """The grid's voxel edge (mm)."""
        return float(self.source.voxel_size)

    @property
    def has_ground_truth(self) -> bool:
        return bool(self.source.has_ground_truth)

    @property
    def angles(self) -> np.ndarray:
        """Every distinct projection angle of the scan, degrees in ``[0, 360)``: the source's (or the rays')
        direction about ``z`` in ctuq's frame, which is ASTRA's 3D frame (geometry-row order). ASTRA's 2D frame is
        ctuq's mirrored in ``y`` (its image row 0 is at the top), which reverses the rotation: a 2D ASTRA geometry
        given to :meth:`from_astra` at angle ``θ`` is at ``(180° − θ) mod 360°`` here; a 3D one at ``θ``."""
        rows, _files = self._all_rows()
        s = self.source.vectors[rows]
        return np.degrees(np.arctan2(s[:, 0], -s[:, 1])) % 360.0

    @property
    def is_subset(self) -> bool:
        """Whether :meth:`subset` chose the measured angles."""
        return isinstance(self.source, SubsetSource)

    @property
    def used_angles(self) -> np.ndarray:
        """Indices into :attr:`angles` that a run measures (every angle, unless :meth:`subset` chose; a run's
        ``data.angular_subsampling`` then thins a full scan further)."""
        return np.flatnonzero(np.isin(self._all_rows()[0], self.source.angle_plan(1)[0]))

    @property
    def heldout_angles(self) -> np.ndarray:
        """Indices into :attr:`angles` held out for the held-out check (empty for a full scan: a run holds out the
        angles its ``data.angular_subsampling`` skips)."""
        return np.setdiff1d(np.arange(len(self.angles)), self.used_angles)

    def _all_rows(self) -> tuple[np.ndarray, np.ndarray]:
        base = self.source.base if isinstance(self.source, SubsetSource) else self.source
        return base.angle_plan(1)

    # ------------------------------------------------------------------------------------------ views
    def subset(self, angles) -> Scan:
        """The scan measured at ``angles`` only (indices into :attr:`angles`, or a boolean mask over them); every
        other angle is held out, for the held-out check. A run of a subset uses exactly these angles
        (:func:`ctuq.reconstruct` sets ``data.angular_subsampling = 1``). ``DataError`` naming ``angles`` for
        indices out of range, repeated, or fewer than one."""
        rows = self._all_rows()[0]
        if hasattr(angles, "detach"):  # a torch tensor
            angles = angles.detach().cpu().numpy()
        idx = np.asarray(angles)
        if idx.dtype == bool:
            if idx.shape != rows.shape:
                raise DataError(f"Scan.subset: angles is a mask of shape {idx.shape}; the scan has {len(rows)} angles")
            idx = np.flatnonzero(idx)
        # indices only: a float (an angle in degrees?) must not be truncated into some index
        if idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise DataError(
                f"Scan.subset: angles must be integer indices into Scan.angles (or a boolean mask), got dtype "
                f"{idx.dtype} (angles in degrees? pick their indices in Scan.angles)"
            )
        if idx.ndim > 1:
            raise DataError(f"Scan.subset: angles must be one-dimensional, got shape {idx.shape}")
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size < 1 or idx.min() < 0 or idx.max() >= len(rows) or len(np.unique(idx)) != idx.size:
            raise DataError(
                f"Scan.subset: angles must be distinct indices in 0 … {len(rows) - 1} (at least one), got "
                f"{idx.size} value(s) in {idx.min() if idx.size else '-'} … {idx.max() if idx.size else '-'}"
            )
        base = self.source.base if isinstance(self.source, SubsetSource) else self.source
        return Scan(SubsetSource(base, rows[np.sort(idx)]), origin=self.origin, folder=None, parent=self)

    def load(
        self,
        *,
        angular_subsampling: int = 1,
        detector_subsampling: int = 1,
        image_shape=None,
        slice_index: int | None = None,
        ndim: int = 2,
        backend: str = "sparse",
        device: str = "cpu",
        heldout: bool = True,
        progress: bool = False,
    ):
        """The loaded problem (:class:`ctuq.data.CTData`: operator ``T``, sinogram ``y`` ``(n_angles, n_cols)``
        float32, ground truth in mm⁻¹, held-out rows) of a 2D slice (``ndim = 2``) or a volume (``ndim = 3``, CUDA),
        cut by the loader that ``ctuq reconstruct`` uses; keyword arguments as the ``data`` config keys."""
        shape = None if image_shape is None else tuple(image_shape)
        kwargs = dict(
            angular_subsampling=angular_subsampling,
            detector_subsampling=detector_subsampling,
            image_shape=shape,
            backend=backend,
            device=device,
            progress=progress,
        )
        if ndim == 2:
            return load_slice(self.source, slice_index=slice_index, heldout=heldout, **kwargs)
        return load_volume(self.source, heldout=heldout, **kwargs)

    def save(self, folder: str | Path) -> Path:
        """Write a scan given as arrays as a ``scan.yaml`` folder that ``ctuq reconstruct --data`` (and
        :func:`load_scan`) reads as this very scan, bit for bit; returns the ``scan.yaml`` path. ``folder`` must not
        exist yet or be empty (``OutDirError`` naming it otherwise). A scan opened from a file is already on disk
        (:attr:`origin`; ``DataError``); a subset is saved as its whole scan."""
        scan = self
        while scan._parent is not None:
            scan = scan._parent
        if scan._folder is None:
            raise DataError(f"Scan.save: this scan is already on disk ({self.origin}); use that path")
        folder = Path(folder).expanduser()
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise OutDirError(f"Scan.save: folder {folder} exists and is not an empty folder; give a new or empty one")
        shutil.copytree(scan._folder, folder, dirs_exist_ok=True)
        return folder / _SCAN_FILE

    def __repr__(self) -> str:
        n_all, used = len(self.angles), len(self.used_angles)
        rows, cols = self.detector_shape
        grid = "×".join(str(n) for n in (self.image_shape[1:] if self.image_shape[0] == 1 else self.image_shape))
        held = f"{n_all - used} held out" if self.is_subset else "held-out angles: those data.angular_subsampling skips"
        return (
            f"Scan({self.geometry_type} beam, {used} of {n_all} angles measured ({held}), detector {rows}×{cols}, "
            f"grid {grid} of {self.voxel_size:.4g} mm, {'with' if self.has_ground_truth else 'no'} ground truth, "
            f"{self.source.measurement}; from {self.origin})"
        )


def _open_written(path: Path) -> ScanSource:
    _fmt, source = open_scan(path)
    return source


# --------------------------------------------------------------------------------------------- ASTRA arrays
def _as_array(x, name: str) -> np.ndarray:
    """``x`` (numpy or torch) as a numpy array of floats; ``DataError`` naming ``name`` otherwise."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError):
        raise DataError(f"Scan.from_astra: {name} must be an array, got {type(x).__name__}") from None
    if not np.issubdtype(a.dtype, np.floating) and not np.issubdtype(a.dtype, np.integer):
        raise DataError(f"Scan.from_astra: {name} must hold numbers, got dtype {a.dtype}")
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    bad = ~np.isfinite(a)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise DataError(f"Scan.from_astra: {name} holds {int(bad.sum())} NaN or Inf value(s) (first at {first})")
    return a


class _AstraArrays:
    """Validated :meth:`Scan.from_astra` inputs in ctuq's convention, and their ``scan.yaml`` folder."""

    def __init__(self, kind, geometry, volume, projections, truth, variances, unit, factor):
        self.kind, self.geometry, self.volume = kind, geometry, volume
        self.projections, self.truth, self.variances = projections, truth, variances
        self.unit, self.factor = unit, factor  # the file's unit and mm per unit

    @classmethod
    def check(cls, projections, proj_geom, vol_geom, ground_truth, units, voxel_size, variances) -> _AstraArrays:
        if not isinstance(proj_geom, dict) or not isinstance(vol_geom, dict):
            raise DataError("Scan.from_astra: proj_geom and vol_geom must be ASTRA geometry dicts")
        ptype = proj_geom.get("type")
        if ptype not in _KINDS_2D and ptype not in _KINDS_3D:
            raise DataError(
                f"Scan.from_astra: proj_geom type {ptype!r} is not one ctuq reads; use one of "
                f"{', '.join([*_KINDS_2D, *_KINDS_3D])}"
            )
        if units not in values(LengthUnit):
            raise DataError(f"Scan.from_astra: units must be one of {list(values(LengthUnit))}, got {units!r}")
        try:
            volume, geometry = from_astra(vol_geom, proj_geom)
        except AstraGeometryError as exc:
            raise DataError(f"Scan.from_astra: {exc}") from None
        if any(abs(c) > 1e-9 * volume.voxel_size for c in volume.center):
            raise DataError(
                f"Scan.from_astra: vol_geom's window is centred at {tuple(float(c) for c in volume.center)}, not the "
                "origin; ctuq's grids are centred: shift the geometry (its vectors) instead"
            )
        unit, factor = units, LENGTH_FACTORS[units]
        if voxel_size is not None:
            if not (isinstance(voxel_size, (int, float)) and math.isfinite(voxel_size) and voxel_size > 0):
                raise DataError(f"Scan.from_astra: voxel_size must be a positive number of mm, got {voxel_size!r}")
            unit, factor = LengthUnit.MM.value, float(voxel_size) / volume.voxel_size
        kind = _beam(geometry)
        p = _astra_order(_as_array(projections, "projections"), geometry, "projections")
        var = None
        if variances is not None:
            var = _astra_order(_as_array(variances, "variances"), geometry, "variances")
            if np.any(var <= 0):
                raise DataError(f"Scan.from_astra: variances must be positive; {int((var <= 0).sum())} are ≤ 0")
        truth = None
        if ground_truth is not None:
            truth = _as_array(ground_truth, "ground_truth")
            if truth.shape != tuple(volume.shape):
                raise DataError(
                    f"Scan.from_astra: ground_truth has shape {truth.shape}; vol_geom's grid is {tuple(volume.shape)}"
                )
            truth = truth / LENGTH_FACTORS[units] if voxel_size is None else truth / factor
        return cls(kind, geometry, volume, p, truth, var, unit, factor)

    def write(self, folder: Path) -> None:
        """The ``scan.yaml`` folder of these arrays (lengths in :attr:`unit`; the vectors scaled to it once)."""
        vec = _vectors_12(self.geometry)
        if self.unit == LengthUnit.MM.value and self.factor != 1.0:  # voxel_size given: the geometry in mm
            vec = vec * self.factor
        save_astra_vectors(
            folder / "geometry.txt", ProjectionGeometry(_kind_3d(self.kind), _det(self.geometry), vectors=vec)
        )
        np.save(folder / "projections.npy", self.projections)
        np.save(folder / "angles.npy", np.degrees(np.arctan2(vec[:, 0], -vec[:, 1])) % 360.0)
        rows, cols = _det(self.geometry)
        pixel = float(np.linalg.norm(vec[0, 6:9]))
        scale = self.factor if self.unit == LengthUnit.MM.value else 1.0
        shape = [int(n) for n in self.volume.shape]
        doc: dict[str, Any] = {
            "format": "ctuq-scan-1",
            "units": self.unit,
            "geometry": {"type": self.kind, "vectors": "geometry.txt"},
            "detector": {"rows": rows, "columns": cols, "pixel_size": pixel},
            "angles": {"unit": "degree", "file": "angles.npy"},
            "measurements": {"type": MeasurementKind.LINE_INTEGRALS.value, "projections": "projections.npy"},
            "volume": {"shape": shape, "voxel_size": float(self.volume.voxel_size) * scale},
        }
        if self.variances is not None:
            np.save(folder / "variances.npy", self.variances)
            doc["measurements"]["variances"] = "variances.npy"
        if self.truth is not None:
            np.save(folder / "ground_truth.npy", self.truth)
            doc["ground_truth"] = "ground_truth.npy"
        write_scan_file(folder / _SCAN_FILE, doc)


def _beam(geometry: ProjectionGeometry) -> str:
    """ctuq's beam name of an ASTRA geometry: parallel, fan (2D fan beam) or cone."""
    if geometry.is_parallel:
        return ScanGeometry.PARALLEL.value
    return ScanGeometry.FAN.value if geometry.ndim == 2 else ScanGeometry.CONE.value


def _kind_3d(beam: str) -> str:
    return "parallel3d_vec" if beam == ScanGeometry.PARALLEL.value else "cone_vec"


def _det(geometry: ProjectionGeometry) -> tuple[int, int]:
    shape = tuple(int(n) for n in geometry.det_shape)
    return (1, shape[0]) if len(shape) == 1 else shape


def _vectors_12(geometry: ProjectionGeometry) -> np.ndarray:
    """The geometry's rows as 3D vectors ``(n, 12)`` (a 2D geometry in the plane ``z = 0``, its one detector row
    ``|u|`` high)."""
    vec = geometry.to_vectors().vectors
    if geometry.ndim == 3:
        return np.array(vec, dtype=np.float64)
    n = len(vec)
    out = np.zeros((n, 12))
    out[:, [0, 1, 3, 4, 6, 7]] = vec
    out[:, 11] = np.linalg.norm(vec[:, 4:6], axis=1)
    return out


def _astra_order(a: np.ndarray, geometry: ProjectionGeometry, name: str) -> np.ndarray:
    """ASTRA's projection array as ctuq's ``(angle, row, column)``, its shape checked against the geometry."""
    n, (rows, cols) = geometry.n_angles, _det(geometry)
    want = (n, cols) if geometry.ndim == 2 else (rows, n, cols)
    if a.shape != want:
        order = "(n_angles, n_det)" if geometry.ndim == 2 else "(n_rows, n_angles, n_cols)"
        raise DataError(f"Scan.from_astra: {name} has shape {a.shape}; the geometry gives {want} {order}")
    return a[:, None, :] if geometry.ndim == 2 else np.ascontiguousarray(a.transpose(1, 0, 2))
