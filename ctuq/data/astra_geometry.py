"""Circular scan geometries as ASTRA vectors, and a loaded scan's geometry to ASTRA (and CIL) and back.

Every scan format ends up as per-angle 3D vectors in ASTRA's conventions (``ctuq.geometry``): ``cone_vec`` rows
``(source xyz, detector centre xyz, u xyz, v xyz)`` for fan and cone beams, ``parallel3d_vec`` rows ``(ray
direction xyz, detector centre xyz, u, v)`` for parallel beams, in mm. :func:`circular_vectors` builds them from
the parameters a scan description gives — angles (radians), source–object and object–detector distances,
detector pitch, centre-of-rotation and row offsets (detector pixels), in-plane detector tilt (degrees) — in ASTRA's
orientation: at angle ``θ`` the source sits at ``(D_so sin θ, −D_so cos θ, 0)``, the detector centre at
``(−D_od sin θ, D_od cos θ, 0)``, ``u = (cos θ, sin θ, 0)·pitch`` along a detector row and ``v = (0, 0, 1)·pitch``
from row to row (row index increasing with ``z``), exactly as ``astra.geom_2vec`` converts ASTRA's ``cone`` and
``parallel3d`` geometries. It is the one formula: the simulator's walnut-layout vectors come from it too, so a
scan written in several layouts has bit-identical geometry in each.

Export: :func:`to_astra` gives the ASTRA ``(vol_geom, proj_geom)`` dicts of a loaded scan (a
:class:`~ctuq.data.problem.CTData`, or a volume and projection geometry) in ctuq's coordinate convention, so ctuq's
arrays — images ``(n_y, n_x)`` / ``(n_z, n_y, n_x)``, sinograms ``(angle, column)`` / ``(angle, row, column)`` —
can be handed to ASTRA (3D: ``astra.data3d`` wants ``(row, angle, column)``: ``y.transpose(1, 0, 2)``) or to CIL's
ASTRA plugin; :func:`from_astra` reads such dicts (or any ASTRA geometry dict) back into ctuq's
:class:`~ctuq.geometry.VolumeGeometry` and :class:`~ctuq.geometry.ProjectionGeometry`. :func:`save_astra_vectors` /
:func:`load_astra_vectors` write and read the vectors as text (one row per angle, the walnut ``.geom`` format).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import astra
import numpy as np

from ctuq.errors import CTUQError
from ctuq.geometry import ProjectionGeometry, VolumeGeometry, astra_geometries
from ctuq.options import AngleUnit, ScanGeometry
from ctuq.utils import atomic_path

__all__ = [
    "AstraGeometryError",
    "angle_range",
    "angle_range_values",
    "to_radians",
    "circular_vectors",
    "to_astra",
    "from_astra",
    "save_astra_vectors",
    "load_astra_vectors",
]


class AstraGeometryError(CTUQError):
    """An ASTRA geometry dict or vector file that ctuq cannot represent; the message names the key or file."""


def to_radians(values: np.ndarray | Sequence[float], unit: str) -> np.ndarray:
    """Angles in ``unit`` (:class:`ctuq.options.AngleUnit`) as float64 radians; degrees go through
    ``numpy.radians`` (the one conversion every format uses, so equal degree values give bit-equal radians)."""
    a = np.asarray(values, dtype=np.float64)
    if unit == AngleUnit.DEGREE:
        return np.radians(a)
    if unit == AngleUnit.RADIAN:
        return a.copy()
    raise ValueError(f"angle unit {unit!r} unknown; valid: {[u.value for u in AngleUnit]}")


def angle_range_values(start: float, stop: float, count: int) -> np.ndarray:
    """``count`` equispaced values from ``start`` towards ``stop`` (``stop`` excluded: 0, 360, 4 → 0, 90, 180, 270),
    float64, in the unit of ``start``/``stop``: ``start + (stop − start)·k/count``."""
    k = np.arange(int(count), dtype=np.float64)
    return float(start) + (float(stop) - float(start)) * k / int(count)


def angle_range(start: float, stop: float, count: int, unit: str) -> np.ndarray:
    """:func:`angle_range_values` in ``unit``, returned in radians (float64) by :func:`to_radians`."""
    return to_radians(angle_range_values(start, stop, count), unit)


def circular_vectors(
    kind: str,
    angles: np.ndarray,
    *,
    pixel_size: float,
    row_pixel_size: float | None = None,
    source_object: float | None = None,
    object_detector: float = 0.0,
    cor_offset_px: float = 0.0,
    row_offset_px: float = 0.0,
    tilt_deg: float = 0.0,
    source_z: float = 0.0,
) -> np.ndarray:
    """ASTRA 3D vectors ``(n_angles, 12)`` (mm) of a circular scan about ``z`` (module docstring).

    Parameters
    ----------
    kind : {"parallel", "fan", "cone"}
        ``parallel`` gives ``parallel3d_vec`` rows (ray direction, detector centre, u, v); ``fan`` and ``cone``
        give ``cone_vec`` rows (source, detector centre, u, v).
    angles : (n_angles,) float64
        Radians.
    pixel_size, row_pixel_size : float
        Detector column pitch ``|u|`` and row pitch ``|v|`` (mm); ``row_pixel_size`` defaults to ``pixel_size``.
    source_object, object_detector : float
        Source–rotation-axis and rotation-axis–detector distances (mm); ``source_object`` is needed for fan/cone.
    cor_offset_px : float
        Centre-of-rotation offset: the rotation axis projects ``cor_offset_px`` columns right of the detector's
        centre column (the detector centre moves by ``−cor_offset_px·u``).
    row_offset_px : float
        The detector centre moves by ``row_offset_px·v`` (rows; up for positive values).
    tilt_deg : float
        In-plane rotation of the detector (degrees, from ``u`` towards ``v``).
    source_z : float
        Height of the source orbit (mm; cone only).
    """
    theta = np.asarray(angles, dtype=np.float64).reshape(-1)
    n = len(theta)
    s, c = np.sin(theta), np.cos(theta)
    zeros, ones = np.zeros(n), np.ones(n)
    du = float(pixel_size)
    dv = float(pixel_size if row_pixel_size is None else row_pixel_size)
    e_u = np.stack([c, s, zeros], axis=1)  # along a detector row
    e_v = np.stack([zeros, zeros, ones], axis=1)  # along a detector column, +z
    if kind == ScanGeometry.PARALLEL:
        head = np.stack([s, -c, zeros], axis=1)  # ASTRA's parallel3d ray direction
        det = np.stack([zeros, zeros, zeros], axis=1)
    elif kind in (ScanGeometry.FAN, ScanGeometry.CONE):
        if source_object is None:
            raise ValueError(f"circular_vectors: a {kind} beam needs source_object (mm)")
        sod, odd = float(source_object), float(object_detector)
        head = np.stack([sod * s, -sod * c, np.full(n, float(source_z))], axis=1)
        det = np.stack([-odd * s, odd * c, zeros], axis=1)
    else:
        raise ValueError(f"circular_vectors: kind {kind!r} unknown; valid: {[k.value for k in ScanGeometry]}")
    # The operation order is the simulator's (ctuq.data.simulate.orbit_vectors): bit-identical vectors per layout.
    det = det + (-float(cor_offset_px)) * du * e_u + float(row_offset_px) * dv * e_v
    phi = math.radians(float(tilt_deg))
    u = du * (math.cos(phi) * e_u + math.sin(phi) * e_v)
    v = dv * (-math.sin(phi) * e_u + math.cos(phi) * e_v)
    return np.concatenate([head, det, u, v], axis=1)


# --------------------------------------------------------------------------------------------- ASTRA export
def to_astra(data_or_volume: Any, geometry: ProjectionGeometry | None = None) -> tuple[dict, dict]:
    """ASTRA ``(vol_geom, proj_geom)`` dicts of a loaded scan, in ctuq's coordinate convention.

    ``data_or_volume`` is a :class:`~ctuq.data.problem.CTData` (its ``volume`` and ``geometry``: for a 2D slice the
    ``fanflat_vec``/``parallel_vec`` geometry of the sinogram ``y`` ``(n_angles, n_cols)``; for a volume the
    ``cone_vec``/``parallel3d_vec`` one of ``y`` ``(n_angles, n_rows, n_cols)``), or a
    :class:`~ctuq.geometry.VolumeGeometry` with ``geometry``. 2D geometries are mirrored in ``y`` so that ctuq's
    image array, whose row index increases with ``y``, can be given to ASTRA as it is (:func:`ctuq.geometry.
    astra_geometries`); 3D ones are ASTRA's own. Lengths in mm.
    """
    if geometry is None:
        volume, geometry = data_or_volume.volume, data_or_volume.geometry
    else:
        volume = data_or_volume
    return astra_geometries(volume, geometry)


def _vol_from_astra(vol_geom: dict) -> VolumeGeometry:
    try:
        opt = vol_geom.get("option", {})
        rows, cols = int(vol_geom["GridRowCount"]), int(vol_geom["GridColCount"])
        x0, x1 = float(opt["WindowMinX"]), float(opt["WindowMaxX"])
        y0, y1 = float(opt["WindowMinY"]), float(opt["WindowMaxY"])
        slices = vol_geom.get("GridSliceCount")
        z0, z1 = (float(opt["WindowMinZ"]), float(opt["WindowMaxZ"])) if slices is not None else (0.0, 0.0)
    except (KeyError, TypeError, ValueError) as exc:
        raise AstraGeometryError(f"vol_geom: missing or invalid key {exc} (an astra.create_vol_geom dict)") from None
    h = (x1 - x0) / cols
    sizes = [(y1 - y0) / rows] + ([(z1 - z0) / int(slices)] if slices is not None else [])
    if any(not math.isclose(s, h, rel_tol=1e-9) for s in sizes):
        raise AstraGeometryError(
            f"vol_geom: voxels are not cubic (x {h:g}, others {sizes} mm); ctuq grids have one voxel size"
        )
    if slices is None:
        return VolumeGeometry((rows, cols), h, ((x0 + x1) / 2, (y0 + y1) / 2))
    return VolumeGeometry((int(slices), rows, cols), h, ((x0 + x1) / 2, (y0 + y1) / 2, (z0 + z1) / 2))


def from_astra(vol_geom: dict, proj_geom: dict) -> tuple[VolumeGeometry, ProjectionGeometry]:
    """ctuq's ``(VolumeGeometry, ProjectionGeometry)`` from ASTRA dicts in ctuq's convention (:func:`to_astra`'s
    output, or any ASTRA geometry: 3D ones are the same in both conventions; 2D ones are un-mirrored in ``y``).

    Angle-based kinds (``parallel``, ``fanflat``, ``cone``, ``parallel3d``) are converted to vectors with
    ``astra.geom_2vec``. Raises :class:`AstraGeometryError` naming the key for a dict ctuq cannot read.
    """
    volume = _vol_from_astra(vol_geom)
    kind = proj_geom.get("type")
    if kind in ("parallel", "fanflat", "cone", "parallel3d"):
        proj_geom = astra.geom_2vec(proj_geom)
        kind = proj_geom["type"]
    if kind not in ("parallel_vec", "fanflat_vec", "cone_vec", "parallel3d_vec"):
        raise AstraGeometryError(f"proj_geom['type'] = {kind!r}: not an ASTRA projection geometry ctuq reads")
    try:
        vec = np.array(proj_geom["Vectors"], dtype=np.float64)
        if kind in ("cone_vec", "parallel3d_vec"):
            det_shape = (int(proj_geom["DetectorRowCount"]), int(proj_geom["DetectorColCount"]))
        else:
            det_shape = (int(proj_geom["DetectorCount"]),)
    except (KeyError, TypeError, ValueError) as exc:
        raise AstraGeometryError(f"proj_geom: missing or invalid key {exc} ({kind})") from None
    if volume.ndim == 2:
        cx, cy = volume.center
        volume = VolumeGeometry(volume.shape, volume.voxel_size, (cx, -cy))
        vec = vec.copy()
        vec[:, 1::2] *= -1.0
    try:
        geometry = ProjectionGeometry(kind, det_shape, vectors=vec)
    except ValueError as exc:
        raise AstraGeometryError(f"proj_geom: {exc}") from None
    if geometry.ndim != volume.ndim:
        raise AstraGeometryError(f"proj_geom {kind!r} is {geometry.ndim}D but vol_geom is {volume.ndim}D")
    return volume, geometry


def save_astra_vectors(path: str | os.PathLike, geometry: ProjectionGeometry) -> Path:
    """Write ``geometry``'s ASTRA vectors as text, one row per angle (``%.17g``: exact float64), with a header
    comment naming the kind and the detector shape; written atomically. Returns the path."""
    path = Path(path)
    vec = geometry.to_vectors()
    header = f"ASTRA {vec.kind} vectors (mm), one row per angle; detector shape {list(vec.det_shape)}"
    with atomic_path(path) as tmp:
        np.savetxt(tmp, vec.vectors, fmt="%.17g", header=header)
    return path


def load_astra_vectors(path: str | os.PathLike, columns: int = 12) -> np.ndarray:
    """Read ASTRA vectors written by :func:`save_astra_vectors` (or a walnut ``.geom`` file): ``(n_angles,
    columns)`` float64 (``#`` lines are comments). Raises :class:`AstraGeometryError` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise AstraGeometryError(f"{path}: file missing")
    try:
        vec = np.loadtxt(path, dtype=np.float64, comments="#", ndmin=2)
    except ValueError as exc:
        raise AstraGeometryError(f"{path}: not a table of numbers ({exc})") from None
    if vec.shape[1] != columns or vec.shape[0] < 1:
        raise AstraGeometryError(f"{path}: shape {vec.shape}, expected (n_angles, {columns}) ASTRA vectors")
    if not np.all(np.isfinite(vec)):
        raise AstraGeometryError(f"{path}: {int((~np.isfinite(vec)).sum())} entries are NaN or Inf")
    return vec
