"""NXtomo: the NeXus application definition for tomography raw data (HDF5), written by Diamond, ESRF and other
facilities and read by CIL and tomopy; read with h5py into a :class:`~ctuq.data.projections.ProjectionScan`.

What ctuq reads from the NXtomo entry (the first ``NXentry`` whose ``definition`` is ``NXtomo``, else the first
with ``instrument/detector/data``):

* ``instrument/detector/data`` — every frame, ``(frame, row, column)`` (each frame an image of ``(y, x)`` rows and
  columns, as nxtomomill and tomoscan write them); ``instrument/detector/image_key`` — per frame ``0`` projection,
  ``1`` flat, ``2`` dark (``3``, invalid, is skipped). Flats and darks are averaged (any number of each).
* ``sample/rotation_angle`` — per frame, in its ``units`` attribute (NXtomo's default: degrees; ``rad`` is read
  as radians). Projection ``k`` keeps its angle; none are dropped or merged.
* ``instrument/detector/x_pixel_size`` (and ``y_pixel_size``, default the x one), ``instrument/detector/distance``
  (sample–detector) and ``instrument/source/distance`` (source–sample; NeXus counts upstream distances negative,
  its magnitude is used), each in its ``units`` attribute (default metres, NeXus's SI). A source distance makes a
  cone beam (fan for a one-row detector); without one the scan is a parallel beam (a synchrotron).
* ``instrument/detector/x_rotation_axis_pixel_position`` — the rotation axis' column offset from the detector
  centre (pixels; :func:`ctuq.data.astra_geometry.circular_vectors`' ``cor_offset_px``), default 0.
* ctuq's own fields, present in scans written by ``ctuq simulate --layout nxtomo``:
  ``instrument/detector/ctuq_read_noise`` (per-frame read-noise sd, counts; default 0) and the group
  ``ctuq_ground_truth`` (``data`` ``(n_z, n_y, n_x)`` in mm⁻¹, ``voxel_size`` in mm), which also sets the volume
  grid; without it the grid is CIL's default (detector pixel over magnification).

Rows increase along ``+z`` (ASTRA's ``v``; CIL's ``vertical``). Every problem raises :class:`NXtomoError` naming the
file and the dataset path.

The format module (:class:`NXtomoFormat`) also writes: a :class:`~ctuq.data.scan_format.ScanContent` of one ideal
circular orbit becomes ``scan.nxs`` (:func:`write_nxtomo`; ``ctuq simulate --layout nxtomo``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import h5py
import numpy as np

from ctuq.data.astra_geometry import angle_range_values, circular_vectors, to_radians
from ctuq.data.projections import ArraySource, ProjectionScan, ScanFormatError, default_volume, mean_flat_dark
from ctuq.data.scan_format import CircularOrbit, ScanContent, ScanFormat, one_plane_orbit
from ctuq.data.source import ValueOrigin
from ctuq.options import AngleUnit, MeasurementKind, ScanGeometry
from ctuq.utils import atomic_path

__all__ = ["NXtomoError", "NXTOMO_SUFFIXES", "is_nxtomo", "open_nxtomo", "write_nxtomo", "IMAGE_KEYS", "NXtomoFormat"]

NXTOMO_SUFFIXES = (".nxs", ".nx", ".nx5", ".h5", ".hdf5", ".hdf")
IMAGE_KEYS = {"projection": 0, "flat": 1, "dark": 2, "invalid": 3}
_LENGTH_MM = {
    "m": 1000.0,
    "metre": 1000.0,
    "meter": 1000.0,
    "cm": 10.0,
    "mm": 1.0,
    "millimetre": 1.0,
    "millimeter": 1.0,
    "um": 1e-3,
    "µm": 1e-3,
    "micron": 1e-3,
    "micrometre": 1e-3,
    "micrometer": 1e-3,
    "nm": 1e-6,
}
_ANGLE = {"deg": AngleUnit.DEGREE, "degree": AngleUnit.DEGREE, "degrees": AngleUnit.DEGREE}
_ANGLE.update({"rad": AngleUnit.RADIAN, "radian": AngleUnit.RADIAN, "radians": AngleUnit.RADIAN})


class NXtomoError(ScanFormatError):
    """An NXtomo file lacks a field ctuq needs or holds an invalid one; the message names the file and the path."""


def is_nxtomo(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an HDF5 file by its name (``.nxs``, ``.h5``, …) and signature."""
    p = Path(path)
    return p.is_file() and p.suffix.lower() in NXTOMO_SUFFIXES and h5py.is_hdf5(p)


