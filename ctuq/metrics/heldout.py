"""The held-out check of a posterior in measurement space, and its recalibration scale (DESIGN.md §8).

Measurements the reconstruction did not use, ``y_h`` (``m`` rows), are predicted by the posterior as
``y_h ~ N(T_h x̂, T_h Σ T_hᵀ + σ² I)``. With zero-mean posterior image samples ``x_j`` projected to ``T_h x_j``
(``(k, m)``), the image part of the predictive variance of row ``i`` is ``v_i = (1/k) Σ_j (T_h x_j)_i²`` and the
row's predictive variance is ``v_i + σ²_i``. No ground truth is needed: this is the check a user can run on a scan.

:func:`heldout_check` scores ``r = y_h − T_h x̂`` and ``z_i = r_i / sqrt(v_i + σ²_i)``: coverage of the central
intervals, a z-score summary, the predictive log-likelihood per row, the image-variance fraction ``mean_i v_i /
(v_i + σ²_i)`` (near 0 the check cannot see the std map at all) and diagnostics of the image part's scale that no
calibration method applies.

:func:`fit_variance_scale` is the maximum-likelihood factor ``k`` on the image std, ``var_i(k) = k² v_i + σ²_i``,
with its uncertainty from the curvature and from a bootstrap that resamples *groups* (the rows of one projection
angle are correlated, so angles are resampled as blocks); ``k > 1``: the std map is too narrow, ``k < 1``: too wide.
The calibration methods fit themselves with it (:mod:`ctuq.calibration.likelihood`) and add their own entries to the
check's report (``scale``: the global ``k`` of ``uq.calibration = heldout``; ``bias``: the bias model's ``τ``).

Everything here is CT-free (torch/numpy only); units are whatever the inputs are in (the CT front end passes mm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np
import torch

from ._common import HEADLINE_LEVELS

__all__ = [
    "HELDOUT_LEVELS",
    "Z_HISTOGRAM_EDGES",
    "heldout_check",
    "fit_variance_scale",
    "fit_variance_and_noise_scale",
    "projected_variance",
    "check_rows",
    "headline_coverage",
]

HELDOUT_LEVELS = (*(round(0.05 * i, 2) for i in range(1, 20)), 0.99)
"""Central-interval masses of the held-out calibration curve: 0.05, 0.10, …, 0.95, 0.99."""

Z_HISTOGRAM_EDGES = tuple(float(e) for e in np.linspace(-5.0, 5.0, 41))
"""Bin edges of the z-score histogram (40 bins of 0.25 over [−5, 5]; rows outside are counted apart)."""

_LOG_2PI = math.log(2.0 * math.pi)
# The bracket of log k² searched by the maximum-likelihood fit: k from 1e-4 to 1e4 covers any std map worth
# reporting; a fit at an end of it is flagged (at_bound) instead of extrapolated.
_LOG_LAMBDA_RANGE = (math.log(1e-8), math.log(1e8))
_GRID_POINTS = 161
_BISECTIONS = 50
_BOOTSTRAP_HALF_WIDTH = 8.0  # in log λ = 2 log k
_JOINT_STEPS = 100
_JOINT_MAX_STEP = 4.0


def _as_float64(x, name: str, where: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{where}: {name} must be a tensor or array of numbers, got {type(x).__name__}") from None
    return arr


def projected_variance(samples) -> np.ndarray:
    """Per-row image variance ``v_i = (1/k) Σ_j s_ji²`` of ``k`` zero-mean projected samples ``(k, m)``: ``(m,)``
    float64 (measurement units²), accumulated in float64."""
    where = "projected_variance"
    s = _as_float64(samples, "samples", where)
    if s.ndim != 2 or s.shape[0] < 1:
        raise ValueError(f"{where}: samples must have shape (k, m) with k ≥ 1, got {tuple(s.shape)}")
    return np.einsum("ij,ij->j", s, s) / s.shape[0]


def _neg_ll_derivative(log_lam: float, r2: np.ndarray, v: np.ndarray, s2: np.ndarray, w: np.ndarray) -> float:
    """d/d(log λ) of the weighted negative log-likelihood ½ Σ w_i [log(λ v_i + σ²_i) + r_i²/(λ v_i + σ²_i)]."""
    lam = math.exp(log_lam)
    u = lam * v + s2
    return float(0.5 * lam * np.sum(w * v * (u - r2) / (u * u)))


def _neg_ll(log_lam: np.ndarray, r2: np.ndarray, v: np.ndarray, s2: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The weighted negative log-likelihood (without the 2π term) at each ``log λ`` of ``log_lam``."""
    lam = np.exp(log_lam)[:, None]
    u = lam * v[None] + s2[None]
    return 0.5 * np.sum(w[None] * (np.log(u) + r2[None] / u), axis=1)


