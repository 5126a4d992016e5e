"""``scan.yaml``: a small description of a circular scan and its measurement files (``--data scan.yaml``).

Every key, its unit and default (``docs/data_formats.md`` has the reference and an example)::

    format: ctuq-scan-1              # required: this file's version
    units: mm                        # lengths below: mm | cm | m | um (converted to mm); default mm
    geometry:
      type: cone                     # parallel | fan (one detector row) | cone (several rows)
      source_object_distance: 66.0   # source to rotation axis (fan, cone; > 0)
      object_detector_distance: 133  # rotation axis to detector (fan, cone; ≥ 0)
      centre_of_rotation_offset: 0   # detector columns: the rotation axis projects this far right of the centre
      vectors: geometry.txt          # instead of the above: ASTRA cone_vec / parallel3d_vec rows, one per angle
    detector:
      rows: 8                        # detector rows (1 for a sinogram)
      columns: 96
      pixel_size: 1.2                # column pitch (length unit); row_pixel_size: row pitch, default pixel_size
      row_offset: 0                  # detector rows: the detector centre sits this far up (+z)
      tilt: 0                        # degrees: in-plane detector rotation from u towards v
    angles:
      unit: degree                   # required: degree | radian
      file: angles.npy               # one angle per projection (.npy, .txt, .tif, or {file, dataset} in HDF5)
      start: 0                       # ... or start/stop/count: count angles from start, stop excluded
      stop: 360
      count: 32
    measurements:
      type: counts                   # counts (raw, with flats and darks) | line_integrals
      projections: projections.npy   # (angle, row, column); .npy | .tif/.tiff stack | {file: x.h5, dataset: /p}
      flats: flats.npy               # counts: (frame, row, column) or (row, column), averaged
      darks: darks.npy               # counts: the same
      read_noise: 0                  # counts: per-frame read-noise sd (counts), for the per-ray variances
      variances: variances.npy       # line_integrals (optional): per-ray variances, shaped like projections
    volume:                          # optional: the reconstruction grid, centred at the origin
      shape: [8, 96, 96]             # (n_z, n_y, n_x); a one-row detector also takes (n_y, n_x)
      voxel_size: 0.6                # length unit; default: CIL's (pixel size / magnification)
    ground_truth: ground_truth.npy   # optional: (n_z, n_y, n_x) attenuation (mm⁻¹) on the volume grid

Relative file paths are relative to the YAML file. Projection ``k`` has angle ``k``; angles increase the source's
position counter-clockwise seen from ``+z`` (ASTRA's orientation: :mod:`ctuq.data.astra_geometry`). Every
problem raises :class:`ScanFileError` naming the YAML file, the key and the measurement file.

The format module (:class:`ScanYamlFormat`) also writes: a :class:`~ctuq.data.scan_format.ScanContent` of one
circular orbit becomes ``scan.yaml`` (the orbit by its parameters, angles in degrees) beside ``projections``,
``flats``, ``darks`` and ``ground_truth`` as ``.npy`` arrays or TIFF stacks (``ctuq simulate --layout yaml-npy`` /
``yaml-tiff``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from ctuq.data.astra_geometry import AstraGeometryError, angle_range, circular_vectors, load_astra_vectors, to_radians
from ctuq.data.projections import ArraySource, ProjectionScan, ScanFormatError, default_volume, mean_flat_dark
from ctuq.data.scan_format import CircularOrbit, ScanContent, ScanFormat, one_plane_orbit, write_tiff_array
from ctuq.data.source import ValueOrigin
from ctuq.options import AngleUnit, LengthUnit, MeasurementKind, ScanGeometry, values
from ctuq.utils import atomic_path

__all__ = [
    "ScanFileError",
    "FORMAT_TAG",
    "LENGTH_FACTORS",
    "SCAN_FILE_KEYS",
    "open_scan_file",
    "is_scan_file",
    "write_scan_file",
    "ScanYamlFormat",
]

FORMAT_TAG = "ctuq-scan-1"
#: mm per unit
LENGTH_FACTORS = {
    LengthUnit.MM.value: 1.0,
    LengthUnit.CM.value: 10.0,
    LengthUnit.M.value: 1000.0,
    LengthUnit.UM.value: 1e-3,
}

#: Every key of a scan description by section (the top level under ``""``).
SCAN_FILE_KEYS: dict[str, tuple[str, ...]] = {
    "": ("format", "units", "geometry", "detector", "angles", "measurements", "volume", "ground_truth"),
    "geometry": (
        "type",
        "source_object_distance",
        "object_detector_distance",
        "centre_of_rotation_offset",
        "vectors",
    ),
    "detector": ("rows", "columns", "pixel_size", "row_pixel_size", "row_offset", "tilt"),
    "angles": ("unit", "file", "start", "stop", "count"),
    "measurements": ("type", "projections", "flats", "darks", "read_noise", "variances"),
    "volume": ("shape", "voxel_size"),
}


class ScanFileError(ScanFormatError):
    """A ``scan.yaml`` or one of the files it names is malformed; the message names the file and the key."""


def is_scan_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``.yaml``/``.yml`` file (a scan description by its name)."""
    p = Path(path)
    return p.is_file() and p.suffix.lower() in (".yaml", ".yml")


