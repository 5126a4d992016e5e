"""A scan given as per-angle ASTRA vectors and a stack of detector frames, whatever file it came from: the one
loader behind every data format except the walnut layout (``scan.yaml``: :mod:`ctuq.data.scan_file`; NXtomo:
:mod:`ctuq.data.nxtomo`), producing the same :class:`~ctuq.data.walnut.CTData` as the walnut loader.

Axis orders where data cross the file boundary (ASTRA's and CIL's default for projections):

* projections ``(angle, row, column)``; a 2D array ``(angle, column)`` is a one-row detector. Row ``r`` and
  column ``k`` lie at ``d + (k − (n_cols − 1)/2)·u + (r − (n_rows − 1)/2)·v`` (``ctuq.geometry``): the row
  index increases along ``v`` (up, ``+z``, for a scan described by parameters), the column index along ``u``;
* flats and darks ``(frame, row, column)`` (one frame may be given as ``(row, column)``), averaged over frames;
* ground truth ``(n_z, n_y, n_x)`` in mm⁻¹ on the scan's volume grid (``ctuq.geometry``'s convention).

Measurements are raw counts (with flats and darks: ``ℓ = −log((p − dark)/(flat − dark))`` and the per-ray
variance of :mod:`ctuq.data.walnut`'s docstring, generalised to ``n_f`` flat and ``n_d`` dark frames:
``1/P + 1/(n_f F) + q·(1/P² + 1/(n_f F²) + (1/P − 1/F)²/n_d)``) or line integrals (optionally with their
variances). Slices and volumes are cut exactly as the walnut loader cuts them: a cone beam through the walnut's own
slice plan (rows interpolated along the line where the slice plane meets the detector), a parallel beam along the
detector line at the slice's height, a one-row detector (fan, or parallel) as it is. Angular subsampling keeps
angles ``0, k, 2k, …`` (every angle of the file is distinct here; the walnut layout's last file repeats the
first). So a scan written in the walnut layout and in these formats loads to the same operator and bit-identical
sinogram and variances.

Errors are :class:`ScanFormatError` (a :class:`ctuq.errors.CTUQError`), one line naming the described file, the key
and the measurement file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch

from ctuq.data.walnut import (
    CTData,
    WalnutFormatError,
    _binned_variance,
    _check_backend,
    _check_image_shape,
    _coarsened,
    _column_plan,
    _plan_slice,
    _positive_int,
    _progress,
    _SlicePlan,
    area_average,
    log_count_variance,
)
from ctuq.errors import CTUQError
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import AstraCudaRayTransform, make_ray_transform
from ctuq.options import Backend, MeasurementKind, ScanGeometry

__all__ = [
    "ScanFormatError",
    "ArraySource",
    "ProjectionScan",
    "count_variance",
    "read_slice",
    "load_slice",
    "read_volume",
    "load_volume",
]

_HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".nxs", ".nx", ".nx5")
_TIFF_SUFFIXES = (".tif", ".tiff")


class ScanFormatError(CTUQError):
    """A scan description or one of its measurement files is malformed; the one-line message names the file, the
    key and (where it is about one) the measurement file."""


def count_variance(P: np.ndarray, F: np.ndarray, read_noise: float, n_flats: int, n_darks: int) -> np.ndarray:
    """``Var(−log(P/F))`` per pixel (module docstring) for a flat that is the mean of ``n_flats`` frames and a dark
    of ``n_darks``: ``P = p − dark``, ``F = flat − dark`` in counts (same shape, > 0), ``read_noise`` the per-frame
    read-noise sd (counts). For two flats and one dark this is :func:`ctuq.data.walnut.log_count_variance`."""
    if (n_flats, n_darks) == (2, 1):
        return log_count_variance(P, F, read_noise)
    q = float(read_noise) ** 2 + 1.0 / 12.0
    iP, iF = 1.0 / P, 1.0 / F
    a, b = 1.0 / n_flats, 1.0 / n_darks
    return iP + a * iF + q * (iP * iP + a * iF * iF + b * (iP - iF) ** 2)


class ArraySource:
    """An array in a file, read lazily frame by frame along its first axis.

    ``.npy`` files are memory-mapped, TIFF stacks are read page by page (one page per frame), HDF5 datasets
    (``dataset`` given) sliced with h5py. ``index`` selects and orders frames of the stored array (NXtomo's
    ``image_key`` selections). ``described_by`` and ``key`` name the scan description and its key in messages,
    which are raised as ``error`` (the format's :class:`ScanFormatError` subclass).

    Attributes
    ----------
    shape : tuple of int
        The array's shape after ``index`` (frames first).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        key: str,
        described_by: str | os.PathLike,
        dataset: str | None = None,
        index: np.ndarray | None = None,
        error: type[ScanFormatError] = ScanFormatError,
    ):
        self.path = Path(path)
        self.error = error
        self.key = key
        self.described_by = Path(described_by)
        self.dataset = dataset
        self._cache: np.ndarray | None = None
        if not self.path.is_file():
            self.fail("file missing")
        suffix = self.path.suffix.lower()
        if dataset is not None or suffix in _HDF5_SUFFIXES:
            self.kind = "hdf5"
            if dataset is None:
                self.fail("an HDF5 file needs a dataset path ({file: ..., dataset: /path/in/file})")
            shape = self._h5_shape()
        elif suffix == ".npy":
            self.kind = "npy"
            try:
                self._cache = np.load(self.path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as exc:
                self.fail(f"not a readable .npy array ({type(exc).__name__}: {exc})")
            shape = tuple(self._cache.shape)
        elif suffix in _TIFF_SUFFIXES:
            self.kind = "tiff"
            try:
                with tifffile.TiffFile(self.path) as tif:
                    shape = tuple(tif.series[0].shape)
                    self._pages = len(tif.pages)
            except Exception as exc:  # noqa: BLE001 - tifffile raises many types; re-raised naming the file
                self.fail(f"not a readable TIFF ({type(exc).__name__}: {exc})")
        else:
            self.fail(f"unknown file type {suffix!r}; use .npy, .tif/.tiff, or an HDF5 file with a dataset path")
        self._stored_shape = shape
        self.index = None if index is None else np.asarray(index, dtype=np.int64)
        self.shape = shape if self.index is None else (len(self.index), *shape[1:])

    @property
    def name(self) -> str:
        """``file`` or ``file:/dataset`` (for messages)."""
        return f"{self.path}:{self.dataset}" if self.dataset is not None else str(self.path)

    def fail(self, problem: str):
        """Raise :class:`ScanFormatError` ``"<description>: <key>: <file>: <problem>"`` (``"<file>:<dataset>:
        <problem>"`` for a dataset of the described file itself, as in NXtomo)."""
        where = f"{self.described_by}: {self.key}: " if self.described_by != self.path else ""
        raise self.error(f"{where}{self.name}: {problem}")

    def _h5_shape(self) -> tuple[int, ...]:
        import h5py  # optional-heavy: only HDF5 sources import it

        try:
            with h5py.File(self.path, "r") as f:
                if self.dataset not in f:
                    top = ", ".join(sorted(f.keys())) or "nothing"
                    self.fail(f"no dataset {self.dataset!r} in the file (top level: {top})")
                ds = f[self.dataset]
                if not isinstance(ds, h5py.Dataset):
                    self.fail(f"{self.dataset!r} is a group, not a dataset")
                return tuple(ds.shape)
        except OSError as exc:
            self.fail(f"not a readable HDF5 file ({exc})")
        raise AssertionError("unreachable")

    def _stored(self, sel) -> np.ndarray:
        """Frames ``sel`` (an int or a sorted int array) of the stored array."""
        if self.kind == "hdf5":
            import h5py  # optional-heavy: only HDF5 sources import it

            with h5py.File(self.path, "r") as f:
                return np.asarray(f[self.dataset][sel])
        if self.kind == "tiff":
            if isinstance(sel, int) and len(self._stored_shape) == 3 and self._pages == self._stored_shape[0]:
                return np.asarray(tifffile.imread(self.path, key=sel))  # one page per frame: read only that one
            if self._cache is None:
                self._cache = np.asarray(tifffile.imread(self.path))
            return np.asarray(self._cache[sel])
        return np.asarray(self._cache[sel])

    def frame(self, i: int) -> np.ndarray:
        """Frame ``i`` (after ``index``) as stored (``shape[1:]``, the file's dtype)."""
        j = int(i) if self.index is None else int(self.index[int(i)])
        return self._stored(j)

    def read(self) -> np.ndarray:
        """The whole (selected) array, ``shape``, in the file's dtype."""
        if self.index is None:
            return self._stored(slice(None))
        order = np.argsort(self.index)
        data = self._stored(self.index[order])
        out = np.empty_like(data)
        out[order] = data
        return out


def _finite(a: np.ndarray, src: ArraySource, what: str) -> np.ndarray:
    if not np.all(np.isfinite(a)):
        bad = ~np.isfinite(a)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        src.fail(f"{int(bad.sum())} values of {what} are NaN or Inf (first at index {first})")
    return a


@dataclasses.dataclass
class ProjectionScan:
    """A validated scan: geometry vectors, measurement files and the volume grid (module docstring).

    Opening (the format readers) reads the geometry, the flats and darks and the array headers; projections are
    read on demand. The attributes the pipeline's setting checks use are those of
    :class:`~ctuq.data.walnut.WalnutScan` (``path``, ``det_shape``, ``gt_shape``, ``voxel_size``,
    ``has_ground_truth``, :meth:`angle_plan`, :meth:`ground_truth_grid`).

    Attributes
    ----------
    path : Path
        The file that describes the scan (``scan.yaml``, ``scan.nxs``), named in every message.
    format : str
        :class:`ctuq.options.DataFormat` value.
    geometry_type : str
        :class:`ctuq.options.ScanGeometry` value.
    vectors : (n_angles, 12) float64
        ``cone_vec`` (fan, cone) or ``parallel3d_vec`` (parallel) rows, mm.
    det_shape : (int, int)
        ``(n_rows, n_cols)``.
    projections : ArraySource
        ``(n_angles, n_rows, n_cols)`` counts or line integrals (``(n_angles, n_cols)`` for one row).
    measurement : str
        :class:`ctuq.options.MeasurementKind` value.
    flat, dark : (n_rows, n_cols) float64 or None
        Mean flat and dark frames (counts).
    n_flats, n_darks : int
        Frames averaged into them.
    read_noise : float
        Per-frame read-noise sd (counts).
    variances : ArraySource or None
        Variances of line integrals, shaped like ``projections``.
    gt_shape : (int, int, int)
        Volume grid ``(n_z, n_y, n_x)``; ``voxel_size`` (mm) and ``voxel_size_source`` say where it came from.
    ground_truth : ArraySource or None
        ``gt_shape`` in mm⁻¹.
    info : dict
        Format-specific record for ``CTData.meta``.
    """

    path: Path
    format: str
    geometry_type: str
    vectors: np.ndarray
    det_shape: tuple[int, int]
    projections: ArraySource
    measurement: str
    gt_shape: tuple[int, int, int]
    voxel_size: float
    voxel_size_source: str
    flat: np.ndarray | None = None
    dark: np.ndarray | None = None
    n_flats: int = 0
    n_darks: int = 0
    read_noise: float = 0.0
    variances: ArraySource | None = None
    ground_truth: ArraySource | None = None
    info: dict = dataclasses.field(default_factory=dict)

    @property
    def error(self) -> type[ScanFormatError]:
        """The format's error class (:class:`ScanFormatError` subclass) for messages about this scan."""
        return self.projections.error

    # ------------------------------------------------------------------ WalnutScan's interface
    @property
    def proj_dir(self) -> Path:
        """The described file (the walnut scan's projection folder plays this role in messages)."""
        return self.path

    @property
    def n_files(self) -> int:
        """Projections in the file (every one a distinct angle)."""
        return int(self.vectors.shape[0])

    @property
    def n_distinct_angles(self) -> int:
        """Distinct projection angles (all of them)."""
        return self.n_files

    @property
    def has_ground_truth(self) -> bool:
        """Whether the scan names a ground truth (``gt_shape``, mm⁻¹)."""
        return self.ground_truth is not None

    def angle_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        """Angles ``0, k, 2k, … < n`` and the projections holding them (the same indices): two int arrays."""
        k = _positive_int(angular_subsampling, "angular_subsampling")
        rows = np.arange(0, self.n_files, k)
        return rows, rows.copy()

    def ground_truth_grid(self) -> VolumeGeometry:
        """The 3D volume grid ``(n_z, n_y, n_x)``, voxel :attr:`voxel_size`, centred at the origin."""
        return VolumeGeometry(self.gt_shape, self.voxel_size)

    def slice_z(self, slice_index: int) -> float:
        """Height (mm) of slice ``slice_index``: ``(k + ½ − n_z/2)·h``."""
        return (slice_index + 0.5 - self.gt_shape[0] / 2.0) * self.voxel_size

    def read_ground_truth_slice(self, slice_index: int) -> np.ndarray:
        """Ground-truth slice ``(n_y, n_x)`` float64 (mm⁻¹)."""
        if len(self.ground_truth.shape) == 2:  # one slice stored as (n_y, n_x)
            img = np.asarray(self.ground_truth.read(), dtype=np.float64)
        else:
            img = np.asarray(self.ground_truth.frame(slice_index), dtype=np.float64)
        return _finite(img, self.ground_truth, f"ground-truth slice {slice_index}")

    # ------------------------------------------------------------------ measurements
    def _projection(self, index: int) -> np.ndarray:
        p = np.asarray(self.projections.frame(index), dtype=np.float64).reshape(self.det_shape)
        return _finite(p, self.projections, f"projection {index}")

    def corrected_counts(self, index: int, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(p − dark, flat − dark)`` (counts) on the pixels ``rows × cols`` of projection ``index``, each
        ``(len(rows), len(cols))`` and > 0; raises naming the file where ``flat ≤ dark`` or ``p ≤ dark``."""
        rows, cols = np.asarray(rows), np.asarray(cols)
        d = self.dark[np.ix_(rows, cols)]
        f = self.flat[np.ix_(rows, cols)]
        bad = f <= d
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise self.error(
                f"{self.path}: measurements.flats: flat ≤ dark at {int(bad.sum())} used pixels (first at detector "
                f"row {rows[r]}, column {cols[c]}: mean flat {f[r, c]:g}, mean dark {d[r, c]:g}); the flat-field "
                f"correction would divide by ≤ 0"
            )
        p = self._projection(index)[np.ix_(rows, cols)]
        bad = p <= d
        if bad.any():
            r, c = np.argwhere(bad)[0]
            self.projections.fail(
                f"projection {index}: {int(bad.sum())} used pixels have counts ≤ dark (first at detector row "
                f"{rows[r]}, column {cols[c]}: {p[r, c]:g} ≤ {d[r, c]:g}); −log is undefined there"
            )
        return p - d, f - d

    def log_rows(
        self, index: int, rows: np.ndarray, cols: np.ndarray, bin_steps: tuple[int, int] | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Line integrals and their variances (``None`` without) on ``rows × cols`` of projection ``index``,
        binned in transmission by ``bin_steps`` ``(rows, columns)`` when given: two ``(n_r, n_c)`` float64 arrays."""
        if self.measurement == MeasurementKind.COUNTS:
            P, F = self.corrected_counts(index, rows, cols)
            t = P / F
            v = count_variance(P, F, self.read_noise, self.n_flats, self.n_darks)
            if bin_steps is not None:
                t, v = _binned_variance(t, v, bin_steps)
            return -np.log(t), v
        ell = self._projection(index)[np.ix_(rows, cols)]
        v = None
        if self.variances is not None:
            v = np.asarray(self.variances.frame(index), dtype=np.float64).reshape(self.det_shape)[np.ix_(rows, cols)]
            if not np.all(np.isfinite(v) & (v > 0)):
                self.variances.fail(f"projection {index}: variances must be finite and positive")
        if bin_steps is None:
            return ell, v
        t = np.exp(-ell)
        if v is None:
            return -np.log(_binned_variance(t, np.ones_like(t), bin_steps)[0]), None
        t, v = _binned_variance(t, v, bin_steps)
        return -np.log(t), v

    @property
    def has_variances(self) -> bool:
        """Whether per-ray variances are known (counts, or line integrals with a variances file)."""
        return self.measurement == MeasurementKind.COUNTS or self.variances is not None

    def record(self) -> dict:
        """JSON-serialisable description for ``CTData.meta``."""
        return {
            "format": self.format,
            "path": str(self.path),
            "geometry_type": self.geometry_type,
            "measurement": self.measurement,
            "projections_file": self.projections.name,
            "n_projections": self.n_files,
            "detector_shape": list(self.det_shape),
            "n_flats": self.n_flats,
            "n_darks": self.n_darks,
            "read_noise_counts": self.read_noise,
            "gt_shape": list(self.gt_shape),
            "gt_voxel_size_mm": self.voxel_size,
            "gt_voxel_size_source": self.voxel_size_source,
            "has_ground_truth": self.has_ground_truth,
            "axis_order": "projections (angle, row, column); row index along v, column index along u",
            **self.info,
        }


# --------------------------------------------------------------------------------------------- slices
def _reraise_plan(scan: ProjectionScan, exc: WalnutFormatError):
    # the walnut slice plan names the walnut layout's geometry file; here the geometry is the described file's
    text = str(exc).split(": ", 1)[-1]
    raise scan.error(f"{scan.path}: geometry: {text}") from None


def _plan_flat_slice(scan: ProjectionScan, z: float, ass, dss, binning) -> _SlicePlan:
    """Parallel beams (rays in the planes ``z = const``) and one-row detectors: the detector line at height ``z``."""
    step = _positive_int(dss, "detector_subsampling")
    rows, files = scan.angle_plan(ass)
    n_rows, n_cols = scan.det_shape
    try:
        cols, centre_off = _column_plan(n_cols, step, binning)
    except ValueError as exc:
        raise scan.error(f"{scan.path}: {exc}") from None
    vec = scan.vectors[rows]
    head, d, u, v = vec[:, 0:3], vec[:, 3:6], vec[:, 6:9], vec[:, 9:12]
    if binning:
        alpha = (np.arange(len(cols) // step) * step + (step - 1) / 2.0) - (n_cols - 1) / 2.0
    else:
        alpha = cols - (n_cols - 1) / 2.0
    if n_rows == 1:
        beta0 = np.zeros(len(rows))
        beta1 = np.zeros(len(rows))
        frac_rows = np.zeros((len(rows), len(alpha)))
    else:
        if np.any(np.abs(head[:, 2]) > 1e-9 * np.linalg.norm(head, axis=1)):
            raise scan.error(f"{scan.path}: geometry: parallel rays are not perpendicular to the rotation axis z")
        if np.any(np.abs(v[:, 2]) < 1e-12 * np.linalg.norm(v, axis=1)):
            raise scan.error(f"{scan.path}: geometry: the detector's v direction has no z component")
        beta0 = (z - d[:, 2]) / v[:, 2]
        beta1 = -u[:, 2] / v[:, 2]
        frac_rows = beta0[:, None] + beta1[:, None] * alpha[None, :] + (n_rows - 1) / 2.0
        lo, hi = frac_rows.min(), frac_rows.max()
        if lo < -1e-6 or hi > n_rows - 1 + 1e-6:
            raise scan.error(
                f"{scan.path}: the slice plane z = {z:.4g} mm meets the detector at rows {lo:.2f} … {hi:.2f}, "
                f"outside the {n_rows} detector rows 0 … {n_rows - 1}"
            )
    centre = d + centre_off * u + (beta0 + beta1 * centre_off)[:, None] * v
    u_line = step * (u + beta1[:, None] * v)
    kind2 = "parallel_vec" if scan.geometry_type == ScanGeometry.PARALLEL else "fanflat_vec"
    kind3 = "parallel3d_vec" if scan.geometry_type == ScanGeometry.PARALLEL else "cone_vec"
    flat = ProjectionGeometry(
        kind2, (len(alpha),), vectors=np.concatenate([head[:, :2], centre[:, :2], u_line[:, :2]], 1)
    )
    one_row = ProjectionGeometry(kind3, (1, len(alpha)), vectors=np.concatenate([head, centre, u_line, v], axis=1))
    return _SlicePlan(rows, files, cols, step, binning, frac_rows, flat, one_row, float(z), 0.0)


def _slice_setup(scan: ProjectionScan, slice_index, ass, dss, binning, image_shape):
    n_z = scan.gt_shape[0]
    k = n_z // 2 if slice_index is None else int(slice_index)
    if not 0 <= k < n_z:
        raise ValueError(f"slice_index {slice_index} out of range: the volume grid has {n_z} slices (0 … {n_z - 1})")
    z = scan.slice_z(k)
    if scan.geometry_type == ScanGeometry.CONE:
        try:
            plan = _plan_slice(scan, z, ass, dss, binning)
        except WalnutFormatError as exc:
            _reraise_plan(scan, exc)
    else:
        plan = _plan_flat_slice(scan, z, ass, dss, binning)
    grid2d = VolumeGeometry(scan.gt_shape[1:], scan.voxel_size)
    return plan, _coarsened(grid2d, image_shape), k


def _read_plan(scan: ProjectionScan, plan: _SlicePlan, progress) -> tuple[np.ndarray, np.ndarray | None]:
    """Sinogram ``(n_angles, n_out)`` and variances (or ``None``): the walnut loader's row interpolation."""
    n_rows = scan.det_shape[0]
    if n_rows == 1:
        r0 = np.zeros(plan.frac_rows.shape, dtype=np.int64)
        r1 = r0
    else:
        r0 = np.clip(np.floor(plan.frac_rows).astype(np.int64), 0, n_rows - 2)
        r1 = r0 + 1
    w = plan.frac_rows - r0  # weight of row r1
    out = np.empty(plan.frac_rows.shape)
    var = np.empty(plan.frac_rows.shape) if scan.has_variances else None
    steps = (1, plan.col_step) if plan.binning else None
    n_a = len(plan.rows)
    for a in _progress(range(n_a), n_a, "read projections", progress):
        need = np.unique(np.concatenate([r0[a], r1[a]]))
        log_t, v = scan.log_rows(int(plan.files[a]), need, plan.cols, steps)
        p0, p1 = np.searchsorted(need, r0[a]), np.searchsorted(need, r1[a])
        j = np.arange(log_t.shape[1])
        out[a] = (1.0 - w[a]) * log_t[p0, j] + w[a] * log_t[p1, j]
        if var is not None:
            var[a] = (1.0 - w[a]) ** 2 * v[p0, j] + w[a] ** 2 * v[p1, j]
    return out, var


def _meta(scan: ProjectionScan, rows, ass, dss, binning, cols) -> dict:
    meta = scan.record()
    meta.update(
        {
            "angular_subsampling": int(ass),
            "detector_subsampling": int(dss),
            "detector_binning": bool(binning),
            "geometry_rows": [int(r) for r in rows],
            "projection_indices": [int(r) for r in rows],
            "detector_columns": {
                "first": int(cols[0]),
                "last": int(cols[-1]),
                "step": int(dss),
                "mode": "bin" if binning else "subsample",
            },
        }
    )
    return meta


def _finish_slice(scan: ProjectionScan, plan, volume, k, op, backend, ass, dss, binning, progress) -> CTData:
    y, var = _read_plan(scan, plan, progress)
    gt = None
    if scan.has_ground_truth:
        gt = torch.from_numpy(area_average(scan.read_ground_truth_slice(k), volume.shape).astype(np.float32))
    meta = _meta(scan, plan.rows, ass, dss, binning, plan.cols)
    centre_col = plan.frac_rows.shape[1] // 2
    meta.update(
        {
            "ndim": 2,
            "slice_index": int(k),
            "z_mm": plan.z,
            "image_shape": list(volume.shape),
            "image_voxel_size_mm": volume.voxel_size,
            "detector_rows_used": [float(r) for r in plan.frac_rows[:, centre_col]],
            "detector_row_range": [float(plan.frac_rows.min()), float(plan.frac_rows.max())],
            "cone_angle_deg": plan.cone_angle_deg,
            "backend": backend,
            "operator_geometry": plan.cone.kind + " slice" if backend == Backend.ASTRA_CUDA else plan.fan.kind,
        }
    )
    y_t = torch.from_numpy(y.astype(np.float32))
    var_t = None if var is None else torch.from_numpy(var.astype(np.float32))
    if op is not None:
        y_t = y_t.to(op.device)
        var_t = None if var_t is None else var_t.to(op.device)
    return CTData(
        op=op,
        y=y_t,
        ground_truth=gt,
        volume=volume,
        geometry=plan.fan,
        meta=meta,
        slice_cone_geometry=plan.cone,
        variances=var_t,
    )


def read_slice(
    scan: ProjectionScan,
    *,
    slice_index: int | None = None,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    image_shape: Sequence[int] | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Everything :func:`load_slice` returns except the operator (``op=None``; ``y`` on the CPU)."""
    image_shape = _check_image_shape(image_shape, 2)
    plan, volume, k = _slice_setup(
        scan, slice_index, angular_subsampling, detector_subsampling, detector_binning, image_shape
    )
    return _finish_slice(
        scan, plan, volume, k, None, "none", angular_subsampling, detector_subsampling, detector_binning, progress
    )


def load_slice(
    scan: ProjectionScan,
    *,
    slice_index: int | None = None,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    image_shape: Sequence[int] | None = None,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cpu",
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """One slice of ``scan`` as a 2D problem: operator, sinogram ``(n_angles, n_cols)``, ground truth.

    Parameters as :func:`ctuq.data.walnut.load_walnut_slice` (``slice_index`` counts the scan's volume grid, default
    its central slice; ``image_shape`` coarsens that grid over the same field of view). ``backend='astra_cuda'``
    gives the exact cone-beam slice operator for a cone beam (GPU), ASTRA's 2D CUDA projector otherwise.
    """
    device = _check_backend(backend, device)
    if backend == Backend.ASTRA_CUDA and device.type != "cuda":
        raise RuntimeError(
            f"load_slice: backend 'astra_cuda' needs a CUDA device, got {device}; use 'sparse' on the CPU"
        )
    image_shape = _check_image_shape(image_shape, 2)
    plan, volume, k = _slice_setup(
        scan, slice_index, angular_subsampling, detector_subsampling, detector_binning, image_shape
    )
    # the operator is built before any pixel data are read: a geometry the backend rejects fails fast
    if backend == Backend.ASTRA_CUDA and scan.geometry_type == ScanGeometry.CONE:
        op = AstraCudaRayTransform.cone_slice(volume, plan.z, plan.cone, device=device)
    else:
        op = make_ray_transform(volume, plan.fan, backend=backend, device=device)
    name = Backend.ASTRA_CUDA.value if backend == Backend.ASTRA_CUDA else type(op).__name__
    return _finish_slice(
        scan, plan, volume, k, op, name, angular_subsampling, detector_subsampling, detector_binning, progress
    )


# --------------------------------------------------------------------------------------------- volumes
def _volume_setup(scan: ProjectionScan, ass, dss, drs, binning, image_shape):
    if scan.geometry_type == ScanGeometry.FAN or scan.det_shape[0] < 2:
        raise scan.error(
            f"{scan.path}: a {scan.geometry_type} beam with {scan.det_shape[0]} detector row(s) gives 2D slices only; "
            f"use data.ndim = 2"
        )
    col_step = _positive_int(dss, "detector_subsampling")
    row_step = col_step if drs is None else _positive_int(drs, "detector_row_subsampling")
    rows, files = scan.angle_plan(ass)
    n_rows, n_cols = scan.det_shape
    try:
        cols, col_off = _column_plan(n_cols, col_step, binning)
        drows, row_off = _column_plan(n_rows, row_step, binning)
    except ValueError as exc:
        raise scan.error(f"{scan.path}: {exc} (rows: {n_rows}, columns: {n_cols})") from None
    vec = scan.vectors[rows].copy()
    u, v = vec[:, 6:9].copy(), vec[:, 9:12].copy()
    vec[:, 3:6] += col_off * u + row_off * v
    vec[:, 6:9] = col_step * u
    vec[:, 9:12] = row_step * v
    n_out_r = len(drows) // row_step if binning else len(drows)
    n_out_c = len(cols) // col_step if binning else len(cols)
    kind = "parallel3d_vec" if scan.geometry_type == ScanGeometry.PARALLEL else "cone_vec"
    geometry = ProjectionGeometry(kind, (n_out_r, n_out_c), vectors=vec)
    volume = _coarsened(scan.ground_truth_grid(), image_shape)
    return rows, files, drows, cols, row_step, col_step, geometry, volume


def _finish_volume(scan: ProjectionScan, setup, op, backend, ass, dss, binning, progress) -> CTData:
    rows, files, drows, cols, row_step, col_step, geometry, volume = setup
    y = np.empty((len(rows), *geometry.det_shape), dtype=np.float32)
    var = np.empty_like(y) if scan.has_variances else None
    steps = (row_step, col_step) if binning else None
    for a in _progress(range(len(rows)), len(rows), "read projections", progress):
        log_t, v = scan.log_rows(int(files[a]), drows, cols, steps)
        y[a] = log_t
        if var is not None:
            var[a] = v
    gt = None
    if scan.has_ground_truth:
        n_z = scan.gt_shape[0]
        planes = np.stack([area_average(scan.read_ground_truth_slice(k), volume.shape[1:]) for k in range(n_z)])
        gt = torch.from_numpy(area_average(planes, volume.shape).astype(np.float32))
    meta = _meta(scan, rows, ass, dss, binning, cols)
    meta.update(
        {
            "ndim": 3,
            "detector_row_subsampling": int(row_step),
            "detector_rows": {"first": int(drows[0]), "last": int(drows[-1]), "step": int(row_step)},
            "image_shape": list(volume.shape),
            "image_voxel_size_mm": volume.voxel_size,
            "backend": backend,
        }
    )
    y_t = torch.from_numpy(y)
    var_t = None if var is None else torch.from_numpy(var)
    if op is not None:
        y_t = y_t.to(op.device)
        var_t = None if var_t is None else var_t.to(op.device)
    return CTData(op=op, y=y_t, ground_truth=gt, volume=volume, geometry=geometry, meta=meta, variances=var_t)


def read_volume(
    scan: ProjectionScan,
    *,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    detector_row_subsampling: int | None = None,
    image_shape: Sequence[int] | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Everything :func:`load_volume` returns except the operator (``op=None``): runs on the CPU."""
    setup = _volume_setup(
        scan,
        angular_subsampling,
        detector_subsampling,
        detector_row_subsampling,
        detector_binning,
        _check_image_shape(image_shape, 3),
    )
    return _finish_volume(
        scan, setup, None, "none", angular_subsampling, detector_subsampling, detector_binning, progress
    )


def load_volume(
    scan: ProjectionScan,
    *,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    detector_row_subsampling: int | None = None,
    image_shape: Sequence[int] | None = None,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cuda",
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """``scan`` as a 3D problem (cone or multi-row parallel beam; GPU: ASTRA CUDA operator): ``y`` ``(n_angles,
    n_rows, n_cols)``, ground truth ``(D, H, W)``. Parameters as :func:`ctuq.data.walnut.load_walnut_volume`."""
    device = _check_backend(backend, device)
    setup = _volume_setup(
        scan,
        angular_subsampling,
        detector_subsampling,
        detector_row_subsampling,
        detector_binning,
        _check_image_shape(image_shape, 3),
    )
    op = make_ray_transform(setup[7], setup[6], backend=backend, device=device)
    return _finish_volume(
        scan, setup, op, type(op).__name__, angular_subsampling, detector_subsampling, detector_binning, progress
    )


def default_volume(
    geometry_type: str, det_shape: tuple[int, int], pixel_size: float, source_object: Any, object_detector: Any
) -> tuple[tuple[int, int, int], float]:
    """The volume grid a scan without one gets (CIL's default image geometry): ``n_x = n_y = n_cols``,
    ``n_z = n_rows``, voxel = the detector pitch over the magnification ``(D_so + D_od)/D_so`` (1 for parallel)."""
    rows, cols = det_shape
    mag = 1.0 if geometry_type == ScanGeometry.PARALLEL else (source_object + object_detector) / source_object
    return (int(rows), int(cols), int(cols)), float(pixel_size) / mag


__all__ += ["default_volume"]