def _ml_log_lambda(r2: np.ndarray, v: np.ndarray, s2: np.ndarray, w: np.ndarray) -> tuple[float, bool]:
    """Maximum-likelihood ``log λ`` (λ = k²) and whether it sits at an end of the searched bracket.

    A grid over the bracket finds the global minimum (the likelihood in λ need not be unimodal for arbitrary
    data), then bisection on the derivative's sign between the neighbouring grid points refines it.
    """
    grid = np.linspace(*_LOG_LAMBDA_RANGE, _GRID_POINTS)
    f = _neg_ll(grid, r2, v, s2, w)
    i = int(np.argmin(f))
    if i == 0 or i == len(grid) - 1:
        return float(grid[i]), True
    return _bisect(float(grid[i - 1]), float(grid[i + 1]), r2, v, s2, w), False


def _bisect(lo: float, hi: float, r2: np.ndarray, v: np.ndarray, s2: np.ndarray, w: np.ndarray) -> float:
    """The zero of the derivative in ``[lo, hi]`` (log λ) by bisection; an end of the bracket when the derivative
    does not change sign there (the minimum lies at or beyond that end)."""
    if _neg_ll_derivative(lo, r2, v, s2, w) >= 0:
        return lo
    if _neg_ll_derivative(hi, r2, v, s2, w) <= 0:
        return hi
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        if _neg_ll_derivative(mid, r2, v, s2, w) > 0:
            hi = mid
        else:
            lo = mid
    return 0.5 * (lo + hi)