class _Reader:
    """Validating access to the parsed YAML: every error names the file and the dotted key."""

    def __init__(self, path: Path, doc: dict):
        self.path = path
        self.doc = doc

    def fail(self, key: str, problem: str):
        raise ScanFileError(f"{self.path}: {key}: {problem}")

    def section(self, name: str, required: bool = True) -> dict:
        sec = self.doc.get(name)
        if sec is None:
            if required:
                self.fail(name, f"missing (a section with keys {', '.join(SCAN_FILE_KEYS[name])})")
            return {}
        if not isinstance(sec, dict):
            self.fail(name, f"must be a mapping with keys {', '.join(SCAN_FILE_KEYS[name])}, got {type(sec).__name__}")
        unknown = sorted(set(sec) - set(SCAN_FILE_KEYS[name]))
        if unknown:
            self.fail(f"{name}.{unknown[0]}", f"unknown key; valid keys of {name}: {', '.join(SCAN_FILE_KEYS[name])}")
        return sec

    def number(self, sec: dict, section: str, key: str, *, required=True, default=None, positive=False, nonneg=False):
        if key not in sec or sec[key] is None:
            if required:
                self.fail(f"{section}.{key}", "missing")
            return default
        v = sec[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"{section}.{key}", f"must be a number, got {v!r}")
        v = float(v)
        if not math.isfinite(v):
            self.fail(f"{section}.{key}", f"must be finite, got {v}")
        if positive and not v > 0:
            self.fail(f"{section}.{key}", f"must be positive, got {v:g}")
        if nonneg and v < 0:
            self.fail(f"{section}.{key}", f"must not be negative, got {v:g}")
        return v

    def integer(self, sec: dict, section: str, key: str, *, required=True, default=None, minimum=1):
        if key not in sec or sec[key] is None:
            if required:
                self.fail(f"{section}.{key}", "missing")
            return default
        v = sec[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(f"{section}.{key}", f"must be an integer ≥ {minimum}, got {v!r}")
        return int(v)

    def choice(self, sec: dict, section: str, key: str, vocabulary, *, default=None) -> str:
        v = sec.get(key, default)
        if v is None:
            self.fail(f"{section}.{key}" if section else key, f"missing; one of {', '.join(values(vocabulary))}")
        if v not in values(vocabulary):
            self.fail(f"{section}.{key}" if section else key, f"{v!r} unknown; valid: {', '.join(values(vocabulary))}")
        return str(v)

    def source(self, sec: dict, section: str, key: str, *, required=True) -> ArraySource | None:
        """An array file: ``name.npy`` / ``name.tif`` or ``{file: name.h5, dataset: /path}``."""
        dotted = f"{section}.{key}" if section else key
        spec = sec.get(key)
        if spec is None:
            if required:
                self.fail(dotted, "missing (a .npy or .tif file, or {file: x.h5, dataset: /path})")
            return None
        dataset = None
        if isinstance(spec, dict):
            bad = sorted(set(spec) - {"file", "dataset"})
            if bad or "file" not in spec:
                self.fail(dotted, f"an HDF5 reference is {{file: name.h5, dataset: /path}}, got keys {sorted(spec)}")
            spec, dataset = spec["file"], spec.get("dataset")
            if not isinstance(dataset, str):
                self.fail(f"{dotted}.dataset", f"must be the dataset's path in the file, got {dataset!r}")
        if not isinstance(spec, str) or not spec:
            self.fail(dotted, f"must be a file name, got {spec!r}")
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = self.path.parent / path
        return ArraySource(path, key=dotted, described_by=self.path, dataset=dataset, error=ScanFileError)


def _load_yaml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ScanFileError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScanFileError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(doc, dict):
        raise ScanFileError(f"{path}: expected a mapping of the keys {', '.join(SCAN_FILE_KEYS[''])}")
    return doc


def _read_angles(r: _Reader, sec: dict) -> np.ndarray:
    unit = r.choice(sec, "angles", "unit", AngleUnit)
    has_range = any(k in sec for k in ("start", "stop", "count"))
    if ("file" in sec) == has_range:
        r.fail("angles", "give either angles.file or angles.start/stop/count")
    if has_range:
        start = r.number(sec, "angles", "start")
        stop = r.number(sec, "angles", "stop")
        count = r.integer(sec, "angles", "count")
        if stop == start:
            r.fail("angles.stop", f"equals angles.start ({start:g}): the angles span no range")
        return angle_range(start, stop, count, unit)
    spec = sec["file"]
    if isinstance(spec, str) and Path(spec).suffix.lower() in (".txt", ".csv", ".dat"):
        path = Path(spec).expanduser()
        path = path if path.is_absolute() else r.path.parent / path
        if not path.is_file():
            r.fail("angles.file", f"{path}: file missing")
        try:
            a = np.loadtxt(path, dtype=np.float64, ndmin=1, delimiter="," if path.suffix.lower() == ".csv" else None)
        except ValueError as exc:
            r.fail("angles.file", f"{path}: not a list of numbers ({exc})")
        name = str(path)
    else:
        src = r.source(sec, "angles", "file")
        a = np.asarray(src.read(), dtype=np.float64)
        name = src.name
    if a.ndim != 1 or a.size < 1:
        r.fail("angles.file", f"{name}: expected one angle per projection (a 1D list), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        r.fail("angles.file", f"{name}: {int((~np.isfinite(a)).sum())} angles are NaN or Inf")
    return to_radians(a, unit)


def _frames(r: _Reader, src: ArraySource, det_shape: tuple[int, int], key: str) -> np.ndarray:
    """Flats or darks as ``(n_frames, rows, cols)`` float64, checked for shape and finiteness."""
    a = np.asarray(src.read(), dtype=np.float64)
    if det_shape[0] == 1 and a.ndim in (1, 2):  # a one-row detector: (frame, column) or (column,)
        a = a.reshape(-1, 1, a.shape[-1])
    elif a.ndim == 2:
        a = a[None]
    if a.ndim != 3 or a.shape[1:] != tuple(det_shape) or a.shape[0] < 1:
        src.fail(
            f"shape {tuple(src.shape)} does not fit (frame, row, column) with detector.rows × detector.columns = "
            f"{det_shape[0]} × {det_shape[1]}"
        )
    if not np.all(np.isfinite(a)):
        src.fail(f"{int((~np.isfinite(a)).sum())} values of {key} are NaN or Inf")
    return a


def open_scan_file(path: str | os.PathLike) -> ProjectionScan:
    """Read and validate a ``scan.yaml`` (module docstring): geometry, flats/darks and array headers.

    Returns a :class:`~ctuq.data.projections.ProjectionScan` (projections are read when a slice or volume is
    loaded: :func:`ctuq.data.loader.load_slice`). Raises :class:`ScanFileError` naming the file and key.
    """
    path = Path(path)
    if not path.is_file():
        raise ScanFileError(f"{path}: file missing")
    r = _Reader(path, _load_yaml(path))
    units = _read_top_level(r)
    mm = LENGTH_FACTORS[units]

    geo = r.section("geometry")
    det = r.section("detector")
    ang = r.section("angles")
    mea = r.section("measurements")
    vol = r.section("volume", required=False)

    kind = r.choice(geo, "geometry", "type", ScanGeometry)
    d = _read_detector(r, det, kind, mm)
    angles = _read_angles(r, ang)
    sod, odd = _read_distances(r, geo, kind)
    vectors, vpath = _scan_vectors(r, geo, det, kind, angles, d, sod, odd, mm)
    m = _read_measurements(r, mea, ang, d.shape, len(angles))
    gt_shape, voxel, source = _volume_grid(r, vol, kind, d, sod, odd, mm)
    gt = _read_ground_truth(r, gt_shape)
    origins = _origins(path, kind, det, vol)
    info = {
        "scan_file": str(path),
        "units": units,
        "angles_rad": [float(a) for a in angles[:3]] + (["…"] if len(angles) > 3 else []),
    }
    return ProjectionScan(
        path=path,
        format=ScanYamlFormat.name,
        geometry_type=kind,
        vectors=vectors,
        det_shape=d.shape,
        projections=m.projections,
        measurement=m.kind,
        gt_shape=gt_shape,
        voxel_size=float(voxel),
        voxel_size_source=source,
        flat=m.flat,
        dark=m.dark,
        n_flats=m.n_flats,
        n_darks=m.n_darks,
        read_noise=float(m.read_noise),
        variances=m.variances,
        ground_truth=gt,
        info=info,
        origins=origins,
        vectors_file=vpath,
    )


def _read_top_level(r: _Reader) -> str:
    """Check the top-level keys and the format tag; returns ``units`` (default ``mm``)."""
    unknown = sorted(set(r.doc) - set(SCAN_FILE_KEYS[""]))
    if unknown:
        r.fail(unknown[0], f"unknown key; valid top-level keys: {', '.join(SCAN_FILE_KEYS[''])}")
    if r.doc.get("format") != FORMAT_TAG:
        r.fail("format", f"must be {FORMAT_TAG!r} (this file's version), got {r.doc.get('format')!r}")
    return r.choice(r.doc, "", "units", LengthUnit, default=LengthUnit.MM.value)


class _Detector(NamedTuple):
    """The ``detector`` section: shape ``(rows, columns)``, pitches (mm), row offset (rows), tilt (degrees)."""

    shape: tuple[int, int]
    pixel: float
    row_pixel: float
    row_offset: float
    tilt: float


def _read_detector(r: _Reader, det: dict, kind: str, mm: float) -> _Detector:
    """The ``detector`` section, its rows checked against the beam ``kind``, lengths converted by ``mm``."""
    rows = r.integer(det, "detector", "rows")
    cols = r.integer(det, "detector", "columns")
    if kind == ScanGeometry.FAN and rows != 1:
        r.fail("detector.rows", f"a fan beam has one detector row, got {rows}; use geometry.type cone for several")
    if kind == ScanGeometry.CONE and rows < 2:
        r.fail("detector.rows", "a cone beam needs at least 2 detector rows; use geometry.type fan for one")
    pixel = r.number(det, "detector", "pixel_size", positive=True) * mm
    row_pixel = r.number(det, "detector", "row_pixel_size", required=False, default=pixel / mm, positive=True) * mm
    row_offset = r.number(det, "detector", "row_offset", required=False, default=0.0)
    tilt = r.number(det, "detector", "tilt", required=False, default=0.0)
    return _Detector((rows, cols), pixel, row_pixel, row_offset, tilt)


def _read_distances(r: _Reader, geo: dict, kind: str) -> tuple[float | None, float | None]:
    """``geometry.source_object_distance`` and ``object_detector_distance`` in the file's unit (``None`` for a
    parallel beam, or when ``geometry.vectors`` replaces them); a parallel beam's are checked only for sign."""
    sod = odd = None
    if kind != ScanGeometry.PARALLEL:
        sod = r.number(geo, "geometry", "source_object_distance", required="vectors" not in geo, positive=True)
        odd = r.number(geo, "geometry", "object_detector_distance", required="vectors" not in geo, nonneg=True)
    elif "source_object_distance" in geo or "object_detector_distance" in geo:
        key = "source_object_distance" if "source_object_distance" in geo else "object_detector_distance"
        r.number(geo, "geometry", key, nonneg=True)  # a negative one is still refused as such
    return sod, odd


def _scan_vectors(r: _Reader, geo: dict, det: dict, kind: str, angles, d: _Detector, sod, odd, mm: float):
    """The geometry rows ``(n_angles, 12)`` (mm) and the ``geometry.vectors`` file they came from (``None``: built
    from the parameters by :func:`~ctuq.data.astra_geometry.circular_vectors`)."""
    cor = r.number(geo, "geometry", "centre_of_rotation_offset", required=False, default=0.0)
    if "vectors" not in geo:
        vectors = circular_vectors(
            kind,
            angles,
            pixel_size=d.pixel,
            row_pixel_size=d.row_pixel,
            source_object=None if sod is None else sod * mm,
            object_detector=0.0 if odd is None else odd * mm,
            cor_offset_px=cor,
            row_offset_px=d.row_offset,
            tilt_deg=d.tilt,
        )
        return vectors, None
    clash = [k for k in ("source_object_distance", "object_detector_distance", "centre_of_rotation_offset") if k in geo]
    clash += [f"detector.{k}" for k in ("row_offset", "tilt") if k in det]
    if clash:
        r.fail("geometry.vectors", f"replaces the parametric geometry; remove {clash[0]}")
    vpath = Path(str(geo["vectors"])).expanduser()
    vpath = vpath if vpath.is_absolute() else r.path.parent / vpath
    try:
        vectors = load_astra_vectors(vpath) * mm
    except AstraGeometryError as exc:
        r.fail("geometry.vectors", str(exc))
    if len(vectors) != len(angles):
        r.fail("geometry.vectors", f"{vpath}: {len(vectors)} rows but the angles give {len(angles)} projections")
    return vectors, vpath


class _Measurements(NamedTuple):
    """The ``measurements`` section: kind, projections, mean flat and dark (counts), frames averaged, read noise,
    variances of line integrals."""

    kind: str
    projections: ArraySource
    flat: np.ndarray | None
    dark: np.ndarray | None
    n_flats: int
    n_darks: int
    read_noise: float
    variances: ArraySource | None


def _read_measurements(r: _Reader, mea: dict, ang: dict, det_shape: tuple[int, int], n: int) -> _Measurements:
    """The ``measurements`` section: the projections' header checked against ``n`` angles and ``det_shape``;
    counts with their flats and darks (read and averaged), or line integrals with optional variances."""
    rows, cols = det_shape
    mkind = r.choice(mea, "measurements", "type", MeasurementKind)
    proj = r.source(mea, "measurements", "projections")
    want = (n, rows, cols)
    if tuple(proj.shape) != want and not (rows == 1 and tuple(proj.shape) == (n, cols)):
        if len(proj.shape) == 3 and proj.shape[0] != n and tuple(proj.shape[1:]) == det_shape:
            proj.fail(
                f"{proj.shape[0]} projections but the angles give {n} (angles.{'file' if 'file' in ang else 'count'})"
            )
        proj.fail(
            f"shape {tuple(proj.shape)} is not (angle, row, column) = {want} from the angles and "
            f"detector.rows/columns" + (" (a transposed stack?)" if sorted(proj.shape) == sorted(want) else "")
        )
    if mkind != MeasurementKind.COUNTS:
        for key in ("flats", "darks", "read_noise"):
            if key in mea:
                r.fail(f"measurements.{key}", "only for counts (line integrals are already flat-field corrected)")
        variances = r.source(mea, "measurements", "variances", required=False)
        if variances is not None and tuple(variances.shape) != tuple(proj.shape):
            variances.fail(f"shape {tuple(variances.shape)} differs from the projections' {tuple(proj.shape)}")
        return _Measurements(mkind, proj, None, None, 0, 0, 0.0, variances)
    if "variances" in mea:
        r.fail("measurements.variances", "only for line_integrals (counts give their own variances)")
    fl = _frames(r, r.source(mea, "measurements", "flats"), det_shape, "flats")
    dk = _frames(r, r.source(mea, "measurements", "darks"), det_shape, "darks")
    flat, dark, problem = mean_flat_dark(fl, dk)
    if problem:
        r.fail("measurements.flats", problem)
    read_noise = r.number(mea, "measurements", "read_noise", required=False, default=0.0, nonneg=True)
    return _Measurements(mkind, proj, flat, dark, fl.shape[0], dk.shape[0], read_noise, None)


def _volume_grid(r: _Reader, vol: dict, kind: str, d: _Detector, sod, odd, mm: float):
    """The volume grid ``(n_z, n_y, n_x)``, its voxel size (mm) and where that came from: the ``volume`` section,
    else CIL's default (:func:`~ctuq.data.projections.default_volume`)."""
    rows = d.shape[0]
    if not vol:
        gt_shape, voxel = default_volume(
            kind, d.shape, d.pixel, None if sod is None else sod * mm, 0.0 if odd is None else odd * mm
        )
        if rows == 1:
            gt_shape = (1, *gt_shape[1:])
        return gt_shape, voxel, "default (detector pixel / magnification)"
    shape = vol.get("shape")
    ok_len = (3,) if rows > 1 else (2, 3)
    if (
        not isinstance(shape, list)
        or len(shape) not in ok_len
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
    ):
        r.fail("volume.shape", f"must be [n_z, n_y, n_x] positive integers, got {shape!r}")
    if len(shape) == 2:
        shape = [1, *shape]
    if rows == 1 and shape[0] != 1:
        r.fail("volume.shape", f"a one-row detector images one slice: n_z must be 1, got {shape[0]}")
    voxel = r.number(vol, "volume", "voxel_size", positive=True) * mm
    return tuple(int(s) for s in shape), voxel, "volume"


def _read_ground_truth(r: _Reader, gt_shape: tuple[int, int, int]) -> ArraySource | None:
    """The ``ground_truth`` array's header, checked against the volume grid (``None`` without one)."""
    gt = r.source(r.doc, "", "ground_truth", required=False)
    if gt is not None:
        gshape = tuple(gt.shape)
        if gshape != gt_shape and not (gt_shape[0] == 1 and gshape == gt_shape[1:]):
            gt.fail(f"shape {gshape} differs from the volume grid {gt_shape} (n_z, n_y, n_x; volume.shape)")
    return gt


def _origins(path: Path, kind: str, det: dict, vol: dict) -> dict[str, ValueOrigin]:
    """The key of ``scan.yaml`` each geometry quantity of a parametric description comes from (for the messages of
    :mod:`ctuq.data.plausibility`; a ``geometry.vectors`` file names its own lines)."""
    row_pitch = "detector.row_pixel_size" if "row_pixel_size" in det else "detector.pixel_size"
    return {
        "source": ValueOrigin(path, "angles" if kind == ScanGeometry.PARALLEL else "geometry.source_object_distance"),
        "detector": ValueOrigin(path, "geometry.object_detector_distance"),
        "u_step": ValueOrigin(path, "detector.pixel_size"),
        "v_step": ValueOrigin(path, row_pitch),
        "voxel_size": ValueOrigin(
            path, "volume.voxel_size" if vol else "detector.pixel_size (no volume: the voxel is pixel / magnification)"
        ),
        "grid": ValueOrigin(path, "volume.shape" if vol else "detector.rows/columns (no volume: the grid is theirs)"),
    }


def write_scan_file(path: str | os.PathLike, doc: dict[str, Any]) -> Path:
    """Write the scan description ``doc`` (keys as in the module docstring, in their order) atomically to
    ``path``; returns the path. The simulator's writer; a description is checked when it is opened."""
    path = Path(path)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(f"# ctuq scan description (docs/data_formats.md)\n{yaml.safe_dump(doc, sort_keys=False)}")
    return path


# --------------------------------------------------------------------------------------------- the format
_ARRAY_SUFFIXES = {"npy": "npy", "tiff": "tif"}
_ARRAY_NAMES = ("projections", "flats", "darks", "ground_truth")
_WRITTEN_RX = re.compile(r"^(scan\.yaml|(projections|flats|darks|ground_truth)\.(npy|tif))$")


def _write_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(array), allow_pickle=False)


def describe_orbit(
    geometry: CircularOrbit, det_shape: tuple[int, int], content: ScanContent, suffix: str
) -> dict[str, Any]:
    """The ``scan.yaml`` of one circular cone-beam orbit (lengths in mm, angles in degrees) whose arrays are
    ``projections.<suffix>``, ``flats``, ``darks`` and ``ground_truth`` beside it."""
    doc: dict[str, Any] = {
        "format": FORMAT_TAG,
        "units": LengthUnit.MM.value,
        "geometry": {
            "type": ScanGeometry.CONE.value,
            "source_object_distance": float(geometry.source_object),
            "object_detector_distance": float(geometry.object_detector),
            # 0.0 rather than −0.0 in the description
            "centre_of_rotation_offset": geometry.cor_offset_px if geometry.cor_offset_px else 0.0,
        },
        "detector": {
            "rows": int(det_shape[0]),
            "columns": int(det_shape[1]),
            "pixel_size": float(geometry.pixel_size),
            "row_pixel_size": float(geometry.row_pixel_size),
            "row_offset": float(geometry.row_offset_px),
            "tilt": float(geometry.tilt_deg),
        },
        "angles": {"unit": AngleUnit.DEGREE.value, "start": 0.0, "stop": 360.0, "count": int(geometry.n_angles)},
        "measurements": {
            "type": MeasurementKind.COUNTS.value,
            "projections": f"projections.{suffix}",
            "flats": f"flats.{suffix}",
            "darks": f"darks.{suffix}",
            "read_noise": float(content.read_noise),
        },
        "volume": {"shape": list(content.gt_shape), "voxel_size": float(content.voxel_size)},
    }
    if content.ground_truth is not None:
        doc["ground_truth"] = f"ground_truth.{suffix}"
    return doc


class ScanYamlFormat(ScanFormat):
    """A ``scan.yaml`` description with its measurement files (module docstring)."""

    name = "scan_yaml"
    expects = "a scan description *.yaml (or a folder holding scan.yaml)"
    layouts = {"yaml-npy": {"arrays": "npy"}, "yaml-tiff": {"arrays": "tiff"}}
    stores_degrees = True
    error = ScanFileError

    @classmethod
    def folder_lacks(cls) -> str:
        return "no scan.yaml"

    @classmethod
    def detect(cls, path: Path) -> Path | None:
        if is_scan_file(path):
            return path
        if path.is_dir() and is_scan_file(path / "scan.yaml"):
            return path / "scan.yaml"
        return None

    @classmethod
    def open(cls, path: Path, orbit: int = 2) -> ProjectionScan:
        return open_scan_file(path)

    @classmethod
    def check_orbits(cls, orbits: Mapping[int, CircularOrbit]) -> None:
        one_plane_orbit(orbits, "scan.yaml")

    @classmethod
    def write(cls, folder: Path, content: ScanContent, *, compress: bool = True, arrays: str = "npy", **options):
        """``folder/scan.yaml`` and its arrays (``arrays``: ``npy`` or ``tiff`` stacks; ``compress``: zlib TIFFs)
        for the content's one orbit (distinct angles only: a closing projection is dropped); returns the YAML
        file, written last (an interrupted write leaves no description that would open a partial scan)."""
        if options:
            raise TypeError(f"ScanYamlFormat.write: unknown options {sorted(options)}")
        if arrays not in _ARRAY_SUFFIXES:
            raise ValueError(f"scan.yaml arrays: {arrays!r} unknown; valid: {', '.join(_ARRAY_SUFFIXES)}")
        orbit = content.only_orbit("scan.yaml")
        cls.check_orbits({n: o.geometry for n, o in content.orbits.items()})
        folder = Path(folder)
        suffix = _ARRAY_SUFFIXES[arrays]
        data = (orbit.projections, orbit.flats, orbit.darks, content.ground_truth)
        for name, array in zip(_ARRAY_NAMES, data):
            if array is None:
                continue
            if suffix == "npy":
                _write_npy(folder / f"{name}.npy", array)
            else:
                write_tiff_array(folder / f"{name}.tif", np.asarray(array), compress)
        return write_scan_file(folder / "scan.yaml", describe_orbit(orbit.geometry, orbit.det_shape, content, suffix))

    @classmethod
    def written_files(cls, folder: Path) -> list[Path]:
        folder = Path(folder)
        return [p for p in folder.iterdir() if p.is_file() and _WRITTEN_RX.match(p.name)] if folder.is_dir() else []
