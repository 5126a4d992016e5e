"""Loader for the cone-beam walnut layout (Der Sarkissian et al. 2019; DESIGN.md §4) and scans written by
``ctuq simulate`` in the same layout.

A ``Walnut{id}`` folder holds ``Projections/tubeV{1,2,3}/`` (``scan_{:06}.tif`` × N, dark ``di000000.tif``,
flats ``io000000.tif``/``io000001.tif``, ``scan_geom_corrected.geom`` with N rows of ASTRA ``cone_vec`` vectors in
mm) and ``Reconstructions/full_AGD_50_{:06}.tiff`` (ground-truth slices). Everything is sized from the files:
detector shape from the dark frame, number of projections from the listing (checked against the geometry rows),
ground-truth shape from the slice files. Only the projection files needed are read.

Rules (those of the data set):

* raw image → projection ``P = transpose(flipud(raw))`` (``det_rows × det_cols``);
* ``−log((P − dark)/(flat − dark))`` with ``flat`` the mean of the two flats;
* angular subsampling ``ass``: geometry row ``k·ass`` (for ``k·ass < N−1``) pairs with file ``N−1−k·ass``;
* detector columns: every ``k``-th column starting at column 0 (default, the published sparse setting: it keeps
  every sample's noise as measured and matches ``c = 60 × 128`` of the papers), or, with
  ``detector_binning=True``, the mean *transmission* of ``k`` adjacent columns (less noise, wider pixels).
  ``u`` becomes ``k·u`` and the detector centre moves to the centre of the kept columns, exactly;
* ground truth: voxel size from the ``voxel_size`` argument, else the simulation sidecar, else the data set's
  0.1 mm; the grid is centred at the origin and slice ``k`` lies at ``z = (k + ½ − n_z/2)·h`` (ctuq's
  convention, ``ctuq.geometry``).

2D slices (:func:`load_walnut_slice`): the sinogram of the plane ``z`` is read off the detector along the line
where the plane through the source and the horizontal line ``{(t·ĥ, z)}`` (``ĥ ⊥`` the source direction; it
contains the central ray through ``(0, 0, z)``) cuts the detector: per angle and column a fractional row, the two
neighbouring rows linearly interpolated (after the log). For a source in the slice plane (orbit 2, central slice)
this plane *is* ``z = const`` and the ``fanflat_vec`` geometry built from the 3D vectors (source xy, detector
points xy) is exact — including a tilted detector, whose row line is then slanted (handled per column). Otherwise
the rays leave the plane by the cone angle, which is reported in a warning. With ``backend="astra_cuda"`` the
operator is the exact cone-beam slice model instead (``AstraCudaRayTransform.cone_slice``, GPU). A coarser
``image_shape`` over the same field of view area-averages the ground truth exactly (box-overlap weights).

3D volumes (:func:`load_walnut_volume`, GPU): the ``cone_vec`` geometry with rows and columns subsampled, the
ASTRA CUDA operator, the ground-truth volume stacked from all slices and area-averaged to ``image_shape``.
:func:`read_walnut_volume` / :func:`read_walnut_slice` do everything but build the operator (CPU-testable).

Per-measurement noise variances (``CTData.variances``, same shape and axis order as ``y``): with ``P = p − dark``
and ``F = mean(flats) − dark`` in counts of one pixel, and ``q = σ_r² + 1/12`` (read noise and the rounding of
integer counts, per frame), the delta method gives for ``ℓ = −log(P/F)`` (Poisson ``p`` and flats; the flat is the
mean of two frames, so its terms halve; the dark frame enters both and its noise counts through ``1/P − 1/F``)::

    Var ℓ ≈ 1/P + 1/(2F) + q · (1/P² + 1/(2F²) + (1/P − 1/F)²)            (:func:`log_count_variance`)

in photons, i.e. for a detector gain of one count per photon (a simulated scan's; on real data the gain is
unknown and the likelihood's learned scale ``σ²`` absorbs it: only the *relative* variances are used). ``σ_r``
is the sidecar's ``read_noise`` for a simulated scan and 0 otherwise (:attr:`WalnutScan.read_noise`). Binning ``k``
columns (and rows) averages transmissions ``t_j`` (independent pixels): ``Var(−log mean t) ≈ Σ_j t_j² Var ℓ_j /
(k t̄)²``; the 2D slice's interpolation between detector rows ``r0`` and ``r0 + 1`` with weight ``w`` gives
``(1 − w)² Var ℓ_r0 + w² Var ℓ_(r0+1)``. Subsampling keeps each pixel's own variance. The CT front end multiplies
by ``dip.scale²`` (the data scale) only implicitly: the likelihood takes them normalised to mean 1. Errors that
the diagonal model leaves out: the flat and dark noise is shared by every angle of a detector pixel (a correlation
of the rays of one column across angles, of relative size ``1/(2F)`` against ``1/P``).

Malformed input raises :class:`WalnutFormatError` naming the file and the problem.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch

from ctuq.errors import CTUQError
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import AstraCudaRayTransform, backend_names, make_ray_transform
from ctuq.options import Backend
from ctuq.utils import progress as _progress_bar

__all__ = [
    "CTData",
    "WalnutFormatError",
    "WalnutScan",
    "area_average",
    "default_data_dir",
    "load_walnut_slice",
    "load_walnut_volume",
    "read_walnut_slice",
    "read_walnut_volume",
    "DEFAULT_VOXEL_SIZE",
    "SIDECAR_NAME",
    "PROJECTION_PATTERN",
    "DARK_NAME",
    "FLAT_NAMES",
    "GEOMETRY_NAME",
    "GT_PATTERN",
    "log_count_variance",
]

DEFAULT_VOXEL_SIZE = 0.1  # mm, the data set's ground-truth voxel
DEFAULT_GT_SHAPE = (501, 501, 501)  # the data set's ground truth, used only when a folder has no Reconstructions
# The file names of the layout (the one home of each; the simulator writes them, the loader reads them).
SIDECAR_NAME = "ctuq_simulation.json"  # a simulated scan's parameters (absent from the real data set)
PROJECTION_PATTERN = "scan_{:06}.tif"  # raw projections, in Projections/tubeV{orbit}/
DARK_NAME = "di000000.tif"
FLAT_NAMES = ("io000000.tif", "io000001.tif")  # before and after the scan; averaged
GEOMETRY_NAME = "scan_geom_corrected.geom"
GT_PATTERN = "full_AGD_50_{:06}.tiff"  # ground-truth slices, in Reconstructions/
_PROJ_RX = re.compile(r"^scan_(\d{6})\.tif$")
_GT_RX = re.compile(r"^full_AGD_50_(\d{6})\.tiff$")
_CONE_WARN_DEG = 0.01  # below this the slice model is exact to well within detector noise


class WalnutFormatError(CTUQError):
    """A walnut folder, file, shape or value is not what the layout requires; the message names the file.

    A user error (:class:`ctuq.errors.CTUQError`, hence also a ``ValueError``)."""


@dataclasses.dataclass
class CTData:
    """A loaded scan: operator, measurements, ground truth, geometry.

    Attributes
    ----------
    op : RayTransform or None
        ``T`` on the requested device (``None`` from the ``read_*`` functions, which build no operator).
    y : torch.Tensor
        Log-transformed projections, ``op.measurement_shape`` — ``(n_angles, n_cols)`` for a slice,
        ``(n_angles, n_rows, n_cols)`` for a volume — float32, on the device (CPU for ``read_*``); line
        integrals (dimensionless: mm⁻¹ × mm).
    ground_truth : torch.Tensor or None
        ``op.image_shape`` (``(H, W)`` or ``(D, H, W)``), float32, CPU, mm⁻¹; ``None`` without Reconstructions.
    volume : VolumeGeometry
        The image grid (mm), centred at the origin (2D: the slice plane).
    geometry : ProjectionGeometry
        2D: the slice's ``fanflat_vec`` geometry (also when the operator is the exact cone-beam slice, whose own
        one-row ``cone_vec`` geometry is ``slice_cone_geometry``); 3D: the subsampled ``cone_vec`` geometry.
    meta : dict
        JSON-serialisable record: files and geometry rows used, slice index and ``z``, voxel sizes, detector rows
        used, subsampling, cone angle, backend, …
    slice_cone_geometry : ProjectionGeometry or None
        2D: the exact one-row ``cone_vec`` geometry of the slice (detector centre at the interpolated row).
    variances : torch.Tensor or None
        Predicted variance of each measurement from the photon statistics (module docstring), same shape, axis
        order, dtype and device as ``y``, in data units² for a gain of one count per photon (on real data only the
        ratios are meaningful); ``None`` where a source has no counts.
    """

    op: Any
    y: torch.Tensor
    ground_truth: torch.Tensor | None
    volume: VolumeGeometry
    geometry: ProjectionGeometry
    meta: dict
    slice_cone_geometry: ProjectionGeometry | None = None
    variances: torch.Tensor | None = None

    def __post_init__(self):
        if self.variances is not None:
            v = self.variances
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(self.y.shape):
                got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"CTData: variances must have the sinogram's shape {tuple(self.y.shape)}, got {got}")
            bad = ~(torch.isfinite(v) & (v > 0))
            if bad.any():
                first = tuple(int(i) for i in bad.nonzero()[0])
                raise ValueError(
                    f"CTData: variances must be finite and positive; {int(bad.sum())} are not (first at index "
                    f"{first}: {float(v[first])})"
                )


def log_count_variance(P: np.ndarray, F: np.ndarray, read_noise: float = 0.0) -> np.ndarray:
    """``Var(−log(P/F))`` per pixel (module docstring): ``P = p − dark``, ``F = mean(flats) − dark`` in counts
    (arrays of one shape, > 0), ``read_noise`` the per-frame read-noise sd in counts; in photons² / photons, i.e.
    for one count per photon. The ``1/12`` is the rounding of integer counts."""
    q = float(read_noise) ** 2 + 1.0 / 12.0
    iP, iF = 1.0 / P, 1.0 / F
    return iP + 0.5 * iF + q * (iP * iP + 0.5 * iF * iF + (iP - iF) ** 2)


def default_data_dir() -> Path:
    """The default scan: ``$CTUQ_DATA`` if set, else the repository's bundled simulated ``data/Walnut1``.

    Raises ``FileNotFoundError`` (saying how to get one) when that folder does not exist.
    """
    env = os.environ.get("CTUQ_DATA")
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"$CTUQ_DATA is {env!r}, which is not a folder (a Walnut{{id}} folder is needed)")
        return path
    path = Path(__file__).resolve().parents[2] / "data" / "Walnut1"
    if not path.is_dir():
        raise FileNotFoundError(
            f"the bundled scan {path} does not exist (it ships with the source repository, not with a wheel); "
            f"create it with `ctuq simulate --preset bundled --out {path}`, or set $CTUQ_DATA to a Walnut folder"
        )
    return path


# --------------------------------------------------------------------------------------------- resampling
def _overlap_matrix(n_in: int, n_out: int) -> np.ndarray:
    """``(n_out, n_in)`` box-overlap weights: output cell ``i`` is the area-weighted mean of the input cells it
    covers when both grids span the same interval (rows sum to 1; works for any, also non-integer, ratio)."""
    e_in = np.arange(n_in + 1) / n_in
    e_out = np.arange(n_out + 1) / n_out
    lo = np.maximum(e_out[:-1, None], e_in[None, :-1])
    hi = np.minimum(e_out[1:, None], e_in[None, 1:])
    return np.clip(hi - lo, 0.0, None) * n_out


def area_average(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Resample ``array`` onto a grid of ``shape`` covering the same extent by exact area (volume) averaging.

    Each output pixel is the mean of the input over its footprint (box-overlap weights per axis, separable), so
    the image mean is preserved and constant images stay constant; ratios such as 501 → 128 need no rounding.
    ``array``: ``(n_0, …)``; returns float64 ``shape``.
    """
    out = np.asarray(array, dtype=np.float64)
    shape = tuple(int(s) for s in shape)
    if len(shape) != out.ndim or min(shape) < 1:
        raise ValueError(f"area_average: target shape {shape} does not fit an array of shape {out.shape}")
    for axis, n_out in enumerate(shape):
        if out.shape[axis] != n_out:
            w = _overlap_matrix(out.shape[axis], n_out)
            out = np.moveaxis(np.tensordot(w, out, axes=([1], [axis])), 0, axis)
    return out