def fit_variance_scale(
    residual,
    variance,
    noise_variance,
    *,
    groups=None,
    n_bootstrap: int = 200,
    seed: int = 0,
) -> dict:
    """Maximum-likelihood scale ``k`` of the image part of the predictive variance, ``var_i(k) = k² v_i + σ²_i``.

    Parameters
    ----------
    residual : ``(m,)``
        ``r = y_h − T_h x̂`` (measurement units).
    variance : ``(m,)``
        Image part ``v_i ≥ 0`` of the predictive variance (measurement units²); not all zero.
    noise_variance : float or ``(m,)``
        ``σ²`` (measurement units²), > 0.
    groups : ``(m,)`` ints, optional
        Block label of each row (its projection angle); the bootstrap resamples blocks. ``None``: every row is
        its own block.
    n_bootstrap : int
        Bootstrap replicates (0: none).
    seed : int
        Seeds the bootstrap's resampling (numpy ``default_rng``).

    Returns
    -------
    dict
        ``k``; ``se_curvature`` (from the Fisher information of λ = k², rows taken as independent: a lower bound
        when rows are correlated); ``se_bootstrap`` and ``interval_95`` (2.5 / 97.5 % bootstrap percentiles) or
        ``None``; ``n_bootstrap``; ``at_bound`` (the fit hit ``k = 1e-4`` or ``1e4``: the image part is not
        identifiable from these rows); ``log_likelihood`` (per row, at ``k``).
    """
    where = "fit_variance_scale"
    r, v, s2, g = check_rows(residual, variance, noise_variance, groups, where)
    if not int(n_bootstrap) == n_bootstrap or n_bootstrap < 0:
        raise ValueError(f"{where}: n_bootstrap must be an int ≥ 0, got {n_bootstrap!r}")
    r2 = r * r
    w = np.ones_like(r)
    log_lam, at_bound = _ml_log_lambda(r2, v, s2, w)
    lam = math.exp(log_lam)
    k = math.sqrt(lam)
    u = lam * v + s2
    fisher = 0.5 * float(np.sum(v * v / (u * u)))
    se_curv = (1.0 / math.sqrt(fisher)) / (2.0 * k) if fisher > 0 and k > 0 else float("inf")
    ll = float(np.mean(-0.5 * (_LOG_2PI + np.log(u) + r2 / u)))
    boot = []
    if n_bootstrap:
        labels, inverse = np.unique(g, return_inverse=True)
        rng = np.random.default_rng(seed)
        for _ in range(int(n_bootstrap)):
            counts = np.bincount(rng.integers(0, len(labels), len(labels)), minlength=len(labels))
            wb = counts[inverse].astype(np.float64)
            # a replicate's optimum lies near the full data's: bisection in a bracket of ×e^±4 in k instead of the
            # global grid (200 replicates over 20k rows in about a second)
            lb = _bisect(log_lam - _BOOTSTRAP_HALF_WIDTH, log_lam + _BOOTSTRAP_HALF_WIDTH, r2, v, s2, wb)
            boot.append(math.exp(0.5 * lb))
    boot_arr = np.asarray(boot)
    return {
        "k": k,
        "se_curvature": se_curv,
        "se_bootstrap": float(boot_arr.std(ddof=1)) if len(boot) > 1 else None,
        "interval_95": [float(np.quantile(boot_arr, 0.025)), float(np.quantile(boot_arr, 0.975))] if boot else None,
        "n_bootstrap": int(n_bootstrap),
        "at_bound": bool(at_bound),
        "log_likelihood": ll,
    }


def _joint_log_scales(r2, v, s2, w, start=None) -> tuple[float, float, bool]:
    """Maximum-likelihood ``(log λ, log τ²)`` of ``var_i = λ v_i + τ² σ²_i`` by Fisher scoring with step halving
    (the expected information is positive definite whenever ``v`` is not proportional to ``σ²``), started from the
    1D fit with ``τ = 1``; and whether it ran off the searched range (the image part is then not identifiable)."""
    if start is None:
        log_lam, hit = _ml_log_lambda(r2, v, s2, w)
        x = np.array([log_lam, 0.0])
    else:
        x, hit = np.array(start, dtype=np.float64), False

    def nll(p):
        if max(abs(p[0]), abs(p[1])) > _LOG_LAMBDA_RANGE[1] + _JOINT_MAX_STEP:
            return math.inf  # far outside the searched range: refused by the step halving
        u = math.exp(p[0]) * v + math.exp(p[1]) * s2
        return 0.5 * float(np.sum(w * (np.log(u) + r2 / u)))

    f = nll(x)
    for _ in range(_JOINT_STEPS):
        a, b = math.exp(x[0]) * v, math.exp(x[1]) * s2
        u = a + b
        d = w * (u - r2) / (u * u)
        grad = 0.5 * np.array([np.sum(a * d), np.sum(b * d)])
        wu = w / (u * u)
        info = 0.5 * np.array([[np.sum(wu * a * a), np.sum(wu * a * b)], [np.sum(wu * a * b), np.sum(wu * b * b)]])
        try:
            step = np.linalg.solve(info, grad)
        except np.linalg.LinAlgError:
            break
        big = float(np.max(np.abs(step)))
        if not math.isfinite(big):
            break
        if big > _JOINT_MAX_STEP:  # a near-singular information: no more than ×e^4 per step in either scale
            step = step * (_JOINT_MAX_STEP / big)
        t = 1.0
        while t > 1e-6:
            cand = x - t * step
            fc = nll(cand)
            if fc <= f:
                break
            t *= 0.5
        if t <= 1e-6:
            break
        x, f_old, f = cand, f, fc
        if not all(_LOG_LAMBDA_RANGE[0] < c < _LOG_LAMBDA_RANGE[1] for c in x):
            return float(np.clip(x[0], *_LOG_LAMBDA_RANGE)), float(np.clip(x[1], *_LOG_LAMBDA_RANGE)), True
        if f_old - f < 1e-10 * max(1.0, abs(f)) and np.max(np.abs(t * step)) < 1e-7:
            break
    return float(x[0]), float(x[1]), hit


