"""Calibration of the predictive standard deviation against the actual error.

* :func:`coverage`, :func:`headline_coverage` — empirical coverage of central Gaussian credible intervals;
* :func:`error_std_histogram` — 2D histogram of ``|error|`` against ``std`` on shared bins;
* :func:`rank_correlation` — Spearman correlation between ``std`` and ``|error|``;
* :func:`error_localisation` — whether the std map points at the errors: Spearman inside the object and over the
  ROI, the AUC of ``std`` for finding the 10 % largest errors, and coverage@0.9 per decile of ``std``.

Images are in image units (mm⁻¹ for attenuation images); stds in the same units.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from scipy.stats import norm, rankdata, spearmanr

from ._common import DEFAULT_LEVELS, HEADLINE_LEVELS, _check_image
from .regions import Roi, _resolve_roi, _select

__all__ = [
    "coverage",
    "headline_coverage",
    "ErrorStdHistogram",
    "error_std_histogram",
    "rank_correlation",
    "error_localisation",
    "OBJECT_FRACTION",
]


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

    A pixel is covered when ``|x_true − mean| ≤ z·std`` (a pixel with ``std = 0`` only when its error is
    exactly 0; the level 1 interval is the whole line).

    Parameters
    ----------
    x_true, mean : ``(H, W)`` or ``(D, H, W)``
        Ground truth and predictive mean, image units (mm⁻¹).
    std : same shape, or a scalar
        Predictive standard deviation, image units (mm⁻¹), ≥ 0.
    levels : sequence of float, optional
        Credible masses ``l`` in [0, 1]; default 0, 0.05, …, 1.
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image.

    Returns
    -------
    (levels, coverage) : tuple of ``(n_levels,)`` float64 numpy arrays
        Coverage is the fraction of ROI pixels covered; perfect calibration is ``coverage == levels``.
    """
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
    """Coverage of the 50%, 90% and 95% central credible intervals.

    Parameters
    ----------
    x_true, mean, std, roi
        As in :func:`coverage` (images ``(H, W)`` or ``(D, H, W)``, image units).

    Returns
    -------
    dict[str, float]
        ``{"0.5": …, "0.9": …, "0.95": …}``, fractions of ROI pixels.
    """
    lv, cov = coverage(x_true, mean, std, HEADLINE_LEVELS, roi)
    return {f"{l:g}": float(c) for l, c in zip(lv, cov)}


class ErrorStdHistogram(NamedTuple):
    """2D histogram of ``|error|`` against ``std``.

    Attributes
    ----------
    counts : ``(bins, bins)`` int64 numpy array
        ``counts[i, j]`` = number of ROI pixels with ``|error|`` in bin ``i`` and ``std`` in bin ``j``
        (rows = error = y axis, ready for ``pcolormesh(edges, edges, counts)``).
    edges : ``(bins + 1,)`` float64 numpy array
        Bin edges shared by both axes (image units, mm⁻¹), so ``y = x`` is the diagonal of the bin grid.
    """

    counts: np.ndarray
    edges: np.ndarray


def _roi_values(x, name, shape, region, where) -> np.ndarray:
    return _select(_check_image(x, name, shape, where, torch.device("cpu")), region).numpy()


