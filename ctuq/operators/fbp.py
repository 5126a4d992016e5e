"""Filtered back-projection (2D parallel and fan beam) and FDK (3D cone beam), in pure torch (CPU and CUDA).

Why our own: ASTRA's CPU FBP handles only parallel beams ("FBP currently only supports parallel projection
geometries"), and ODL's ``fbp_op`` needs an ODL geometry, which cannot express the per-angle corrected vector
geometries of the walnut data (``fanflat_vec``/``cone_vec``); neither applies the exact fan-beam weights. ODL's
``fbp_op`` and ASTRA's FBP serve as references in the tests (parallel beams), and analytic sinograms of
ellipses/balls pin the fan- and cone-beam formulas.

Every view is treated on its own, from its vectors (ctuq's coordinate convention, :mod:`ctuq.geometry`), so
arbitrary per-angle vectors (detector offsets, varying distances) work:

* **parallel** (``parallel``, ``parallel_vec``): ``f(x) = Σ_a w_a · (g_a ∗ h)(t_a(x))``, ramp ``h`` along the
  detector coordinate ``t`` (mm, spacing ``|u × r̂|``), angular weights ``w_a`` from the actual angle spacing
  modulo π.
* **fan** (``fanflat``, ``fanflat_vec``), flat detector: cosine pre-weighting ``D_sd / |Q − s|`` (``D_sd`` the
  perpendicular source–detector distance, ``Q`` the pixel), ramp filter along the detector coordinate scaled to
  the isocentre (spacing ``|u|·D_so/D_sd``), pixel-driven back-projection with linear interpolation on the
  detector and the distance weight ``(D_so/U)²`` (``U`` the depth of the pixel along the detector normal),
  ``f(x) = ½ Σ_a w_a (D_so/U)² q_a(x)`` for a full 360° scan. ``D_so`` is the depth of the origin (the rotation
  axis) along the detector normal.
* **FDK** (``cone``, ``cone_vec``): the same per detector row, cosine weights in ``u`` and ``v``, bilinear
  interpolation on the detector.

Angle sets: weights ``w_a`` are half the distance between the neighbouring views (sparse and non-uniform sets
work). A full scan (no large gap in the view angles) gets the ``½`` of the redundant 360° data. A *short scan*
(a fan/cone arc with a gap larger than ``max(4 × median spacing, 45°)``, or ``short_scan=True``) that covers at
least ``180° + fan angle`` gets Parker redundancy weights; an arc shorter than that is limited-angle data: it is
reconstructed without redundancy weighting (each line counted once) and a warning says so. Parallel beams
reduce angles modulo 180°; a gap larger than ``max(4 × median spacing, 22.5°)`` is reported as limited angle.

Filters (``filter_type``, :class:`ctuq.options.FilterType`, matched case-insensitively): ``Ram-Lak``,
``Shepp-Logan``, ``Cosine``, ``Hamming``, ``Hann``; the ramp is the band-limited Ram-Lak kernel (exact at zero
frequency) times the window, which is cut off above ``frequency_scaling`` × Nyquist (ODL's window definitions).
Data are zero-padded to avoid circular convolution.

Units: ``y`` holds line integrals (mm) of an image in mm⁻¹; the reconstruction is in mm⁻¹.

The module also holds the pixel-driven back-projector with the *adjoint* density weights that
:class:`~ctuq.operators.astra_cuda.AstraCudaRayTransform` uses as the transpose of ASTRA's fan-beam/cone-slice
forward projection (:func:`slab_adjoint_backprojection`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.options import FilterType, values

__all__ = [
    "fbp",
    "fdk",
    "field_of_view",
    "ramp_filter",
    "angular_weights",
    "slab_adjoint_backprojection",
    "DetectorViews",
    "grid_points",
]

# Filter names match case-insensitively; the canonical spelling is the FilterType value.
_FILTER_KEYS = {name.lower(): name for name in values(FilterType)}

# Elements of the largest (batch × views × pixels) temporary of the back-projection; bounds its memory
# (~16 MB per float32 buffer) without making the loop over view chunks noticeable.
_CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------- filters
def _check_filter(filter_type: str, frequency_scaling: float) -> str:
    if not isinstance(filter_type, str) or filter_type.lower() not in _FILTER_KEYS:
        raise ValueError(f"filter_type {filter_type!r} unknown; valid: {list(values(FilterType))}")
    fs = float(frequency_scaling)
    if not (0.0 < fs <= 1.0) or not math.isfinite(fs):
        raise ValueError(f"frequency_scaling must be in (0, 1] (relative cut-off frequency), got {frequency_scaling}")
    return _FILTER_KEYS[filter_type.lower()]


def ramp_filter(
    n_det: int,
    spacing: float = 1.0,
    filter_type: str = FilterType.RAM_LAK,
    frequency_scaling: float = 1.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, int]:
    """Frequency response of the windowed ramp filter for ``n_det`` samples ``spacing`` (mm) apart.

    Returns ``(H, n_fft)``: ``H`` has shape ``(n_fft // 2 + 1,)`` (``rfft`` layout) and includes the sample
    spacing, so ``irfft(rfft(g, n_fft) · H)[..., :n_det]`` is ``Δ Σ_j g_j h(p_k − p_j)`` — the ramp-filtered
    projection in mm⁻¹ per mm of ``g``. ``n_fft ≥ 2·n_det`` (zero padding against wrap-around).
    The ramp is the DFT of the band-limited spatial Ram-Lak kernel (``h_0 = 1/(4Δ²)``, ``h_k = −1/(πkΔ)²`` for
    odd ``k``), which gets the zero-frequency value right; the window (see the module docstring) multiplies it.
    """
    name = _check_filter(filter_type, frequency_scaling)
    n_det = int(n_det)
    if n_det < 1:
        raise ValueError(f"ramp_filter: n_det must be positive, got {n_det}")
    if not (spacing > 0 and math.isfinite(spacing)):
        raise ValueError(f"ramp_filter: spacing must be positive (mm), got {spacing}")
    n_fft = 1 << max(1, int(math.ceil(math.log2(2 * n_det))))
    k = np.arange(n_fft)
    k = np.where(k < n_fft // 2, k, k - n_fft)  # circular lags
    h = np.zeros(n_fft)
    h[0] = 1.0 / (4.0 * spacing**2)
    odd = (k % 2) != 0
    h[odd] = -1.0 / (math.pi * k[odd] * spacing) ** 2
    ramp = np.real(np.fft.rfft(h)) * spacing
    norm_freq = np.arange(n_fft // 2 + 1) / (n_fft // 2)
    fs = float(frequency_scaling)
    if name == FilterType.RAM_LAK:
        window = np.ones_like(norm_freq)
    elif name == FilterType.SHEPP_LOGAN:
        window = np.sinc(norm_freq / (2.0 * fs))
    elif name == FilterType.COSINE:
        window = np.cos(norm_freq * math.pi / (2.0 * fs))
    elif name == FilterType.HAMMING:
        window = 0.54 + 0.46 * np.cos(norm_freq * math.pi / fs)
    else:  # Hann
        window = np.cos(norm_freq * math.pi / (2.0 * fs)) ** 2
    window = window * (norm_freq <= fs)
    return torch.as_tensor(ramp * window, dtype=dtype, device=device), n_fft


def _filter_rows(g: torch.Tensor, response: torch.Tensor, n_fft: int) -> torch.Tensor:
    """Ramp-filter ``g`` along its last axis (zero-padded FFT convolution)."""
    n = g.shape[-1]
    spec = torch.fft.rfft(g, n=n_fft, dim=-1)
    return torch.fft.irfft(spec * response, n=n_fft, dim=-1)[..., :n]


# ---------------------------------------------------------------------------------------------- angles
def angular_weights(angles: np.ndarray, period: float, gap_threshold: float | None = None):
    """Quadrature weights (radians) for views at ``angles``, from the actual spacing modulo ``period``.

    Parameters
    ----------
    angles : numpy.ndarray
        ``(n_angles,)`` view angles in radians (any order, any offset).
    period : float
        ``2π`` for divergent beams (a view and its opposite differ), ``π`` for parallel beams.
    gap_threshold : float, optional
        A gap between neighbouring views larger than this makes the set an *arc* (short scan / limited angle);
        default ``max(4 × median spacing, period/8)``.

    Returns
    -------
    weights : numpy.ndarray
        ``(n_angles,)``: half the distance to the two neighbouring views (on an arc, the outermost views get
        half their inner spacing only).
    arc : dict or None
        ``None`` for a closed (full) scan, else ``{'start': angle of the first view of the arc, 'coverage':
        angular extent of the arc (rad)}``; angles along the arc increase counter-clockwise from ``start``.
    """
    a = np.mod(np.asarray(angles, dtype=np.float64).reshape(-1), period)
    n = a.size
    if n == 0:
        raise ValueError("angular_weights: no angles")
    if n == 1:
        return np.array([period]), None
    order = np.argsort(a, kind="stable")
    s = a[order]
    gaps = np.diff(np.concatenate([s, s[:1] + period]))  # gaps[i]: from view i to view i+1 (circular)
    median = float(np.median(gaps))
    thr = max(4.0 * median, period / 8.0) if gap_threshold is None else float(gap_threshold)
    big = int(np.argmax(gaps))
    w_sorted = np.empty(n)
    arc = None
    if gaps[big] > thr:
        # Open the circle at the big gap: the arc runs from view big+1 to view big (counter-clockwise).
        roll = (big + 1) % n
        s_arc = np.roll(s, -roll)
        beta = np.mod(s_arc - s_arc[0], period)
        d = np.diff(beta)
        w_arc = np.empty(n)
        w_arc[0], w_arc[-1] = d[0] / 2.0, d[-1] / 2.0
        w_arc[1:-1] = (d[:-1] + d[1:]) / 2.0
        w_sorted = np.roll(w_arc, roll)
        arc = {"start": float(s_arc[0]), "coverage": float(beta[-1])}
    else:
        w_sorted = (gaps + np.roll(gaps, 1)) / 2.0
    w = np.empty(n)
    w[order] = w_sorted
    return w, arc


def _parker_weights(beta: np.ndarray, gamma: np.ndarray, delta: float) -> np.ndarray:
    """Parker's short-scan weights ``w(β, γ)`` for ``β ∈ [0, π + 2δ]`` (counter-clockwise from the start of the
    arc) and fan angle ``γ`` (counter-clockwise from the central ray). The conjugate of ray ``(β, γ)`` is
    ``(β + π + 2γ, −γ)``, and ``w(β, γ) + w(β + π + 2γ, −γ) = 1``."""
    beta = beta[:, None]
    w = np.zeros(np.broadcast_shapes(beta.shape, gamma.shape))
    with np.errstate(divide="ignore", invalid="ignore"):
        r1 = (beta >= 0) & (beta < 2 * delta - 2 * gamma)
        r2 = (beta >= 2 * delta - 2 * gamma) & (beta < math.pi - 2 * gamma)
        r3 = (beta >= math.pi - 2 * gamma) & (beta <= math.pi + 2 * delta + 1e-12)
        w1 = np.sin(math.pi / 4 * beta / (delta - gamma)) ** 2
        w3 = np.sin(math.pi / 4 * (math.pi + 2 * delta - beta) / (delta + gamma)) ** 2
    w = np.where(r1, w1, w)
    w = np.where(r2, 1.0, w)
    w = np.where(r3, w3, w)
    return np.nan_to_num(w)


# ---------------------------------------------------------------------------------------------- views
class DetectorViews:
    """Per-view vectors of a geometry as float32 tensors on ``device``, and point → detector projections.

    ``a`` is the source (divergent) or ray direction (parallel), ``d`` the detector centre, ``u``/``v`` the
    pixel steps, ``n`` the unit detector normal oriented from the source side towards the detector,
    ``ud``/``vd`` the dual basis of ``(u, v)`` in the detector plane (``(P − d)·ud`` is the column offset of a
    detector-plane point ``P`` in pixels).
    """

    def __init__(self, geometry: ProjectionGeometry, device: torch.device):
        g = geometry.to_vectors()
        vec = np.asarray(g.vectors, dtype=np.float64)
        self.geometry = g
        self.ndim = g.ndim
        self.parallel = g.is_parallel
        self.det_shape = g.det_shape
        nd = self.ndim
        a, d, u = vec[:, 0:nd], vec[:, nd : 2 * nd], vec[:, 2 * nd : 3 * nd]
        if nd == 2:
            v = None
            n = np.stack([-u[:, 1], u[:, 0]], axis=1)
            uu = np.sum(u * u, axis=1)
            ud = u / uu[:, None]
            vd = None
        else:
            v = vec[:, 9:12]
            n = np.cross(u, v)
            uu, vv, uv = np.sum(u * u, 1), np.sum(v * v, 1), np.sum(u * v, 1)
            det = uu * vv - uv**2
            if np.any(det <= 1e-12 * uu * vv):
                raise ValueError(f"ProjectionGeometry({g.kind}): detector vectors u and v are parallel")
            ud = (vv[:, None] * u - uv[:, None] * v) / det[:, None]
            vd = (uu[:, None] * v - uv[:, None] * u) / det[:, None]
        ray = a if self.parallel else d - a
        side = np.sum(ray * n, axis=1)
        if np.any(np.abs(side) <= 1e-12 * np.linalg.norm(ray, axis=1) * np.linalg.norm(n, axis=1)):
            bad = int(np.argmin(np.abs(side)))
            raise ValueError(f"ProjectionGeometry({g.kind}): view {bad} has rays parallel to its detector")
        n = n * np.sign(side)[:, None]
        n = n / np.linalg.norm(n, axis=1, keepdims=True)
        self.np = {"a": a, "d": d, "u": u, "v": v, "n": n, "ud": ud, "vd": vd}
        if not self.parallel:
            self.np["D_sd"] = np.sum((d - a) * n, axis=1)
            self.np["D_so"] = np.sum((0.0 - a) * n, axis=1)
        self.device = device
        self.t = {
            k: (None if val is None else torch.as_tensor(val, dtype=torch.float32, device=device))
            for k, val in self.np.items()
        }

    @property
    def n_views(self) -> int:
        return int(self.np["a"].shape[0])

    def project(self, points: torch.Tensor, sl: slice) -> dict[str, torch.Tensor]:
        """Project ``points`` ``(N, ndim)`` (mm) in views ``sl``: ``col`` (and ``row`` in 3D) fractional pixel
        indices ``(A_c, N)``; for divergent beams also the depth ``U`` (mm along the normal, ``(A_c, N)``)."""
        t = self.t
        a, d, n, ud = t["a"][sl], t["d"][sl], t["n"][sl], t["ud"][sl]
        vd = t["vd"][sl] if self.ndim == 3 else None
        out: dict[str, torch.Tensor] = {}
        if self.parallel:
            # P = X + λ a on the detector plane: λ = ((d − X)·n)/(a·n); offsets (P − d)·ud, (P − d)·vd.
            an = (a * n).sum(1)
            lam = ((d * n).sum(1)[:, None] - n @ points.T) / an[:, None]
            col = ud @ points.T - (d * ud).sum(1)[:, None] + lam * (a * ud).sum(1)[:, None]
            if vd is not None:
                row = vd @ points.T - (d * vd).sum(1)[:, None] + lam * (a * vd).sum(1)[:, None]
        else:
            # P = s + (X − s)·D_sd/U with U = (X − s)·n.
            U = n @ points.T - (a * n).sum(1)[:, None]
            scale = t["D_sd"][sl][:, None] / U
            col = (a - d).mul(ud).sum(1)[:, None] + (ud @ points.T - (a * ud).sum(1)[:, None]) * scale
            if vd is not None:
                row = (a - d).mul(vd).sum(1)[:, None] + (vd @ points.T - (a * vd).sum(1)[:, None]) * scale
            out["U"] = U
        out["col"] = col + (self.det_shape[-1] - 1) / 2.0
        if vd is not None:
            out["row"] = row + (self.det_shape[0] - 1) / 2.0
        return out

    def view_angles(self) -> np.ndarray:
        """Angle (rad) of the source (divergent) or ray direction (parallel) about the z axis, per view."""
        a = self.np["a"]
        return np.arctan2(a[:, 1], a[:, 0])

    def pixel_offsets(self) -> np.ndarray:
        """Distance (mm) of every detector pixel centre from the principal point (foot of the perpendicular from
        the source): ``(n_views, *det_shape)``. Divergent beams only."""
        a, d, u, n = self.np["a"], self.np["d"], self.np["u"], self.np["n"]
        foot = a + self.np["D_sd"][:, None] * n
        k = np.arange(self.det_shape[-1]) - (self.det_shape[-1] - 1) / 2.0
        if self.ndim == 2:
            q = d[:, None, :] + k[None, :, None] * u[:, None, :]
            return np.linalg.norm(q - foot[:, None, :], axis=-1)
        v = self.np["v"]
        r = np.arange(self.det_shape[0]) - (self.det_shape[0] - 1) / 2.0
        q = (
            d[:, None, None, :]
            + k[None, None, :, None] * u[:, None, None, :]
            + r[None, :, None, None] * v[:, None, None, :]
        )
        return np.linalg.norm(q - foot[:, None, None, :], axis=-1)

    def fan_angles(self) -> np.ndarray:
        """Signed in-plane angle (rad, counter-clockwise) between the central ray (source → origin) and the ray
        to each detector column (central row): ``(n_views, n_cols)``. Divergent beams only."""
        a, d, u = self.np["a"][:, :2], self.np["d"][:, :2], self.np["u"][:, :2]
        k = np.arange(self.det_shape[-1]) - (self.det_shape[-1] - 1) / 2.0
        q = d[:, None, :] + k[None, :, None] * u[:, None, :]
        ray = q - a[:, None, :]
        c = -a[:, None, :]
        cross = c[..., 0] * ray[..., 1] - c[..., 1] * ray[..., 0]
        dot = np.sum(c * ray, axis=-1)
        return np.arctan2(cross, dot)


def _interp(q: torch.Tensor, col: torch.Tensor, row: torch.Tensor | None) -> torch.Tensor:
    """Linear (2D data) / bilinear (3D data) interpolation of ``q`` ``(B, A_c, [n_rows,] n_cols)`` at fractional
    indices ``(A_c, N)``, zero outside the detector (like a texture fetch with a zero border). → ``(B, A_c, N)``."""
    b, ac = q.shape[0], q.shape[1]
    n_pts = col.shape[1]
    nc = q.shape[-1]
    # Clamp before floor so that far-away (or infinite) coordinates land on the zero border.
    col = torch.nan_to_num(col, nan=-2.0, posinf=nc + 1.0, neginf=-2.0).clamp(-2.0, nc + 1.0)
    c0 = torch.floor(col)
    fc = col - c0
    c0 = c0.long() + 1  # +1: index into the zero-padded array
    c1 = (c0 + 1).clamp(0, nc + 1)
    c0 = c0.clamp(0, nc + 1)
    view_offset = torch.arange(ac, device=q.device)[:, None]
    if row is None:
        qp = torch.nn.functional.pad(q, (1, 1)).reshape(b, ac * (nc + 2))
        base = view_offset * (nc + 2)
        v0 = qp.index_select(1, (base + c0).reshape(-1)).reshape(b, ac, n_pts)
        v1 = qp.index_select(1, (base + c1).reshape(-1)).reshape(b, ac, n_pts)
        return v0 + fc * (v1 - v0)
    nr = q.shape[-2]
    row = torch.nan_to_num(row, nan=-2.0, posinf=nr + 1.0, neginf=-2.0).clamp(-2.0, nr + 1.0)
    r0 = torch.floor(row)
    fr = row - r0
    r0 = r0.long() + 1
    r1 = (r0 + 1).clamp(0, nr + 1)
    r0 = r0.clamp(0, nr + 1)
    stride = nc + 2
    qp = torch.nn.functional.pad(q, (1, 1, 1, 1)).reshape(b, ac * (nr + 2) * stride)
    base = view_offset * ((nr + 2) * stride)

    def fetch(r, c):
        return qp.index_select(1, (base + r * stride + c).reshape(-1)).reshape(b, ac, n_pts)

    top = fetch(r0, c0) * (1 - fc) + fetch(r0, c1) * fc
    bottom = fetch(r1, c0) * (1 - fc) + fetch(r1, c1) * fc
    return top + fr * (bottom - top)


def _backproject(
    views: DetectorViews,
    points: torch.Tensor,
    q: torch.Tensor,
    weight: Callable[[dict[str, torch.Tensor], slice], torch.Tensor | None] | None = None,
    interp_rows: bool = True,
) -> torch.Tensor:
    """Pixel-driven back-projection ``Σ_a w_a(X) · q_a(P_a(X))`` for ``points`` ``(N, ndim)`` and data ``q``
    ``(B, n_views, *det_shape)``; ``weight(proj, sl)`` gives the ``(A_c, N)`` weights of a chunk of views.
    ``interp_rows=False`` interpolates only along the columns of a one-row detector. → ``(B, N)``."""
    b, n_pts = q.shape[0], points.shape[0]
    out = torch.zeros(b, n_pts, dtype=q.dtype, device=q.device)
    # Bound the (batch × views × points) temporaries: chunk the batch first, then the views.
    b_chunk = max(1, min(b, _CHUNK_ELEMENTS // max(1, n_pts)))
    chunk = max(1, _CHUNK_ELEMENTS // max(1, b_chunk * n_pts))
    for a0 in range(0, views.n_views, chunk):
        sl = slice(a0, min(a0 + chunk, views.n_views))
        proj = views.project(points, sl)
        w = None if weight is None else weight(proj, sl)
        for b0 in range(0, b, b_chunk):
            qs = q[b0 : b0 + b_chunk, sl]
            if q.ndim == 4 and not interp_rows:
                vals = _interp(qs[:, :, 0], proj["col"], None)
            else:
                vals = _interp(qs, proj["col"], proj.get("row") if q.ndim == 4 else None)
            if w is not None:
                vals = vals * w
            out[b0 : b0 + b_chunk] += vals.sum(1)
    return out


def field_of_view(
    views_or_geometry: Any, volume: VolumeGeometry, *, z: float | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Boolean ``volume.shape`` mask of the pixels/voxels that every view projects onto its detector.

    Outside it, some views never saw the pixel, so no analytic reconstruction is defined there (FBP leaves
    streaks of partially back-projected data; the walnut's 50.1 mm grid is wider than the ≈38 mm disc the
    detector covers). ``z``: height of a 2D slab seen by a one-row 3D geometry. A pixel counts as seen when its
    projection lies within the detector's outer pixel edges.
    """
    views = (
        views_or_geometry
        if isinstance(views_or_geometry, DetectorViews)
        else DetectorViews(views_or_geometry, torch.device(device))
    )
    points = grid_points(volume, views.device, z)
    inside = torch.ones(points.shape[0], dtype=torch.bool, device=views.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, points.shape[0]))
    n_cols = views.det_shape[-1]
    for a0 in range(0, views.n_views, chunk):
        proj = views.project(points, slice(a0, min(a0 + chunk, views.n_views)))
        ok = (proj["col"] >= -0.5) & (proj["col"] <= n_cols - 0.5)
        if "row" in proj and z is None:
            ok &= (proj["row"] >= -0.5) & (proj["row"] <= views.det_shape[0] - 0.5)
        if "U" in proj:
            ok &= proj["U"] > 0
        inside &= ok.all(0)
    return inside.reshape(volume.shape)