def fit_variance_and_noise_scale(
    residual,
    variance,
    noise_variance,
    *,
    groups=None,
    n_bootstrap: int = 100,
    seed: int = 0,
) -> dict:
    """Joint maximum-likelihood scales of both parts of the predictive variance, ``var_i = k² v_i + τ² σ²_i``.

    Where :func:`fit_variance_scale` takes ``σ²`` as given, this also refits the noise level on the held-out
    rows: a ``σ²`` learned on the rows the reconstruction fitted can be too small (the fit absorbs some of their
    noise), and with ``σ²`` fixed that deficit is charged to the image part. ``k`` is then identified by how the
    residuals grow with ``v_i`` across rows. Arguments as :func:`fit_variance_scale`.

    Returns
    -------
    dict
        ``k``, ``noise_scale`` (``τ``: held-out noise std over the given one), ``se_bootstrap`` of both (block
        bootstrap over ``groups``) and ``interval_95`` of ``k``, or ``None`` without bootstrap; ``n_bootstrap``;
        ``at_bound``; ``log_likelihood`` (per row, at the fit).
    """
    where = "fit_variance_and_noise_scale"
    r, v, s2, g = check_rows(residual, variance, noise_variance, groups, where)
    if not int(n_bootstrap) == n_bootstrap or n_bootstrap < 0:
        raise ValueError(f"{where}: n_bootstrap must be an int ≥ 0, got {n_bootstrap!r}")
    r2 = r * r
    log_lam, log_tau, at_bound = _joint_log_scales(r2, v, s2, np.ones_like(r))
    u = math.exp(log_lam) * v + math.exp(log_tau) * s2
    ks, taus = [], []
    if n_bootstrap:
        labels, inverse = np.unique(g, return_inverse=True)
        rng = np.random.default_rng(seed)
        for _ in range(int(n_bootstrap)):
            wb = np.bincount(rng.integers(0, len(labels), len(labels)), minlength=len(labels))[inverse].astype(float)
            lb, tb, _hit = _joint_log_scales(r2, v, s2, wb, start=(log_lam, log_tau))
            ks.append(math.exp(0.5 * lb))
            taus.append(math.exp(0.5 * tb))
    return {
        "k": math.exp(0.5 * log_lam),
        "noise_scale": math.exp(0.5 * log_tau),
        "se_bootstrap": float(np.std(ks, ddof=1)) if len(ks) > 1 else None,
        "se_bootstrap_noise_scale": float(np.std(taus, ddof=1)) if len(taus) > 1 else None,
        "interval_95": [float(np.quantile(ks, 0.025)), float(np.quantile(ks, 0.975))] if ks else None,
        "n_bootstrap": int(n_bootstrap),
        "at_bound": bool(at_bound),
        "log_likelihood": float(np.mean(-0.5 * (_LOG_2PI + np.log(u) + r2 / u))),
    }


