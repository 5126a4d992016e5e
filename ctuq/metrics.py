"""Uncertainty metrics from image-space posterior samples (DESIGN.md §1 "Uncertainty outputs", §7).

Everything here is CT-agnostic: it sees a ground truth ``x_true``, a predictive mean ``x̃`` (``mean``) and
``k`` samples, all image-shaped, and never a scanner or a network.

Shapes and units
----------------
* an image is ``(H, W)`` (a slice) or ``(D, H, W)`` (a volume), in image units (e.g. attenuation per mm,
  or the DIP's scaled units; every metric is computed in whatever units it is given);
* ``samples`` is ``(k, H, W)`` or ``(k, D, H, W)``, float32 or float64, on any device. The linearised
  sampler hands over **zero-mean** deviations ``x_j`` (predictive samples are ``x̃ + x_j``); MC dropout hands
  over raw stochastic forward passes, which are not zero-mean — see *centering* below;
* variances are in image units², standard deviations in image units, log-likelihoods in nats per pixel.

Sums of squares, covariances, Cholesky factors and log-likelihoods are accumulated in float64 on the
samples' device, chunked so that memory stays bounded (≈ 3 × ``chunk_bytes`` at peak, independent of ``k``
and of the image size) — 501² slices with ``k = 1024`` (a 1 GB float32 input) included.

Regions of interest
-------------------
Every function that reduces over pixels takes ``roi``, one of

* ``None`` — the whole image;
* ``"inner_square"`` — :func:`inner_square_roi` of the image shape (the published walnut evaluation region);
* a tuple of ``slice`` objects, one per image axis (``(slice(72, 424), slice(72, 424))`` for a slice;
  a volume needs three), with any start/stop/step;
* a boolean mask (torch tensor or numpy array) of the image's shape.

Centering
---------
``centering`` says how to turn ``samples`` into the deviations ``x_j`` that all estimators use:

* ``"none"`` (default): the samples already are zero-mean deviations (linearised inference); second
  moments divide by ``k``;
* ``"empirical"``: subtract the samples' own average and divide second moments by ``k − 1`` (Bessel), the
  unbiased sample covariance — for MC-dropout forward passes;
* ``"mean"``: deviations from the given predictive mean ``mean`` (treated as known, divide by ``k``).

PSNR and SSIM are in :func:`ctuq.outputs.image_metrics`.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, NamedTuple, Sequence, Union

import numpy as np
import torch

__all__ = [
    "inner_square_roi",
    "roi_mask",
    "pixelwise_variance",
    "pixelwise_std",
    "pixelwise_std_about",
    "marginal_log_likelihood",
    "patch_joint_log_likelihood",
    "coverage",
    "headline_coverage",
    "ErrorStdHistogram",
    "error_std_histogram",
    "rank_correlation",
    "uq_summary",
    "DEFAULT_ETA_REL",
    "DEFAULT_LEVELS",
    "HEADLINE_LEVELS",
]

#: Published walnut evaluation region: pixels 72:424 along each axis of the 501² slice (DESIGN.md §7).
PUBLISHED_GRID = 501
PUBLISHED_ROI = (72, 424)
#: Default η of the stabilised patch covariance, relative to the mean pixel variance in the ROI.
DEFAULT_ETA_REL = 1e-4
#: Credible-interval masses 0, 0.05, …, 1 of the calibration curve.
DEFAULT_LEVELS = np.round(np.linspace(0.0, 1.0, 21), 10)
#: The three coverage numbers reported in summaries.
HEADLINE_LEVELS = (0.5, 0.9, 0.95)
#: Bytes of float64 sample data handled per chunk (peak memory is about three times this).
DEFAULT_CHUNK_BYTES = 2**27
_CENTERINGS = ("none", "empirical", "mean")
_LOG_2PI = math.log(2.0 * math.pi)

Roi = Union[None, str, Sequence[slice], torch.Tensor, np.ndarray]


# ============================================================================================ ROI handling
def inner_square_roi(shape: Sequence[int]) -> tuple[slice, ...]:
    """The published evaluation region, scaled to ``shape``: one ``slice`` per axis.

    For a 501-pixel axis this is exactly ``slice(72, 424)`` (DESIGN.md §7). For an axis of ``n`` pixels
    both ends are scaled proportionally and rounded half up: ``start = round(72·n/501)``,
    ``stop = round(424·n/501)`` (e.g. 128 → ``18:108``, 256 → ``37:217``). Every axis of a 2D ``(H, W)`` or
    3D ``(D, H, W)`` shape is cropped the same way, so a 501³ volume gets the inner cube ``72:424``³.

    Raises ``ValueError`` for shapes that are not 2 or 3 positive ints, or too small to hold a region.
    """
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError as exc:
        raise ValueError(f"inner_square_roi: shape must be a sequence of ints, got {shape!r}") from exc
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"inner_square_roi: shape must be 2 or 3 positive ints (H, W) / (D, H, W), got {shape}")
    out = []
    for n in shape:
        # integer round-half-up of a·n/501, free of float representation error
        start = (2 * PUBLISHED_ROI[0] * n + PUBLISHED_GRID) // (2 * PUBLISHED_GRID)
        stop = (2 * PUBLISHED_ROI[1] * n + PUBLISHED_GRID) // (2 * PUBLISHED_GRID)
        if stop <= start:
            raise ValueError(f"inner_square_roi: an axis of {n} pixels is too small for the inner region")
        out.append(slice(start, stop))
    return tuple(out)


class _Region(NamedTuple):
    """A resolved ROI: a unit-step bounding box and, when the ROI is not the whole box, a mask of the box."""

    box: tuple[slice, ...]
    mask: torch.Tensor | None  # bool, shape of the box (CPU); None: every pixel of the box
    n: int  # number of ROI pixels


def _resolve_roi(roi: Roi, shape: tuple[int, ...], where: str) -> _Region:
    full = tuple(slice(0, n) for n in shape)
    if roi is None:
        return _Region(full, None, math.prod(shape))
    if isinstance(roi, str):
        if roi != "inner_square":
            raise ValueError(f"{where}: roi string must be 'inner_square', got {roi!r}")
        roi = inner_square_roi(shape)
    if isinstance(roi, (tuple, list)):
        if len(roi) != len(shape) or not all(isinstance(s, slice) for s in roi):
            raise ValueError(
                f"{where}: a roi given as slices needs exactly one slice per image axis ({len(shape)} for "
                f"image shape {shape}), got {roi!r}"
            )
        idx = [s.indices(n) for s, n in zip(roi, shape)]
        if any(len(range(*i)) == 0 for i in idx):
            raise ValueError(f"{where}: roi {roi!r} selects no pixel of an image of shape {shape}")
        if all(step == 1 for _, _, step in idx):
            box = tuple(slice(a, b) for a, b, _ in idx)
            return _Region(box, None, math.prod(b - a for a, b, _ in idx))
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[tuple(slice(*i) for i in idx)] = True
        roi = mask
    if isinstance(roi, np.ndarray):
        roi = torch.from_numpy(np.ascontiguousarray(roi))
    if isinstance(roi, torch.Tensor):
        if roi.dtype != torch.bool:
            raise TypeError(f"{where}: a roi mask must have dtype bool, got {roi.dtype}")
        if tuple(roi.shape) != shape:
            raise ValueError(f"{where}: roi mask has shape {tuple(roi.shape)}, the image has shape {shape}")
        mask = roi.detach().cpu()
        n = int(mask.sum())
        if n == 0:
            raise ValueError(f"{where}: the roi mask selects no pixel")
        box = []
        for axis in range(mask.ndim):
            other = tuple(a for a in range(mask.ndim) if a != axis)
            hit = torch.nonzero(mask.any(dim=other) if other else mask).flatten()
            box.append(slice(int(hit[0]), int(hit[-1]) + 1))
        box = tuple(box)
        sub = mask[box]
        return _Region(box, None if bool(sub.all()) else sub.contiguous(), n)
    raise TypeError(
        f"{where}: roi must be None, 'inner_square', a tuple of slices or a boolean mask, got {type(roi).__name__}"
    )


def roi_mask(roi: Roi, shape: Sequence[int]) -> torch.Tensor:
    """The ROI as a boolean CPU tensor of ``shape`` (any of the accepted ROI forms, see the module docstring)."""
    shape = tuple(int(n) for n in shape)
    region = _resolve_roi(roi, shape, "roi_mask")
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[region.box] = True if region.mask is None else region.mask
    return mask


def _select(t: torch.Tensor, region: _Region) -> torch.Tensor:
    """Flat ``(n_roi,)`` values of an image-shaped tensor inside the ROI."""
    sub = t[region.box]
    if region.mask is None:
        return sub.reshape(-1)
    return sub[region.mask.to(sub.device)]


# =========================================================================================== input checks
def _as_tensor(x, name: str, where: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise TypeError(f"{where}: {name} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _check_samples(samples, where: str) -> torch.Tensor:
    samples = _as_tensor(samples, "samples", where)
    if samples.ndim not in (3, 4):
        raise ValueError(
            f"{where}: samples must be (k, H, W) or (k, D, H, W), got shape {tuple(samples.shape)}"
        )
    if samples.shape[0] < 1 or samples[0].numel() == 0:
        raise ValueError(f"{where}: samples of shape {tuple(samples.shape)} hold no sample or no pixel")
    if not samples.is_floating_point():
        raise TypeError(f"{where}: samples must be floating point, got {samples.dtype}")
    return samples


def _check_image(x, name: str, shape: tuple[int, ...] | None, where: str, device=None) -> torch.Tensor:
    """An image-shaped float64 tensor on ``device``; shape-checked against ``shape`` and finite."""
    t = _as_tensor(x, name, where)
    if shape is None:
        if t.ndim not in (2, 3):
            raise ValueError(f"{where}: {name} must be (H, W) or (D, H, W), got shape {tuple(t.shape)}")
    elif tuple(t.shape) != shape:
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape} (the image shape)")
    t = t.to(device=device if device is not None else t.device, dtype=torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: {name} contains NaN or Inf")
    return t


def _check_centering(centering: str, mean_given: bool, k: int, where: str) -> None:
    if centering not in _CENTERINGS:
        raise ValueError(f"{where}: centering must be one of {_CENTERINGS}, got {centering!r}")
    if centering == "mean" and not mean_given:
        raise ValueError(f"{where}: centering='mean' needs the predictive mean")
    if centering == "empirical" and k < 2:
        raise ValueError(f"{where}: centering='empirical' needs at least 2 samples, got k = {k}")


def _chunk_count(bytes_per_item: int, chunk_bytes: int) -> int:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, int(chunk_bytes) // max(1, bytes_per_item))


# ======================================================================================= pixel variances
class _Moments(NamedTuple):
    """Second moments of the samples over a box: what every estimator here needs."""

    var: torch.Tensor  # float64, box shape: (scale2 / k) Σ_j (s_j − offset)²
    offset: torch.Tensor | None  # float64, box shape, subtracted from each sample (None: zero)
    scale2: float  # k / (k − 1) for empirical centering, else 1


def _moments(samples: torch.Tensor, box: tuple[slice, ...], centering: str, about: torch.Tensor | None,
             chunk_bytes: int, where: str) -> _Moments:
    k = samples.shape[0]
    view = samples[(slice(None),) + box]
    step = _chunk_count(8 * view[0].numel(), chunk_bytes)
    offset = None
    scale2 = 1.0
    if centering == "mean":
        offset = about[box]
    elif centering == "empirical":
        # two passes (mean, then deviations) rather than E[s²] − E[s]²: MC-dropout passes have a mean
        # far larger than their spread, and the one-pass formula would cancel away the variance.
        acc = torch.zeros(view.shape[1:], dtype=torch.float64, device=view.device)
        for i in range(0, k, step):
            acc += view[i:i + step].to(torch.float64).sum(0)
        offset = acc / k
        scale2 = k / (k - 1)
    acc = torch.zeros(view.shape[1:], dtype=torch.float64, device=view.device)
    for i in range(0, k, step):
        c = view[i:i + step].to(torch.float64)
        if offset is not None:
            c = c - offset
        acc += (c * c).sum(0)
    var = acc * (scale2 / k)
    if not bool(torch.isfinite(var).all()):
        raise ValueError(f"{where}: samples contain NaN or Inf")
    return _Moments(var, offset, scale2)


def pixelwise_variance(samples, jitter: float = 0.0, *, centering: str = "none", mean=None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> torch.Tensor:
    """Pixelwise predictive variance ``(1/k) Σ_j x_j² + jitter`` of ``k`` samples.

    Parameters
    ----------
    samples : ``(k, H, W)`` or ``(k, D, H, W)`` tensor or array, image units.
    jitter : float
        Added to every pixel (image units²), e.g. the σ²-free image-space noise term of DESIGN.md §1; ≥ 0.
    centering : ``"none"`` | ``"empirical"`` | ``"mean"``
        How the samples become deviations (module docstring); ``"mean"`` needs ``mean``.
    mean : ``(H, W)`` / ``(D, H, W)``, only for ``centering="mean"``.

    Returns
    -------
    torch.Tensor
        Image-shaped variance (image units²) in ``samples.dtype`` on ``samples.device``, accumulated in
        float64.
    """
    where = "pixelwise_variance"
    samples = _check_samples(samples, where)
    shape = tuple(samples.shape[1:])
    _check_centering(centering, mean is not None, samples.shape[0], where)
    if not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"{where}: jitter must be finite and ≥ 0, got {jitter}")
    about = _check_image(mean, "mean", shape, where, samples.device) if centering == "mean" else None
    full = tuple(slice(0, n) for n in shape)
    m = _moments(samples, full, centering, about, chunk_bytes, where)
    return (m.var + jitter).to(samples.dtype)


def pixelwise_std(samples, jitter: float = 0.0) -> torch.Tensor:
    """Pixelwise standard deviation ``sqrt((1/k) Σ_j x_j² + jitter)`` of **zero-mean** samples ``x_j``.

    ``samples``: ``(k, H, W)`` or ``(k, D, H, W)`` (image units); ``jitter`` in image units² (≥ 0).
    Returns the image-shaped std (image units) in ``samples.dtype`` on ``samples.device``. For samples that
    are not zero-mean (MC dropout) use :func:`pixelwise_std_about`.
    """
    return pixelwise_variance(samples, jitter).sqrt()


def pixelwise_std_about(samples, mean=None, jitter: float = 0.0) -> torch.Tensor:
    """Pixelwise standard deviation of samples that are **not** zero-mean (e.g. MC-dropout forward passes).

    ``mean=None``: the spread about the samples' own average, ``sqrt(Σ_j (s_j − s̄)² / (k − 1) + jitter)``
    (unbiased; needs k ≥ 2). ``mean`` given (image-shaped, e.g. the predictive mean): the spread about it,
    ``sqrt(Σ_j (s_j − mean)² / k + jitter)``. Shapes and units as in :func:`pixelwise_std`.
    """
    centering = "empirical" if mean is None else "mean"
    return pixelwise_variance(samples, jitter, centering=centering, mean=mean).sqrt()


# ============================================================================================ likelihoods
def marginal_log_likelihood(x_true, mean, var, roi: Roi = None) -> float:
    """Mean over ROI pixels of ``log N(x_true_i; mean_i, var_i)`` (nats per pixel).

    ``x_true``, ``mean``: ``(H, W)`` or ``(D, H, W)`` (image units); ``var``: the same shape or a scalar
    (image units², must be > 0 in the ROI). Computed in float64.
    """
    where = "marginal_log_likelihood"
    x_true = _check_image(x_true, "x_true", None, where)
    shape = tuple(x_true.shape)
    mu = _check_image(mean, "mean", shape, where, x_true.device)
    if isinstance(var, (int, float)) or (isinstance(var, (torch.Tensor, np.ndarray)) and var.ndim == 0):
        var = torch.full(shape, float(var), dtype=torch.float64, device=x_true.device)
    var = _check_image(var, "var", shape, where, x_true.device)
    region = _resolve_roi(roi, shape, where)
    v = _select(var, region)
    if bool((v <= 0).any()):
        raise ValueError(f"{where}: var must be > 0 in the ROI; {int((v <= 0).sum())} pixel(s) are ≤ 0")
    e = _select(x_true - mu, region)
    return float((-0.5 * (_LOG_2PI + torch.log(v) + e * e / v)).mean())


def _patch_blocks(D: int, nh: int, nw: int, n_max: int):
    """(d, r0, r1, c0, c1) blocks of patch rows/columns holding at most ``n_max`` patches each."""
    for d in range(D):
        if nw <= n_max:
            rows = max(1, n_max // nw)
            for r0 in range(0, nh, rows):
                yield d, r0, min(r0 + rows, nh), 0, nw
        else:
            for r in range(nh):
                for c0 in range(0, nw, n_max):
                    yield d, r, r + 1, c0, min(c0 + n_max, nw)


def _batched_gaussian_logpdf(e: torch.Tensor, cov: torch.Tensor, fallback_scale: float):
    """``log N(e; 0, cov)`` for ``e`` ``(n, q)`` and ``cov`` ``(n, q, q)`` (float64).

    Covariances whose Cholesky factorisation fails get extra jitter ``s·10^m`` (``s`` the mean diagonal of
    that covariance, ``m = −8, …, 0``) until it succeeds. Returns ``(logpdf (n,), n_failed, max_extra)``.
    """
    L, info = torch.linalg.cholesky_ex(cov)
    failed = torch.nonzero(info != 0).flatten()
    max_extra = 0.0
    if failed.numel():
        sub = cov[failed]
        scale = sub.diagonal(dim1=-2, dim2=-1).mean(-1)
        scale = torch.where(torch.isfinite(scale) & (scale > 0), scale, torch.full_like(scale, fallback_scale))
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        todo = torch.ones(failed.numel(), dtype=torch.bool, device=cov.device)
        for m in range(-8, 1):
            extra = scale * 10.0**m
            L2, info2 = torch.linalg.cholesky_ex(sub + extra[:, None, None] * eye)
            ok = todo & (info2 == 0)
            if bool(ok.any()):
                L[failed[ok]] = L2[ok]
                max_extra = max(max_extra, float(extra[ok].max()))
            todo &= ~ok
            if not bool(todo.any()):
                break
        if bool(todo.any()):
            raise FloatingPointError(
                f"{int(todo.sum())} patch covariance(s) stay indefinite even with jitter equal to their mean "
                "variance; the samples are probably corrupt"
            )
    z = torch.linalg.solve_triangular(L, e.unsqueeze(-1), upper=False).squeeze(-1)
    logdet = 2.0 * torch.log(L.diagonal(dim1=-2, dim2=-1)).sum(-1)
    q = e.shape[-1]
    return -0.5 * ((z * z).sum(-1) + logdet + q * _LOG_2PI), int(failed.numel()), max_extra


def _joint_ll_one_size(samples: torch.Tensor, diff: torch.Tensor, region: _Region, mom: _Moments, p: int,
                       eta: float, chunk_bytes: int, where: str) -> float:
    """Patch joint log-likelihood for one patch size ``p`` (see :func:`patch_joint_log_likelihood`)."""
    k = samples.shape[0]
    view = samples[(slice(None),) + region.box]
    off, mask = mom.offset, region.mask
    if view.ndim == 3:  # treat a slice as a one-slice volume so 2D and 3D share one code path
        view, diff = view.unsqueeze(1), diff.unsqueeze(0)
        off = off.unsqueeze(0) if off is not None else None
        mask = mask.unsqueeze(0) if mask is not None else None
    D, h, w = diff.shape
    nh, nw = h // p, w // p
    valid = None
    if mask is not None and nh and nw:
        valid = mask[:, : nh * p, : nw * p].reshape(D, nh, p, nw, p).all(dim=4).all(dim=2).to(view.device)
    if nh == 0 or nw == 0 or (valid is not None and not bool(valid.any())):
        raise ValueError(
            f"{where}: the ROI (bounding box {h}×{w} pixels per slice) holds no complete {p}×{p} patch; "
            "use smaller patch sizes or a larger ROI"
        )
    q = p * p
    n_max = _chunk_count(8 * (k * q + 3 * q * q), chunk_bytes)
    total = torch.zeros((), dtype=torch.float64, device=view.device)
    count = n_failed = 0
    max_extra = 0.0
    fallback = float(mom.var.mean()) or 1.0
    for d, r0, r1, c0, c1 in _patch_blocks(D, nh, nw, n_max):
        nr, nc = r1 - r0, c1 - c0
        rows, cols = slice(r0 * p, r1 * p), slice(c0 * p, c1 * p)
        # one copy that converts to float64 and reorders to (patch row, patch col, sample, p, p)
        x = torch.empty((nr, nc, k, p, p), dtype=torch.float64, device=view.device)
        x.copy_(view[:, d, rows, cols].reshape(k, nr, p, nc, p).permute(1, 3, 0, 2, 4))
        if off is not None:
            x -= off[d, rows, cols].reshape(nr, p, nc, p).permute(0, 2, 1, 3).unsqueeze(2)
        x = x.reshape(nr * nc, k, q)
        e = diff[d, rows, cols].reshape(nr, p, nc, p).permute(0, 2, 1, 3).reshape(nr * nc, q)
        if valid is not None:
            keep = valid[d, r0:r1, c0:c1].reshape(-1)
            x, e = x[keep], e[keep]
            if x.shape[0] == 0:
                continue
        s = x.transpose(1, 2) @ x  # Σ_j x_j x_jᵀ per patch, (n, q, q)
        cov = (s + torch.diag_embed(s.diagonal(dim1=-2, dim2=-1))) * (mom.scale2 / (2 * k))
        cov.diagonal(dim1=-2, dim2=-1).add_(eta)
        ll, nf, extra = _batched_gaussian_logpdf(e, cov, fallback)
        total += ll.sum() / q
        count += e.shape[0]
        n_failed += nf
        max_extra = max(max_extra, extra)
    if n_failed:
        warnings.warn(
            f"{where}: {n_failed} of {count} {p}×{p} patch covariances were not positive definite with "
            f"η = {eta:.3g}; added extra jitter (at most {max_extra:.3g} image units²) to those patches",
            RuntimeWarning,
            stacklevel=3,
        )
    return float(total) / count


def _check_patch_sizes(patch_sizes, where: str) -> list[int]:
    try:
        given = list(patch_sizes)
        sizes = [int(p) for p in given]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: patch_sizes must be an iterable of positive ints, got {patch_sizes!r}") from exc
    if not sizes or min(sizes) < 1 or any(a != b for a, b in zip(sizes, given)):
        raise ValueError(f"{where}: patch_sizes must be a non-empty iterable of positive ints, got {patch_sizes!r}")
    return list(dict.fromkeys(sizes))


def _resolve_eta(eta: float | None, eta_rel: float, mean_var: float, where: str) -> float:
    if eta is not None:
        if not (math.isfinite(eta) and eta >= 0):
            raise ValueError(f"{where}: eta must be finite and ≥ 0 (image units²), got {eta}")
        return float(eta)
    if not (math.isfinite(eta_rel) and eta_rel > 0):
        raise ValueError(f"{where}: eta_rel must be finite and > 0, got {eta_rel}")
    if mean_var <= 0:
        raise ValueError(
            f"{where}: the samples have zero variance everywhere in the ROI, so the relative default η is 0; "
            "pass eta explicitly (image units²)"
        )
    return eta_rel * mean_var


class _Prepared(NamedTuple):
    samples: torch.Tensor
    region: _Region
    diff: torch.Tensor  # float64, box shape: x_true − mean
    mom: _Moments
    roi_var: torch.Tensor  # float64, (n_roi,): unstabilised pixel variances in the ROI


def _prepare(x_true, mean, samples, roi, centering, chunk_bytes, where) -> _Prepared:
    samples = _check_samples(samples, where)
    shape = tuple(samples.shape[1:])
    x_true = _check_image(x_true, "x_true", shape, where, samples.device)
    mu = _check_image(mean, "mean", shape, where, samples.device)
    _check_centering(centering, True, samples.shape[0], where)
    region = _resolve_roi(roi, shape, where)
    mom = _moments(samples, region.box, centering, mu if centering == "mean" else None, chunk_bytes, where)
    diff = (x_true - mu)[region.box]
    full_box = _Region(tuple(slice(0, n) for n in mom.var.shape), region.mask, region.n)
    return _Prepared(samples, region, diff, mom, _select(mom.var, full_box))


def patch_joint_log_likelihood(x_true, mean, samples, patch_sizes: Iterable[int] = range(1, 11), roi: Roi = None,
                               eta: float | None = None, *, eta_rel: float = DEFAULT_ETA_REL,
                               centering: str = "none", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict[int, float]:
    """Joint test log-likelihood of ``p×p`` patches under the stabilised sample covariance (nats per pixel).

    For each patch size ``p``, the ROI's bounding box is tiled with non-overlapping ``p×p`` patches starting
    at its top-left corner; incomplete patches at the bottom/right border are dropped (so a 352-pixel ROI
    uses 350 pixels per axis for ``p = 10``), as are patches not entirely inside a mask ROI. Volumes are
    tiled slice by slice with 2D ``p×p`` patches (the ``(H, W)`` axes). For each patch, with its ``k``
    deviations ``x_j`` (``q = p²`` pixels; see *centering* in the module docstring),

        Σ̂ = (1/2k) [diag(Σ_j x_j x_jᵀ) + Σ_j x_j x_jᵀ] + η I         (k → k − 1 for empirical centering)

    — the sample covariance with its off-diagonal halved, positive definite whenever every pixel has
    non-zero variance, even when k < q — and the value for ``p`` is the mean over patches of
    ``log N(x_true_patch; mean_patch, Σ̂) / p²``. With ``p = 1`` this equals
    :func:`marginal_log_likelihood` with variance ``pixelwise variance + η``. All patches of a chunk are
    factorised at once (batched ``torch.linalg.cholesky_ex``); a patch whose Σ̂ is still not positive
    definite gets extra jitter (a ``RuntimeWarning`` says how many patches and how much).

    Parameters
    ----------
    x_true, mean : ``(H, W)`` or ``(D, H, W)``, image units.
    samples : ``(k, H, W)`` or ``(k, D, H, W)``, image units, any device (the work runs there).
    patch_sizes : iterable of positive ints, default 1…10 (the published sizes).
    roi : see the module docstring; default the whole image.
    eta : float or None
        Absolute η in image units². ``None`` (default): ``η = eta_rel · v̄`` with ``v̄`` the mean over the
        ROI of the pixelwise variance and ``eta_rel = 1e-4``. Why relative: images arrive in different
        units (attenuation per mm, ×14-scaled DIP units), so a fixed value would be negligible in one and
        dominant in the other. Why this size: η only matters where a pixel's variance is tiny; 1e-4·v̄ is a
        standard-deviation floor of 1% of the typical std, changes the log-likelihood of a typical pixel by
        about ½·1e-4 nats, and keeps Σ̂'s condition number below ~1e4·p²·max(var)/v̄, harmless in float64.
        The same η is used for every patch size, so ``p = 1`` stays comparable with the marginal.
    centering : ``"none"`` (zero-mean samples), ``"empirical"`` (MC dropout) or ``"mean"``.
    chunk_bytes : bytes of float64 patch data per batch; peak memory ≈ 3 × this.

    Returns
    -------
    dict[int, float]
        ``{p: mean over patches of log N / p²}`` in the order of ``patch_sizes``.
    """
    where = "patch_joint_log_likelihood"
    sizes = _check_patch_sizes(patch_sizes, where)
    prep = _prepare(x_true, mean, samples, roi, centering, chunk_bytes, where)
    eta = _resolve_eta(eta, eta_rel, float(prep.roi_var.mean()), where)
    out = {}
    for p in sizes:  # a loop, not a comprehension, so the warning's stacklevel points at the caller
        out[p] = _joint_ll_one_size(prep.samples, prep.diff, prep.region, prep.mom, p, eta, chunk_bytes, where)
    return out


# ============================================================================================ calibration
def _check_std(std, shape: tuple[int, ...], device, where: str) -> torch.Tensor:
    if isinstance(std, (int, float)) or (isinstance(std, (torch.Tensor, np.ndarray)) and std.ndim == 0):
        std = torch.full(shape, float(std), dtype=torch.float64, device=device)
    std = _check_image(std, "std", shape, where, device)
    if bool((std < 0).any()):
        raise ValueError(f"{where}: std must be ≥ 0; {int((std < 0).sum())} pixel(s) are negative")
    return std


def _check_levels(levels, where: str) -> np.ndarray:
    lv = np.asarray(DEFAULT_LEVELS if levels is None else levels, dtype=np.float64)
    if lv.ndim != 1 or lv.size == 0 or not np.all(np.isfinite(lv)) or lv.min() < 0 or lv.max() > 1:
        raise ValueError(f"{where}: levels must be a non-empty 1D sequence of values in [0, 1], got {levels!r}")
    return lv


def coverage(x_true, mean, std, levels=None, roi: Roi = None) -> tuple[np.ndarray, np.ndarray]:
    """Empirical coverage of central Gaussian credible intervals ``mean ± z_{(1+l)/2}·std``.

    ``x_true``, ``mean``, ``std``: ``(H, W)`` or ``(D, H, W)`` (image units; ``std`` may be a scalar, ≥ 0).
    ``levels``: credible masses ``l`` in [0, 1], default 0, 0.05, …, 1. A pixel is covered when
    ``|x_true − mean| ≤ z·std`` (a pixel with ``std = 0`` only when its error is exactly 0; the level 1
    interval is the whole line). Returns ``(levels, coverage)``, float64 numpy arrays of equal length;
    perfect calibration is ``coverage == levels``.
    """
    from scipy.stats import norm

    where = "coverage"
    x_true = _check_image(x_true, "x_true", None, where)
    shape = tuple(x_true.shape)
    mu = _check_image(mean, "mean", shape, where, x_true.device)
    sd = _check_std(std, shape, x_true.device, where)
    lv = _check_levels(levels, where)
    region = _resolve_roi(roi, shape, where)
    err = _select((x_true - mu).abs(), region).cpu().numpy()
    s = _select(sd, region).cpu().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(s > 0, err / np.where(s > 0, s, 1.0), np.where(err > 0, np.inf, 0.0))
    ratio.sort()
    z = norm.ppf(0.5 * (1.0 + lv))  # inf at l = 1
    covered = np.searchsorted(ratio, z, side="right") / ratio.size
    covered[lv >= 1.0] = 1.0
    return lv, covered


def headline_coverage(x_true, mean, std, roi: Roi = None) -> dict[str, float]:
    """Coverage of the 50%, 90% and 95% central credible intervals: ``{"0.5": …, "0.9": …, "0.95": …}``
    (same inputs as :func:`coverage`)."""
    lv, cov = coverage(x_true, mean, std, HEADLINE_LEVELS, roi)
    return {f"{l:g}": float(c) for l, c in zip(lv, cov)}


class ErrorStdHistogram(NamedTuple):
    """2D histogram of ``|error|`` against ``std``.

    ``counts``: ``(bins, bins)`` int64, ``counts[i, j]`` = number of ROI pixels with ``|error|`` in bin ``i``
    and ``std`` in bin ``j`` (rows = error = y axis, ready for ``pcolormesh(edges, edges, counts)``).
    ``edges``: ``(bins + 1,)`` float64 bin edges shared by both axes (image units), so ``y = x`` is the
    diagonal of the bin grid.
    """

    counts: np.ndarray
    edges: np.ndarray


def _roi_values(x, name, shape, region, where) -> np.ndarray:
    return _select(_check_image(x, name, shape, where, torch.device("cpu")), region).numpy()


def error_std_histogram(abs_error, std, bins: int = 100, roi: Roi = None, *, log: bool = True,
                        range: tuple[float, float] | None = None) -> ErrorStdHistogram:
    """Counts of ROI pixels by ``(|error|, std)`` on a shared grid of ``bins × bins`` bins.

    ``abs_error``, ``std``: ``(H, W)`` or ``(D, H, W)``, image units, ≥ 0. ``log``: logarithmically spaced
    edges (default; errors and stds span decades) or linear ones. ``range = (lo, hi)`` fixes the edges
    (``lo > 0`` when ``log``); by default ``hi`` is the largest value of either map and ``lo`` the smallest
    positive one (log, floored at ``hi·1e-6``) or 0 (linear). Values outside ``[lo, hi]`` (e.g. exact
    zeros on log bins) are counted in the first/last bin, so the counts always sum to the ROI size.
    """
    where = "error_std_histogram"
    if int(bins) != bins or bins < 1:
        raise ValueError(f"{where}: bins must be a positive int, got {bins!r}")
    err_t = _check_image(abs_error, "abs_error", None, where, torch.device("cpu"))
    shape = tuple(err_t.shape)
    region = _resolve_roi(roi, shape, where)
    err = _select(err_t, region).numpy()
    sd = _roi_values(std, "std", shape, region, where)
    if err.min() < 0 or sd.min() < 0:
        raise ValueError(f"{where}: abs_error and std must be ≥ 0 (got a negative value in "
                         f"{'abs_error' if err.min() < 0 else 'std'})")
    if range is None:
        hi = float(max(err.max(), sd.max()))
        if log:
            pos = np.concatenate([err[err > 0], sd[sd > 0]])
            hi = hi if hi > 0 else 1.0
            lo = max(float(pos.min()) if pos.size else hi * 1e-6, hi * 1e-6)
        else:
            lo = 0.0
        if hi <= lo:
            hi = lo * 10 if log else (lo + 1.0)
    else:
        lo, hi = (float(v) for v in range)
        if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo and (lo > 0 or not log)):
            raise ValueError(f"{where}: range must be finite (lo, hi) with hi > lo (and lo > 0 for log bins), "
                             f"got {range!r}")
    edges = np.geomspace(lo, hi, int(bins) + 1) if log else np.linspace(lo, hi, int(bins) + 1)
    # clip into [lo, hi] so no pixel is silently dropped from the figure
    counts, _, _ = np.histogram2d(np.clip(err, lo, hi), np.clip(sd, lo, hi), bins=[edges, edges])
    return ErrorStdHistogram(counts.astype(np.int64), edges)


def rank_correlation(std, abs_error, roi: Roi = None) -> float:
    """Spearman rank correlation between ``std`` and ``|error|`` over the ROI pixels (``scipy.stats``).

    Inputs ``(H, W)`` or ``(D, H, W)``, image units. 1 means the uncertainty ranks pixels exactly like the
    error does; NaN when either map is constant in the ROI.
    """
    from scipy.stats import spearmanr

    where = "rank_correlation"
    sd_t = _check_image(std, "std", None, where, torch.device("cpu"))
    shape = tuple(sd_t.shape)
    region = _resolve_roi(roi, shape, where)
    sd = _select(sd_t, region).numpy()
    err = _roi_values(abs_error, "abs_error", shape, region, where)
    if sd.size < 2 or np.all(sd == sd[0]) or np.all(err == err[0]):
        return float("nan")
    return float(spearmanr(sd, err).statistic)


# ================================================================================================ summary
def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def uq_summary(x_true, mean, samples, roi: Roi, *, patch_sizes: Iterable[int] = range(1, 11),
               eta: float | None = None, eta_rel: float = DEFAULT_ETA_REL, centering: str = "none",
               levels=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> dict:
    """All uncertainty metrics of one method in one JSON-ready dict.

    Inputs as in :func:`patch_joint_log_likelihood`. One stabilised variance ``v_i = pixelwise variance + η``
    (η as there) is used throughout, so ``marginal_ll == joint_ll["1"]`` and the coverage, std and
    correlation numbers describe the same predictive distribution that the likelihoods score.

    Returns
    -------
    dict with keys
        ``n_samples``, ``n_pixels`` (ROI size), ``centering``, ``eta`` (image units²);
        ``marginal_ll`` (nats/pixel); ``joint_ll``: ``{"1": …, "2": …}`` (patch size as string);
        ``coverage``: ``{"0.5", "0.9", "0.95"}``; ``calibration``: ``{"levels": [...], "coverage": [...]}``;
        ``spearman`` (std vs |error|, ``None`` if undefined); ``mean_std`` (mean over ROI of ``sqrt(v_i)``,
        image units); ``rmse`` (of ``mean`` against ``x_true`` in the ROI, image units).
    """
    where = "uq_summary"
    sizes = _check_patch_sizes(patch_sizes, where)
    lv = _check_levels(levels, where)
    prep = _prepare(x_true, mean, samples, roi, centering, chunk_bytes, where)
    eta = _resolve_eta(eta, eta_rel, float(prep.roi_var.mean()), where)
    box_region = _Region(tuple(slice(0, n) for n in prep.diff.shape), prep.region.mask, prep.region.n)
    var = prep.roi_var + eta
    if bool((var <= 0).any()):
        raise ValueError(f"{where}: pixel variance + η is 0 at {int((var <= 0).sum())} ROI pixel(s); pass eta > 0")
    err = _select(prep.diff, box_region)
    std = var.sqrt()

    marginal = float((-0.5 * (_LOG_2PI + torch.log(var) + err * err / var)).mean())
    joint = {}
    for p in sizes:
        joint[str(p)] = _joint_ll_one_size(prep.samples, prep.diff, prep.region, prep.mom, p, eta, chunk_bytes, where)
    # calibration and correlation on the flat ROI values (1D "images", roi = all of them)
    err_np, std_np = err.cpu().numpy().reshape(1, -1), std.cpu().numpy().reshape(1, -1)
    zeros = np.zeros_like(err_np)
    cal_levels, cal = coverage(err_np, zeros, std_np, lv)
    _, head = coverage(err_np, zeros, std_np, HEADLINE_LEVELS)
    rho = rank_correlation(std_np, np.abs(err_np)) if err_np.size > 1 else float("nan")
    return {
        "n_samples": int(prep.samples.shape[0]),
        "n_pixels": int(prep.region.n),
        "centering": centering,
        "eta": float(eta),
        "marginal_ll": _finite_or_none(marginal),
        "joint_ll": {p: _finite_or_none(v) for p, v in joint.items()},
        "coverage": {f"{l:g}": float(c) for l, c in zip(HEADLINE_LEVELS, head)},
        "calibration": {"levels": [float(v) for v in cal_levels], "coverage": [float(v) for v in cal]},
        "spearman": _finite_or_none(rho),
        "mean_std": float(std.mean()),
        "rmse": float(torch.sqrt((err * err).mean())),
    }
