"""The one slice and volume loader of every scan format: plan → read rows → finish into a :class:`CTData`.

Any :class:`~ctuq.data.source.ScanSource` (the walnut folder, ``scan.yaml``, NXtomo, a format of your own) loads
through these functions; formats differ only in how their source reads its rows.

2D slices (:func:`load_slice`, :func:`read_slice`): the sinogram of the plane ``z`` of slice ``k`` of the scan's
volume grid (``z = (k + ½ − n_z/2)·h``, default the central slice) is read off the detector

* for a cone beam along the line where the plane through the source and the horizontal line ``{(t·ĥ, z)}`` (``ĥ ⊥``
  the source direction; it contains the central ray through ``(0, 0, z)``) cuts the detector: per angle and column
  a fractional row, the two neighbouring rows linearly interpolated (after the log). For a source in the slice
  plane (the walnut data set's orbit 2, central slice) this plane *is* ``z = const`` and the ``fanflat_vec``
  geometry built from the 3D vectors (source xy, detector points xy) is exact — including a tilted detector, whose
  row line is then slanted (handled per column). Otherwise the rays leave the plane by the cone angle, which is
  reported in a warning. With ``backend="astra_cuda"`` the operator is the exact cone-beam slice model instead
  (``AstraCudaRayTransform.cone_slice``, GPU);
* for a parallel beam along the detector line at the slice's height; a one-row detector (fan or parallel) as it is.

Angular subsampling ``k`` keeps the geometry rows :meth:`~ctuq.data.source.ScanSource.angle_plan` gives (``0, k, 2k,
…`` of the distinct angles); detector columns: every ``k``-th column starting at column 0 (the published sparse
setting: it keeps every sample's noise as measured), or, with ``detector_binning=True``, the mean *transmission* of
``k`` adjacent columns (less noise, wider pixels); ``u`` becomes ``k·u`` and the detector centre moves to the
centre of the kept columns, exactly. A coarser ``image_shape`` over the same field of view area-averages the ground
truth exactly (box-overlap weights, :func:`area_average`).

Held-out rows (:func:`load_slice` ``heldout=True``): the scan's other angles
(:meth:`~ctuq.data.source.ScanSource.heldout_plan`), read in the same pass; each projection is corrected on its own,
so the used rows are bit for bit those of a load without held-out rows.

3D volumes (:func:`load_volume`, GPU; :func:`read_volume` on the CPU): the ``cone_vec`` (or ``parallel3d_vec``)
geometry with rows and columns subsampled or binned, the ASTRA CUDA operator, the ground-truth volume area-averaged
to ``image_shape``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from ctuq.data.problem import (
    HELDOUT_NO_UNUSED_ANGLES,
    HELDOUT_NOT_READ,
    HELDOUT_VOLUME,
    CTData,
    HeldoutData,
    heldout_every_angle_used,
)
from ctuq.data.source import ScanSource, column_plan, positive_int
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import AstraCudaRayTransform, backend_names, make_ray_transform
from ctuq.options import Backend, ScanGeometry
from ctuq.utils import progress as _progress_bar

__all__ = [
    "SlicePlan",
    "plan_slice",
    "load_slice",
    "read_slice",
    "load_volume",
    "read_volume",
    "area_average",
    "check_backend",
]

CONE_WARN_DEG = 0.01  # below this the fan-beam slice model is exact to well within detector noise


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


# --------------------------------------------------------------------------------------------- option checks
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


def check_backend(backend: str, device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device`` after checking that ``backend`` names a ray-transform backend
    (``ValueError`` listing them otherwise)."""
    if backend not in backend_names():
        raise ValueError(f"backend {backend!r} unknown; valid: {list(backend_names())}")
    return torch.device(device)


def _progress(iterable, total: int, desc: str, progress: bool | None):
    return _progress_bar(iterable, total=total, desc=desc, disable=None if progress is None else not progress)