def error_std_histogram(
    abs_error, std, bins: int = 100, roi: Roi = None, *, log: bool = True, range: tuple[float, float] | None = None
) -> ErrorStdHistogram:
    """Counts of ROI pixels by ``(|error|, std)`` on a shared grid of ``bins × bins`` bins.

    Parameters
    ----------
    abs_error, std : ``(H, W)`` or ``(D, H, W)``
        Image units (mm⁻¹), ≥ 0.
    bins : int
        Number of bins per axis.
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image.
    log : bool
        Logarithmically spaced edges (default; errors and stds span decades) or linear ones.
    range : (lo, hi), optional
        Fixes the edges (image units; ``lo > 0`` when ``log``). By default ``hi`` is the largest value of
        either map and ``lo`` the smallest positive one (log, floored at ``hi·1e-6``) or 0 (linear).

    Returns
    -------
    ErrorStdHistogram
        Values outside ``[lo, hi]`` (e.g. exact zeros on log bins) are counted in the first/last bin, so the
        counts always sum to the ROI size.
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
        raise ValueError(
            f"{where}: abs_error and std must be ≥ 0 (got a negative value in "
            f"{'abs_error' if err.min() < 0 else 'std'})"
        )
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
            raise ValueError(
                f"{where}: range must be finite (lo, hi) with hi > lo (and lo > 0 for log bins), got {range!r}"
            )
    edges = np.geomspace(lo, hi, int(bins) + 1) if log else np.linspace(lo, hi, int(bins) + 1)
    # clip into [lo, hi] so no pixel is silently dropped from the figure
    counts, _, _ = np.histogram2d(np.clip(err, lo, hi), np.clip(sd, lo, hi), bins=[edges, edges])
    return ErrorStdHistogram(counts.astype(np.int64), edges)


def rank_correlation(std, abs_error, roi: Roi = None) -> float:
    """Spearman rank correlation between ``std`` and ``|error|`` over the ROI pixels (``scipy.stats``).

    Parameters
    ----------
    std, abs_error : ``(H, W)`` or ``(D, H, W)``
        Image units (mm⁻¹).
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image.

    Returns
    -------
    float
        In [−1, 1]; 1 means the uncertainty ranks pixels exactly like the error does. NaN when either map is
        constant in the ROI.
    """
    where = "rank_correlation"
    sd_t = _check_image(std, "std", None, where, torch.device("cpu"))
    shape = tuple(sd_t.shape)
    region = _resolve_roi(roi, shape, where)
    sd = _select(sd_t, region).numpy()
    err = _roi_values(abs_error, "abs_error", shape, region, where)
    if sd.size < 2 or np.all(sd == sd[0]) or np.all(err == err[0]):
        return float("nan")
    return float(spearmanr(sd, err).statistic)


#: The object of :func:`error_localisation`: pixels whose ground truth exceeds this fraction of its maximum.
OBJECT_FRACTION = 0.2
_Z90 = float(norm.ppf(0.95))


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    if a.size < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    return float(spearmanr(a, b).statistic)


def _auc(score: np.ndarray, positive: np.ndarray) -> float | None:
    """ROC AUC of ``score`` for the boolean labels ``positive`` (Mann–Whitney, ties counted half)."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = rankdata(score)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _decile_coverage(err: np.ndarray, sd: np.ndarray) -> list[float] | None:
    """Coverage@0.9 of the pixels in each decile of ``sd`` (lowest std first); ``None`` for fewer than 10 pixels."""
    if err.size < 10:
        return None
    order = np.argsort(sd, kind="stable")
    return [float(np.mean(err[idx] <= _Z90 * sd[idx])) for idx in np.array_split(order, 10)]


def error_localisation(std, abs_error, ground_truth, roi: Roi = None, *, top: float = 0.1) -> dict:
    """Whether the std map points at the errors (DESIGN.md §8): ranks inside the object as well as over the ROI,
    because over the ROI a map that is only brighter on the object than on the background already scores high.

    Parameters
    ----------
    std, abs_error, ground_truth : ``(H, W)`` or ``(D, H, W)``
        The std map, ``|reconstruction − ground truth|`` and the ground truth (mm⁻¹).
    roi : Roi
        The evaluation region (default the whole image); the object is its pixels whose ground truth exceeds
        :data:`OBJECT_FRACTION` of the ground truth's maximum.
    top : float
        The share of the largest errors the AUC tries to find.

    Returns
    -------
    dict
        ``spearman_inside`` and ``spearman_roi`` (Spearman(std, |error|); ``None`` when a map is constant),
        ``auc_top10`` (ROC AUC of ``std`` for the ``top`` largest |error| inside the object: 0.5 is chance),
        ``conditional_coverage_0.9`` (coverage of the 90 % intervals in each decile of ``std`` inside the object,
        lowest first: a map right on average but wrong in its brightest pixels shows here) and its ``_roi`` twin,
        ``object_fraction`` (of the ROI's pixels).
    """
    where = "error_localisation"
    sd_t = _check_image(std, "std", None, where, torch.device("cpu"))
    shape = tuple(sd_t.shape)
    region = _resolve_roi(roi, shape, where)
    sd = _select(sd_t, region).numpy()
    err = _roi_values(abs_error, "abs_error", shape, region, where)
    gt = _roi_values(ground_truth, "ground_truth", shape, region, where)
    inside = gt > OBJECT_FRACTION * float(np.max(gt)) if gt.size else np.zeros(0, dtype=bool)
    e_in, s_in = err[inside], sd[inside]
    positive = e_in >= np.quantile(e_in, 1.0 - top) if e_in.size else np.zeros(0, dtype=bool)
    return {
        "spearman_inside": _spearman(s_in, e_in),
        "spearman_roi": _spearman(sd, err),
        "auc_top10": _auc(s_in, positive),
        "conditional_coverage_0.9": _decile_coverage(e_in, s_in),
        "conditional_coverage_0.9_roi": _decile_coverage(err, sd),
        "object_fraction": float(inside.mean()) if inside.size else 0.0,
    }