def check_rows(residual, variance, noise_variance, groups, where: str):
    """Held-out rows checked and as float64 arrays: ``(r, v, σ², groups)``, each ``(m,)`` (``σ²`` broadcast from a
    scalar; ``groups`` ``arange(m)`` when ``None``: every row its own block). ``ValueError`` starting with ``where``
    for fewer than 2 rows, shapes that disagree, NaN/Inf, ``σ² ≤ 0``, ``v < 0`` or ``v`` 0 on every row."""
    r = _as_float64(residual, "residual", where)
    if r.ndim != 1 or r.size < 2:
        raise ValueError(f"{where}: the residual (y − mean) must have shape (m,) with m ≥ 2, got {tuple(r.shape)}")
    m = r.size
    v = _as_float64(variance, "variance", where)
    if v.shape != (m,):
        raise ValueError(f"{where}: variance has shape {tuple(v.shape)}; expected ({m},), one per held-out row")
    s2 = _as_float64(noise_variance, "noise_variance", where)
    if s2.ndim == 0:
        s2 = np.full(m, float(s2))
    if s2.shape != (m,):
        raise ValueError(f"{where}: noise_variance has shape {tuple(s2.shape)}; expected a scalar or ({m},)")
    for name, a in (("residual", r), ("variance", v), ("noise_variance", s2)):
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{where}: {name} holds {int((~np.isfinite(a)).sum())} NaN or Inf value(s)")
    if np.any(s2 <= 0):
        raise ValueError(f"{where}: noise_variance must be > 0 (the held-out rows have measurement noise)")
    if np.any(v < 0):
        raise ValueError(f"{where}: variance must be ≥ 0, got a minimum of {float(v.min()):g}")
    if not np.any(v > 0):
        raise ValueError(f"{where}: the image part of the variance is 0 on every row; there is no std to calibrate")
    if groups is None:
        g = np.arange(m)
    else:
        g = np.asarray(groups.cpu() if isinstance(groups, torch.Tensor) else groups)
        if g.shape != (m,) or not np.issubdtype(g.dtype, np.integer):
            raise ValueError(f"{where}: groups must be ({m},) integers (one block label per row), got {g.shape}")
    return r, v, s2, g


def headline_coverage(z_abs: np.ndarray) -> dict[str, float]:
    """``{"0.5", "0.9", "0.95"}`` → the fraction of rows whose ``|z|`` lies inside the central interval of that
    mass (``z_abs``: ``(m,)`` ``|r_i| / sqrt(var_i)``)."""
    return dict(zip((f"{q:g}" for q in HEADLINE_LEVELS), _coverage(z_abs, HEADLINE_LEVELS)))


def _coverage(z_abs: np.ndarray, levels: Sequence[float]) -> list[float]:
    """Fraction of rows inside the central interval of mass ``q``, ``|z| ≤ Φ⁻¹((1 + q)/2)``, per level."""
    nd = NormalDist()
    return [float(np.mean(z_abs <= nd.inv_cdf(0.5 * (1.0 + q)))) for q in levels]