def grid_points(volume: VolumeGeometry, device: torch.device, z: float | None = None) -> torch.Tensor:
    """World coordinates (mm) of every pixel/voxel centre in C order: ``(N, 2)`` ``(x, y)`` for a 2D grid,
    ``(N, 3)`` for 3D (or for a 2D grid lifted to the plane ``z``)."""
    centers = [torch.as_tensor(c, dtype=torch.float32, device=device) for c in volume.pixel_centers()]
    grids = torch.meshgrid(*centers, indexing="ij")
    if volume.ndim == 2:
        yy, xx = grids
        cols = [xx.reshape(-1), yy.reshape(-1)]
        if z is not None:
            cols.append(torch.full_like(cols[0], float(z)))
        return torch.stack(cols, dim=1)
    zz, yy, xx = grids
    return torch.stack([xx.reshape(-1), yy.reshape(-1), zz.reshape(-1)], dim=1)


# ---------------------------------------------------------------------------------------------- inputs
def _resolve(op: Any, y: torch.Tensor | None, where: str):
    """``(volume, geometry, device, y, slab_z)`` from an operator (``.volume``/``.geometry``/``.device``), a data object
    with ``.op`` and ``.y`` (e.g. :class:`ctuq.data.CTData`), or a ``(volume, geometry)`` pair."""
    if y is None and hasattr(op, "op") and hasattr(op, "y"):
        op, y = op.op, op.y
    if isinstance(op, (tuple, list)) and len(op) == 2:
        volume, geometry = op
        device = y.device if isinstance(y, torch.Tensor) else torch.device("cpu")
    else:
        volume, geometry = getattr(op, "volume", None), getattr(op, "geometry", None)
        device = torch.device(getattr(op, "device", y.device if isinstance(y, torch.Tensor) else "cpu"))
    if not isinstance(volume, VolumeGeometry) or not isinstance(geometry, ProjectionGeometry):
        raise TypeError(
            f"{where}: needs an operator with .volume (VolumeGeometry) and .geometry (ProjectionGeometry), "
            f"a data object with .op and .y, or a (volume, geometry) pair; got {type(op).__name__}"
        )
    if y is None:
        raise TypeError(f"{where}: no sinogram y given")
    if not isinstance(y, torch.Tensor):
        y = torch.as_tensor(np.asarray(y))
    # A cone-slice operator (AstraCudaRayTransform.cone_slice): 2D slab at height z seen by a one-row cone_vec.
    z = getattr(op, "slab_z", None) if not isinstance(op, (tuple, list)) else None
    if z is not None:
        if volume.ndim != 2 or geometry.ndim != 3 or geometry.det_shape[0] != 1:
            raise ValueError(
                f"{where}: a slab operator needs a 2D volume and a one-row 3D geometry, got "
                f"{volume.shape} and {geometry.kind!r} {geometry.det_shape}"
            )
    elif volume.ndim != geometry.ndim:
        raise ValueError(
            f"{where}: {volume.ndim}D volume {volume.shape} with a {geometry.ndim}D geometry {geometry.kind!r}"
        )
    return volume, geometry, device, y, z


