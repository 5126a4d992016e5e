"""The walnut layout: the cone-beam data set of Der Sarkissian et al. (2019; DESIGN.md §4) and scans written by
``ctuq simulate`` in the same layout — the format module (:class:`WalnutFormat`: detect, open, write) and its
source (:class:`WalnutScan`).

A ``Walnut{id}`` folder holds ``Projections/tubeV{1,2,3}/`` (``scan_{:06}.tif`` × N, dark ``di000000.tif``,
flats ``io000000.tif``/``io000001.tif``, ``scan_geom_corrected.geom`` with N rows of ASTRA ``cone_vec`` vectors in
mm) and ``Reconstructions/full_AGD_50_{:06}.tiff`` (ground-truth slices). Everything is sized from the files:
detector shape from the dark frame, number of projections from the listing (checked against the geometry rows),
ground-truth shape from the slice files. Only the projection files needed are read.

Rules (those of the data set):

* raw image → projection ``P = transpose(flipud(raw))`` (``det_rows × det_cols``);
* ``−log((P − dark)/(flat − dark))`` with ``flat`` the mean of the two flats; per-measurement variances as
  :mod:`ctuq.data.source` derives them (:func:`~ctuq.data.source.log_count_variance`), with the read noise
  ``σ_r`` of the sidecar of a simulated scan and 0 otherwise (:attr:`WalnutScan.read_noise`);
* the last file repeats the first angle: ``N`` files hold ``N − 1`` distinct angles; angular subsampling ``ass``
  pairs geometry row ``k·ass`` (for ``k·ass < N−1``) with file ``N−1−k·ass``;
* ground truth: voxel size from the ``voxel_size`` argument, else the simulation sidecar, else the data set's
  0.1 mm; the grid is centred at the origin and slice ``k`` lies at ``z = (k + ½ − n_z/2)·h`` (ctuq's
  convention, ``ctuq.geometry``).

Slices and volumes are cut by the one loader (:mod:`ctuq.data.loader`) from a :class:`WalnutScan`
(``load_slice(WalnutScan(path), angular_subsampling=20, detector_subsampling=6)`` is the published sparse setting:
60 of 1200 angles, every 6th of 768 columns), or by :func:`ctuq.data.load_data` from any scan path. Writing
(:meth:`WalnutFormat.write`, or piece by piece through :meth:`WalnutFormat.writer`, as ``ctuq simulate`` does)
stores the raw images as ``flipud(P.T)``, the geometry with the closing row, and the content's record as the
sidecar ``ctuq_simulation.json`` (where a simulated scan's read noise and voxel size live).

Malformed input raises :class:`WalnutFormatError` naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import tifffile

from ctuq.data.scan_format import CircularOrbit, ScanContent, ScanFormat, ScanWriter, write_tiff_array
from ctuq.data.source import VECTOR_PARTS, ScanSource, ValueOrigin, detector_record, positive_int, vector_file_origin
from ctuq.errors import CTUQError
from ctuq.options import MeasurementKind, ScanGeometry
from ctuq.utils import atomic_path, atomic_write_json

__all__ = [
    "WalnutFormat",
    "WalnutFormatError",
    "WalnutScan",
    "WalnutWriter",
    "default_data_dir",
    "DEFAULT_VOXEL_SIZE",
    "SIDECAR_NAME",
    "PROJECTION_PATTERN",
    "DARK_NAME",
    "FLAT_NAMES",
    "GEOMETRY_NAME",
    "GT_PATTERN",
]

DEFAULT_VOXEL_SIZE = 0.1  # mm, the data set's ground-truth voxel
DEFAULT_GT_SHAPE = (501, 501, 501)  # the data set's ground truth, used only when a folder has no Reconstructions
# The file names of the layout (the one home of each; the writer writes them, the source reads them).
SIDECAR_NAME = "ctuq_simulation.json"  # a simulated scan's parameters (absent from the real data set)
PROJECTION_PATTERN = "scan_{:06}.tif"  # raw projections, in Projections/tubeV{orbit}/
DARK_NAME = "di000000.tif"
FLAT_NAMES = ("io000000.tif", "io000001.tif")  # before and after the scan; averaged
GEOMETRY_NAME = "scan_geom_corrected.geom"
GT_PATTERN = "full_AGD_50_{:06}.tiff"  # ground-truth slices, in Reconstructions/
_PROJ_RX = re.compile(r"^scan_(\d{6})\.tif$")
_GT_RX = re.compile(r"^full_AGD_50_(\d{6})\.tiff$")
_ORBIT_FILES_RX = re.compile(r"^(scan_\d{6}\.tif|di000000\.tif|io00000[01]\.tif|scan_geom_corrected\.geom)$")


class WalnutFormatError(CTUQError):
    """A walnut folder, file, shape or value is not what the layout requires; the message names the file.

    A user error (:class:`ctuq.errors.CTUQError`, hence also a ``ValueError``)."""


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


class WalnutScan(ScanSource):
    """One orbit of a ``Walnut{id}`` folder (a :class:`~ctuq.data.source.ScanSource`): validated layout, geometry
    vectors and file access.

    Opening reads only the geometry file, TIFF headers and the folder listings; pixel data are read on demand.

    Parameters
    ----------
    path : path
        The ``Walnut{id}`` folder.
    orbit : int
        1, 2 or 3 (``Projections/tubeV{orbit}``).
    voxel_size : float, optional
        Ground-truth voxel edge (mm); default: the sidecar's, else 0.1.

    Attributes are :class:`~ctuq.data.source.ScanSource`'s (``n_files``: the ``N`` projection files and geometry
    rows; ``det_shape`` after ``transpose(flipud(raw))``; ``gt_shape`` from the files, else the sidecar's or 501³) and:

    Attributes
    ----------
    sidecar : dict or None
        ``ctuq_simulation.json`` of a simulated scan.
    read_noise : float
        Per-frame read-noise sd (counts) used for :attr:`CTData.variances`: the sidecar's for a simulated scan
        with noise, else 0.
    """

    format = "walnut"
    geometry_type = ScanGeometry.CONE.value
    measurement = MeasurementKind.COUNTS.value
    n_flats, n_darks = len(FLAT_NAMES), 1
    error = WalnutFormatError

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

    def projection(self, index: int) -> np.ndarray:
        """Projection file ``index`` (``scan_{index:06}.tif``) as a ``(det_rows, det_cols)`` float64 array of counts
        (:meth:`read_image`)."""
        return self.read_image(self.projection_name(index))

    def flat_dark(self) -> tuple[np.ndarray, np.ndarray]:
        """The mean of the two flats and the dark frame, ``(det_rows, det_cols)`` (counts)."""
        dark = self.dark()
        return self.flat(), dark

    def flat_error(self, n_bad: int, row: int, col: int, flat: float, dark: float) -> WalnutFormatError:
        return WalnutFormatError(
            f"{self.proj_dir}: flat field ≤ dark at {n_bad} used pixels (first at detector row {row}, column {col}: "
            f"mean of {FLAT_NAMES[0]}/{FLAT_NAMES[1]} = {flat:g}, {DARK_NAME} = {dark:g}); the flat-field "
            f"correction would divide by ≤ 0"
        )

    def counts_error(self, index: int, n_bad: int, row: int, col: int, counts: float, dark: float):
        return WalnutFormatError(
            f"{self.proj_dir / self.projection_name(index)}: {n_bad} used pixels have counts ≤ dark, i.e. "
            f"non-positive transmission (first at detector row {row}, column {col}: {counts:g} ≤ {dark:g}); −log "
            f"is undefined there"
        )

    def geometry_error(self, problem: str, *, slice_plane: bool = False) -> WalnutFormatError:
        where = self.proj_dir if slice_plane else self.proj_dir / GEOMETRY_NAME
        return WalnutFormatError(f"{where}: {problem}")

    def origin(self, quantity: str, row: int | None = None) -> ValueOrigin:
        """:meth:`ScanSource.origin <ctuq.data.source.ScanSource.origin>`: the line of the ``.geom`` file, the
        sidecar's key, the first ground-truth slice file or the projection folder."""
        if quantity in VECTOR_PARTS:
            return vector_file_origin(self.proj_dir / GEOMETRY_NAME, quantity, row)
        if quantity == "voxel_size" and self.voxel_size_source == SIDECAR_NAME:
            return ValueOrigin(self.path / SIDECAR_NAME, "gt_voxel_size_mm")
        if quantity == "voxel_size":
            return ValueOrigin(self.path, f"voxel size: {self.voxel_size_source}")
        if quantity == "grid" and self.has_ground_truth:
            return ValueOrigin(self.rec_dir / GT_PATTERN.format(0))
        if quantity == "grid" and self.sidecar and "gt_shape" in self.sidecar:
            return ValueOrigin(self.path / SIDECAR_NAME, "gt_shape")
        if quantity == "grid":
            return ValueOrigin(self.path, f"no {self.rec_dir.name}: the data set's grid {self.gt_shape}")
        return super().origin(quantity, row)

    # ------------------------------------------------------------------ geometry
    def angle_plan(self, angular_subsampling: int) -> tuple[np.ndarray, np.ndarray]:
        """Geometry rows ``k·ass < N−1`` and their files ``N−1−k·ass``: two int arrays."""
        ass = positive_int(angular_subsampling, "angular_subsampling")
        rows = np.arange(0, self.n_files - 1, ass)
        return rows, (self.n_files - 1) - rows

    @property
    def n_distinct_angles(self) -> int:
        """Distinct angles: the files less the last, which repeats the first angle."""
        return self.n_files - 1

    def describe_angles(self) -> str:
        """``"tubeV2 has 1201 files, 1200 distinct angles"``."""
        return f"tubeV{self.orbit} has {self.n_files} files, {self.n_files - 1} distinct angles"

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

    def ground_truth_files(self, slices: Sequence[int]) -> list[str]:
        """``full_AGD_50_{k:06}.tiff`` of ``slices`` (empty without ground truth)."""
        return [GT_PATTERN.format(int(k)) for k in slices] if self.has_ground_truth else []

    def record(self, rows, files, angular_subsampling, detector_subsampling, binning, cols) -> dict:
        """The walnut layout's ``CTData.meta`` entries: folder, orbit, files read, preprocessing, ground truth."""
        det = detector_record(rows, files, angular_subsampling, detector_subsampling, binning, cols)
        return {
            "path": str(self.path),
            "orbit": self.orbit,
            "projection_folder": str(self.proj_dir),
            "n_projection_files": self.n_files,
            "detector_shape": list(self.det_shape),
            "angular_subsampling": det["angular_subsampling"],
            "detector_subsampling": det["detector_subsampling"],
            "detector_binning": det["detector_binning"],
            "geometry_rows": det["geometry_rows"],
            "projection_files": [self.projection_name(int(f)) for f in files],
            "detector_columns": det["detector_columns"],
            "preprocessing": "-log((P - dark)/(mean(flats) - dark)), P = transpose(flipud(raw))",
            "variances": "1/P + 1/(2F) + q (1/P^2 + 1/(2F^2) + (1/P - 1/F)^2), P = p - dark, F = mean(flats) - "
            "dark, q = read_noise^2 + 1/12 (counts; one count per photon), then binning and row interpolation",
            "read_noise_counts": self.read_noise,
            "gt_shape": list(self.gt_shape),
            "gt_voxel_size_mm": self.voxel_size,
            "gt_voxel_size_source": self.voxel_size_source,
            "has_ground_truth": self.has_ground_truth,
            "simulated": self.sidecar is not None,
        }