def heldout_check(
    y,
    mean,
    *,
    samples=None,
    variance=None,
    noise_variance,
    photon_variance=None,
    groups=None,
    levels: Sequence[float] = HELDOUT_LEVELS,
    n_bootstrap: int = 200,
    seed: int = 0,
    image_rows_fraction: float = 0.25,
) -> dict:
    """The held-out check of a Gaussian posterior predictive (module docstring): the posterior's own statistics and
    the diagnostics of its scale; JSON-ready. The calibration methods' entries (``scale``, ``bias``) are added by
    :meth:`ctuq.calibration.HeldoutRows.score`.

    Parameters
    ----------
    y : ``(m,)``
        Held-out measurements (measurement units, e.g. line integrals in mm⁻¹·mm = 1).
    mean : ``(m,)``
        Predictive mean ``T_h x̂``.
    samples : ``(k, m)``, optional
        Zero-mean projected posterior image samples ``T_h x_j``; give either these or ``variance``.
    variance : ``(m,)``, optional
        The image part ``v_i`` of the predictive variance directly (measurement units²).
    noise_variance : float or ``(m,)``
        ``σ²`` (measurement units²), > 0.
    photon_variance : ``(m,)``, optional
        Each row's noise variance from the scan's photon statistics (measurement units², > 0): the noise the rows
        carry for certain, as opposed to the fitted ``σ²``, which also absorbs the model misfit of the rows the
        reconstruction fitted. Adds ``scale_photon``.
    groups : ``(m,)`` ints, optional
        Block label per row (projection angle) for the bootstraps; ``None``: rows are independent.
    levels : sequence of float in (0, 1)
        Central-interval masses of the calibration curve (default :data:`HELDOUT_LEVELS`).
    n_bootstrap, seed : int
        Bootstrap replicates of each fitted scale and their seed.
    image_rows_fraction : float in (0, 1]
        The share of rows, those with the largest image-variance fraction ``v_i/(v_i + σ²_i)``, that
        ``scale_image_rows`` is fitted on (a ranking that does not change when the std map is rescaled).

    Returns
    -------
    dict
        ``n_rows``, ``n_groups``, ``n_samples`` (``None`` when ``variance`` was given); ``levels``, ``coverage``
        (per level), ``coverage_headline`` (``"0.5"``, ``"0.9"``, ``"0.95"``); ``z``: ``mean``, ``std``,
        ``frac_abs_gt_3``, ``abs_quantile_0.9`` (the 0.9 quantile of ``|z|``: over 1.645 it is the factor on the
        predictive std that makes the 90 % intervals cover 90 % of the rows), ``histogram`` (``edges``,
        ``density``, ``below``/``above`` fractions outside them);
        ``log_likelihood`` (mean per row, nats) and ``log_likelihood_noise_only`` (σ² alone, the image part
        dropped); ``image_variance_fraction``; ``mean_image_variance``, ``mean_noise_variance``;
        ``scale_with_noise``: :func:`fit_variance_and_noise_scale`; with ``photon_variance``, ``scale_photon``: the
        :func:`fit_variance_scale` dict with the photon variances as the noise part, plus its
        ``image_variance_fraction`` and ``coverage_headline``; ``scale_image_rows``: the :func:`fit_variance_scale`
        dict on the image-dominated rows only, plus ``n_rows``, ``fraction`` and their ``image_variance_fraction``.

    Raises
    ------
    ValueError
        Naming the argument: shapes that disagree, both or neither of ``samples``/``variance``, non-finite
        values, ``σ² ≤ 0``, an image variance that is 0 on every row, levels outside (0, 1).
    """
    where = "heldout_check"
    residual, variance, n_samples, lv = _heldout_inputs(y, mean, samples, variance, levels, where)
    if not 0.0 < float(image_rows_fraction) <= 1.0:
        raise ValueError(f"{where}: image_rows_fraction must lie in (0, 1], got {image_rows_fraction!r}")
    r, v, s2, g = check_rows(residual, variance, noise_variance, groups, where)
    m = r.size
    u = v + s2
    z = r / np.sqrt(u)
    z_abs = np.abs(z)
    joint = fit_variance_and_noise_scale(r, v, s2, groups=g, n_bootstrap=min(int(n_bootstrap), 100), seed=seed)
    image_rows = _image_rows_scale(r, v, s2, g, image_rows_fraction, n_bootstrap, seed)
    out = {
        "n_rows": int(m),
        "n_groups": int(len(np.unique(g))),
        "n_samples": n_samples,
        "levels": lv,
        "coverage": _coverage(z_abs, lv),
        "coverage_headline": headline_coverage(z_abs),
        "z": _z_summary(z, z_abs),
        "log_likelihood": float(np.mean(-0.5 * (_LOG_2PI + np.log(u) + r * r / u))),
        "log_likelihood_noise_only": float(np.mean(-0.5 * (_LOG_2PI + np.log(s2) + r * r / s2))),
        "image_variance_fraction": float(np.mean(v / u)),
        "mean_image_variance": float(v.mean()),
        "mean_noise_variance": float(s2.mean()),
        "scale_with_noise": joint,
        "scale_image_rows": image_rows,
    }
    if photon_variance is not None:
        out["scale_photon"] = _photon_scale(r, v, photon_variance, g, n_bootstrap, seed, where)
    return out