def _text(v) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray):
        return _text(v.reshape(-1)[0]) if v.size else ""
    return str(v)


def _find_entry(f, path: Path) -> str:
    entries = [k for k, g in f.items() if isinstance(g, h5py.Group)]
    for k in entries:
        if "definition" in f[k] and _text(f[k]["definition"][()]).strip() == "NXtomo":
            return k
    for k in entries:
        if "instrument/detector/data" in f[k]:
            return k
    raise NXtomoError(
        f"{path}: no NXtomo entry (an NXentry with definition 'NXtomo' or instrument/detector/data); top level: "
        f"{', '.join(entries) or 'nothing'}"
    )


def open_nxtomo(path: str | os.PathLike) -> ProjectionScan:
    """Read and validate an NXtomo file (module docstring) into a :class:`~ctuq.data.projections.ProjectionScan`
    (raw counts; projections are read on demand). Raises :class:`NXtomoError` naming the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise NXtomoError(f"{path}: file missing")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise NXtomoError(f"{path}: not a readable HDF5 file ({exc})") from None
    with f:
        nx = _Entry(f, path, _find_entry(f, path))
        e = nx.name
        frames = _read_frames(nx)
        angles, unit = _projection_angles(nx, frames)
        det = _read_detector(nx)
        kind, sod = _beam(nx, det.source_distance, frames.rows)
        flat, dark = _mean_flat_dark(nx, frames)
        gt_shape, voxel, vsource, gt = _volume_grid(nx, kind, frames, det.pixel, sod, det.distance)
    vectors = circular_vectors(
        kind,
        angles,
        pixel_size=det.pixel,
        row_pixel_size=det.row_pixel,
        source_object=sod,
        object_detector=det.distance,
        cor_offset_px=det.cor,
    )
    projections = ArraySource(
        path,
        key=f"/{e}/instrument/detector/data",
        described_by=path,
        error=NXtomoError,
        dataset=f"/{e}/instrument/detector/data",
        index=frames.projections,
    )
    origins = _origins(path, e, kind, det.row_pixel_given, gt is not None)
    return ProjectionScan(
        path=path,
        format=NXtomoFormat.name,
        geometry_type=kind,
        vectors=vectors,
        det_shape=(frames.rows, frames.cols),
        projections=projections,
        measurement=MeasurementKind.COUNTS.value,
        gt_shape=gt_shape,
        voxel_size=float(voxel),
        voxel_size_source=vsource,
        flat=flat,
        dark=dark,
        n_flats=int(len(frames.flats)),
        n_darks=int(len(frames.darks)),
        read_noise=det.read_noise,
        ground_truth=gt,
        info={"nxtomo_entry": f"/{e}", "rotation_angle_units": unit, "frames": frames.n},
        origins=origins,
    )


class _Entry:
    """Validating access to the NXtomo entry ``name`` of the open file ``f``: every error names the file and the
    dataset path."""

    def __init__(self, f: h5py.File, path: Path, name: str):
        self.f, self.path, self.name = f, path, name

    def fail(self, key: str, problem: str):
        raise NXtomoError(f"{self.path}:/{self.name}/{key}: {problem}")

    def dataset(self, key: str, required: bool = True):
        """The dataset ``key`` of the entry (``None`` when absent and not ``required``)."""
        if key not in self.f[self.name]:
            if required:
                self.fail(key, "missing (NXtomo needs it)")
            return None
        ds = self.f[self.name][key]
        if not isinstance(ds, h5py.Dataset):
            self.fail(key, "is a group, not a dataset")
        return ds

    def length(self, key: str, required: bool = True, default: float | None = None) -> float | None:
        """The length ``key`` in mm (its ``units`` attribute, default metres); ``default`` when absent."""
        ds = self.dataset(key, required)
        if ds is None:
            return default
        unit = _text(ds.attrs.get("units", "m")).strip()
        if unit not in _LENGTH_MM:
            self.fail(key, f"units {unit!r} unknown; valid: {', '.join(_LENGTH_MM)}")
        v = float(np.asarray(ds[()], dtype=np.float64).reshape(-1)[0])
        if not np.isfinite(v):
            self.fail(key, f"must be finite, got {v}")
        return v * _LENGTH_MM[unit]


class _Frames(NamedTuple):
    """``instrument/detector/data`` (the dataset, its frame count and detector shape) and the frame indices of the
    projections, flats and darks by ``image_key``."""

    data: h5py.Dataset
    n: int
    rows: int
    cols: int
    projections: np.ndarray
    flats: np.ndarray
    darks: np.ndarray


def _read_frames(nx: _Entry) -> _Frames:
    """The detector data's header and the frames' ``image_key`` (from ``instrument/detector`` or ``data``),
    checked: one key per frame, known values, at least one projection, flat and dark."""
    data = nx.dataset("instrument/detector/data")
    if data.ndim != 3:
        nx.fail("instrument/detector/data", f"shape {data.shape}: expected (frame, row, column)")
    n_frames, rows, cols = (int(s) for s in data.shape)
    keys_ds = nx.dataset("instrument/detector/image_key", required=False)
    if keys_ds is None:
        keys_ds = nx.dataset("data/image_key")
    keys = np.asarray(keys_ds[()]).reshape(-1)
    if keys.shape != (n_frames,):
        nx.fail("instrument/detector/image_key", f"{keys.size} entries but the data have {n_frames} frames")
    unknown = sorted(set(np.unique(keys).tolist()) - set(IMAGE_KEYS.values()))
    if unknown:
        nx.fail(
            "instrument/detector/image_key", f"unknown value {unknown[0]} (0 projection, 1 flat, 2 dark, 3 invalid)"
        )
    proj_idx = np.flatnonzero(keys == 0)
    flat_idx = np.flatnonzero(keys == 1)
    dark_idx = np.flatnonzero(keys == 2)
    for name, idx, k in (("projections", proj_idx, 0), ("flats", flat_idx, 1), ("darks", dark_idx, 2)):
        if idx.size == 0:
            nx.fail("instrument/detector/image_key", f"no {name} (image_key {k}); ctuq needs raw counts with both")
    return _Frames(data, n_frames, rows, cols, proj_idx, flat_idx, dark_idx)


def _projection_angles(nx: _Entry, frames: _Frames) -> tuple[np.ndarray, str]:
    """The projections' ``sample/rotation_angle`` in radians ``(n_projections,)`` and the unit as stored."""
    ang_ds = nx.dataset("sample/rotation_angle")
    unit = _text(ang_ds.attrs.get("units", "degree")).strip().lower()
    if unit not in _ANGLE:
        nx.fail("sample/rotation_angle", f"units {unit!r} unknown; valid: {', '.join(_ANGLE)}")
    ang_all = np.asarray(ang_ds[()], dtype=np.float64).reshape(-1)
    if ang_all.shape != (frames.n,):
        nx.fail("sample/rotation_angle", f"{ang_all.size} angles but the data have {frames.n} frames (one per frame)")
    angles = to_radians(ang_all[frames.projections], _ANGLE[unit])
    if not np.all(np.isfinite(angles)):
        nx.fail("sample/rotation_angle", f"{int((~np.isfinite(angles)).sum())} projection angles are NaN or Inf")
    return angles, unit


