"""Uncertainty metrics from image-space posterior samples (DESIGN.md §1 "Uncertainty outputs", §7).

Everything here is CT-agnostic: it sees a ground truth ``x_true``, a predictive mean ``x̃`` (``mean``) and
``k`` samples (or running sums over them), all image-shaped, and never a scanner or a network.

Map of the package
------------------
==================  =====================================================================================
``regions``         ROIs: :func:`inner_square_roi`, :func:`roi_mask`, the :data:`Roi` forms, and the tiling
                    of a ROI into non-overlapping patches shared by every patch statistic
``moments``         pixelwise :func:`pixelwise_variance` / :func:`pixelwise_std` /
                    :func:`pixelwise_std_about` from samples in memory, and :class:`SampleMoments`, the
                    streaming accumulator (pixel sums of squares + per-patch second-moment sums) whose
                    memory does not grow with ``k``
``likelihoods``     :func:`marginal_log_likelihood`, :func:`patch_joint_log_likelihood` (stabilised patch
                    covariance Σ̂ = (1/2k)[diag(Σ_j x_j²) + Σ_j x_j x_jᵀ] + ηI)
``calibration``     :func:`coverage`, :func:`headline_coverage`, :func:`error_std_histogram`,
                    :func:`rank_correlation`, and the map's contrast (DESIGN.md §8): :func:`reliability`
                    (RMSE against RMV per std bin, ENCE), :func:`calibrated_spearman` (a perfect map's
                    Spearman), :func:`error_localisation` (all of them inside the object), :func:`power_fit`
``heldout``         :func:`heldout_check` — the check without ground truth: held-out measurements against the
                    posterior predictive (coverage, z-scores, LL, the recalibration scale ``k``,
                    :func:`fit_variance_scale`)
``summary``         :func:`uq_summary` (samples in memory) and :func:`uq_summary_from_moments` (from a
                    :class:`SampleMoments`), the one JSON-ready dict a run reports
``image``           image quality against a ground truth: :func:`psnr` (torch), :func:`psnr_from_mse`,
                    :func:`image_metrics` (PSNR and SSIM with ``skimage``, for ``metrics.json``)
``classification``  NLL, accuracy, ECE, Brier score, reliability diagrams, joint log-likelihood of κ-tuples
                    (:func:`nll`, :func:`expected_calibration_error`, …, :func:`classification_summary`), and
                    :func:`paired_bootstrap` (two predictives' differences, with intervals)
==================  =====================================================================================

Shapes and units
----------------
* an image is ``(H, W)`` (a slice) or ``(D, H, W)`` (a volume), in image units (attenuation in mm⁻¹, or the
  DIP's scaled units; every metric is computed in whatever units it is given);
* ``samples`` is ``(k, H, W)`` or ``(k, D, H, W)``, float32 or float64, on any device. The linearised
  sampler hands over **zero-mean** deviations ``x_j`` (predictive samples are ``x̃ + x_j``); MC dropout hands
  over raw stochastic forward passes, which are not zero-mean — see *centering* below;
* variances are in image units² (mm⁻²), standard deviations in image units (mm⁻¹), log-likelihoods in
  nats per pixel.

Sums of squares, covariances, Cholesky factors and log-likelihoods are accumulated in float64 on the
samples' device, chunked so that memory stays bounded (≈ 3 × ``chunk_bytes`` at peak, independent of ``k``
and of the image size) — 501² slices with ``k = 1024`` (a 1 GB float32 input) included. When even the
samples do not fit (3D volumes, thousands of samples), stream them through :class:`SampleMoments` and call
:func:`uq_summary_from_moments`.

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
  unbiased sample covariance — for MC-dropout forward passes; needs all samples at once;
* ``"mean"``: deviations from the given predictive mean ``mean`` (treated as known, divide by ``k``).

:class:`SampleMoments` streams ``"none"`` only (``"mean"`` is ``"none"`` applied to ``samples − mean``).
"""

from __future__ import annotations

from ._common import DEFAULT_CHUNK_BYTES, DEFAULT_ETA_REL, DEFAULT_LEVELS, HEADLINE_LEVELS
from .calibration import (
    ErrorStdHistogram,
    Reliability,
    calibrated_spearman,
    coverage,
    error_localisation,
    error_std_histogram,
    headline_coverage,
    power_fit,
    rank_correlation,
    reliability,
)
from .classification import (
    accuracy,
    brier_score,
    classification_summary,
    expected_calibration_error,
    joint_log_likelihood,
    joint_log_likelihoods,
    nll,
    paired_bootstrap,
    reliability_diagram,
)
from .heldout import HELDOUT_LEVELS, fit_variance_scale, heldout_check, projected_variance
from .image import image_metrics, psnr, psnr_from_mse
from .likelihoods import marginal_log_likelihood, patch_joint_log_likelihood
from .moments import SampleMoments, pixelwise_std, pixelwise_std_about, pixelwise_variance
from .regions import PUBLISHED_GRID, PUBLISHED_ROI, Roi, inner_square_roi, roi_mask
from .summary import uq_summary, uq_summary_from_moments

__all__ = [
    "Roi",
    "PUBLISHED_ROI",
    "PUBLISHED_GRID",
    "DEFAULT_CHUNK_BYTES",
    "inner_square_roi",
    "roi_mask",
    "pixelwise_variance",
    "pixelwise_std",
    "pixelwise_std_about",
    "SampleMoments",
    "marginal_log_likelihood",
    "patch_joint_log_likelihood",
    "coverage",
    "headline_coverage",
    "ErrorStdHistogram",
    "error_std_histogram",
    "rank_correlation",
    "Reliability",
    "reliability",
    "calibrated_spearman",
    "error_localisation",
    "power_fit",
    "uq_summary",
    "uq_summary_from_moments",
    "heldout_check",
    "fit_variance_scale",
    "projected_variance",
    "HELDOUT_LEVELS",
    "nll",
    "accuracy",
    "expected_calibration_error",
    "reliability_diagram",
    "brier_score",
    "paired_bootstrap",
    "joint_log_likelihood",
    "joint_log_likelihoods",
    "classification_summary",
    "psnr",
    "psnr_from_mse",
    "image_metrics",
    "DEFAULT_ETA_REL",
    "DEFAULT_LEVELS",
    "HEADLINE_LEVELS",
]