# --------------------------------------------------------------------------------------------- slice plans
@dataclasses.dataclass
class SlicePlan:
    """Where one slice's sinogram lies on the detector, per geometry row read.

    Attributes
    ----------
    rows, files : (n_a,) int arrays
        Geometry rows and the projections (file indices) holding them.
    cols : (n_c,) int array
        Detector columns read; ``col_step`` and ``binning`` say how they become the output columns.
    frac_rows : (n_a, n_out) float64
        Fractional detector row of each output column (interpolated between its two neighbours).
    fan : ProjectionGeometry
        The slice's 2D geometry (``fanflat_vec`` or ``parallel_vec``), one row per angle.
    cone : ProjectionGeometry
        Its exact one-row 3D geometry (``cone_vec`` or ``parallel3d_vec``).
    z : float
        The slice plane's height (mm).
    cone_angle_deg : float
        The largest angle between a source and the slice plane (0 for parallel beams and one-row detectors).
    """

    rows: np.ndarray
    files: np.ndarray
    cols: np.ndarray
    col_step: int
    binning: bool
    frac_rows: np.ndarray
    fan: ProjectionGeometry
    cone: ProjectionGeometry
    z: float
    cone_angle_deg: float


def plan_slice(
    scan: ScanSource, z: float, rows: np.ndarray, files: np.ndarray, detector_subsampling: int, binning: bool
) -> SlicePlan:
    """The :class:`SlicePlan` of the plane at height ``z`` (mm) over the geometry ``rows`` (read from ``files``)
    of ``scan`` (module docstring): for a cone beam the detector line through the slice plane, for parallel beams
    (rays in the planes ``z = const``) and one-row detectors the detector line at height ``z``. Raises the scan's
    error naming its geometry when the plane misses the detector."""
    step = positive_int(detector_subsampling, "detector_subsampling")
    n_rows, n_cols = scan.det_shape
    try:
        cols, centre_off = column_plan(n_cols, step, binning)
    except ValueError as exc:
        raise scan.error(f"{scan.path}: {exc}") from None
    vec = scan.vectors[rows]
    s, d, u, v = vec[:, 0:3], vec[:, 3:6], vec[:, 6:9], vec[:, 9:12]  # s: the source, or the ray direction
    if binning:  # output columns in pixels from the detector centre (a bin's centre when binning)
        alpha = (np.arange(len(cols) // step) * step + (step - 1) / 2.0) - (n_cols - 1) / 2.0
    else:
        alpha = cols - (n_cols - 1) / 2.0
    cone = scan.geometry_type == ScanGeometry.CONE
    cone_angle = 0.0
    if cone:
        p0 = np.array([0.0, 0.0, z])
        horiz = np.linalg.norm(s[:, :2], axis=1)
        if np.any(horiz <= 0):
            raise scan.geometry_error("a source lies on the rotation axis")
        h_dir = np.stack([-s[:, 1], s[:, 0], np.zeros(len(s))], axis=1) / horiz[:, None]
        normal = np.cross(h_dir, s - p0)  # normal of the plane through the source and the line p0 + t·ĥ
        nv = np.einsum("ij,ij->i", normal, v)
        if np.any(np.abs(nv) < 1e-12 * np.linalg.norm(normal, axis=1) * np.linalg.norm(v, axis=1)):
            raise scan.geometry_error(
                f"the detector columns are parallel to the slice plane at z = {z} mm for some angle"
            )
        # Points d + α u + β v on that plane: β = β0 + β1 α (α, β in pixels from the detector centre).
        beta0 = -np.einsum("ij,ij->i", normal, d - p0) / nv
        beta1 = -np.einsum("ij,ij->i", normal, u) / nv
        cone_angle = float(np.degrees(np.max(np.arctan2(np.abs(s[:, 2] - z), horiz))))
    elif n_rows == 1:
        beta0 = beta1 = np.zeros(len(rows))
    else:
        if np.any(np.abs(s[:, 2]) > 1e-9 * np.linalg.norm(s, axis=1)):
            raise scan.geometry_error("parallel rays are not perpendicular to the rotation axis z")
        if np.any(np.abs(v[:, 2]) < 1e-12 * np.linalg.norm(v, axis=1)):
            raise scan.geometry_error("the detector's v direction has no z component")
        beta0 = (z - d[:, 2]) / v[:, 2]
        beta1 = -u[:, 2] / v[:, 2]
    if cone or n_rows > 1:
        frac_rows = beta0[:, None] + beta1[:, None] * alpha[None, :] + (n_rows - 1) / 2.0
        lo, hi = frac_rows.min(), frac_rows.max()
        if lo < -1e-6 or hi > n_rows - 1 + 1e-6:
            where = f"the slice plane z = {z:.4g} mm meets the detector at rows {lo:.2f} … {hi:.2f}, outside the "
            if cone:
                raise scan.geometry_error(
                    f"{where}{n_rows} detector rows 0 … {n_rows - 1}; choose a slice nearer the source plane",
                    slice_plane=True,
                )
            raise scan.error(f"{scan.path}: {where}{n_rows} detector rows 0 … {n_rows - 1}")
    else:
        frac_rows = np.zeros((len(rows), len(alpha)))
    centre = d + centre_off * u + (beta0 + beta1 * centre_off)[:, None] * v
    u_line = step * (u + beta1[:, None] * v)
    parallel = scan.geometry_type == ScanGeometry.PARALLEL
    fan = ProjectionGeometry(
        "parallel_vec" if parallel else "fanflat_vec",
        (len(alpha),),
        vectors=np.concatenate([s[:, :2], centre[:, :2], u_line[:, :2]], axis=1),
    )
    one_row = ProjectionGeometry(
        "parallel3d_vec" if parallel else "cone_vec",
        (1, len(alpha)),
        vectors=np.concatenate([s, centre, u_line, v], axis=1),
    )
    return SlicePlan(rows, files, cols, step, binning, frac_rows, fan, one_row, float(z), cone_angle)


def _read_plans(scan: ScanSource, plans: list[SlicePlan], progress) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Each plan's sinogram ``(n_a, n_out)`` float64 and variances (``None`` without), in one pass over their
    projections: per angle the two detector rows around the slice line, linearly interpolated after the log."""
    n_rows = scan.det_shape[0]
    jobs, results = [], []
    for plan in plans:
        if n_rows == 1:
            r0 = np.zeros(plan.frac_rows.shape, dtype=np.int64)
            r1 = r0
        else:
            r0 = np.clip(np.floor(plan.frac_rows).astype(np.int64), 0, n_rows - 2)
            r1 = r0 + 1
        w = plan.frac_rows - r0  # weight of row r1
        out = np.empty(plan.frac_rows.shape)
        var = np.empty(plan.frac_rows.shape) if scan.has_variances else None
        results.append((out, var))
        jobs += [(plan, r0, r1, w, out, var, a) for a in range(len(plan.rows))]
    for plan, r0, r1, w, out, var, a in _progress(jobs, len(jobs), "read projections", progress):
        need = np.unique(np.concatenate([r0[a], r1[a]]))
        log_t, v = scan.log_rows(int(plan.files[a]), need, plan.cols, (1, plan.col_step) if plan.binning else None)
        p0, p1 = np.searchsorted(need, r0[a]), np.searchsorted(need, r1[a])
        j = np.arange(log_t.shape[1])
        out[a] = (1.0 - w[a]) * log_t[p0, j] + w[a] * log_t[p1, j]
        if var is not None:
            var[a] = (1.0 - w[a]) ** 2 * v[p0, j] + w[a] ** 2 * v[p1, j]
    return results


# --------------------------------------------------------------------------------------------- slices
def _rows_tensor(a: np.ndarray | None, op) -> torch.Tensor | None:
    if a is None:
        return None
    t = torch.from_numpy(a.astype(np.float32))
    return t if op is None else t.to(op.device)


def _slice(
    scan: ScanSource,
    slice_index,
    ass,
    dss,
    image_shape,
    binning: bool,
    progress,
    backend=None,
    device=None,
    heldout: bool = False,
) -> CTData:
    """:func:`load_slice`'s work (``backend`` ``None``: :func:`read_slice`'s, no operators): plan the used and
    held-out rows, build the operators, read the rows and the ground truth, assemble the :class:`CTData`."""
    image_shape = _check_image_shape(image_shape, 2)
    k = _slice_number(scan, slice_index)
    ass = positive_int(ass, "angular_subsampling")
    z = scan.slice_z(k)
    plan = plan_slice(scan, z, *scan.angle_plan(ass), dss, binning)
    if plan.cone_angle_deg > CONE_WARN_DEG:
        warnings.warn(
            f"slice {k} (z = {z:.3f} mm) of {scan.proj_dir}: the source is not in the slice plane (cone angle up to "
            f"{plan.cone_angle_deg:.3f}°), so the 2D fan-beam model is approximate; the exact model is "
            f"backend='astra_cuda' (GPU), or use a slice at the source height",
            stacklevel=3,
        )
    held, reason = _heldout_slice_plan(scan, z, ass, dss, binning, heldout)
    volume = _coarsened(VolumeGeometry(scan.gt_shape[1:], scan.voxel_size), image_shape)

    def operator(p: SlicePlan):
        if backend == Backend.ASTRA_CUDA and scan.geometry_type == ScanGeometry.CONE:
            return AstraCudaRayTransform.cone_slice(volume, p.z, p.cone, device=device)
        return make_ray_transform(volume, p.fan, backend=backend, device=device)

    # the operators are built before any pixel data are read: a geometry the backend rejects fails fast
    op = None if backend is None else operator(plan)
    held_op = None if backend is None or held is None else operator(held)
    read = _read_plans(scan, [plan] if held is None else [plan, held], progress)
    y, var = read[0]
    gt = None
    if scan.has_ground_truth:
        gt = torch.from_numpy(area_average(scan.read_ground_truth_slice(k), volume.shape).astype(np.float32))
    meta = _slice_meta(scan, plan, k, ass, dss, binning, volume, backend, op)
    heldout_data = None
    if held is not None:
        y_h, var_h = read[1]
        heldout_data = HeldoutData(
            op=held_op,
            y=_rows_tensor(y_h, held_op),
            geometry_rows=held.rows,
            n_used=len(plan.rows),
            variances=_rows_tensor(var_h, held_op),
        )
    return CTData(
        op=op,
        y=_rows_tensor(y, op),
        ground_truth=gt,
        volume=volume,
        geometry=plan.fan,
        meta=meta,
        slice_cone_geometry=plan.cone,
        variances=_rows_tensor(var, op),
        heldout=heldout_data,
        heldout_reason=reason,
    )


def _slice_number(scan: ScanSource, slice_index) -> int:
    """The slice of the volume grid to load (default the central one, ``n_z // 2``), checked in range."""
    n_z = scan.gt_shape[0]
    k = n_z // 2 if slice_index is None else int(slice_index)
    if not 0 <= k < n_z:
        raise ValueError(f"slice_index {slice_index} out of range: the volume grid has {n_z} slices (0 … {n_z - 1})")
    return k


def _heldout_slice_plan(scan: ScanSource, z: float, ass: int, dss, binning: bool, heldout: bool):
    """The plan of the held-out angles of the slice at height ``z`` and why there is none (``(None, reason)``):
    not asked for, no angle left out, or every angle used."""
    if not heldout:
        return None, HELDOUT_NOT_READ
    rows, files = scan.heldout_plan(ass)  # a subset of a scan holds out its other angles at any subsampling
    if len(rows):
        return plan_slice(scan, z, rows, files, dss, binning), ""
    return None, HELDOUT_NO_UNUSED_ANGLES if ass == 1 else heldout_every_angle_used(scan.path)


def _slice_meta(scan: ScanSource, plan: SlicePlan, k: int, ass, dss, binning, volume, backend, op) -> dict:
    """``CTData.meta`` of a slice: the scan's record, the slice and grid, the detector rows read, the cone angle,
    the backend and the operator's geometry."""
    meta = scan.record(plan.rows, plan.files, ass, dss, binning, plan.cols)
    meta.update(
        {
            "ndim": 2,
            "slice_index": int(k),
            "z_mm": plan.z,
            "image_shape": list(volume.shape),
            "image_voxel_size_mm": volume.voxel_size,
        }
    )
    names = scan.ground_truth_files([k])
    if names is not None:
        meta["ground_truth_files"] = names
    centre_col = plan.frac_rows.shape[1] // 2
    meta.update(
        {
            "detector_rows_used": [float(r) for r in plan.frac_rows[:, centre_col]],
            "detector_row_range": [float(plan.frac_rows.min()), float(plan.frac_rows.max())],
            "cone_angle_deg": plan.cone_angle_deg,
        }
    )
    if scan.geometry_type == ScanGeometry.CONE:
        meta["exact_fan_geometry"] = plan.cone_angle_deg <= CONE_WARN_DEG
    if backend is None:
        meta["backend"] = "none"
    else:
        meta["backend"] = Backend.ASTRA_CUDA.value if backend == Backend.ASTRA_CUDA else type(op).__name__
    meta["operator_geometry"] = plan.cone.kind + " slice" if backend == Backend.ASTRA_CUDA else plan.fan.kind
    return meta


def read_slice(
    scan: ScanSource,
    *,
    slice_index: int | None = None,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    image_shape: Sequence[int] | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Everything :func:`load_slice` returns except the operator and the held-out rows (``op=None``; ``y`` on the
    CPU)."""
    return _slice(scan, slice_index, angular_subsampling, detector_subsampling, image_shape, detector_binning, progress)


def load_slice(
    scan: ScanSource,
    *,
    slice_index: int | None = None,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    image_shape: Sequence[int] | None = None,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cpu",
    detector_binning: bool = False,
    progress: bool | None = None,
    heldout: bool = False,
) -> CTData:
    """One slice of ``scan`` as a 2D problem: operator, sinogram, variances, ground truth (module docstring).

    Parameters
    ----------
    scan : ScanSource
        An opened scan (:func:`ctuq.data.open_scan`, :class:`~ctuq.data.WalnutScan`, a format's ``open``).
    slice_index : int, optional
        Slice of the scan's volume grid (default: the central one, ``n_z // 2``).
    angular_subsampling : int
        Keep one angle in ``k`` (:meth:`~ctuq.data.source.ScanSource.angle_plan`).
    detector_subsampling : int
        Keep every k-th detector column, or bin k columns with ``detector_binning``.
    image_shape : (int, int), optional
        Reconstruction grid over the volume grid's field of view (default: that grid); coarser grids get an
        area-averaged ground truth.
    backend : {"auto", "sparse", "astra_cuda"}
        ``auto``/``sparse``: the fan- (or parallel-) beam sparse matrix (CPU or CUDA); ``astra_cuda``: the exact
        cone-beam slice operator for a cone beam, ASTRA's 2D CUDA projector otherwise (GPU only).
    device : torch.device or str
        Where the operator and ``y`` live.
    detector_binning : bool
        Average ``detector_subsampling`` adjacent columns (in transmission) instead of picking every k-th.
    progress : bool, optional
        Progress bar while reading (default: on unless ``CTUQ_NO_PROGRESS=1``).
    heldout : bool
        Also read the angles the subsampling leaves out into ``CTData.heldout`` (same pass, same slice, columns,
        grid, backend and device); otherwise, or when there are none, ``CTData.heldout_reason`` says why.

    Returns
    -------
    CTData
        ``y`` ``(n_angles, n_cols)`` float32 on ``device``, ``ground_truth`` ``image_shape`` (mm⁻¹), ``geometry``
        ``fanflat_vec`` (``parallel_vec`` for a parallel beam).
    """
    device = check_backend(backend, device)
    if backend == Backend.ASTRA_CUDA and device.type != "cuda":
        raise RuntimeError(
            f"load_slice: backend 'astra_cuda' needs a CUDA device, got {device}; use backend 'sparse' (the "
            f"fan-beam slice model) on the CPU"
        )
    return _slice(
        scan,
        slice_index,
        angular_subsampling,
        detector_subsampling,
        image_shape,
        detector_binning,
        progress,
        backend,
        device,
        heldout,
    )


# --------------------------------------------------------------------------------------------- volumes
def _volume(
    scan: ScanSource, ass, dss, drs, image_shape, binning: bool, progress, reason: str, backend=None, device=None
) -> CTData:
    """:func:`load_volume`'s work (``backend`` ``None``: :func:`read_volume`'s, no operator)."""
    image_shape = _check_image_shape(image_shape, 3)
    if scan.geometry_type == ScanGeometry.FAN or scan.det_shape[0] < 2:
        raise scan.error(
            f"{scan.path}: a {scan.geometry_type} beam with {scan.det_shape[0]} detector row(s) gives 2D slices only; "
            f"use data.ndim = 2"
        )
    col_step = positive_int(dss, "detector_subsampling")
    row_step = col_step if drs is None else positive_int(drs, "detector_row_subsampling")
    rows, files = scan.angle_plan(ass)
    drows, cols, geometry = _volume_detector(scan, rows, row_step, col_step, binning)
    volume = _coarsened(scan.ground_truth_grid(), image_shape)
    op = None if backend is None else make_ray_transform(volume, geometry, backend=backend, device=device)

    y = np.empty((len(rows), *geometry.det_shape), dtype=np.float32)
    var = np.empty_like(y) if scan.has_variances else None
    steps = (row_step, col_step) if binning else None
    for a in _progress(range(len(rows)), len(rows), "read projections", progress):
        log_t, va = scan.log_rows(int(files[a]), drows, cols, steps)
        y[a] = log_t
        if var is not None:
            var[a] = va
    gt = _volume_ground_truth(scan, volume, progress) if scan.has_ground_truth else None
    meta = scan.record(rows, files, ass, dss, binning, cols)
    meta.update(
        {
            "ndim": 3,
            "detector_row_subsampling": int(row_step),
            "detector_rows": {"first": int(drows[0]), "last": int(drows[-1]), "step": row_step},
            "image_shape": list(volume.shape),
            "image_voxel_size_mm": volume.voxel_size,
        }
    )
    names = scan.ground_truth_files(range(scan.gt_shape[0]))
    if names is not None:
        meta["ground_truth_files"] = names
    meta["backend"] = "none" if op is None else type(op).__name__
    y_t = torch.from_numpy(y)
    var_t = None if var is None else torch.from_numpy(var)
    if op is not None:
        y_t = y_t.to(op.device)
        var_t = None if var_t is None else var_t.to(op.device)
    return CTData(
        op=op,
        y=y_t,
        ground_truth=gt,
        volume=volume,
        geometry=geometry,
        meta=meta,
        variances=var_t,
        heldout_reason=reason,
    )


def _volume_detector(scan: ScanSource, rows: np.ndarray, row_step: int, col_step: int, binning: bool):
    """The detector rows and columns a volume reads and its projection geometry (geometry ``rows`` of the scan,
    the detector subsampled or binned by ``row_step`` × ``col_step``); the scan's error when a step exceeds the
    detector."""
    n_rows, n_cols = scan.det_shape
    try:
        cols, col_off = column_plan(n_cols, col_step, binning)
    except ValueError as exc:
        raise scan.error(f"{scan.path}: {exc}") from None
    try:
        drows, row_off = column_plan(n_rows, row_step, binning)
    except ValueError:
        raise scan.error(
            f"{scan.path}: detector_row_subsampling {row_step} exceeds the {n_rows} detector rows"
        ) from None
    vec = scan.vectors[rows].copy()
    u, v = vec[:, 6:9].copy(), vec[:, 9:12].copy()
    vec[:, 3:6] += col_off * u + row_off * v
    vec[:, 6:9] = col_step * u
    vec[:, 9:12] = row_step * v
    n_out_r = len(drows) // row_step if binning else len(drows)
    n_out_c = len(cols) // col_step if binning else len(cols)
    kind = "parallel3d_vec" if scan.geometry_type == ScanGeometry.PARALLEL else "cone_vec"
    return drows, cols, ProjectionGeometry(kind, (n_out_r, n_out_c), vectors=vec)


def _volume_ground_truth(scan: ScanSource, volume: VolumeGeometry, progress) -> torch.Tensor:
    """The ground truth area-averaged onto ``volume`` (float32, mm⁻¹)."""
    # In-plane averaging slice by slice, then along z (the weights are separable): a 501³ ground truth never
    # sits in memory at full resolution in float64.
    n_z = scan.gt_shape[0]
    planes = np.stack(
        [
            area_average(scan.read_ground_truth_slice(k), volume.shape[1:])
            for k in _progress(range(n_z), n_z, "read ground truth", progress)
        ]
    )
    return torch.from_numpy(area_average(planes, volume.shape).astype(np.float32))


def read_volume(
    scan: ScanSource,
    *,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    detector_row_subsampling: int | None = None,
    image_shape: Sequence[int] | None = None,
    detector_binning: bool = False,
    progress: bool | None = None,
) -> CTData:
    """Everything :func:`load_volume` returns except the operator (``op=None``): runs on the CPU."""
    return _volume(
        scan,
        angular_subsampling,
        detector_subsampling,
        detector_row_subsampling,
        image_shape,
        detector_binning,
        progress,
        HELDOUT_NOT_READ,
    )


def load_volume(
    scan: ScanSource,
    *,
    angular_subsampling: int = 1,
    detector_subsampling: int = 1,
    detector_row_subsampling: int | None = None,
    image_shape: Sequence[int] | None = None,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cuda",
    detector_binning: bool = False,
    progress: bool | None = None,
    heldout: bool = False,
) -> CTData:
    """``scan`` as a 3D problem (cone or multi-row parallel beam; GPU: ASTRA CUDA operator).

    Parameters
    ----------
    scan, angular_subsampling, detector_binning, progress
        As in :func:`load_slice`.
    detector_subsampling : int
        Keep every k-th detector column (or bin k with ``detector_binning``).
    detector_row_subsampling : int, optional
        The same for detector rows; default: ``detector_subsampling`` (square effective pixels).
    image_shape : (int, int, int), optional
        ``(D, H, W)`` over the volume grid's field of view, same aspect ratio (default: the grid itself).
    backend : {"auto", "astra_cuda"}
        3D needs ASTRA CUDA; ``"sparse"`` is rejected by :func:`~ctuq.operators.make_ray_transform`.
    device : torch.device or str
        A CUDA device; on the CPU the operator construction raises ``make_ray_transform``'s error before any
        pixel data are read (use :func:`read_volume` there).
    heldout : bool
        Accepted for symmetry with :func:`load_slice`: volumes have no held-out rows, and
        ``CTData.heldout_reason`` says so.

    Returns
    -------
    CTData
        ``y`` ``(n_angles, n_rows, n_cols)``, ``ground_truth`` ``(D, H, W)`` (mm⁻¹), ``geometry`` ``cone_vec`` (or
        ``parallel3d_vec``).
    """
    device = check_backend(backend, device)
    return _volume(
        scan,
        angular_subsampling,
        detector_subsampling,
        detector_row_subsampling,
        image_shape,
        detector_binning,
        progress,
        HELDOUT_VOLUME if heldout else HELDOUT_NOT_READ,
        backend,
        device,
    )
