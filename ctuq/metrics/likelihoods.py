"""Test log-likelihoods of a ground truth under the sample-based predictive distribution.

* :func:`marginal_log_likelihood` — pixels scored independently under ``N(mean_i, var_i)``;
* :func:`patch_joint_log_likelihood` — non-overlapping ``p×p`` patches scored jointly under the
  stabilised sample covariance Σ̂ = (1/2k)[diag(Σ_j x_j²) + Σ_j x_j x_jᵀ] + ηI (DESIGN.md §1).

All values are in nats per pixel (a patch's log density is divided by its ``p²`` pixels). The patch
covariance is assembled from the per-patch sums ``Σ_j x_j x_jᵀ`` by :func:`_patch_ll_sum`, the one place
that turns such sums into log-likelihoods, shared with :func:`ctuq.metrics.uq_summary_from_moments`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from ctuq.options import Centering

from ._common import (
    _LOG_2PI,
    DEFAULT_CHUNK_BYTES,
    DEFAULT_ETA_REL,
    _check_centering,
    _check_image,
    _check_samples,
    _chunk_count,
)
from .moments import _Moments, _moments
from .regions import Roi, _check_patch_sizes, _patch_blocks, _patch_grid, _Region, _resolve_roi, _select

__all__ = ["marginal_log_likelihood", "patch_joint_log_likelihood"]


def marginal_log_likelihood(x_true, mean, var, roi: Roi = None) -> float:
    """Mean over ROI pixels of ``log N(x_true_i; mean_i, var_i)``, computed in float64.

    Parameters
    ----------
    x_true, mean : ``(H, W)`` or ``(D, H, W)`` tensor or array
        Ground truth and predictive mean, image units (mm⁻¹ for attenuation images).
    var : same shape, or a scalar
        Predictive variance, image units² (mm⁻²); must be > 0 in the ROI.
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image.

    Returns
    -------
    float
        Log-likelihood in nats per pixel.
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


def _patch_ll_sum(s: torch.Tensor, e: torch.Tensor, factor: float, eta: float, fallback: float):
    """Sum over patches of ``log N(e; 0, Σ̂) / q`` from the per-patch second-moment sums ``s``.

    ``s``: ``(n, q, q)`` float64, ``Σ_j x_j x_jᵀ`` of each patch; ``e``: ``(n, q)`` float64 errors
    ``x_true − mean``; ``factor``: ``scale2 / (2k)`` (``scale2 = k/(k − 1)`` for empirical centering, else
    1), so that Σ̂ = factor·(s + diag s) + ηI. Returns ``(sum (0-dim tensor), n_failed, max_extra)`` with the
    last two as in :func:`_batched_gaussian_logpdf`.
    """
    cov = (s + torch.diag_embed(s.diagonal(dim1=-2, dim2=-1))) * factor
    cov.diagonal(dim1=-2, dim2=-1).add_(eta)
    ll, nf, extra = _batched_gaussian_logpdf(e, cov, fallback)
    return ll.sum() / e.shape[-1], nf, extra


def _warn_indefinite(
    where: str, n_failed: int, count: int, p: int, eta: float, max_extra: float, stacklevel: int
) -> None:
    """The warning for patches that needed extra jitter; ``stacklevel`` counts from the caller."""
    if n_failed:
        warnings.warn(
            f"{where}: {n_failed} of {count} {p}×{p} patch covariances were not positive definite with "
            f"η = {eta:.3g}; added extra jitter (at most {max_extra:.3g} image units²) to those patches",
            RuntimeWarning,
            stacklevel=stacklevel + 1,
        )


def _joint_ll_one_size(
    samples: torch.Tensor,
    diff: torch.Tensor,
    region: _Region,
    mom: _Moments,
    p: int,
    eta: float,
    chunk_bytes: int,
    where: str,
) -> float:
    """Patch joint log-likelihood for one patch size ``p`` (see :func:`patch_joint_log_likelihood`)."""
    k = samples.shape[0]
    view = samples[(slice(None),) + region.box]
    off = mom.offset
    if view.ndim == 3:  # treat a slice as a one-slice volume so 2D and 3D share one code path
        view, diff = view.unsqueeze(1), diff.unsqueeze(0)
        off = off.unsqueeze(0) if off is not None else None
    grid = _patch_grid(region, p, where)
    D, nh, nw = grid.D, grid.nh, grid.nw
    valid = grid.valid.to(view.device) if grid.valid is not None else None
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
        ll, nf, extra = _patch_ll_sum(s, e, mom.scale2 / (2 * k), eta, fallback)
        total += ll
        count += e.shape[0]
        n_failed += nf
        max_extra = max(max_extra, extra)
    _warn_indefinite(where, n_failed, count, p, eta, max_extra, stacklevel=3)
    return float(total) / count


