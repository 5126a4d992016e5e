"""A scan given as per-angle ASTRA vectors and a stack of detector frames, whatever file it came from: the
:class:`~ctuq.data.source.ScanSource` of every format but the walnut layout (``scan.yaml``:
:mod:`ctuq.data.scan_file`; NXtomo: :mod:`ctuq.data.nxtomo`).

Axis orders where data cross the file boundary (ASTRA's and CIL's default for projections):

* projections ``(angle, row, column)``; a 2D array ``(angle, column)`` is a one-row detector. Row ``r`` and
  column ``k`` lie at ``d + (k − (n_cols − 1)/2)·u + (r − (n_rows − 1)/2)·v`` (``ctuq.geometry``): the row
  index increases along ``v`` (up, ``+z``, for a scan described by parameters), the column index along ``u``;
* flats and darks ``(frame, row, column)`` (one frame may be given as ``(row, column)``), averaged over frames;
* ground truth ``(n_z, n_y, n_x)`` in mm⁻¹ on the scan's volume grid (``ctuq.geometry``'s convention).

Measurements are raw counts (with flats and darks: ``ℓ = −log((p − dark)/(flat − dark))`` and the per-ray
variance of :mod:`ctuq.data.source` for ``n_f`` flat and ``n_d`` dark frames) or line integrals (optionally with
their variances). Every angle of the file is distinct (the walnut layout's last file repeats the first). Slices and
volumes are cut by the one loader (:mod:`ctuq.data.loader`), so a scan written in the walnut layout and in these
formats loads to the same operator and bit-identical sinogram and variances.

Errors are :class:`ScanFormatError` (a :class:`ctuq.errors.CTUQError`), one line naming the described file, the key
and the measurement file.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import tifffile

from ctuq.data.source import VECTOR_PARTS, ScanSource, ValueOrigin, positive_int, vector_file_origin
from ctuq.errors import CTUQError
from ctuq.options import MeasurementKind, ScanGeometry

__all__ = ["ScanFormatError", "ArraySource", "ProjectionScan", "mean_flat_dark", "default_volume"]

_HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".nxs", ".nx", ".nx5")
_TIFF_SUFFIXES = (".tif", ".tiff")


class ScanFormatError(CTUQError):
    """A scan description or one of its measurement files is malformed; the one-line message names the file, the
    key and (where it is about one) the measurement file."""


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

    def problem(self, problem: str) -> ScanFormatError:
        """The error ``"<description>: <key>: <file>: <problem>"`` (``"<file>:<dataset>: <problem>"`` for a dataset
        of the described file itself, as in NXtomo), as :attr:`error`."""
        where = f"{self.described_by}: {self.key}: " if self.described_by != self.path else ""
        return self.error(f"{where}{self.name}: {problem}")

    def fail(self, problem: str):
        """Raise :meth:`problem`."""
        raise self.problem(problem)

    def _h5_shape(self) -> tuple[int, ...]:
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
class ProjectionScan(ScanSource):
    """A validated scan of per-angle vectors and a stack of frames (module docstring), the
    :class:`~ctuq.data.source.ScanSource` of ``scan.yaml`` and NXtomo (attributes as there, and those below).

    Opening (the format readers) reads the geometry, the flats and darks and the array headers; projections are
    read on demand.

    Attributes
    ----------
    projections : ArraySource
        ``(n_angles, n_rows, n_cols)`` counts or line integrals (``(n_angles, n_cols)`` for one row).
    flat, dark : (n_rows, n_cols) float64 or None
        Mean flat and dark frames (counts).
    variances : ArraySource or None
        Variances of line integrals, shaped like ``projections``.
    ground_truth : ArraySource or None
        ``gt_shape`` in mm⁻¹.
    info : dict
        Format-specific record for ``CTData.meta``.
    origins : dict of str to ValueOrigin
        Where each :meth:`origin` quantity came from (the described file's key or field), for messages.
    vectors_file : Path or None
        The text file the geometry rows were read from, one row per line (``scan.yaml``'s ``geometry.vectors``);
        :meth:`origin` then names its line.
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
    origins: dict[str, ValueOrigin] = dataclasses.field(default_factory=dict)
    vectors_file: Path | None = None

    @property
    def error(self) -> type[ScanFormatError]:
        """The format's error class (:class:`ScanFormatError` subclass) for messages about this scan."""
        return self.projections.error

    # ------------------------------------------------------------------ facts
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

    def describe_angles(self) -> str:
        """``"it has 32 projections"``."""
        return f"it has {self.n_files} projections"

    @property
    def has_ground_truth(self) -> bool:
        """Whether the scan names a ground truth (``gt_shape``, mm⁻¹)."""
        return self.ground_truth is not None

    @property
    def has_variances(self) -> bool:
        """Whether per-ray variances are known (counts, or line integrals with a variances file)."""
        return self.measurement == MeasurementKind.COUNTS or self.variances is not None

    def angle_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        """Angles ``0, k, 2k, … < n`` and the projections holding them (the same indices): two int arrays."""
        k = positive_int(angular_subsampling, "angular_subsampling")
        rows = np.arange(0, self.n_files, k)
        return rows, rows.copy()

    def read_ground_truth_slice(self, slice_index: int) -> np.ndarray:
        """Ground-truth slice ``(n_y, n_x)`` float64 (mm⁻¹)."""
        if len(self.ground_truth.shape) == 2:  # one slice stored as (n_y, n_x)
            img = np.asarray(self.ground_truth.read(), dtype=np.float64)
        else:
            img = np.asarray(self.ground_truth.frame(slice_index), dtype=np.float64)
        return _finite(img, self.ground_truth, f"ground-truth slice {slice_index}")

    # ------------------------------------------------------------------ measurements
    def projection(self, index: int) -> np.ndarray:
        """Projection ``index`` as stored (counts or line integrals), ``det_shape`` float64, checked finite."""
        p = np.asarray(self.projections.frame(index), dtype=np.float64).reshape(self.det_shape)
        return _finite(p, self.projections, f"projection {index}")

    def flat_dark(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The mean flat and dark frames (counts), or ``None`` for line integrals."""
        return None if self.flat is None else (self.flat, self.dark)

    def projection_variances(self, index: int) -> np.ndarray | None:
        """The variances file's frame ``index`` (``det_shape`` float64, checked finite and positive), or ``None``."""
        if self.variances is None:
            return None
        v = np.asarray(self.variances.frame(index), dtype=np.float64).reshape(self.det_shape)
        if not np.all(np.isfinite(v) & (v > 0)):
            self.variances.fail(f"projection {index}: variances must be finite and positive")
        return v

    def counts_error(self, index: int, n_bad: int, row: int, col: int, counts: float, dark: float):
        return self.projections.problem(
            f"projection {index}: {n_bad} used pixels have counts ≤ dark (first at detector row {row}, column "
            f"{col}: {counts:g} ≤ {dark:g}); −log is undefined there"
        )

    def origin(self, quantity: str, row: int | None = None) -> ValueOrigin:
        """:meth:`ScanSource.origin <ctuq.data.source.ScanSource.origin>`: the line of :attr:`vectors_file`, the
        key or field :attr:`origins` names, or the projections' file (and dataset)."""
        if quantity in VECTOR_PARTS and self.vectors_file is not None:
            return vector_file_origin(self.vectors_file, quantity, row)
        if quantity in self.origins:
            return self.origins[quantity]
        if quantity == "projections":
            return ValueOrigin(self.projections.path, self.projections.dataset)
        return super().origin(quantity, row)

    def record(self, *args) -> dict:
        """:meth:`ScanSource.record <ctuq.data.source.ScanSource.record>`'s entries, the projections file, the axis
        order and the format's own (:attr:`info`)."""
        return {
            **super().record(*args),
            "projections_file": self.projections.name,
            "axis_order": "projections (angle, row, column); row index along v, column index along u",
            **self.info,
        }


def mean_flat_dark(flats: np.ndarray, darks: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """The mean flat and dark ``(rows, cols)`` of frames ``(n, rows, cols)`` float64 (counts) and the problem where
    the mean flat is not above the mean dark (``""``: none)."""
    # integer counts: any summation order is exact, and ·(1/n) is the walnut loader's 0.5·(f0 + f1) for n = 2
    flat = flats.sum(axis=0) * (1.0 / len(flats))
    dark = darks.sum(axis=0) * (1.0 / len(darks))
    bad = flat <= dark
    if not bad.any():
        return flat, dark, ""
    r, c = np.argwhere(bad)[0]
    return (
        flat,
        dark,
        (
            f"mean flat ≤ mean dark at {int(bad.sum())} pixels (first at row {r}, column {c}: {flat[r, c]:g} ≤ "
            f"{dark[r, c]:g}); the flat-field correction would divide by ≤ 0"
        ),
    )


def default_volume(
    geometry_type: str, det_shape: tuple[int, int], pixel_size: float, source_object: Any, object_detector: Any
) -> tuple[tuple[int, int, int], float]:
    """The volume grid a scan without one gets (CIL's default image geometry): ``n_x = n_y = n_cols``,
    ``n_z = n_rows``, voxel = the detector pitch over the magnification ``(D_so + D_od)/D_so`` (1 for parallel)."""
    rows, cols = det_shape
    mag = 1.0 if geometry_type == ScanGeometry.PARALLEL else (source_object + object_detector) / source_object
    return (int(rows), int(cols), int(cols)), float(pixel_size) / mag
