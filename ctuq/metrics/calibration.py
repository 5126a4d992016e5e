"""Calibration of the predictive standard deviation against the actual error.

* :func:`coverage`, :func:`headline_coverage` — empirical coverage of central Gaussian credible intervals;
* :func:`error_std_histogram` — 2D histogram of ``|error|`` against ``std`` on shared bins;
* :func:`rank_correlation` — Spearman correlation between ``std`` and ``|error|``;
* :func:`reliability` — RMSE against the root mean variance (RMV) per equal-count bin of ``std``, and their ENCE;
* :func:`calibrated_spearman` — the Spearman a perfectly calibrated map with the same ``std`` would get;
* :func:`error_localisation` — whether the std map points at the errors, by the right amount (DESIGN.md §8): inside
  the object ENCE, the reliability bins, coverage@0.9 per decile of ``std``, Spearman and its ratio to the calibrated
  reference, the AUC of ``std`` for finding the 10 % largest errors;
* :func:`power_fit` — the best ``c·std^γ`` of a map by maximum likelihood against known errors (a study's
  reference, fitted on the ground truth).

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
    "Reliability",
    "reliability",
    "calibrated_spearman",
    "error_localisation",
    "power_fit",
    "OBJECT_FRACTION",
    "CONTRAST_BINS",
]


def _check_std(std, shape: tuple[int, ...], device, where: str) -> torch.Tensor:
    if isinstance(std, (int, float)) or (isinstance(std, (torch.Tensor, np.ndarray)) and std.ndim == 0):
        std = torch.full(shape, float(std), dtype=torch.float64, device=device)
    std = _check_image(std, "std", shape, where, device)
    if bool((std < 0).any()):
        raise ValueError(f"{where}: std must be ≥ 0; {int((std < 0).sum())} pixel(s) are negative")
    return std


def _check_bins(bins, where: str) -> int:
    if int(bins) != bins or bins < 1:
        raise ValueError(f"{where}: bins must be a positive int, got {bins!r}")
    return int(bins)


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
    bins = _check_bins(bins, where)
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
    edges = np.geomspace(lo, hi, bins + 1) if log else np.linspace(lo, hi, bins + 1)
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


def _std_bins(sd: np.ndarray, bins: int) -> list[np.ndarray] | None:
    """The pixel indices of ``bins`` equal-count bins of ``sd``, lowest std first (ties split by position: a stable
    sort); ``None`` for fewer pixels than bins. The bins of the decile coverage and of :func:`reliability`."""
    if sd.size < bins:
        return None
    return np.array_split(np.argsort(sd, kind="stable"), bins)


def _decile_coverage(err: np.ndarray, sd: np.ndarray) -> list[float] | None:
    """Coverage@0.9 of the pixels in each decile of ``sd`` (lowest std first); ``None`` for fewer than 10 pixels."""
    groups = _std_bins(sd, 10)
    if groups is None:
        return None
    return [float(np.mean(err[idx] <= _Z90 * sd[idx])) for idx in groups]


#: The bins of :func:`reliability` and of the contrast scores of :func:`error_localisation`: deciles of ``std``.
CONTRAST_BINS = 10
_REFERENCE_DRAWS = 8


class Reliability(NamedTuple):
    """RMSE against RMV per equal-count bin of ``std`` (lowest ``std`` first), and the ENCE.

    Attributes
    ----------
    rmv : ``(bins,)`` float64 numpy array
        Root mean variance the map claims in each bin, ``sqrt(mean std²)`` (image units, mm⁻¹).
    rmse : ``(bins,)`` float64 numpy array
        Root mean squared error in the same bin (mm⁻¹).
    ence : float
        Expected normalised calibration error, ``mean_b |RMV_b − RMSE_b| / RMV_b`` (Levi et al. 2022): 0 when every
        bin's errors are as large as its std says; ``inf`` when a bin claims zero variance but has errors.
    """

    rmv: np.ndarray
    rmse: np.ndarray
    ence: float


def _reliability(err: np.ndarray, sd: np.ndarray, bins: int) -> Reliability | None:
    groups = _std_bins(sd, bins)
    if groups is None:
        return None
    rmv = np.array([np.sqrt(np.mean(sd[g] ** 2)) for g in groups])
    rmse = np.array([np.sqrt(np.mean(err[g] ** 2)) for g in groups])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(rmv > 0, np.abs(rmv - rmse) / np.where(rmv > 0, rmv, 1.0), np.where(rmse > 0, np.inf, 0.0))
    return Reliability(rmv, rmse, float(np.mean(rel)))


def reliability(std, abs_error, roi: Roi = None, *, bins: int = CONTRAST_BINS) -> Reliability:
    """RMSE against RMV in ``bins`` equal-count bins of ``std`` over the ROI pixels, and the ENCE (DESIGN.md §8).

    Parameters
    ----------
    std, abs_error : ``(H, W)`` or ``(D, H, W)``
        The std map and ``|reconstruction − ground truth|``, image units (mm⁻¹), ≥ 0.
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image (a boolean mask selects e.g. the object).
    bins : int
        Number of equal-count bins (ties in ``std`` split by position); at most the number of ROI pixels.

    Returns
    -------
    Reliability
        ``rmv``, ``rmse`` (``(bins,)``, mm⁻¹) and ``ence``. A map that is right bin by bin lies on the diagonal
        ``rmse = rmv`` (:func:`ctuq.figures.plot_reliability`).
    """
    where = "reliability"
    bins = _check_bins(bins, where)
    err_t = _check_image(abs_error, "abs_error", None, where, torch.device("cpu"))
    shape = tuple(err_t.shape)
    region = _resolve_roi(roi, shape, where)
    err = _select(err_t, region).numpy()
    sd = _select(_check_std(std, shape, torch.device("cpu"), where), region).numpy()
    out = _reliability(np.abs(err), sd, bins)
    if out is None:
        raise ValueError(f"{where}: the ROI has {err.size} pixel(s), fewer than bins={bins}")
    return out


def _reference_spearman(sd: np.ndarray, seed: int, draws: int = _REFERENCE_DRAWS) -> float | None:
    if sd.size < 3 or np.all(sd == sd[0]):
        return None
    rng = np.random.default_rng(seed)
    return float(np.mean([spearmanr(sd, sd * np.abs(rng.standard_normal(sd.size))).statistic for _ in range(draws)]))


def calibrated_spearman(std, roi: Roi = None, *, seed: int = 0, draws: int = _REFERENCE_DRAWS) -> float | None:
    """The Spearman(std, |error|) a perfectly calibrated map with these stds would get: the mean over ``draws``
    draws of ``z ~ N(0, 1)`` per pixel of Spearman(std, std·|z|).

    Spearman(std, |error|) has a ceiling below 1 even for a perfect map, set by how much ``std`` varies: ``ln|z|``
    adds variance π²/8 to every pixel's ``ln|error|``, so ``sd(ln std)`` of 0.2 / 0.5 / 1.0 caps it at about
    0.21 / 0.45 / 0.70 (DESIGN.md §8). The observed Spearman over this reference is the *Spearman ratio*: 1 when the
    map's spread matches the errors', above 1 too flat, below 1 too contrasty.

    Parameters
    ----------
    std : ``(H, W)`` or ``(D, H, W)``
        The std map (mm⁻¹), ≥ 0.
    roi : Roi
        See :mod:`ctuq.metrics`; default the whole image.
    seed, draws : int
        The draws' generator seed (numpy) and their number; the reference's Monte Carlo error is about
        ``1 / sqrt(draws · pixels)``.

    Returns
    -------
    float or None
        ``None`` when the map is constant over the ROI (or has fewer than 3 pixels there).
    """
    where = "calibrated_spearman"
    if int(draws) != draws or draws < 1:
        raise ValueError(f"{where}: draws must be a positive int, got {draws!r}")
    sd_t = _check_image(std, "std", None, where, torch.device("cpu"))
    region = _resolve_roi(roi, tuple(sd_t.shape), where)
    return _reference_spearman(_select(sd_t, region).numpy(), int(seed), int(draws))


def _gaussian_nll(err: np.ndarray, sd: np.ndarray) -> float:
    return float(np.mean(np.log(sd) + 0.5 * (err / sd) ** 2))


def power_fit(std, abs_error, roi: Roi = None, *, gammas=None) -> dict | None:
    """The map ``c·std^γ`` closest to the errors by maximum likelihood: the Gaussian LL of the errors over the ROI,
    ``c`` in closed form for each ``γ`` of a grid (``c² = mean(e² / std^{2γ})``), the best ``γ``.

    A study's *reference*, fitted on the ground truth: the best any monotone power of the map can do, which no
    ground-truth-free method should be expected to beat (issue 44). ``γ = 1`` is a global scale, ``γ = 0`` a
    constant std.

    Parameters
    ----------
    std, abs_error : ``(H, W)`` or ``(D, H, W)``
        The map and the errors (mm⁻¹); ``std`` > 0 over the ROI.
    roi : Roi
        See :mod:`ctuq.metrics` (e.g. the object's boolean mask).
    gammas : sequence of float, optional
        The grid of ``γ``; default 0, 0.05, …, 3.

    Returns
    -------
    dict or None
        ``gamma``, ``c`` (in units of mm⁻¹ per (mm⁻¹)^γ) and ``ence`` (of ``c·std^γ`` over the ROI,
        :data:`CONTRAST_BINS` bins); ``None`` for fewer than :data:`CONTRAST_BINS` pixels.
    """
    where = "power_fit"
    sd_t = _check_image(std, "std", None, where, torch.device("cpu"))
    shape = tuple(sd_t.shape)
    region = _resolve_roi(roi, shape, where)
    sd = _select(sd_t, region).numpy().astype(np.float64)
    err = np.abs(_roi_values(abs_error, "abs_error", shape, region, where)).astype(np.float64)
    if sd.size < CONTRAST_BINS:
        return None
    if not (np.all(np.isfinite(sd)) and sd.min() > 0):
        raise ValueError(f"{where}: std must be finite and > 0 over the ROI")
    grid = np.arange(0.0, 3.0 + 1e-9, 0.05) if gammas is None else np.asarray(gammas, np.float64)
    # std normalised by its geometric mean, so std^γ neither over- nor underflows for any γ of the grid
    log_s = np.log(sd) - np.mean(np.log(sd))
    best = None
    for g in grid:
        shape_g = np.exp(g * log_s)
        c = float(np.sqrt(np.mean(err**2 / shape_g**2)))
        if c <= 0:
            continue
        nll = _gaussian_nll(err, c * shape_g)
        if best is None or nll < best[0]:
            best = (nll, float(g), c, c * shape_g)
    if best is None:
        return None
    _, g, c, fitted = best
    rel = _reliability(err, fitted, CONTRAST_BINS)
    # c back in the map's own units: c·exp(γ(ln s − m)) = (c·e^{−γm})·s^γ
    return {"gamma": g, "c": c * float(np.exp(-g * np.mean(np.log(sd)))), "ence": rel.ence}


def error_localisation(std, abs_error, ground_truth, roi: Roi = None, *, top: float = 0.1, seed: int = 0) -> dict:
    """Whether the std map points at the errors, by the right amount (DESIGN.md §8): inside the object as well as
    over the ROI, because over the ROI a map that is only brighter on the object than on the background already
    scores high.

    Parameters
    ----------
    std, abs_error, ground_truth : ``(H, W)`` or ``(D, H, W)``
        The std map, ``|reconstruction − ground truth|`` and the ground truth (mm⁻¹).
    roi : Roi
        The evaluation region (default the whole image); the object is its pixels whose ground truth exceeds
        :data:`OBJECT_FRACTION` of the ground truth's maximum.
    top : float
        The share of the largest errors the AUC tries to find.
    seed : int
        Seeds the draws of the calibrated reference Spearman (:func:`calibrated_spearman`).

    Returns
    -------
    dict
        Inside the object:

        * ``ence`` (:func:`reliability`, :data:`CONTRAST_BINS` equal-count bins of ``std``) and ``reliability``
          (``{"rmv": [...], "rmse": [...]}`` per bin, lowest ``std`` first, mm⁻¹);
        * ``conditional_coverage_0.9``: coverage of the 90 % intervals in each decile of ``std``, lowest first (a
          map right on average but wrong in its brightest pixels shows here), and its ``_roi`` twin;
        * ``spearman_inside`` (Spearman(std, |error|); ``None`` when a map is constant), ``spearman_reference``
          (what a perfectly calibrated map with these stds would get) and ``spearman_ratio`` (observed over
          reference: 1 right, > 1 too flat, < 1 too contrasty; ``None`` when the reference is not positive);
        * ``auc_top10``: ROC AUC of ``std`` for the ``top`` largest |error| (0.5 is chance);

        and ``spearman_roi`` over the whole ROI, ``object_fraction`` (of the ROI's pixels). Each entry is ``None``
        when the object has too few pixels for it.
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
    rel = _reliability(e_in, s_in, CONTRAST_BINS)
    observed = _spearman(s_in, e_in)
    reference = _reference_spearman(s_in, seed)
    return {
        "ence": None if rel is None else rel.ence,
        "reliability": None if rel is None else {"rmv": rel.rmv.tolist(), "rmse": rel.rmse.tolist()},
        "spearman_inside": observed,
        "spearman_reference": reference,
        "spearman_ratio": observed / reference if observed is not None and reference and reference > 0 else None,
        "spearman_roi": _spearman(sd, err),
        "auc_top10": _auc(s_in, positive),
        "conditional_coverage_0.9": _decile_coverage(e_in, s_in),
        "conditional_coverage_0.9_roi": _decile_coverage(err, sd),
        "object_fraction": float(inside.mean()) if inside.size else 0.0,
    }