def _batched_sinogram(y: torch.Tensor, shape: tuple[int, ...], device, where: str):
    if tuple(y.shape) == shape:
        yb, squeeze = y.unsqueeze(0), True
    elif y.ndim == len(shape) + 1 and tuple(y.shape[1:]) == shape:
        yb, squeeze = y, False
    else:
        raise ValueError(
            f"{where}: sinogram has shape {tuple(y.shape)}; the geometry needs {shape} or "
            f"(batch, {', '.join(map(str, shape))}) (angle-major)"
        )
    if not torch.is_floating_point(yb):
        raise ValueError(f"{where}: sinogram must be a floating-point tensor, got {yb.dtype}")
    return yb.detach().to(device=device, dtype=torch.float32), squeeze


def _redundancy(views: DetectorViews, where: str, short_scan: bool | None):
    """Per-view quadrature weights and, for divergent short scans, Parker weights ``(n_views, n_cols)``.

    Returns ``(w, parker)``; ``w`` already contains the ``½`` of a full divergent scan."""
    angles = views.view_angles()
    if views.parallel:
        w, arc = angular_weights(angles, math.pi)
        if arc is not None:
            warnings.warn(
                f"{where}: parallel-beam views cover only {math.degrees(arc['coverage']):.1f}° of the 180° needed "
                "(limited-angle data); the reconstruction will show limited-angle artefacts",
                RuntimeWarning,
                stacklevel=3,
            )
        return w, None
    threshold = None
    if short_scan is True:
        threshold = 0.0  # open the circle at its largest gap whatever its size
    elif short_scan is False:
        threshold = math.inf
    w, arc = angular_weights(angles, 2 * math.pi, threshold)
    if arc is None:
        return 0.5 * w, None
    gamma = views.fan_angles()
    delta = float(np.max(np.abs(gamma)))
    coverage = arc["coverage"]
    if coverage < math.pi + 2 * delta - 1e-9:
        warnings.warn(
            f"{where}: the views cover {math.degrees(coverage):.1f}°, less than the 180° + fan angle "
            f"({math.degrees(math.pi + 2 * delta):.1f}°) a short scan needs (limited-angle data); reconstructing "
            "without redundancy (Parker) weights",
            RuntimeWarning,
            stacklevel=3,
        )
        return w, None
    beta = np.mod(angles - arc["start"], 2 * math.pi)
    parker = _parker_weights(beta, gamma, (coverage - math.pi) / 2.0)
    return w, parker