def _joint_ll_from_sums(
    sums: torch.Tensor, e: torch.Tensor, k: int, p: int, eta: float, fallback: float, chunk_bytes: int, where: str
) -> float:
    """Patch joint log-likelihood for one patch size from accumulated second-moment sums (centering none).

    ``sums``: ``(n, p², p²)`` ``Σ_j x_j x_jᵀ`` of the ``n`` counted patches (left unchanged); ``e``: their
    ``(n, p²)`` errors ``x_true − mean`` in the same order; ``k``: number of samples summed. The same
    estimator as :func:`_joint_ll_one_size` with ``scale2 = 1``, patches factorised in batches.
    """
    q = p * p
    n = e.shape[0]
    n_max = _chunk_count(8 * 3 * q * q, chunk_bytes)
    total = torch.zeros((), dtype=torch.float64, device=e.device)
    n_failed = 0
    max_extra = 0.0
    for i in range(0, n, n_max):
        s = sums[i : i + n_max].to(torch.float64)
        ll, nf, extra = _patch_ll_sum(s, e[i : i + n_max], 1.0 / (2 * k), eta, fallback)
        total += ll
        n_failed += nf
        max_extra = max(max_extra, extra)
    _warn_indefinite(where, n_failed, n, p, eta, max_extra, stacklevel=3)
    return float(total) / n


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
    mom = _moments(samples, region.box, centering, mu if centering == Centering.MEAN else None, chunk_bytes, where)
    diff = (x_true - mu)[region.box]
    full_box = _Region(tuple(slice(0, n) for n in mom.var.shape), region.mask, region.n)
    return _Prepared(samples, region, diff, mom, _select(mom.var, full_box))


def patch_joint_log_likelihood(
    x_true,
    mean,
    samples,
    patch_sizes: Iterable[int] = range(1, 11),
    roi: Roi = None,
    eta: float | None = None,
    *,
    eta_rel: float = DEFAULT_ETA_REL,
    centering: str = Centering.NONE,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict[int, float]:
    """Joint test log-likelihood of ``p×p`` patches under the stabilised sample covariance (nats per pixel).

    For each patch size ``p``, the ROI's bounding box is tiled with non-overlapping ``p×p`` patches starting
    at its top-left corner; incomplete patches at the bottom/right border are dropped (so a 352-pixel ROI
    uses 350 pixels per axis for ``p = 10``), as are patches not entirely inside a mask ROI. Volumes are
    tiled slice by slice with 2D ``p×p`` patches (the ``(H, W)`` axes). For each patch, with its ``k``
    deviations ``x_j`` (``q = p²`` pixels; see *centering* in :mod:`ctuq.metrics`),

        Σ̂ = (1/2k) [diag(Σ_j x_j x_jᵀ) + Σ_j x_j x_jᵀ] + η I         (k → k − 1 for empirical centering)

    — the sample covariance with its off-diagonal halved, positive definite whenever every pixel has
    non-zero variance, even when k < q — and the value for ``p`` is the mean over patches of
    ``log N(x_true_patch; mean_patch, Σ̂) / p²``. With ``p = 1`` this equals
    :func:`marginal_log_likelihood` with variance ``pixelwise variance + η``. All patches of a chunk are
    factorised at once (batched ``torch.linalg.cholesky_ex``); a patch whose Σ̂ is still not positive
    definite gets extra jitter (a ``RuntimeWarning`` says how many patches and how much).

    Parameters
    ----------
    x_true, mean : ``(H, W)`` or ``(D, H, W)``
        Image units (mm⁻¹ for attenuation images).
    samples : ``(k, H, W)`` or ``(k, D, H, W)``
        Image units, any device (the work runs there).
    patch_sizes : iterable of positive ints, default 1…10 (the published sizes).
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image.
    eta : float or None
        Absolute η in image units² (mm⁻²). ``None`` (default): ``η = eta_rel · v̄`` with ``v̄`` the mean over
        the ROI of the pixelwise variance and ``eta_rel = 1e-4``. Why relative: images arrive in different
        units (attenuation per mm, ×14-scaled DIP units), so a fixed value would be negligible in one and
        dominant in the other. Why this size: η only matters where a pixel's variance is tiny; 1e-4·v̄ is a
        standard-deviation floor of 1% of the typical std, changes the log-likelihood of a typical pixel by
        about ½·1e-4 nats, and keeps Σ̂'s condition number below ~1e4·p²·max(var)/v̄, harmless in float64.
        The same η is used for every patch size, so ``p = 1`` stays comparable with the marginal.
    centering : ``"none"`` (zero-mean samples), ``"empirical"`` (MC dropout) or ``"mean"``.
    chunk_bytes : int
        Bytes of float64 patch data per batch; peak memory ≈ 3 × this.

    Returns
    -------
    dict[int, float]
        ``{p: mean over patches of log N / p²}`` (nats per pixel) in the order of ``patch_sizes``.
    """
    where = "patch_joint_log_likelihood"
    sizes = _check_patch_sizes(patch_sizes, where)
    prep = _prepare(x_true, mean, samples, roi, centering, chunk_bytes, where)
    eta = _resolve_eta(eta, eta_rel, float(prep.roi_var.mean()), where)
    out = {}
    for p in sizes:  # a loop, not a comprehension, so the warning's stacklevel points at the caller
        out[p] = _joint_ll_one_size(prep.samples, prep.diff, prep.region, prep.mom, p, eta, chunk_bytes, where)
    return out
