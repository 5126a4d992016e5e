"""Is an opened scan's geometry one a CT scanner can have? :func:`check_geometry` refuses impossible geometry in one
line and returns a warning for implausible physical sizes (a ``scan.yaml`` whose ``units`` do not match its numbers,
a voxel size off by 10³), before any projection is read.

Ranges (CT from nano-CT to clinical and industrial scanners, generous on both sides): detector pixels and voxels
between :data:`SIZE_RANGE_MM` (0.1 µm and 10 mm). Impossible: a non-finite or zero pixel or voxel size, a source at
the rotation axis, a detector between the source and the axis (cone and fan beam). Implausible, besides the
sizes: a source–axis distance not larger than the object's radius (half the image grid's width: the source would be
inside the object). An object wider than the field of view is seen in the data, not the headers:
:func:`truncation_warning` on the loaded sinogram.

Every refusal and warning names the file the value came from, and the row or field where the format knows it
(:meth:`ScanSource.origin <ctuq.data.source.ScanSource.origin>`): a line of the walnut layout's ``.geom`` file or
of ``scan.yaml``'s ``geometry.vectors`` file, a key of ``scan.yaml`` (``detector.pixel_size``), a field of the NXtomo
file (``scan.nxs:/entry/instrument/detector/x_pixel_size``).
"""

from __future__ import annotations

import numpy as np

from ctuq.data.source import VECTOR_PARTS, ScanSource, ValueOrigin
from ctuq.options import ScanGeometry

__all__ = ["SIZE_RANGE_MM", "check_geometry", "truncation_warning"]

#: Plausible detector-pixel and voxel sizes of a CT scanner, mm (0.1 µm – 10 mm).
SIZE_RANGE_MM = (1e-4, 10.0)
# the detector's edge columns see this fraction of the sinogram's largest line integral, or more, on average over
# the angles: the object reaches past the field of view (truncated projections)
_TRUNCATION_FRACTION = 0.05


def _mm(value: float) -> str:
    return f"{value:.4g} mm"


