"""Is an opened scan's geometry one a CT scanner can have? :func:`check_geometry` refuses impossible geometry in one
line and returns a warning for implausible physical sizes (a ``scan.yaml`` whose ``units`` do not match its numbers,
a voxel size off by 10³), before any projection is read.

Ranges (CT from nano-CT to clinical and industrial scanners, generous on both sides): detector pixels and voxels
between :data:`SIZE_RANGE_MM` (0.1 µm and 10 mm). Impossible: a non-finite or zero pixel or voxel size, a source at
the rotation axis, a detector between the source and the axis (cone and fan beam). Implausible, besides the
sizes: a source–axis distance not larger than the object's radius (half the image grid's width: the source would be
inside the object). An object wider than the field of view is seen in the data, not the headers:
:func:`truncation_warning` on the loaded sinogram.
"""

from __future__ import annotations

import numpy as np

from ctuq.data.source import ScanSource
from ctuq.options import ScanGeometry

__all__ = ["SIZE_RANGE_MM", "check_geometry", "truncation_warning"]

#: Plausible detector-pixel and voxel sizes of a CT scanner, mm (0.1 µm – 10 mm).
SIZE_RANGE_MM = (1e-4, 10.0)
# the detector's edge columns see this fraction of the sinogram's largest line integral, or more, on average over
# the angles: the object reaches past the field of view (truncated projections)
_TRUNCATION_FRACTION = 0.05


def _mm(value: float) -> str:
    return f"{value:.4g} mm"


def check_geometry(scan: ScanSource) -> str | None:
    """One warning line (``None`` when nothing is implausible) naming every implausible value of ``scan``'s geometry,
    its unit and the plausible range; ``scan.error`` (a one-line user error naming the scan) for impossible
    geometry. Reads the headers only (``vectors``, ``det_shape``, ``gt_shape``, ``voxel_size``)."""
    v = np.asarray(scan.vectors, dtype=np.float64)
    where = str(scan.path)
    if not np.all(np.isfinite(v)):
        raise scan.error(f"{where}: the projection geometry has non-finite values")
    u_step = np.linalg.norm(v[:, 6:9], axis=1)
    v_step = np.linalg.norm(v[:, 9:12], axis=1)
    voxel = float(scan.voxel_size)
    if not (u_step.min() > 0 and v_step.min() > 0):
        raise scan.error(f"{where}: a detector pixel has zero size (u or v step of the geometry)")
    if not (np.isfinite(voxel) and voxel > 0):
        raise scan.error(f"{where}: the voxel size must be finite and positive, got {voxel}")
    problems = []
    lo, hi = SIZE_RANGE_MM
    pixel = float(np.median(np.concatenate([u_step, v_step])))
    if not lo <= pixel <= hi:
        problems.append(f"detector pixel {_mm(pixel)}")
    if not lo <= voxel <= hi:
        problems.append(f"voxel {_mm(voxel)}")
    radius = 0.5 * max(scan.gt_shape[1:]) * voxel  # the object's radius: half the image grid's width
    if scan.geometry_type != ScanGeometry.PARALLEL:
        source = v[:, 0:3]
        sod = np.linalg.norm(source, axis=1)
        sdd = np.linalg.norm(v[:, 3:6] - source, axis=1)
        if not sod.min() > 0:
            raise scan.error(f"{where}: the source lies on the rotation axis (source–axis distance 0)")
        if not np.all(sdd >= sod):
            raise scan.error(
                f"{where}: the detector lies between the source and the rotation axis (source–detector "
                f"{_mm(float(sdd.min()))}, source–axis {_mm(float(sod.min()))}): the object cannot be projected"
            )
        if sod.min() <= radius:
            problems.append(f"source–axis distance {_mm(float(sod.min()))} not larger than the object's radius "
                            f"{_mm(radius)} (half the image grid)")  # fmt: skip
    if not problems:
        return None
    units = getattr(scan, "info", {}).get("units")
    hint = f"; check `units` in {scan.path.name} (now {units})" if units else ""
    return (
        f"{where}: implausible geometry for a CT scanner: {'; '.join(problems)} (plausible pixel and voxel sizes: "
        f"{lo * 1e3:g} µm – {hi:g} mm){hint}"
    )


def truncation_warning(y, where: str) -> str | None:
    """A warning when the object reaches past the field of view: the detector's outermost columns of the sinogram
    ``y`` ``(n_angles, [n_rows,] n_cols)`` (line integrals) carry, averaged over angles (and rows), at least 5 % of
    its largest value; ``None`` otherwise. ``where`` names the scan."""
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
