"""All uncertainty metrics of one method in one JSON-ready dict.

* :func:`uq_summary` — from the ``k`` samples held in memory (any centering);
* :func:`uq_summary_from_moments` — from a :class:`ctuq.metrics.SampleMoments` accumulator fed chunk by
  chunk (zero-mean samples, centering ``"none"``), for sample counts or volumes that do not fit in memory.

Both return the same keys computed by the same estimators; they differ only in the order in which float64
sums are formed (≤ 1e-9 relative in practice).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from ctuq.options import Centering

from ._common import _LOG_2PI, DEFAULT_CHUNK_BYTES, DEFAULT_ETA_REL, HEADLINE_LEVELS, _check_image
from .calibration import _check_levels, coverage, rank_correlation
from .likelihoods import _joint_ll_from_sums, _joint_ll_one_size, _prepare, _resolve_eta
from .moments import SampleMoments
from .regions import Roi, _check_patch_sizes, _grid_patches, _Region, _select

__all__ = ["uq_summary", "uq_summary_from_moments"]


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _box_region(diff: torch.Tensor, region: _Region) -> _Region:
    """``region`` expressed in the coordinates of its own bounding box (for tensors cropped to the box)."""
    return _Region(tuple(slice(0, n) for n in diff.shape), region.mask, region.n)


def _stabilised(diff: torch.Tensor, region: _Region, roi_var: torch.Tensor, eta: float, where: str):
    """ROI variances ``v_i + η``, errors and stds (flat ``(n_roi,)`` float64, image units² / units)."""
    var = roi_var + eta
    if bool((var <= 0).any()):
        raise ValueError(f"{where}: pixel variance + η is 0 at {int((var <= 0).sum())} ROI pixel(s); pass eta > 0")
    err = _select(diff, _box_region(diff, region))
    return var, err, var.sqrt()


def _assemble(
    n_samples: int,
    n_pixels: int,
    centering: str,
    eta: float,
    var: torch.Tensor,
    err: torch.Tensor,
    std: torch.Tensor,
    joint: dict,
    lv: np.ndarray,
) -> dict:
    marginal = float((-0.5 * (_LOG_2PI + torch.log(var) + err * err / var)).mean())
    # calibration and correlation on the flat ROI values (1D "images", roi = all of them)
    err_np, std_np = err.cpu().numpy().reshape(1, -1), std.cpu().numpy().reshape(1, -1)
    zeros = np.zeros_like(err_np)
    cal_levels, cal = coverage(err_np, zeros, std_np, lv)
    _, head = coverage(err_np, zeros, std_np, HEADLINE_LEVELS)
    rho = rank_correlation(std_np, np.abs(err_np)) if err_np.size > 1 else float("nan")
    return {
        "n_samples": int(n_samples),
        "n_pixels": int(n_pixels),
        "centering": str(centering),  # the plain string (JSON, checkpoints)
        "eta": float(eta),
        "marginal_ll": _finite_or_none(marginal),
        "joint_ll": {p: _finite_or_none(v) for p, v in joint.items()},
        "coverage": {f"{l:g}": float(c) for l, c in zip(HEADLINE_LEVELS, head)},
        "calibration": {"levels": [float(v) for v in cal_levels], "coverage": [float(v) for v in cal]},
        "spearman": _finite_or_none(rho),
        "mean_std": float(std.mean()),
        "rmse": float(torch.sqrt((err * err).mean())),
    }


def uq_summary(
    x_true,
    mean,
    samples,
    roi: Roi,
    *,
    patch_sizes: Iterable[int] = range(1, 11),
    eta: float | None = None,
    eta_rel: float = DEFAULT_ETA_REL,
    centering: str = Centering.NONE,
    levels=None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict:
    """All uncertainty metrics of one method in one JSON-ready dict, from samples held in memory.

    One stabilised variance ``v_i = pixelwise variance + η`` (η as in
    :func:`ctuq.metrics.patch_joint_log_likelihood`) is used throughout, so ``marginal_ll == joint_ll["1"]``
    and the coverage, std and correlation numbers describe the same predictive distribution that the
    likelihoods score.

    Parameters
    ----------
    x_true, mean : ``(H, W)`` or ``(D, H, W)``
        Ground truth and predictive mean, image units (mm⁻¹).
    samples : ``(k, H, W)`` or ``(k, D, H, W)``
        Image units, any device (the work runs there); see *centering* in :mod:`ctuq.metrics`.
    roi : Roi
        Region of interest (see :mod:`ctuq.metrics`); ``None`` for the whole image.
    patch_sizes : iterable of positive ints
        Patch sizes of the joint log-likelihood, default 1…10.
    eta, eta_rel : float
        Absolute η (image units², mm⁻²) or, when ``eta`` is None, η relative to the ROI's mean variance.
    centering : ``"none"`` | ``"empirical"`` | ``"mean"``
    levels : sequence of float, optional
        Credible masses of the calibration curve, default 0, 0.05, …, 1.
    chunk_bytes : int
        Bytes of float64 sample data per batch; peak memory ≈ 3 × this.

    Returns
    -------
    dict with keys
        ``n_samples``, ``n_pixels`` (ROI size), ``centering``, ``eta`` (image units², mm⁻²);
        ``marginal_ll`` (nats/pixel); ``joint_ll``: ``{"1": …, "2": …}`` (patch size as string; nats/pixel);
        ``coverage``: ``{"0.5", "0.9", "0.95"}``; ``calibration``: ``{"levels": [...], "coverage": [...]}``;
        ``spearman`` (std vs |error|, ``None`` if undefined); ``mean_std`` (mean over ROI of ``sqrt(v_i)``,
        image units); ``rmse`` (of ``mean`` against ``x_true`` in the ROI, image units).
        Non-finite log-likelihoods are reported as ``None``.
    """
    where = "uq_summary"
    sizes = _check_patch_sizes(patch_sizes, where)
    lv = _check_levels(levels, where)
    prep = _prepare(x_true, mean, samples, roi, centering, chunk_bytes, where)
    eta = _resolve_eta(eta, eta_rel, float(prep.roi_var.mean()), where)
    var, err, std = _stabilised(prep.diff, prep.region, prep.roi_var, eta, where)
    joint = {}
    for p in sizes:  # called from here so the warning's stacklevel points at the caller
        joint[str(p)] = _joint_ll_one_size(prep.samples, prep.diff, prep.region, prep.mom, p, eta, chunk_bytes, where)
    return _assemble(prep.samples.shape[0], prep.region.n, centering, eta, var, err, std, joint, lv)


def uq_summary_from_moments(
    x_true,
    mean,
    moments: SampleMoments,
    *,
    eta: float | None = None,
    eta_rel: float = DEFAULT_ETA_REL,
    levels=None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> dict:
    """:func:`uq_summary` computed from a streaming :class:`~ctuq.metrics.SampleMoments` accumulator.

    Gives the same dict as ``uq_summary(x_true, mean, samples, moments_roi, patch_sizes=moments.patch_sizes,
    centering="none", eta=eta, eta_rel=eta_rel, levels=levels)`` on the samples that were fed to
    ``moments``: same keys, same η rule, same stabilised patch covariance
    Σ̂ = (1/2k)[diag(Σ_j x_j²) + Σ_j x_j x_jᵀ] + ηI, same patches. Only the order of float64 summation
    differs (≤ 1e-9 relative). The ROI and the patch sizes are those of the accumulator.

    Parameters
    ----------
    x_true, mean : ``moments.image_shape``
        Ground truth and predictive mean, image units (mm⁻¹); moved to ``moments.device``.
    moments : SampleMoments
        Holding at least one sample.
    eta, eta_rel : float
        As in :func:`uq_summary` (η in image units², mm⁻²).
    levels : sequence of float, optional
        Credible masses of the calibration curve, default 0, 0.05, …, 1.
    chunk_bytes : int
        Bytes of float64 covariance data factorised per batch; peak extra memory ≈ this.

    Returns
    -------
    dict
        The keys of :func:`uq_summary`, with ``centering = "none"``.

    Raises
    ------
    ValueError
        If ``moments`` holds no sample, or the images do not have its image shape.
    """
    where = "uq_summary_from_moments"
    if not isinstance(moments, SampleMoments):
        raise TypeError(f"{where}: moments must be a SampleMoments, got {type(moments).__name__}")
    k = moments.n_samples
    if k < 1:
        raise ValueError(f"{where}: the accumulator holds no sample yet")
    lv = _check_levels(levels, where)
    shape, device = moments.image_shape, moments.device
    x_true = _check_image(x_true, "x_true", shape, where, device)
    mu = _check_image(mean, "mean", shape, where, device)
    region = moments._region
    box_var = moments._sum_sq[region.box].to(torch.float64) * (1.0 / k)
    diff = (x_true - mu)[region.box]
    roi_var = _select(box_var, _box_region(diff, region))
    eta = _resolve_eta(eta, eta_rel, float(roi_var.mean()), where)
    var, err, std = _stabilised(diff, region, roi_var, eta, where)
    fallback = float(box_var.mean()) or 1.0
    joint = {}
    for p in moments.patch_sizes:
        e = _grid_patches(diff, moments._grids[p], p)
        joint[str(p)] = _joint_ll_from_sums(moments._patch_sums[p], e, k, p, eta, fallback, chunk_bytes, where)
    return _assemble(k, region.n, "none", eta, var, err, std, joint, lv)