def _refuse_impossible(scan: ScanSource, v: np.ndarray, u_step: np.ndarray, v_step: np.ndarray) -> None:
    """Raise ``scan.error`` naming the file (and row or field) of the first impossible value: non-finite vectors,
    a zero detector step, a non-finite or non-positive voxel size."""
    finite = np.isfinite(v)
    if not np.all(finite):
        row, col = (int(i) for i in np.argwhere(~finite)[0])
        where = scan.origin(list(VECTOR_PARTS)[col // 3], row)
        raise scan.error(f"{where}: the projection geometry has non-finite values")
    zero = ~((u_step > 0) & (v_step > 0))
    if zero.any():
        row = int(np.argmax(zero))
        part = "u_step" if not u_step[row] > 0 else "v_step"
        raise scan.error(f"{scan.origin(part, row)}: a detector pixel has zero size")
    voxel = float(scan.voxel_size)
    if not (np.isfinite(voxel) and voxel > 0):
        raise scan.error(f"{scan.origin('voxel_size')}: the voxel size must be finite and positive, got {voxel}")


def _refuse_source_and_detector(scan: ScanSource, sod: np.ndarray, sdd: np.ndarray) -> None:
    """Raise ``scan.error`` naming the file (and row or field) of a source on the rotation axis or a detector
    between the source and the axis (cone and fan beam; ``sod``, ``sdd`` per geometry row, mm)."""
    on_axis = ~(sod > 0)
    if on_axis.any():
        where = scan.origin("source", int(np.argmax(on_axis)))
        raise scan.error(f"{where}: the source lies on the rotation axis (source–axis distance 0)")
    inside = ~(sdd >= sod)
    if inside.any():
        row = int(np.argmax(inside))
        raise scan.error(
            f"{scan.origin('detector', row)}: the detector lies between the source and the rotation axis "
            f"(source–detector {_mm(float(sdd[row]))}, source–axis {_mm(float(sod[row]))}): the object cannot be "
            f"projected"
        )


def _implausible_message(scan: ScanSource, problems: list[tuple[str, list[ValueOrigin]]]) -> str:
    """The one warning line of ``problems`` (each a value with its unit and the origins it came from): led by the
    one file they all came from (each problem then names its field), else by the scan (each problem names its
    file)."""
    files = {o.file for _, origins in problems for o in origins}
    one_file = len(files) == 1
    parts = []
    for text, origins in problems:
        named = [o.field if one_file else str(o) for o in origins]
        named = list(dict.fromkeys(n for n in named if n))
        parts.append(f"{text} ({', '.join(named)})" if named else text)
    lo, hi = SIZE_RANGE_MM
    units = getattr(scan, "info", {}).get("units")
    hint = f"; check `units` in {scan.path.name} (now {units})" if units else ""
    return (
        f"{next(iter(files)) if one_file else scan.path}: implausible geometry for a CT scanner: {'; '.join(parts)} "
        f"(plausible pixel and voxel sizes: {lo * 1e3:g} µm – {hi:g} mm){hint}"
    )


def check_geometry(scan: ScanSource) -> str | None:
    """One warning line (``None`` when nothing is implausible) naming every implausible value of ``scan``'s geometry,
    its unit, the plausible range and the file (and field) it came from; ``scan.error`` (a one-line user error
    naming the file, and the row or field, that holds the value, :meth:`ScanSource.origin
    <ctuq.data.source.ScanSource.origin>`) for impossible geometry. Reads the headers only (``vectors``,
    ``det_shape``, ``gt_shape``, ``voxel_size``)."""
    v = np.asarray(scan.vectors, dtype=np.float64)
    u_step = np.linalg.norm(v[:, 6:9], axis=1)
    v_step = np.linalg.norm(v[:, 9:12], axis=1)
    _refuse_impossible(scan, v, u_step, v_step)
    voxel = float(scan.voxel_size)
    problems: list[tuple[str, list[ValueOrigin]]] = []
    lo, hi = SIZE_RANGE_MM
    pixel = float(np.median(np.concatenate([u_step, v_step])))
    if not lo <= pixel <= hi:
        problems.append((f"detector pixel {_mm(pixel)}", [scan.origin("u_step"), scan.origin("v_step")]))
    if not lo <= voxel <= hi:
        problems.append((f"voxel {_mm(voxel)}", [scan.origin("voxel_size")]))
    radius = 0.5 * max(scan.gt_shape[1:]) * voxel  # the object's radius: half the image grid's width
    if scan.geometry_type != ScanGeometry.PARALLEL:
        source = v[:, 0:3]
        sod = np.linalg.norm(source, axis=1)
        sdd = np.linalg.norm(v[:, 3:6] - source, axis=1)
        _refuse_source_and_detector(scan, sod, sdd)
        if sod.min() <= radius:
            nearest = int(np.argmin(sod))
            problems.append((
                f"source–axis distance {_mm(float(sod.min()))} not larger than the object's radius {_mm(radius)} "
                f"(half the image grid)",
                [scan.origin("source", nearest), scan.origin("grid")],
            ))  # fmt: skip
    return _implausible_message(scan, problems) if problems else None


def truncation_warning(y, where: str) -> str | None:
    """A warning when the object reaches past the field of view: the detector's outermost columns of the sinogram
        ``y`` ``(n_angles, [n_rows,] n_cols)`` (line integrals) carry, averaged over angles (and rows), at least 5 % of
        its largest value; ``None`` otherwise. ``where`` names the file the sinogram came from (the scan's
    ``origin("projections")``)."""
    arr = y.detach().to("cpu").double().numpy() if hasattr(y, "detach") else np.asarray(y, dtype=np.float64)
    top = float(np.max(arr))
    if not top > 0 or arr.shape[-1] < 3:
        return None
    edge = max(float(np.mean(arr[..., 0])), float(np.mean(arr[..., -1])))
    if edge < _TRUNCATION_FRACTION * top:
        return None
    return (
        f"{where}: the object seems wider than the field of view: the detector's edge columns carry "
        f"{100 * edge / top:.0f} % of the largest line integral on average (truncated projections bias the "
        f"reconstruction near the edge of the field of view)"
    )