# --------------------------------------------------------------------------------------------- writing
class WalnutWriter(ScanWriter):
    """Writes a scan into the walnut layout file by file as it arrives (:meth:`WalnutFormat.writer`): per orbit
    ``Projections/tubeV{n}/`` with the geometry (``N = n_angles + 1`` rows, the last repeating the first), the dark,
    the two flats and ``scan_{N−1−k:06}.tif`` for projection ``k`` (file 0 the closing projection), raw images
    ``flipud(P.T)``; ``Reconstructions/full_AGD_50_{k:06}.tiff`` per ground-truth slice; the sidecar at
    :meth:`close` (``content.record``, or the facts the source reads back: voxel size, grid, read noise)."""

    def __init__(self, folder: Path, content: ScanContent, *, compress: bool = True):
        self.folder = Path(folder)
        self.content = content
        self.compress = bool(compress)
        self._n: dict[int, int] = {}
        self._first: dict[int, np.ndarray] = {}
        self._closed: set[int] = set()

    def _orbit_dir(self, number: int) -> Path:
        return self.folder / "Projections" / f"tubeV{int(number)}"

    def _image(self, path: Path, frame: np.ndarray) -> None:
        write_tiff_array(path, np.flipud(np.asarray(frame).T), self.compress)

    def orbit(self, number: int, geometry: CircularOrbit, flats: np.ndarray, darks: np.ndarray) -> None:
        if int(number) not in (1, 2, 3):
            raise ValueError(f"the walnut layout holds orbits 1, 2 and 3 (tubeV1..3), got orbit {number}")
        if len(flats) != len(FLAT_NAMES) or len(darks) != 1:
            raise ValueError(
                f"the walnut layout holds {len(FLAT_NAMES)} flats and 1 dark per orbit, got {len(flats)} and "
                f"{len(darks)}"
            )
        folder = self._orbit_dir(number)
        with atomic_path(folder / GEOMETRY_NAME) as tmp:
            np.savetxt(tmp, geometry.vectors(closing=True), fmt="%.17g")
        self._image(folder / DARK_NAME, darks[0])
        for name, frame in zip(FLAT_NAMES, flats):
            self._image(folder / name, frame)
        self._n[int(number)] = int(geometry.n_angles)

    def projection(self, number: int, k: int, counts: np.ndarray) -> None:
        n = self._n[int(number)]
        if k == 0:
            self._first[int(number)] = counts
        self._image(self._orbit_dir(number) / PROJECTION_PATTERN.format(n - int(k)), counts)

    def closing(self, number: int, counts: np.ndarray) -> None:
        self._image(self._orbit_dir(number) / PROJECTION_PATTERN.format(0), counts)
        self._closed.add(int(number))

    def ground_truth_slice(self, k: int, image: np.ndarray) -> None:
        path = self.folder / "Reconstructions" / GT_PATTERN.format(int(k))
        write_tiff_array(path, np.asarray(image, dtype=np.float32), self.compress)

    def close(self) -> Path:
        for number in set(self._n) - self._closed:  # no closing projection: the first angle's again
            self.closing(number, self._first[number])
        c = self.content
        record = c.record
        if record is None:
            record = {
                "format": "ctuq scan (walnut layout)",
                "complete": True,
                "gt_voxel_size_mm": float(c.voxel_size),
                "gt_shape": list(c.gt_shape),
                "parameters": {"read_noise": float(c.read_noise)},
            }
        atomic_write_json(self.folder / SIDECAR_NAME, record)
        return self.folder