class _Detector(NamedTuple):
    """The detector's and source's fields: pitches and distances (mm; ``source_distance`` ``None`` for a parallel
    beam), centre-of-rotation offset (pixels), read noise (counts)."""

    pixel: float
    row_pixel: float
    row_pixel_given: bool
    source_distance: float | None
    distance: float
    cor: float
    read_noise: float


def _read_detector(nx: _Entry) -> _Detector:
    """The pixel sizes, source and detector distances, centre-of-rotation offset and ctuq's read noise, checked."""
    px = nx.length("instrument/detector/x_pixel_size")
    py = nx.length("instrument/detector/y_pixel_size", required=False, default=px)
    py_given = "instrument/detector/y_pixel_size" in nx.f[nx.name]
    for key, v in (("instrument/detector/x_pixel_size", px), ("instrument/detector/y_pixel_size", py)):
        if not v > 0:
            nx.fail(key, f"must be positive, got {v:g} mm")
    src = nx.length("instrument/source/distance", required=False)
    odd = nx.length("instrument/detector/distance", required=src is not None, default=0.0)
    if odd < 0:
        nx.fail("instrument/detector/distance", f"must not be negative, got {odd:g} mm")
    cor_ds = nx.dataset("instrument/detector/x_rotation_axis_pixel_position", required=False)
    cor = 0.0 if cor_ds is None else float(np.asarray(cor_ds[()], dtype=np.float64).reshape(-1)[0])
    rn_ds = nx.dataset("instrument/detector/ctuq_read_noise", required=False)
    read_noise = 0.0 if rn_ds is None else float(np.asarray(rn_ds[()], dtype=np.float64).reshape(-1)[0])
    if not (np.isfinite(cor) and np.isfinite(read_noise) and read_noise >= 0):
        nx.fail("instrument/detector", f"x_rotation_axis_pixel_position {cor} / ctuq_read_noise {read_noise} invalid")
    return _Detector(px, py, py_given, src, odd, cor, read_noise)