# ---------------------------------------------------------------------------------------------- FBP / FDK
def fbp(
    op: Any,
    y: torch.Tensor | None = None,
    *,
    filter_type: str = FilterType.HANN,
    frequency_scaling: float = 1.0,
    short_scan: bool | None = None,
    mask_outside: bool = True,
) -> torch.Tensor:
    """Filtered back-projection of 2D sinograms (parallel or flat-detector fan beam, any per-angle vectors).

    Parameters
    ----------
    op : RayTransform, data object or (VolumeGeometry, ProjectionGeometry)
        Anything with ``.volume`` and ``.geometry`` (and ``.device``), e.g. a
        :class:`~ctuq.operators.sparse.SparseRayTransform`; or a data object with ``.op`` and ``.y`` (then ``y``
        may be omitted); or a ``(volume, geometry)`` pair (output on ``y``'s device). A 3D operator is handed
        to :func:`fdk`.
    y : torch.Tensor
        Sinogram(s) (line integrals, mm): ``measurement_shape = (n_angles, n_det)`` or
        ``(B, n_angles, n_det)``, angle-major.
    filter_type : str
        ``'Ram-Lak'``, ``'Shepp-Logan'``, ``'Cosine'``, ``'Hamming'`` or ``'Hann'``.
    frequency_scaling : float
        Relative cut-off in ``(0, 1]`` (1 = Nyquist).
    short_scan : bool, optional
        Fan beams: force (``True``) or forbid (``False``) Parker short-scan weighting; default: detect an arc
        from the gaps between view angles (module docstring).
    mask_outside : bool
        Set pixels outside the field of view seen by every view (:func:`field_of_view`) to zero: FBP is
        undefined there and would otherwise show streaks of partial back-projections.

    Returns
    -------
    torch.Tensor
        ``image_shape`` (or ``(B, *image_shape)``) float32 on the operator's device, in mm⁻¹ (not
        differentiable: ``y`` is detached).
    """
    volume, geometry, device, y, z = _resolve(op, y, "fbp")
    if volume.ndim == 3:
        return fdk(
            (volume, geometry),
            y.to(device),
            filter_type=filter_type,
            frequency_scaling=frequency_scaling,
            short_scan=short_scan,
            mask_outside=mask_outside,
        )
    _check_filter(filter_type, frequency_scaling)
    views = DetectorViews(geometry, device)
    if z is None:
        yb, squeeze = _batched_sinogram(y, tuple(geometry.measurement_shape), device, "fbp")
    else:
        # Cone slice: fan-beam FBP with the true 3D vectors of the one-row detector (FDK with a single row).
        n_angles, _, n_cols = geometry.measurement_shape
        yb, squeeze = _batched_sinogram(y, (n_angles, n_cols), device, "fbp")
        yb = yb.reshape(yb.shape[0], n_angles, 1, n_cols)
    x = _filtered_backprojection(views, volume, yb, filter_type, frequency_scaling, short_scan, "fbp", z)
    x = x.reshape(yb.shape[0], *volume.shape)
    if mask_outside:
        x = x * field_of_view(views, volume, z=z)
    return x[0] if squeeze else x