def _heldout_inputs(y, mean, samples, variance, levels, where: str):
    """``(y − mean, v, n_samples, levels)`` of :func:`heldout_check`'s arguments, checked: ``v`` from ``samples``
    (:func:`projected_variance`) when they are given (``n_samples`` then their count, else ``None``)."""
    yv = _as_float64(y, "y", where)
    mu = _as_float64(mean, "mean", where)
    if yv.ndim != 1:
        raise ValueError(f"{where}: y must have shape (m,) (flattened held-out rows), got {tuple(yv.shape)}")
    m = yv.size
    if mu.shape != (m,):
        raise ValueError(f"{where}: mean has shape {tuple(mu.shape)}; expected ({m},), the shape of y")
    if (samples is None) == (variance is None):
        raise ValueError(f"{where}: give exactly one of samples (k, m) and variance (m,)")
    n_samples = None
    if samples is not None:
        s = _as_float64(samples, "samples", where)
        if s.ndim != 2 or s.shape[1] != m or s.shape[0] < 1:
            raise ValueError(f"{where}: samples has shape {tuple(s.shape)}; expected (k, {m}) with k ≥ 1")
        n_samples = int(s.shape[0])
        variance = projected_variance(s)
    lv = [float(q) for q in levels]
    if not lv or any(not 0.0 < q < 1.0 for q in lv):
        raise ValueError(f"{where}: levels must lie in (0, 1), got {lv}")
    return yv - mu, variance, n_samples, lv


def _z_summary(z: np.ndarray, z_abs: np.ndarray) -> dict:
    """The report's ``z`` entry (:func:`heldout_check`): mean, std, tail fraction, 0.9 quantile of ``|z|`` and the
    histogram over :data:`Z_HISTOGRAM_EDGES`."""
    m = z.size
    density, _ = np.histogram(z, bins=np.asarray(Z_HISTOGRAM_EDGES), density=False)
    width = Z_HISTOGRAM_EDGES[1] - Z_HISTOGRAM_EDGES[0]
    return {
        "mean": float(z.mean()),
        "std": float(z.std()),
        "frac_abs_gt_3": float(np.mean(z_abs > 3.0)),
        "abs_quantile_0.9": float(np.quantile(z_abs, 0.9)),
        "histogram": {
            "edges": list(Z_HISTOGRAM_EDGES),
            "density": [float(c) / (m * width) for c in density],
            "below": float(np.mean(z < Z_HISTOGRAM_EDGES[0])),
            "above": float(np.mean(z > Z_HISTOGRAM_EDGES[-1])),
        },
    }


def _image_rows_scale(r, v, s2, g, image_rows_fraction: float, n_bootstrap: int, seed: int) -> dict:
    """``scale_image_rows`` (:func:`heldout_check`): :func:`fit_variance_scale` on the ``image_rows_fraction`` of
    the rows with the largest image-variance fraction, with their count, fraction and mean image-variance fraction."""
    share = v / (v + s2)
    # the rows where the image part is largest against the noise: k there depends least on the noise model
    top = np.argsort(-share, kind="stable")[: max(2, int(math.ceil(float(image_rows_fraction) * r.size)))]
    image_rows = fit_variance_scale(r[top], v[top], s2[top], groups=g[top], n_bootstrap=n_bootstrap, seed=seed)
    image_rows.update(
        {
            "n_rows": int(top.size),
            "fraction": float(image_rows_fraction),
            "image_variance_fraction": float(share[top].mean()),
        }
    )
    return image_rows


def _photon_scale(r, v, photon_variance, g, n_bootstrap: int, seed: int, where: str) -> dict:
    """``scale_photon`` (:func:`heldout_check`): :func:`fit_variance_scale` with the photon variances as the noise
    part, plus the image-variance fraction and the headline coverage at its ``k``."""
    m = r.size
    pv = _as_float64(photon_variance, "photon_variance", where)
    if pv.shape != (m,) or not np.all(np.isfinite(pv)) or np.any(pv <= 0):
        raise ValueError(f"{where}: photon_variance must be ({m},) finite values > 0, got shape {tuple(pv.shape)}")
    photon = fit_variance_scale(r, v, pv, groups=g, n_bootstrap=n_bootstrap, seed=seed)
    kp2 = photon["k"] ** 2
    photon["image_variance_fraction"] = float(np.mean(kp2 * v / (kp2 * v + pv)))
    photon["coverage_headline"] = headline_coverage(np.abs(r) / np.sqrt(kp2 * v + pv))
    return photon