def _beam(nx: _Entry, src: float | None, rows: int) -> tuple[str, float | None]:
    """The beam kind and the source–axis distance (mm): parallel without a source distance, else cone (fan for one
    detector row) at ``|src|``."""
    if src is None:
        return ScanGeometry.PARALLEL.value, None
    sod = abs(src)
    if sod == 0:
        nx.fail("instrument/source/distance", "is 0: a cone or fan beam needs the source away from the sample")
    return (ScanGeometry.CONE.value if rows > 1 else ScanGeometry.FAN.value), sod


def _mean_flat_dark(nx: _Entry, frames: _Frames) -> tuple[np.ndarray, np.ndarray]:
    """The mean flat and dark ``(rows, cols)`` float64 (counts) of the flat and dark frames, checked finite and
    flat above dark."""
    flats = np.asarray(frames.data[frames.flats], dtype=np.float64)
    darks = np.asarray(frames.data[frames.darks], dtype=np.float64)
    for name, stack in (("flats", flats), ("darks", darks)):
        if not np.all(np.isfinite(stack)):
            nx.fail(
                "instrument/detector/data",
                f"{int((~np.isfinite(stack)).sum())} values of the {name} are NaN or Inf",
            )
    flat, dark, problem = mean_flat_dark(flats, darks)
    if problem:
        nx.fail("instrument/detector/data", problem)
    return flat, dark


def _volume_grid(nx: _Entry, kind: str, frames: _Frames, px: float, sod, odd: float):
    """The volume grid, its voxel size (mm), where that came from and the ground truth: ctuq's
    ``ctuq_ground_truth`` group, else CIL's default grid (:func:`~ctuq.data.projections.default_volume`) and
    ``None``."""
    e = nx.name
    if "ctuq_ground_truth" not in nx.f[e]:
        gt_shape, voxel = default_volume(kind, (frames.rows, frames.cols), px, sod, odd)
        return gt_shape, voxel, "default (detector pixel / magnification)", None
    gds = nx.dataset("ctuq_ground_truth/data")
    voxel = nx.length("ctuq_ground_truth/voxel_size")
    if gds.ndim != 3 or min(gds.shape) < 1 or not voxel > 0:
        nx.fail("ctuq_ground_truth", f"data {gds.shape} must be (n_z, n_y, n_x) with a positive voxel_size")
    gt = ArraySource(
        nx.path,
        key=f"/{e}/ctuq_ground_truth/data",
        described_by=nx.path,
        error=NXtomoError,
        dataset=f"/{e}/ctuq_ground_truth/data",
    )
    return tuple(int(s) for s in gds.shape), voxel, "ctuq_ground_truth/voxel_size", gt