def fdk(
    op: Any,
    y: torch.Tensor | None = None,
    *,
    filter_type: str = FilterType.HANN,
    frequency_scaling: float = 1.0,
    short_scan: bool | None = None,
    volume: VolumeGeometry | None = None,
    geometry: ProjectionGeometry | None = None,
    mask_outside: bool = True,
) -> torch.Tensor:
    """FDK reconstruction of cone-beam projections (``cone``/``cone_vec``; ``parallel3d(_vec)`` row-wise FBP).

    Pure torch, so it runs on the CPU as well (only the 3D *forward* operator is GPU-only). Pixel-driven: each
    voxel is projected onto every detector, the cosine-weighted, row-wise ramp-filtered projections are
    interpolated bilinearly and weighted by ``(D_so/U)²``; the ramp runs along ``u`` (detector rows must be
    roughly perpendicular to the rotation axis ``z``).

    Parameters
    ----------
    op : AstraCudaRayTransform, object with ``.volume``/``.geometry``, data object, or (volume, geometry)
        See :func:`fbp`. ``op`` may be ``None`` when ``volume`` and ``geometry`` are given.
    y : torch.Tensor
        Projections (mm), ``(n_angles, n_rows, n_cols)`` or ``(B, n_angles, n_rows, n_cols)``.
    filter_type, frequency_scaling, short_scan
        As in :func:`fbp`.
    volume, geometry : optional
        Explicit geometries (instead of ``op``).
    mask_outside : bool
        Zero the voxels that some view does not project onto its detector (:func:`field_of_view`).

    Returns
    -------
    torch.Tensor
        ``(D, H, W)`` (or batched) float32 volume in mm⁻¹ on the operator's (or ``y``'s) device.
    """
    if op is None:
        op = (volume, geometry)
    elif volume is not None or geometry is not None:
        raise TypeError("fdk: give either op or volume=/geometry=, not both")
    volume, geometry, device, y, z = _resolve(op, y, "fdk")
    if volume.ndim != 3 or z is not None:
        raise ValueError(
            f"fdk: needs a 3D volume and geometry; got a {volume.ndim}D volume {volume.shape} "
            f"with {geometry.kind!r} (use fbp)"
        )
    _check_filter(filter_type, frequency_scaling)
    yb, squeeze = _batched_sinogram(y, tuple(geometry.measurement_shape), device, "fdk")
    views = DetectorViews(geometry, device)
    u = views.np["u"]
    tilt = np.abs(u[:, 2]) / np.linalg.norm(u, axis=1)
    if np.any(tilt > 0.5):
        raise ValueError(
            f"fdk: detector rows (u) of view {int(np.argmax(tilt))} are tilted "
            f"{math.degrees(math.asin(tilt.max())):.0f}° towards the rotation axis z; FDK filters along rows, "
            "which must be roughly perpendicular to z"
        )
    x = _filtered_backprojection(views, volume, yb, filter_type, frequency_scaling, short_scan, "fdk", None)
    x = x.reshape(yb.shape[0], *volume.shape)
    if mask_outside:
        x = x * field_of_view(views, volume)
    return x[0] if squeeze else x