class WalnutFormat(ScanFormat):
    """The walnut data set's folder (module docstring): ``Projections/tubeV{1,2,3}/``, ``Reconstructions/``."""

    name = "walnut"
    expects = "a walnut folder (Projections/tubeV*/ with scan_NNNNNN.tif, flats, dark and the .geom file)"
    layouts = {"walnut": {}}
    error = WalnutFormatError

    @classmethod
    def folder_lacks(cls) -> str:
        return "no Projections/tubeV* folder (walnut layout)"

    @classmethod
    def detect(cls, path: Path) -> Path | None:
        return path if path.is_dir() and (path / "Projections").is_dir() else None

    @classmethod
    def open(cls, path: Path, orbit: int = 2) -> WalnutScan:
        return WalnutScan(path, orbit)

    @classmethod
    def check_orbits(cls, orbits: Mapping[int, CircularOrbit]) -> None:
        bad = sorted(set(orbits) - {1, 2, 3})
        if bad:
            raise ValueError(f"the walnut layout holds orbits 1, 2 and 3 (tubeV1..3), got orbit {bad[0]}")

    @classmethod
    def writer(cls, folder: Path, content: ScanContent, *, compress: bool = True, **options) -> WalnutWriter:
        return WalnutWriter(folder, content, compress=compress, **options)

    @classmethod
    def write(cls, folder: Path, content: ScanContent, *, compress: bool = True, **options) -> Path:
        cls.check_orbits({n: o.geometry for n, o in content.orbits.items()})
        w = cls.writer(folder, content, compress=compress, **options)
        for number, orbit in content.orbits.items():
            w.orbit(number, orbit.geometry, orbit.flats, orbit.darks)
            for k, counts in enumerate(orbit.projections):
                w.projection(number, k, counts)
            if orbit.closing is not None:
                w.closing(number, orbit.closing)
        if content.ground_truth is not None:
            for k, image in enumerate(content.ground_truth):
                w.ground_truth_slice(k, image)
        return w.close()

    @classmethod
    def written_files(cls, folder: Path) -> list[Path]:
        found = []
        for sub, rx in (("Projections/tubeV*", _ORBIT_FILES_RX), ("Reconstructions", _GT_RX)):
            for d in Path(folder).glob(sub):
                if d.is_dir():
                    found += [p for p in d.iterdir() if p.is_file() and rx.match(p.name)]
        return found