def _origins(path: Path, e: str, kind: str, has_y_pixel: bool, has_ground_truth: bool) -> dict[str, ValueOrigin]:
    """The field of the NXtomo file (entry ``e``) each geometry quantity comes from, for the messages of
    :mod:`ctuq.data.plausibility`."""
    det = f"/{e}/instrument/detector"
    return {
        "source": ValueOrigin(
            path, f"/{e}/sample/rotation_angle" if kind == ScanGeometry.PARALLEL else f"/{e}/instrument/source/distance"
        ),
        "detector": ValueOrigin(path, f"{det}/distance"),
        "u_step": ValueOrigin(path, f"{det}/x_pixel_size"),
        "v_step": ValueOrigin(path, f"{det}/y_pixel_size" if has_y_pixel else f"{det}/x_pixel_size"),
        "voxel_size": ValueOrigin(
            path,
            f"/{e}/ctuq_ground_truth/voxel_size"
            if has_ground_truth
            else f"{det}/x_pixel_size (no ctuq_ground_truth: the voxel is pixel / magnification)",
        ),
        "grid": ValueOrigin(path, f"/{e}/ctuq_ground_truth/data" if has_ground_truth else f"{det}/data"),
    }


def _frame_stack(projections, flats, darks, angles_deg):
    """``(frames, image_key, rotation_angle)`` of :func:`write_nxtomo`: darks, the first flat, the projections, the
    remaining flats (flats before and after, as at a beamline); the flats and darks at the nearest projection's
    angle."""
    proj = np.asarray(projections)
    fl, dk = np.asarray(flats), np.asarray(darks)
    frames = np.concatenate([dk, fl[:1], proj, fl[1:]], axis=0)
    keys = np.concatenate(
        [np.full(len(dk), 2), np.full(min(1, len(fl)), 1), np.zeros(len(proj), np.int64), np.full(len(fl) - 1, 1)]
    ).astype(np.int32)
    ang = np.asarray(angles_deg, dtype=np.float64)
    frame_angles = np.concatenate([np.full(len(dk) + min(1, len(fl)), ang[0]), ang, np.full(len(fl) - 1, ang[-1])])
    return frames, keys, frame_angles


def _nx(group, cls):
    """``group`` tagged as NeXus class ``cls``."""
    group.attrs["NX_class"] = cls
    return group


def _put(group, name, value, units=None):
    """A dataset ``name`` of ``group`` holding ``value``, with its ``units`` attribute when given."""
    ds = group.create_dataset(name, data=value)
    if units is not None:
        ds.attrs["units"] = units
    return ds


def write_nxtomo(
    path: str | os.PathLike,
    *,
    projections: np.ndarray,
    flats: np.ndarray,
    darks: np.ndarray,
    angles_deg: np.ndarray,
    pixel_size: float,
    row_pixel_size: float | None = None,
    source_object: float | None = None,
    object_detector: float | None = None,
    cor_offset_px: float = 0.0,
    read_noise: float | None = None,
    ground_truth: np.ndarray | None = None,
    voxel_size: float | None = None,
    title: str = "ctuq scan",
) -> Path:
    """Write a minimal NXtomo file (module docstring; lengths in mm, stated in ``units`` attributes).

    ``projections`` ``(n, rows, cols)`` counts at ``angles_deg`` ``(n,)``; ``flats`` and ``darks`` ``(k, rows,
    cols)``. Frames are stored darks, the first flat, projections, the remaining flats (flats before and after, as
    at a beamline). ``source_object`` ``None`` writes a parallel-beam scan. ``ground_truth`` ``(n_z, n_y, n_x)``
    (mm⁻¹, ``voxel_size`` mm) and ``read_noise`` (counts) go into ctuq's own fields. Written atomically.
    """
    path = Path(path)
    frames, keys, frame_angles = _frame_stack(projections, flats, darks, angles_deg)
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs["default"] = "entry"
            e = _nx(f.create_group("entry"), "NXentry")
            e.attrs["default"] = "data"
            _put(e, "definition", "NXtomo")
            _put(e, "title", title)
            inst = _nx(e.create_group("instrument"), "NXinstrument")
            src = _nx(inst.create_group("source"), "NXsource")
            _put(src, "type", "Fixed Tube X-ray" if source_object is not None else "Synchrotron X-ray Source")
            _put(src, "probe", "x-ray")
            if source_object is not None:
                _put(src, "distance", -float(source_object), "mm")  # NeXus: upstream of the sample is negative
            det = _nx(inst.create_group("detector"), "NXdetector")
            _put(det, "data", frames).attrs["interpretation"] = "image"
            _put(det, "image_key", keys)
            _put(det, "x_pixel_size", float(pixel_size), "mm")
            _put(det, "y_pixel_size", float(pixel_size if row_pixel_size is None else row_pixel_size), "mm")
            if object_detector is not None:
                _put(det, "distance", float(object_detector), "mm")
            _put(det, "x_rotation_axis_pixel_position", float(cor_offset_px), "pixel")
            if read_noise is not None:
                _put(det, "ctuq_read_noise", float(read_noise), "counts")
            sample = _nx(e.create_group("sample"), "NXsample")
            _put(sample, "name", title)
            _put(sample, "rotation_angle", frame_angles, "degree")
            d = _nx(e.create_group("data"), "NXdata")
            d.attrs["signal"] = "data"
            d["data"] = det["data"]
            d["rotation_angle"] = sample["rotation_angle"]
            d["image_key"] = det["image_key"]
            if ground_truth is not None:
                g = _nx(e.create_group("ctuq_ground_truth"), "NXdata")
                g.attrs["signal"] = "data"
                _put(g, "data", np.asarray(ground_truth, dtype=np.float32), "1/mm")
                _put(g, "voxel_size", float(voxel_size), "mm")
    return path