def _filtered_backprojection(
    views: DetectorViews,
    volume: VolumeGeometry,
    yb: torch.Tensor,
    filter_type: str,
    frequency_scaling: float,
    short_scan: bool | None,
    where: str,
    z,
) -> torch.Tensor:
    """Weight, filter and back-project ``yb`` ``(B, n_views, *det_shape)`` → ``(B, N)`` voxel values (``z``: the
    height of a 2D slab seen by a one-row 3D geometry, else ``None``)."""
    device = yb.device
    if not views.parallel and np.any(views.np["D_so"] <= 0):
        bad = int(np.argmin(views.np["D_so"]))
        raise ValueError(
            f"{where}: ProjectionGeometry({views.geometry.kind}): the origin is not between source and detector in "
            f"view {bad} (depth {views.np['D_so'][bad]:.4g} mm); FBP/FDK assume rotation about the origin"
        )
    w, parker = _redundancy(views, where, short_scan)
    n_cols = views.det_shape[-1]
    response, n_fft = ramp_filter(n_cols, 1.0, filter_type, frequency_scaling, device=device)
    u_len = np.linalg.norm(views.np["u"], axis=1)
    if views.parallel:
        # Perpendicular spacing of neighbouring rays: |u| times the sine between u and the ray.
        a = views.np["a"]
        cos = np.abs(np.sum(a * views.np["u"], 1)) / (np.linalg.norm(a, axis=1) * u_len)
        spacing = u_len * np.sqrt(np.clip(1.0 - cos**2, 0.0, 1.0))
        g = yb
    else:
        spacing = u_len * views.np["D_so"] / views.np["D_sd"]  # detector pixel scaled to the isocentre
        rho = views.pixel_offsets()
        d_sd = views.np["D_sd"].reshape(-1, *([1] * len(views.det_shape)))
        cosine = d_sd / np.sqrt(d_sd**2 + rho**2)
        if parker is not None:
            cosine = cosine * (parker if views.ndim == 2 else parker[:, None, :])
        g = yb * torch.as_tensor(cosine, dtype=torch.float32, device=device)
    # The ramp of spacing Δ is (1/Δ)·(ramp of spacing 1); fold 1/Δ and the angular weight into one factor.
    factor = torch.as_tensor(w / spacing, dtype=torch.float32, device=device)
    q = _filter_rows(g, response, n_fft) * factor.reshape(1, -1, *([1] * len(views.det_shape)))
    points = grid_points(volume, device, z)
    # A one-row detector seen from a 2D slab: interpolate along the row only (the slab lies on it).
    interp_rows = z is None
    if views.parallel:
        return _backproject(views, points, q, interp_rows=interp_rows)
    d_so = views.t["D_so"]

    def distance_weight(proj, sl):
        U = proj["U"]
        return torch.where(U > 0, (d_so[sl][:, None] / U) ** 2, torch.zeros_like(U))

    return _backproject(views, points, q, distance_weight, interp_rows=interp_rows)


