"""What an opened scan offers, whatever its format: :class:`ScanSource`.

Every format's opener (the walnut folder, ``scan.yaml``, NXtomo, …) returns a :class:`ScanSource`: the validated
geometry and facts of the scan (headers, listings, flats and darks; no projection pixels yet), the angle plan,
per-projection access to its corrected measurements with their variances (:meth:`ScanSource.log_rows`) and the
ground truth where there is one (the class docstring lists it all). The one loader (:mod:`ctuq.data.loader`) cuts a
slice or a volume from any source through this interface, so formats differ only in how a source reads its rows.

Per-measurement variances (``CTData.variances``): with ``P = p − dark`` and ``F = flat − dark`` in counts of one
pixel (``flat`` the mean of ``n_f`` frames, ``dark`` of ``n_d``) and ``q = σ_r² + 1/12`` (read noise and the
rounding of integer counts, per frame), the delta method gives for ``ℓ = −log(P/F)`` (Poisson ``p`` and flats; the
dark frame enters both and its noise counts through ``1/P − 1/F``)::

    Var ℓ ≈ 1/P + 1/(n_f F) + q · (1/P² + 1/(n_f F²) + (1/P − 1/F)²/n_d)          (:func:`count_variance`)

in photons, i.e. for a detector gain of one count per photon (a simulated scan's; on real data the gain is unknown
and the likelihood's learned scale ``σ²`` absorbs it: only the *relative* variances are used). Binning ``k``
columns (and rows) averages transmissions ``t_j`` (independent pixels): ``Var(−log mean t) ≈ Σ_j t_j² Var ℓ_j /
(k t̄)²`` (:func:`binned_variance`); a slice's interpolation between detector rows ``r0`` and ``r0 + 1`` with
weight ``w`` gives ``(1 − w)² Var ℓ_r0 + w² Var ℓ_(r0+1)``. Subsampling keeps each pixel's own variance. Errors
the diagonal model leaves out: the flat and dark noise is shared by every angle of a detector pixel (a correlation
of the rays of one column across angles, of relative size ``1/(n_f F)`` against ``1/P``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ctuq.errors import CTUQError
from ctuq.geometry import VolumeGeometry
from ctuq.options import MeasurementKind

__all__ = [
    "ScanSource",
    "SubsetSource",
    "ValueOrigin",
    "VECTOR_PARTS",
    "vector_file_origin",
    "log_count_variance",
    "count_variance",
    "binned_variance",
    "bin_pixels",
    "column_plan",
    "positive_int",
    "detector_record",
]


# --------------------------------------------------------------------------------------------- pixel arithmetic
def log_count_variance(P: np.ndarray, F: np.ndarray, read_noise: float = 0.0) -> np.ndarray:
    """``Var(−log(P/F))`` per pixel (module docstring) for a flat that is the mean of two frames and one dark (the
    walnut data set's): ``P = p − dark``, ``F = mean(flats) − dark`` in counts (arrays of one shape, > 0),
    ``read_noise`` the per-frame read-noise sd in counts; in photons² / photons, i.e. for one count per photon. The
    ``1/12`` is the rounding of integer counts."""
    q = float(read_noise) ** 2 + 1.0 / 12.0
    iP, iF = 1.0 / P, 1.0 / F
    return iP + 0.5 * iF + q * (iP * iP + 0.5 * iF * iF + (iP - iF) ** 2)


def count_variance(P: np.ndarray, F: np.ndarray, read_noise: float, n_flats: int, n_darks: int) -> np.ndarray:
    """``Var(−log(P/F))`` per pixel (module docstring) for a flat that is the mean of ``n_flats`` frames and a dark
    of ``n_darks``: ``P = p − dark``, ``F = flat − dark`` in counts (same shape, > 0), ``read_noise`` the per-frame
    read-noise sd (counts). For two flats and one dark this is :func:`log_count_variance`."""
    if (n_flats, n_darks) == (2, 1):
        return log_count_variance(P, F, read_noise)
    q = float(read_noise) ** 2 + 1.0 / 12.0
    iP, iF = 1.0 / P, 1.0 / F
    a, b = 1.0 / n_flats, 1.0 / n_darks
    return iP + a * iF + q * (iP * iP + a * iF * iF + b * (iP - iF) ** 2)


def positive_int(value, name: str) -> int:
    """``value`` as an int ≥ 1; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def column_plan(n_cols: int, step: int, binning: bool) -> tuple[np.ndarray, float]:
    """Columns to read and the fractional column (pixel units from the detector centre) of the new detector
    centre. Subsampling keeps columns ``0, k, 2k, …``; binning averages ``k`` adjacent columns per block (the
    remainder columns at the far end are dropped). ``ValueError`` when ``step > n_cols``."""
    if step > n_cols:
        raise ValueError(f"detector_subsampling {step} exceeds the {n_cols} detector columns")
    if binning:
        m = n_cols // step
        cols = np.arange(m * step)
        centre = (m * step - 1) / 2.0
    else:
        cols = np.arange(0, n_cols, step)
        centre = (cols[0] + cols[-1]) / 2.0
    return cols, centre - (n_cols - 1) / 2.0


def bin_pixels(a: np.ndarray, step: int, axis: int) -> np.ndarray:
    """Means of ``step`` adjacent entries along ``axis`` (its length a multiple of ``step``)."""
    if step == 1:
        return a
    a = np.moveaxis(a, axis, -1)
    a = a.reshape(*a.shape[:-1], a.shape[-1] // step, step).mean(axis=-1)
    return np.moveaxis(a, -1, axis)


def binned_variance(t: np.ndarray, var: np.ndarray, steps: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Transmissions ``t`` ``(n_r, n_c)`` binned by ``steps`` (rows, columns) and ``Var(−log t̄)`` from the pixels'
    ``Var(−log t)``: ``Σ t_j² Var_j / (k t̄)²`` over each block of ``k`` pixels (module docstring)."""
    tb = bin_pixels(bin_pixels(t, steps[0], 0), steps[1], 1)
    k = steps[0] * steps[1]
    return tb, bin_pixels(bin_pixels(t * t * var, steps[0], 0), steps[1], 1) / (k * tb * tb)


# --------------------------------------------------------------------------------------------- where values come from
#: The four 3-vectors of a geometry row (columns 1–3, 4–6, 7–9, 10–12 of ``vectors``) by the name
#: :meth:`ScanSource.origin` takes, with the words messages use for them.
VECTOR_PARTS = {
    "source": "source position",
    "detector": "detector centre",
    "u_step": "u step",
    "v_step": "v step",
}


@dataclasses.dataclass(frozen=True)
class ValueOrigin:
    """Where a value of an opened scan came from, for messages (:meth:`ScanSource.origin`): a file and, where the
    format knows it, the row or field in it. ``str`` gives ``"<file>: <field>"`` (``"<file>:<field>"`` for an HDF5
    path, as h5py names datasets), or the file alone."""

    file: Path
    field: str | None = None

    def __str__(self) -> str:
        if self.field is None:
            return str(self.file)
        sep = ":" if self.field.startswith("/") else ": "
        return f"{self.file}{sep}{self.field}"


def _data_line(path: Path, row: int) -> int | None:
    """The 1-based line of text file ``path`` that holds data row ``row`` (blank lines and ``#`` comments skipped,
    as the vector readers skip them); ``None`` when the file cannot be read or is shorter."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    data = [i + 1 for i, line in enumerate(lines) if line.split("#", 1)[0].strip()]
    return data[row] if 0 <= row < len(data) else None


def vector_file_origin(path: Path, part: str, row: int | None = None) -> ValueOrigin:
    """The origin of ``part`` (a :data:`VECTOR_PARTS` name) of geometry row ``row`` in a text file of ASTRA vectors,
    one row per line (the walnut ``.geom`` file, ``scan.yaml``'s ``geometry.vectors``): ``"line 3, columns 7–9 (u
    step)"``; the file alone without ``row``."""
    if row is None:
        return ValueOrigin(Path(path))
    first = 3 * list(VECTOR_PARTS).index(part) + 1
    line = _data_line(Path(path), row)
    where = f"row {row}" if line is None else f"line {line}"
    return ValueOrigin(Path(path), f"{where}, columns {first}–{first + 2} ({VECTOR_PARTS[part]})")


# --------------------------------------------------------------------------------------------- the protocol
class ScanSource(ABC):
    """An opened scan (module docstring): geometry, angle plan, measurements, ground truth, grid facts.

    Opening (a format's ``open``) validates the description, the geometry, flats and darks and the projection
    headers; projections are read on demand. Subclasses set the attributes below (plain attributes or
    properties) and implement the abstract methods; the error messages and :meth:`record` have defaults a format
    may refine.

    Attributes
    ----------
    path : Path
        The folder or file that describes the scan (named in messages and ``CTData.meta``).
    proj_dir : Path
        Where the projections are (the walnut orbit's folder, or the described file), for messages.
    n_files : int
        Projections stored (rows of ``vectors``).
    n_distinct_angles : int
        Distinct projection angles (what :meth:`angle_plan` subsamples; the walnut layout's last file repeats the
        first angle).
    has_ground_truth : bool
        Whether the scan holds a ground truth on its volume grid.
    geometry_type : str
        :class:`ctuq.options.ScanGeometry` value: ``cone`` (several detector rows), ``fan`` (one row) or
        ``parallel``.
    format : str
        The format's registry name (``ctuq.registry.DATA_FORMATS``).
    measurement : str
        :class:`ctuq.options.MeasurementKind` value: raw ``counts`` (with flats and darks) or ``line_integrals``.
    vectors : (n_files, 12) float64
        Per projection (file order of :meth:`angle_plan`'s geometry rows): ``cone_vec`` rows (source, detector
        centre, u step, v step) or ``parallel3d_vec`` rows (ray direction, …), mm.
    det_shape : (int, int)
        ``(det_rows, det_cols)``: row ``r``, column ``k`` at ``d + (k − (n_cols − 1)/2)·u + (r − (n_rows − 1)/2)·v``.
    gt_shape : (int, int, int)
        The volume grid ``(n_z, n_y, n_x)`` (the ground truth's, where there is one).
    voxel_size : float
        Its voxel edge (mm); ``voxel_size_source`` says where it came from.
    n_flats, n_darks : int
        Frames averaged into the flat and the dark (0 for line integrals).
    read_noise : float
        Per-frame read-noise sd (counts) of :func:`count_variance`.
    error : type
        The format's error class (a :class:`~ctuq.errors.CTUQError`), raised for malformed files.
    """

    path: Path
    proj_dir: Path
    n_files: int
    n_distinct_angles: int
    has_ground_truth: bool
    format: str
    geometry_type: str
    measurement: str
    vectors: np.ndarray
    det_shape: tuple[int, int]
    gt_shape: tuple[int, int, int]
    voxel_size: float
    voxel_size_source: str
    n_flats: int
    n_darks: int
    read_noise: float
    error: type[CTUQError]

    # ------------------------------------------------------------------ facts
    @abstractmethod
    def describe_angles(self) -> str:
        """How the scan holds its angles, for messages (``"tubeV2 has 33 files, 32 distinct angles"``)."""

    @property
    def has_variances(self) -> bool:
        """Whether per-measurement variances are known (counts, or line integrals with variances)."""
        return self.measurement == MeasurementKind.COUNTS

    # ------------------------------------------------------------------ angle plans
    @abstractmethod
    def angle_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        """The geometry rows one in ``angular_subsampling`` keeps and the projection (file) indices holding them:
        two ``(n_used,)`` int arrays, geometry rows increasing."""

    def heldout_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        """The distinct angles :meth:`angle_plan` does not keep: ``(rows, files)`` ``(n_held,)`` int arrays in
        geometry-row order (empty when subsampling keeps every angle)."""
        rows, files = self.angle_plan(1)
        held = ~np.isin(rows, self.angle_plan(angular_subsampling)[0])
        return rows[held], files[held]

    # ------------------------------------------------------------------ grid and ground truth
    def ground_truth_grid(self) -> VolumeGeometry:
        """The 3D volume grid ``(n_z, n_y, n_x)``, voxel :attr:`voxel_size`, centred at the origin."""
        return VolumeGeometry(self.gt_shape, self.voxel_size)

    def slice_z(self, slice_index: int) -> float:
        """Height (mm) of slice ``slice_index`` of the volume grid: ``(k + ½ − n_z/2)·h``."""
        return (slice_index + 0.5 - self.gt_shape[0] / 2.0) * self.voxel_size

    @abstractmethod
    def read_ground_truth_slice(self, slice_index: int) -> np.ndarray:
        """Ground-truth slice ``(n_y, n_x)`` float64 (mm⁻¹), checked for shape and finiteness."""

    def ground_truth_files(self, slices: Sequence[int]) -> list[str] | None:
        """Names of the files holding ground-truth ``slices``, for ``CTData.meta`` (``None``: the format keeps the
        ground truth in one array, which :meth:`record` names)."""
        return None

    # ------------------------------------------------------------------ measurements
    @abstractmethod
    def projection(self, index: int) -> np.ndarray:
        """Projection ``index`` (a file index of :meth:`angle_plan`) as measured: ``det_shape`` float64 counts or
        line integrals, checked for finiteness."""

    @abstractmethod
    def flat_dark(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The mean flat and mean dark frames ``det_shape`` float64 (counts), or ``None`` for line integrals."""

    def projection_variances(self, index: int) -> np.ndarray | None:
        """Given variances of line-integral projection ``index`` (``det_shape`` float64), or ``None``."""
        return None

    def corrected_counts(self, index: int, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(p − dark, flat − dark)`` (counts) on the pixels ``rows × cols`` of projection ``index``, each
        ``(len(rows), len(cols))`` and > 0; raises :attr:`error` naming the file where ``flat ≤ dark`` or
        ``p ≤ dark``."""
        rows, cols = np.asarray(rows), np.asarray(cols)
        flat, dark = self.flat_dark()
        d = dark[np.ix_(rows, cols)]
        f = flat[np.ix_(rows, cols)]
        bad = f <= d
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise self.flat_error(int(bad.sum()), int(rows[r]), int(cols[c]), float(f[r, c]), float(d[r, c]))
        p = self.projection(index)[np.ix_(rows, cols)]
        bad = p <= d
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise self.counts_error(index, int(bad.sum()), int(rows[r]), int(cols[c]), float(p[r, c]), float(d[r, c]))
        return p - d, f - d

    def log_rows(
        self, index: int, rows: np.ndarray, cols: np.ndarray, bin_steps: tuple[int, int] | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Line integrals and their variances (``None`` without) on ``rows × cols`` of projection ``index``,
        binned in transmission by ``bin_steps`` ``(rows, columns)`` when given: two ``(n_r, n_c)`` float64 arrays
        (module docstring)."""
        if self.measurement == MeasurementKind.COUNTS:
            P, F = self.corrected_counts(index, rows, cols)
            t = P / F
            v = count_variance(P, F, self.read_noise, self.n_flats, self.n_darks)
            if bin_steps is not None:
                t, v = binned_variance(t, v, bin_steps)
            return -np.log(t), v
        sel = np.ix_(np.asarray(rows), np.asarray(cols))
        ell = self.projection(index)[sel]
        v = self.projection_variances(index)
        v = None if v is None else v[sel]
        if bin_steps is None:
            return ell, v
        t = np.exp(-ell)
        if v is None:
            return -np.log(binned_variance(t, np.ones_like(t), bin_steps)[0]), None
        t, v = binned_variance(t, v, bin_steps)
        return -np.log(t), v

    # ------------------------------------------------------------------ messages and records
    def flat_error(self, n_bad: int, row: int, col: int, flat: float, dark: float) -> CTUQError:
        """The error for ``n_bad`` used pixels whose mean flat is not above the mean dark (first at detector
        ``row``, ``col``)."""
        return self.error(
            f"{self.path}: flat ≤ dark at {n_bad} used pixels (first at detector row {row}, column {col}: mean flat "
            f"{flat:g}, mean dark {dark:g}); the flat-field correction would divide by ≤ 0"
        )

    def counts_error(self, index: int, n_bad: int, row: int, col: int, counts: float, dark: float) -> CTUQError:
        """The error for ``n_bad`` used pixels of projection ``index`` whose counts are not above the dark."""
        return self.error(
            f"{self.path}: projection {index}: {n_bad} used pixels have counts ≤ dark (first at detector row {row}, "
            f"column {col}: {counts:g} ≤ {dark:g}); −log is undefined there"
        )

    def geometry_error(self, problem: str, *, slice_plane: bool = False) -> CTUQError:
        """The error for a geometry the loader cannot cut (``slice_plane``: the slice plane misses the detector),
        naming where the geometry comes from: ``"<path>: geometry: <problem>"``."""
        return self.error(f"{self.path}: geometry: {problem}")

    def origin(self, quantity: str, row: int | None = None) -> ValueOrigin:
        """The file (and, where known, the row or field) that ``quantity`` of this scan came from, for the
        messages of :mod:`ctuq.data.plausibility`: a :data:`VECTOR_PARTS` name (``source``, ``detector``,
        ``u_step``, ``v_step``: that part of :attr:`vectors`, ``row`` the geometry row at fault), ``voxel_size``,
        ``grid`` (:attr:`gt_shape`) or ``projections`` (the measurements). Default: :attr:`path` (:attr:`proj_dir`
        for the projections) with the geometry row; formats refine it."""
        if quantity == "projections":
            return ValueOrigin(Path(self.proj_dir))
        if quantity in VECTOR_PARTS and row is not None:
            return ValueOrigin(Path(self.path), f"geometry row {row} ({VECTOR_PARTS[quantity]})")
        return ValueOrigin(Path(self.path))

    def record(self, rows, files, angular_subsampling, detector_subsampling, binning, cols) -> dict:
        """The source's entries of ``CTData.meta`` for the geometry ``rows`` read from projections ``files`` with
        the given subsampling and detector columns ``cols`` (JSON-serialisable)."""
        return {
            "format": self.format,
            "path": str(self.path),
            "geometry_type": self.geometry_type,
            "measurement": self.measurement,
            "n_projections": self.n_files,
            "detector_shape": list(self.det_shape),
            "n_flats": self.n_flats,
            "n_darks": self.n_darks,
            "read_noise_counts": self.read_noise,
            "gt_shape": list(self.gt_shape),
            "gt_voxel_size_mm": self.voxel_size,
            "gt_voxel_size_source": self.voxel_size_source,
            "has_ground_truth": self.has_ground_truth,
            **detector_record(rows, files, angular_subsampling, detector_subsampling, binning, cols),
        }


def detector_record(rows, files, angular_subsampling, detector_subsampling, binning, cols) -> dict:
    """The ``CTData.meta`` entries of a subsampling: factors, geometry rows and projection indices read, detector
    columns (first, last, step, subsample or bin)."""
    return {
        "angular_subsampling": int(angular_subsampling),
        "detector_subsampling": int(detector_subsampling),
        "detector_binning": bool(binning),
        "geometry_rows": [int(r) for r in rows],
        "projection_indices": [int(f) for f in files],
        "detector_columns": {
            "first": int(cols[0]),
            "last": int(cols[-1]),
            "step": int(detector_subsampling),
            "mode": "bin" if binning else "subsample",
        },
    }


class SubsetSource:
    """A scan (any :class:`~ctuq.data.source.ScanSource`) of which only the geometry rows ``used`` are measured; the
    scan's other distinct angles are its held-out angles. A proxy: everything but the angle plan is the scan's own."""

    def __init__(self, base: ScanSource, used: np.ndarray):
        """``used``: the geometry rows measured (of ``base.angle_plan(1)``)."""
        self._base = base
        rows, files = base.angle_plan(1)
        keep = np.isin(rows, used)
        self._rows, self._files = rows[keep], files[keep]

    def __getattr__(self, name: str) -> Any:  # the scan's own facts, geometry and readers
        if name.startswith("__") or name == "_base":
            raise AttributeError(name)
        return getattr(self._base, name)

    @property
    def base(self) -> ScanSource:
        """The whole scan."""
        return self._base

    @property
    def n_distinct_angles(self) -> int:
        return len(self._rows)

    def describe_angles(self) -> str:
        return f"the subset uses {len(self._rows)} of its {self._base.n_distinct_angles} distinct angles"

    def angle_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        k = int(angular_subsampling)
        return self._rows[::k].copy(), self._files[::k].copy()

    def heldout_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        rows, files = self._base.angle_plan(1)
        held = ~np.isin(rows, self.angle_plan(angular_subsampling)[0])
        return rows[held], files[held]