class NXtomoFormat(ScanFormat):
    """NXtomo, the NeXus application definition for tomography raw data (module docstring)."""

    name = "nxtomo"
    expects = "an NXtomo file (*.nxs, *.h5; or a folder holding exactly one)"
    layouts = {"nxtomo": {}}
    stores_degrees = True
    error = NXtomoError

    @classmethod
    def folder_lacks(cls) -> str:
        return "no single NXtomo file (*.nxs, *.h5)"

    @classmethod
    def detect(cls, path: Path) -> Path | None:
        if is_nxtomo(path):
            return path
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in NXTOMO_SUFFIXES and is_nxtomo(p))
            if len(found) == 1:
                return found[0]
        return None

    @classmethod
    def open(cls, path: Path, orbit: int = 2) -> ProjectionScan:
        return open_nxtomo(path)

    @classmethod
    def check_orbits(cls, orbits: Mapping[int, CircularOrbit]) -> None:
        geometry = one_plane_orbit(orbits, "NXtomo")
        if geometry.corrected:
            raise ValueError(
                "NXtomo has no field for the simulated detector tilt and row offset; add --no-corrections (an "
                "ideal circular geometry) to write it"
            )

    @classmethod
    def write(cls, folder: Path, content: ScanContent, *, compress: bool = True, **options) -> Path:
        """``folder/scan.nxs`` (:func:`write_nxtomo`) of the content's one orbit (distinct angles only: a closing
        projection is dropped); HDF5 datasets are stored uncompressed (``compress`` is not used)."""
        if options:
            raise TypeError(f"NXtomoFormat.write: unknown options {sorted(options)}")
        orbit = content.only_orbit("NXtomo")
        cls.check_orbits({n: o.geometry for n, o in content.orbits.items()})
        g = orbit.geometry
        return write_nxtomo(
            Path(folder) / "scan.nxs",
            projections=orbit.projections,
            flats=orbit.flats,
            darks=orbit.darks,
            angles_deg=angle_range_values(0.0, 360.0, g.n_angles),
            pixel_size=g.pixel_size,
            row_pixel_size=g.row_pixel_size,
            source_object=g.source_object,
            object_detector=g.object_detector,
            cor_offset_px=g.cor_offset_px if g.cor_offset_px else 0.0,  # 0.0 rather than −0.0 in the file
            read_noise=content.read_noise,
            ground_truth=content.ground_truth,
            voxel_size=content.voxel_size if content.ground_truth is not None else None,
            title=content.title,
        )

    @classmethod
    def written_files(cls, folder: Path) -> list[Path]:
        p = Path(folder) / "scan.nxs"
        return [p] if p.is_file() else []