# ---------------------------------------------------------------------------------------------- adjoint BP
def slab_adjoint_backprojection(
    volume2d: VolumeGeometry,
    z: float,
    geometry: ProjectionGeometry,
    y: torch.Tensor,
    *,
    views: DetectorViews | None = None,
    points: torch.Tensor | None = None,
) -> torch.Tensor:
    """Transpose (to ray-driven-projector accuracy) of the forward projection of a one-voxel-thick slab.

    The slab is the 2D grid ``volume2d`` (pixel ``h`` mm) at height ``z`` (mm), one voxel (``h``) thick; the
    forward projection is ASTRA's ray-driven cone-beam projection (texture interpolation) onto the one-row
    ``cone_vec`` detector of ``geometry`` — the fan-beam and cone-slice operators of
    :class:`~ctuq.operators.astra_cuda.AstraCudaRayTransform`. ASTRA's own cone back-projection weights every
    voxel by the 3D ray density (``∝ 1/depth²``), which is not the transpose here (a one-row detector samples the
    slab in-plane only; the error would grow to tens of per cent across the walnut's field of view), so this
    pixel-driven back-projection uses the in-plane density instead::

        Tᵀy(X) = Σ_a  h² · hat(δz/h) · |X − s| · D_sd / (U · |u_x r_y − u_y r_x|) · y_a(col_a(X))

    with ``r = X − s``, ``U`` the depth of ``X`` along the detector normal, ``col_a(X)`` the (linearly
    interpolated) detector column ``X`` projects to, and ``δz`` the height of ``X`` above the ray to that column
    on the detector's central row (``hat`` = ASTRA's linear interpolation across the slab). For an in-plane
    source ``δz = 0`` and this is the fan-beam transpose ``h² D_sd / (U |u| cos γ)``.

    Parameters
    ----------
    volume2d : VolumeGeometry
        2D grid ``(H, W)``.
    z : float
        Height (mm) of the slab centre.
    geometry : ProjectionGeometry
        ``cone_vec`` with ``det_shape (1, n_cols)``.
    y : torch.Tensor
        ``(B, n_angles, 1, n_cols)`` float32.
    views, points : optional
        Precomputed :class:`DetectorViews` / slab points (the operator caches them).

    Returns
    -------
    torch.Tensor
        ``(B, H·W)`` float32 on ``y``'s device.
    """
    device = y.device
    if views is None:
        views = DetectorViews(geometry, device)
    if points is None:
        points = grid_points(volume2d, device, z)
    h = float(volume2d.voxel_size)
    t = views.t
    a, u, v = t["a"], t["u"], t["v"]
    d_sd = t["D_sd"]
    px, py = points[:, 0], points[:, 1]

    def weight(proj, sl):
        s, uu, vv = a[sl], u[sl], v[sl]
        U = proj["U"]
        rx = px[None, :] - s[:, 0:1]
        ry = py[None, :] - s[:, 1:2]
        rz = points[None, :, 2] - s[:, 2:3]
        r_len = torch.sqrt(rx**2 + ry**2 + rz**2)
        cross = (uu[:, 0:1] * ry - uu[:, 1:2] * rx).abs()
        # Height of X above the ray to the central row: the row offset of X's projection, scaled back to
        # X's depth (fraction U/D_sd of the source-detector distance) along the detector's v (z component).
        dz = (proj["row"]) * (U / d_sd[sl][:, None]) * vv[:, 2:3]
        hat = (1.0 - dz.abs() / h).clamp_min(0.0)
        w = (h * h) * hat * r_len * d_sd[sl][:, None] / (U * cross)
        return torch.where((U > 0) & (cross > 0), w, torch.zeros_like(w))

    return _backproject(views, points, y, weight, interp_rows=False)