# --------------------------------------------------------------------------------------------- the folder
def _read_header(path: Path) -> tuple[tuple[int, ...], np.dtype]:
    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            return tuple(series.shape), np.dtype(series.dtype)
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file
        raise WalnutFormatError(f"{path}: not a readable TIFF ({type(exc).__name__}: {exc})") from exc


def _read_tiff(path: Path) -> np.ndarray:
    if not path.is_file():
        raise WalnutFormatError(f"{path}: file missing")
    try:
        return np.asarray(tifffile.imread(path))
    except Exception as exc:  # noqa: BLE001 - re-raised naming the file
        raise WalnutFormatError(f"{path}: not a readable TIFF ({type(exc).__name__}: {exc})") from exc


def _contiguous(indices: list[int], folder: Path, pattern: str) -> int:
    """Number of files ``0 … n−1``; raises naming the first missing one."""
    if not indices:
        return 0
    present = set(indices)
    n = max(indices) + 1
    missing = [i for i in range(n) if i not in present]
    if missing:
        raise WalnutFormatError(
            f"{folder}: {len(missing)} of the files {pattern.format(0)} … {pattern.format(n - 1)} are missing, "
            f"first {pattern.format(missing[0])}"
        )
    return n


class WalnutScan:
    """One orbit of a ``Walnut{id}`` folder: validated layout, geometry vectors and file access.

    Opening reads only the geometry file, TIFF headers and the folder listings; pixel data are read on demand.

    Parameters
    ----------
    path : path
        The ``Walnut{id}`` folder.
    orbit : int
        1, 2 or 3 (``Projections/tubeV{orbit}``).
    voxel_size : float, optional
        Ground-truth voxel edge (mm); default: the sidecar's, else 0.1.

    Attributes
    ----------
    n_files : int
        Projection files ``N`` (geometry rows too).
    det_shape : (int, int)
        ``(det_rows, det_cols)`` after ``transpose(flipud(raw))``.
    vectors : (N, 12) float64
        ``cone_vec`` rows (mm).
    gt_shape : (int, int, int)
        Ground-truth ``(n_z, n_y, n_x)`` (from the files; else the sidecar's or 501³).
    has_ground_truth : bool
    voxel_size : float
        Ground-truth voxel edge (mm); ``voxel_size_source`` says where it came from.
    sidecar : dict or None
        ``ctuq_simulation.json`` of a simulated scan.
    read_noise : float
        Per-frame read-noise sd (counts) used for :attr:`CTData.variances`: the sidecar's for a simulated scan
        with noise, else 0.
    """

    def __init__(self, path: str | os.PathLike, orbit: int = 2, voxel_size: float | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise WalnutFormatError(f"walnut folder {self.path} does not exist (or is not a folder)")
        if orbit not in (1, 2, 3):
            raise ValueError(f"orbit must be 1, 2 or 3, got {orbit!r}")
        self.orbit = int(orbit)
        self.proj_dir = self.path / "Projections" / f"tubeV{self.orbit}"
        if not self.proj_dir.is_dir():
            have = (
                sorted(p.name for p in (self.path / "Projections").glob("tubeV*"))
                if (self.path / "Projections").is_dir()
                else []
            )
            raise WalnutFormatError(
                f"{self.proj_dir}: projection folder missing (orbit {self.orbit}); "
                + (f"this scan has {', '.join(have)}" if have else f"{self.path} has no Projections/tubeV* folder")
            )
        self.sidecar = self._read_sidecar()

        idx = [int(m.group(1)) for p in self.proj_dir.iterdir() if (m := _PROJ_RX.match(p.name))]
        self.n_files = _contiguous(idx, self.proj_dir, "scan_{:06}.tif")
        if self.n_files < 2:
            raise WalnutFormatError(
                f"{self.proj_dir}: found {self.n_files} projection files scan_NNNNNN.tif; need at least 2"
            )
        self.vectors = self._read_geometry()
        if self.vectors.shape[0] != self.n_files:
            raise WalnutFormatError(
                f"{self.proj_dir / GEOMETRY_NAME}: {self.vectors.shape[0]} geometry rows, but the folder has "
                f"{self.n_files} projection files (scan_000000.tif … scan_{self.n_files - 1:06}.tif); they must match"
            )

        shape, _ = _read_header(self._need(DARK_NAME))
        if len(shape) != 2:
            raise WalnutFormatError(f"{self.proj_dir / DARK_NAME}: expected a 2D image, got shape {shape}")
        self.raw_shape = shape
        self.det_shape = (shape[1], shape[0])  # transpose(flipud(raw))
        for name in FLAT_NAMES:
            self._check_raw_shape(self._need(name), _read_header(self._need(name))[0])

        self.rec_dir = self.path / "Reconstructions"
        gt_idx = (
            [int(m.group(1)) for p in self.rec_dir.iterdir() if (m := _GT_RX.match(p.name))]
            if self.rec_dir.is_dir()
            else []
        )
        self.has_ground_truth = bool(gt_idx)
        if self.has_ground_truth:
            n_z = _contiguous(gt_idx, self.rec_dir, GT_PATTERN)
            first = self.rec_dir / GT_PATTERN.format(0)
            s, _ = _read_header(first)
            if len(s) != 2:
                raise WalnutFormatError(f"{first}: ground-truth slice must be a 2D image (n_y, n_x), got shape {s}")
            self.gt_shape = (n_z, s[0], s[1])
        elif self.sidecar and "gt_shape" in self.sidecar:
            self.gt_shape = tuple(int(v) for v in self.sidecar["gt_shape"])
        else:
            self.gt_shape = DEFAULT_GT_SHAPE

        if voxel_size is not None:
            if not (voxel_size > 0 and math.isfinite(voxel_size)):
                raise ValueError(f"voxel_size must be positive and finite (mm), got {voxel_size}")
            self.voxel_size, self.voxel_size_source = float(voxel_size), "argument"
        elif self.sidecar and "gt_voxel_size_mm" in self.sidecar:
            self.voxel_size, self.voxel_size_source = float(self.sidecar["gt_voxel_size_mm"]), SIDECAR_NAME
        else:
            self.voxel_size, self.voxel_size_source = DEFAULT_VOXEL_SIZE, "default (data set)"
        self._dark: np.ndarray | None = None
        self._flat: np.ndarray | None = None
        params = (self.sidecar or {}).get("parameters") or {}
        # a simulated scan states its read noise; for real data it is unknown and taken as 0 (Poisson terms only)
        self.read_noise = float(params.get("read_noise", 0.0)) if params.get("noise", True) else 0.0

    # ------------------------------------------------------------------ files
    def _need(self, name: str) -> Path:
        p = self.proj_dir / name
        if not p.is_file():
            raise WalnutFormatError(f"{p}: file missing")
        return p

    def _read_sidecar(self) -> dict | None:
        p = self.path / SIDECAR_NAME
        if not p.is_file():
            return None
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise WalnutFormatError(f"{p}: not valid JSON ({exc})") from exc
        if not isinstance(d, dict):
            raise WalnutFormatError(f"{p}: expected a JSON object")
        if d.get("complete") is False:
            raise WalnutFormatError(
                f"{p}: the simulation that wrote this scan did not finish (complete: false); "
                f"run `ctuq simulate --overwrite` again"
            )
        return d

    def _read_geometry(self) -> np.ndarray:
        p = self._need(GEOMETRY_NAME)
        rows = []
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                values = [float(v) for v in line.split()]
            except ValueError as exc:
                raise WalnutFormatError(f"{p}: line {i + 1} is not a row of numbers ({exc})") from exc
            if len(values) != 12:
                raise WalnutFormatError(
                    f"{p}: line {i + 1} has {len(values)} columns; a cone_vec geometry row needs 12 "
                    f"(source xyz, detector centre xyz, u xyz, v xyz)"
                )
            rows.append(values)
        vec = np.array(rows, dtype=np.float64).reshape(-1, 12)
        bad = ~np.all(np.isfinite(vec), axis=1)
        if bad.any():
            raise WalnutFormatError(
                f"{p}: {int(bad.sum())} geometry rows contain NaN or Inf (first: row {int(np.argmax(bad))})"
            )
        return vec

    def _check_raw_shape(self, path: Path, shape: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(self.raw_shape):
            raise WalnutFormatError(
                f"{path}: image shape {tuple(shape)} differs from the dark frame {DARK_NAME} {tuple(self.raw_shape)} "
                f"(raw images are det_cols × det_rows)"
            )

    def read_image(self, name: str) -> np.ndarray:
        """One raw file of the orbit as a ``(det_rows, det_cols)`` float64 array (``transpose(flipud(raw))``),
        checked for shape and finiteness."""
        path = self._need(name)
        raw = _read_tiff(path)
        self._check_raw_shape(path, raw.shape)
        img = np.transpose(np.flipud(raw)).astype(np.float64)
        if not np.all(np.isfinite(img)):
            bad = ~np.isfinite(img)
            r, c = np.argwhere(bad)[0]
            raise WalnutFormatError(
                f"{path}: {int(bad.sum())} pixels are NaN or Inf (first at row {r}, column {c} "
                f"of the loaded {self.det_shape} projection)"
            )
        return img

    def dark(self) -> np.ndarray:
        """Dark frame ``(det_rows, det_cols)`` (counts)."""
        if self._dark is None:
            self._dark = self.read_image(DARK_NAME)
        return self._dark

    def flat(self) -> np.ndarray:
        """Mean of the two flat fields ``(det_rows, det_cols)`` (counts)."""
        if self._flat is None:
            self._flat = 0.5 * (self.read_image(FLAT_NAMES[0]) + self.read_image(FLAT_NAMES[1]))
        return self._flat

    def projection_name(self, file_index: int) -> str:
        """File name ``scan_{file_index:06}.tif``."""
        return f"scan_{int(file_index):06}.tif"

    def transmission(self, file_index: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """``(P − dark)/(flat − dark)`` on the pixels ``rows × cols`` of projection file ``file_index``:
        ``(len(rows), len(cols))``. Raises naming the file when ``flat ≤ dark`` or ``P ≤ dark`` there."""
        P, F = self.corrected_counts(file_index, rows, cols)
        return P / F

    def corrected_counts(self, file_index: int, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(P − dark, flat − dark)`` in counts on the pixels ``rows × cols`` of projection file ``file_index``,
        each ``(len(rows), len(cols))``, > 0 (their ratio is :meth:`transmission`; with :func:`log_count_variance`
        they give the measurement's variance). Raises naming the file when ``flat ≤ dark`` or ``P ≤ dark``."""
        rows, cols = np.asarray(rows), np.asarray(cols)
        d = self.dark()[np.ix_(rows, cols)]
        f = self.flat()[np.ix_(rows, cols)]
        bad = f <= d
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise WalnutFormatError(
                f"{self.proj_dir}: flat field ≤ dark at {int(bad.sum())} used pixels (first at detector row "
                f"{rows[r]}, column {cols[c]}: mean of {FLAT_NAMES[0]}/{FLAT_NAMES[1]} = {f[r, c]:g}, "
                f"{DARK_NAME} = {d[r, c]:g}); the flat-field correction would divide by ≤ 0"
            )
        name = self.projection_name(file_index)
        p = self.read_image(name)[np.ix_(rows, cols)]
        bad = p <= d
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise WalnutFormatError(
                f"{self.proj_dir / name}: {int(bad.sum())} used pixels have counts ≤ dark, i.e. non-positive "
                f"transmission (first at detector row {rows[r]}, column {cols[c]}: {p[r, c]:g} ≤ {d[r, c]:g}); "
                f"−log is undefined there"
            )
        return p - d, f - d

    # ------------------------------------------------------------------ geometry
    def angle_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        """Geometry rows ``k·ass < N−1`` and their files ``N−1−k·ass``: two int arrays."""
        ass = _positive_int(angular_subsampling, "angular_subsampling")
        rows = np.arange(0, self.n_files - 1, ass)
        return rows, (self.n_files - 1) - rows

    def ground_truth_grid(self) -> VolumeGeometry:
        """The 3D ground-truth grid ``(n_z, n_y, n_x)``, voxel :attr:`voxel_size`, centred at the origin."""
        return VolumeGeometry(self.gt_shape, self.voxel_size)

    def slice_z(self, slice_index: int) -> float:
        """Height (mm) of ground-truth slice ``slice_index``: ``(k + ½ − n_z/2)·h``."""
        return (slice_index + 0.5 - self.gt_shape[0] / 2.0) * self.voxel_size

    def read_ground_truth_slice(self, slice_index: int) -> np.ndarray:
        """Ground-truth slice ``(n_y, n_x)`` float64 (mm⁻¹)."""
        path = self.rec_dir / GT_PATTERN.format(int(slice_index))
        img = _read_tiff(path)
        if img.shape != self.gt_shape[1:]:
            raise WalnutFormatError(
                f"{path}: shape {img.shape} differs from {GT_PATTERN.format(0)}'s {self.gt_shape[1:]}"
            )
        img = img.astype(np.float64)
        if not np.all(np.isfinite(img)):
            raise WalnutFormatError(f"{path}: {int((~np.isfinite(img)).sum())} pixels are NaN or Inf")
        return img


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _column_plan(n_cols: int, step: int, binning: bool) -> tuple[np.ndarray, float]:
    """Columns to read and the fractional column (pixel units from the detector centre) of the new detector
    centre. Subsampling keeps columns ``0, k, 2k, …``; binning averages ``k`` adjacent columns per block (the
    remainder columns at the far end are dropped)."""
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


def _bin(a: np.ndarray, step: int, axis: int) -> np.ndarray:
    if step == 1:
        return a
    a = np.moveaxis(a, axis, -1)
    a = a.reshape(*a.shape[:-1], a.shape[-1] // step, step).mean(axis=-1)
    return np.moveaxis(a, -1, axis)


@dataclasses.dataclass
class _SlicePlan:
    rows: np.ndarray  # geometry rows used (n_a,)
    files: np.ndarray  # file indices (n_a,)
    cols: np.ndarray  # detector columns read
    col_step: int
    binning: bool
    frac_rows: np.ndarray  # (n_a, n_out) fractional detector row per output column
    fan: ProjectionGeometry
    cone: ProjectionGeometry
    z: float
    cone_angle_deg: float


def _plan_slice(
    scan: WalnutScan, z: float, angular_subsampling: int, detector_subsampling: int, binning: bool
) -> _SlicePlan:
    """Geometry of the detector line through the slice plane at height ``z`` (see the module docstring)."""
    step = _positive_int(detector_subsampling, "detector_subsampling")
    rows, files = scan.angle_plan(angular_subsampling)
    n_rows, n_cols = scan.det_shape
    cols, centre_off = _column_plan(n_cols, step, binning)
    vec = scan.vectors[rows]
    s, d, u, v = vec[:, 0:3], vec[:, 3:6], vec[:, 6:9], vec[:, 9:12]
    p0 = np.array([0.0, 0.0, z])
    horiz = np.linalg.norm(s[:, :2], axis=1)
    if np.any(horiz <= 0):
        raise WalnutFormatError(f"{scan.proj_dir / GEOMETRY_NAME}: a source lies on the rotation axis")
    h_dir = np.stack([-s[:, 1], s[:, 0], np.zeros(len(s))], axis=1) / horiz[:, None]
    normal = np.cross(h_dir, s - p0)  # normal of the plane through the source and the line p0 + t·ĥ
    nv = np.einsum("ij,ij->i", normal, v)
    if np.any(np.abs(nv) < 1e-12 * np.linalg.norm(normal, axis=1) * np.linalg.norm(v, axis=1)):
        raise WalnutFormatError(
            f"{scan.proj_dir / GEOMETRY_NAME}: the detector columns are parallel to the "
            f"slice plane at z = {z} mm for some angle"
        )
    # Points d + α u + β v on that plane: β = β0 + β1 α (α, β in pixels from the detector centre).
    beta0 = -np.einsum("ij,ij->i", normal, d - p0) / nv
    beta1 = -np.einsum("ij,ij->i", normal, u) / nv
    if binning:
        alpha = (np.arange(len(cols) // step) * step + (step - 1) / 2.0) - (n_cols - 1) / 2.0
    else:
        alpha = cols - (n_cols - 1) / 2.0
    frac_rows = beta0[:, None] + beta1[:, None] * alpha[None, :] + (n_rows - 1) / 2.0
    lo, hi = frac_rows.min(), frac_rows.max()
    if lo < -1e-6 or hi > n_rows - 1 + 1e-6:
        raise WalnutFormatError(
            f"{scan.proj_dir}: the slice plane z = {z:.4g} mm meets the detector at rows {lo:.2f} … {hi:.2f}, "
            f"outside the {n_rows} detector rows 0 … {n_rows - 1}; choose a slice nearer the source plane"
        )
    centre = d + centre_off * u + (beta0 + beta1 * centre_off)[:, None] * v
    u_line = step * (u + beta1[:, None] * v)
    fan = ProjectionGeometry(
        "fanflat_vec", (len(alpha),), vectors=np.concatenate([s[:, :2], centre[:, :2], u_line[:, :2]], axis=1)
    )
    cone = ProjectionGeometry("cone_vec", (1, len(alpha)), vectors=np.concatenate([s, centre, u_line, v], axis=1))
    cone_angle = float(np.degrees(np.max(np.arctan2(np.abs(s[:, 2] - z), horiz))))
    return _SlicePlan(rows, files, cols, step, binning, frac_rows, fan, cone, float(z), cone_angle)


def _check_image_shape(image_shape, ndim: int) -> tuple[int, ...] | None:
    if image_shape is None:
        return None
    shape = tuple(int(s) for s in image_shape)
    if len(shape) != ndim or min(shape) < 1:
        raise ValueError(f"image_shape {tuple(image_shape)} must be {ndim} positive ints")
    return shape


def _coarsened(grid: VolumeGeometry, image_shape: tuple[int, ...] | None) -> VolumeGeometry:
    if image_shape is None:
        return grid
    try:
        return grid.coarsened(image_shape)
    except ValueError as exc:
        raise ValueError(
            f"image_shape {image_shape} must keep the aspect ratio of the ground-truth grid "
            f"{grid.shape} (same field of view): {exc}"
        ) from exc


def _check_backend(backend: str, device) -> torch.device:
    if backend not in backend_names():
        raise ValueError(f"backend {backend!r} unknown; valid: {list(backend_names())}")
    return torch.device(device)


def _progress(iterable, total: int, desc: str, progress: bool | None):
    return _progress_bar(iterable, total=total, desc=desc, disable=None if progress is None else not progress)


def _binned_variance(t: np.ndarray, var: np.ndarray, steps: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Transmissions ``t`` binned by ``steps`` (rows, columns) and ``Var(−log t̄)`` from the pixels' ``Var(−log t)``:
    ``Σ t_j² Var_j / (k t̄)²`` over each block of ``k`` pixels (module docstring)."""
    tb = _bin(_bin(t, steps[0], 0), steps[1], 1)
    k = steps[0] * steps[1]
    return tb, _bin(_bin(t * t * var, steps[0], 0), steps[1], 1) / (k * tb * tb)


def _read_slice(scan: WalnutScan, plan: _SlicePlan, progress: bool | None) -> tuple[np.ndarray, np.ndarray]:
    """The slice's sinogram ``(n_angles, n_out)`` and its per-measurement variances (module docstring)."""
    n_a = len(plan.rows)
    n_rows = scan.det_shape[0]
    r0 = np.clip(np.floor(plan.frac_rows).astype(np.int64), 0, n_rows - 2)
    w = plan.frac_rows - r0  # weight of row r0 + 1
    out = np.empty(plan.frac_rows.shape)
    var = np.empty(plan.frac_rows.shape)
    for a in _progress(range(n_a), n_a, "read projections", progress):
        need = np.unique(np.concatenate([r0[a], r0[a] + 1]))
        P, F = scan.corrected_counts(int(plan.files[a]), need, plan.cols)
        t = P / F
        v = log_count_variance(P, F, scan.read_noise)
        if plan.binning:
            t, v = _binned_variance(t, v, (1, plan.col_step))
        log_t = -np.log(t)  # (len(need), n_out)
        pos = np.searchsorted(need, r0[a])
        j = np.arange(log_t.shape[1])
        out[a] = (1.0 - w[a]) * log_t[pos, j] + w[a] * log_t[pos + 1, j]
        var[a] = (1.0 - w[a]) ** 2 * v[pos, j] + w[a] ** 2 * v[pos + 1, j]
    return out, var


def _meta_common(scan: WalnutScan, rows, files, angular_subsampling, detector_subsampling, binning, cols) -> dict:
    return {
        "path": str(scan.path),
        "orbit": scan.orbit,
        "projection_folder": str(scan.proj_dir),
        "n_projection_files": scan.n_files,
        "detector_shape": list(scan.det_shape),
        "angular_subsampling": int(angular_subsampling),
        "detector_subsampling": int(detector_subsampling),
        "detector_binning": bool(binning),
        "geometry_rows": [int(r) for r in rows],
        "projection_files": [scan.projection_name(int(f)) for f in files],
        "detector_columns": {
            "first": int(cols[0]),
            "last": int(cols[-1]),
            "step": int(detector_subsampling),
            "mode": "bin" if binning else "subsample",
        },
        "preprocessing": "-log((P - dark)/(mean(flats) - dark)), P = transpose(flipud(raw))",
        "variances": "1/P + 1/(2F) + q (1/P^2 + 1/(2F^2) + (1/P - 1/F)^2), P = p - dark, F = mean(flats) - dark, "
        "q = read_noise^2 + 1/12 (counts; one count per photon), then binning and row interpolation",
        "read_noise_counts": scan.read_noise,
        "gt_shape": list(scan.gt_shape),
        "gt_voxel_size_mm": scan.voxel_size,
        "gt_voxel_size_source": scan.voxel_size_source,
        "has_ground_truth": scan.has_ground_truth,
        "simulated": scan.sidecar is not None,
    }


def read_walnut_slice(
    path: str | os.PathLike,
    *,
    slice_index: int | None = None,
    orbit: int = 2,
    angular_subsampling: int = 20,
    detector_subsampling: int = 6,
    image_shape: Sequence[int] | None = None,
    voxel_size: float | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Everything :func:`load_walnut_slice` returns except the operator (``op=None``; ``y`` on the CPU).

    Same parameters as :func:`load_walnut_slice` (minus ``backend``/``device``).
    """
    scan = WalnutScan(path, orbit, voxel_size)
    image_shape = _check_image_shape(image_shape, 2)
    plan, volume, k = _slice_setup(
        scan, slice_index, angular_subsampling, detector_subsampling, detector_binning, image_shape
    )
    return _finish_slice(
        scan, plan, volume, k, None, "none", angular_subsampling, detector_subsampling, detector_binning, progress
    )


def _slice_setup(scan: WalnutScan, slice_index, angular_subsampling, detector_subsampling, binning, image_shape):
    n_z = scan.gt_shape[0]
    k = n_z // 2 if slice_index is None else int(slice_index)
    if not 0 <= k < n_z:
        raise ValueError(f"slice_index {slice_index} out of range: the ground truth has {n_z} slices (0 … {n_z - 1})")
    z = scan.slice_z(k)
    plan = _plan_slice(scan, z, angular_subsampling, detector_subsampling, binning)
    if plan.cone_angle_deg > _CONE_WARN_DEG:
        warnings.warn(
            f"walnut slice {k} (z = {z:.3f} mm) of orbit {scan.orbit}: the source is not in the slice plane (cone "
            f"angle up to {plan.cone_angle_deg:.3f}°), so the 2D fan-beam model is approximate; the exact model is "
            f"backend='astra_cuda' (GPU), or use orbit 2 and a slice at the source height",
            stacklevel=3,
        )
    grid2d = VolumeGeometry(scan.gt_shape[1:], scan.voxel_size)
    return plan, _coarsened(grid2d, image_shape), k


def _finish_slice(scan, plan, volume, k, op, backend, ass, dss, binning, progress) -> CTData:
    y, var = _read_slice(scan, plan, progress)
    gt = None
    gt_files: list[str] = []
    if scan.has_ground_truth:
        img = scan.read_ground_truth_slice(k)
        gt = torch.from_numpy(area_average(img, volume.shape).astype(np.float32))
        gt_files = [GT_PATTERN.format(k)]
    meta = _meta_common(scan, plan.rows, plan.files, ass, dss, binning, plan.cols)
    centre_col = plan.frac_rows.shape[1] // 2
    meta.update(
        {
            "ndim": 2,
            "slice_index": int(k),
            "z_mm": plan.z,
            "image_shape": list(volume.shape),
            "image_voxel_size_mm": volume.voxel_size,
            "ground_truth_files": gt_files,
            "detector_rows_used": [float(r) for r in plan.frac_rows[:, centre_col]],
            "detector_row_range": [float(plan.frac_rows.min()), float(plan.frac_rows.max())],
            "cone_angle_deg": plan.cone_angle_deg,
            "exact_fan_geometry": plan.cone_angle_deg <= _CONE_WARN_DEG,
            "backend": backend,
            "operator_geometry": "cone_vec slice" if backend == Backend.ASTRA_CUDA else "fanflat_vec",
        }
    )
    y_t = torch.from_numpy(y.astype(np.float32))
    var_t = torch.from_numpy(var.astype(np.float32))
    if op is not None:
        y_t, var_t = y_t.to(op.device), var_t.to(op.device)
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


def load_walnut_slice(
    path: str | os.PathLike,
    *,
    slice_index: int | None = None,
    orbit: int = 2,
    angular_subsampling: int = 20,
    detector_subsampling: int = 6,
    image_shape: Sequence[int] | None = None,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cpu",
    voxel_size: float | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Load one slice of a walnut scan as a 2D problem: operator, sinogram, ground truth.

    Parameters
    ----------
    path : path
        ``Walnut{id}`` folder (real or simulated).
    slice_index : int, optional
        Ground-truth slice (default: the central one, ``n_z // 2``; for 501 slices that is ``z = 0``).
    orbit : int
        Source orbit 1, 2 or 3 (``tubeV{orbit}``); orbit 2 has the source in ``z = 0``.
    angular_subsampling : int
        Use geometry rows ``0, k, 2k, … < N−1`` (20 → 60 angles of the real data's 1200).
    detector_subsampling : int
        Keep every k-th detector column (6 → 128 of 768), or bin k columns with ``detector_binning``.
    image_shape : (int, int), optional
        Reconstruction grid over the ground truth's field of view (default: the ground-truth grid); coarser
        grids get an area-averaged ground truth.
    backend : {"auto", "sparse", "astra_cuda"}
        ``auto``/``sparse``: fan-beam sparse matrix (CPU or CUDA); ``astra_cuda``: the exact cone-beam slice
        operator (GPU only).
    device : torch.device or str
        Where the operator and ``y`` live.
    voxel_size : float, optional
        Ground-truth voxel edge (mm); default: the simulation sidecar's, else 0.1.
    detector_binning : bool
        Average ``detector_subsampling`` adjacent columns (in transmission) instead of picking every k-th.
    progress : bool, optional
        Progress bar while reading (default: on unless ``CTUQ_NO_PROGRESS=1``).

    Returns
    -------
    CTData
        ``y`` ``(n_angles, n_cols)``, ``ground_truth`` ``image_shape`` (mm⁻¹), ``geometry`` ``fanflat_vec``.
    """
    device = _check_backend(backend, device)
    if backend == Backend.ASTRA_CUDA and device.type != "cuda":
        raise RuntimeError(
            f"load_walnut_slice: backend 'astra_cuda' (the exact cone-beam slice) needs a CUDA "
            f"device, got {device}; use backend 'sparse' (fan-beam slice model) on the CPU"
        )
    scan = WalnutScan(path, orbit, voxel_size)
    image_shape = _check_image_shape(image_shape, 2)
    plan, volume, k = _slice_setup(
        scan, slice_index, angular_subsampling, detector_subsampling, detector_binning, image_shape
    )
    # The operator is built before any pixel data are read: a geometry the backend rejects fails fast.
    if backend == Backend.ASTRA_CUDA:
        op = AstraCudaRayTransform.cone_slice(volume, plan.z, plan.cone, device=device)
    else:
        op = make_ray_transform(volume, plan.fan, backend=backend, device=device)
    name = Backend.ASTRA_CUDA.value if backend == Backend.ASTRA_CUDA else type(op).__name__
    return _finish_slice(
        scan, plan, volume, k, op, name, angular_subsampling, detector_subsampling, detector_binning, progress
    )


# --------------------------------------------------------------------------------------------- volumes
def _volume_setup(
    scan: WalnutScan, angular_subsampling, detector_subsampling, detector_row_subsampling, binning, image_shape
):
    col_step = _positive_int(detector_subsampling, "detector_subsampling")
    row_step = (
        col_step
        if detector_row_subsampling is None
        else _positive_int(detector_row_subsampling, "detector_row_subsampling")
    )
    rows, files = scan.angle_plan(angular_subsampling)
    n_rows, n_cols = scan.det_shape
    cols, col_off = _column_plan(n_cols, col_step, binning)
    try:
        drows, row_off = _column_plan(n_rows, row_step, binning)
    except ValueError as exc:
        raise ValueError(f"detector_row_subsampling {row_step} exceeds the {n_rows} detector rows") from exc
    vec = scan.vectors[rows].copy()
    u, v = vec[:, 6:9].copy(), vec[:, 9:12].copy()
    vec[:, 3:6] += col_off * u + row_off * v
    vec[:, 6:9] = col_step * u
    vec[:, 9:12] = row_step * v
    n_out_r = len(drows) // row_step if binning else len(drows)
    n_out_c = len(cols) // col_step if binning else len(cols)
    geometry = ProjectionGeometry("cone_vec", (n_out_r, n_out_c), vectors=vec)
    volume = _coarsened(scan.ground_truth_grid(), image_shape)
    return rows, files, drows, cols, row_step, col_step, geometry, volume


def _finish_volume(scan, setup, op, backend, ass, dss, binning, progress) -> CTData:
    rows, files, drows, cols, row_step, col_step, geometry, volume = setup
    y = np.empty((len(rows), *geometry.det_shape), dtype=np.float32)
    var = np.empty_like(y)
    for a in _progress(range(len(rows)), len(rows), "read projections", progress):
        P, F = scan.corrected_counts(int(files[a]), drows, cols)
        t = P / F
        v = log_count_variance(P, F, scan.read_noise)
        if binning:
            t, v = _binned_variance(t, v, (row_step, col_step))
        y[a] = -np.log(t)
        var[a] = v
    gt = None
    if scan.has_ground_truth:
        # In-plane averaging slice by slice, then along z (the weights are separable): a 501³ ground truth never
        # sits in memory at full resolution in float64.
        n_z = scan.gt_shape[0]
        planes = np.stack(
            [
                area_average(scan.read_ground_truth_slice(k), volume.shape[1:])
                for k in _progress(range(n_z), n_z, "read ground truth", progress)
            ]
        )
        gt = torch.from_numpy(area_average(planes, volume.shape).astype(np.float32))
    meta = _meta_common(scan, rows, files, ass, dss, binning, cols)
    meta.update(
        {
            "ndim": 3,
            "detector_row_subsampling": int(row_step),
            "detector_rows": {"first": int(drows[0]), "last": int(drows[-1]), "step": int(row_step)},
            "image_shape": list(volume.shape),
            "image_voxel_size_mm": volume.voxel_size,
            "ground_truth_files": [GT_PATTERN.format(k) for k in range(scan.gt_shape[0])] if gt is not None else [],
            "backend": backend,
        }
    )
    y_t, var_t = torch.from_numpy(y), torch.from_numpy(var)
    if op is not None:
        y_t, var_t = y_t.to(op.device), var_t.to(op.device)
    return CTData(op=op, y=y_t, ground_truth=gt, volume=volume, geometry=geometry, meta=meta, variances=var_t)


def read_walnut_volume(
    path: str | os.PathLike,
    *,
    orbit: int = 2,
    angular_subsampling: int = 20,
    detector_subsampling: int = 6,
    detector_row_subsampling: int | None = None,
    image_shape: Sequence[int] | None = None,
    voxel_size: float | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Everything :func:`load_walnut_volume` returns except the operator (``op=None``): runs on the CPU."""
    scan = WalnutScan(path, orbit, voxel_size)
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


def load_walnut_volume(
    path: str | os.PathLike,
    *,
    orbit: int = 2,
    angular_subsampling: int = 20,
    detector_subsampling: int = 6,
    detector_row_subsampling: int | None = None,
    image_shape: Sequence[int] | None = None,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cuda",
    voxel_size: float | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Load a walnut scan as a 3D cone-beam problem (GPU: ASTRA CUDA operator).

    Parameters
    ----------
    path, orbit, angular_subsampling, voxel_size, detector_binning, progress
        As in :func:`load_walnut_slice`.
    detector_subsampling : int
        Keep every k-th detector column (or bin k with ``detector_binning``).
    detector_row_subsampling : int, optional
        The same for detector rows; default: ``detector_subsampling`` (square effective pixels).
    image_shape : (int, int, int), optional
        ``(D, H, W)`` over the ground truth's field of view, same aspect ratio (default: the ground-truth grid).
    backend : {"auto", "astra_cuda"}
        3D needs ASTRA CUDA; ``"sparse"`` is rejected by :func:`~ctuq.operators.make_ray_transform`.
    device : torch.device or str
        A CUDA device; on the CPU the operator construction raises ``make_ray_transform``'s error before any
        pixel data are read (use :func:`read_walnut_volume` there).

    Returns
    -------
    CTData
        ``y`` ``(n_angles, n_rows, n_cols)``, ``ground_truth`` ``(D, H, W)`` (mm⁻¹), ``geometry`` ``cone_vec``.
    """
    device = _check_backend(backend, device)
    scan = WalnutScan(path, orbit, voxel_size)
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
