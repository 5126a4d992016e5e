"""The TV-PredCP fit's default optimiser (``uq.tv_predcp.optimizer = lbfgs``): a MacKay warm start of the global
scale, then projected L-BFGS in a box with a line search on the directional derivative only.

Written out rather than taken from a library because the fit has gradients but no values of its objective: the
log-determinant is never computed and the gradient is a fixed-probe Hutchinson estimate, which is not the gradient of
any scalar the fit could evaluate. ``torch.optim.LBFGS(line_search_fn="strong_wolfe")`` and SciPy's ``L-BFGS-B`` both
test sufficient decrease on values; given the exact value (dense, small ``c`` only) and this gradient they stopped
elsewhere, needed more gradients, and stopped or stepped to non-finite values after a gradient the oracle refused
(``docs/tv_predcp.md``, "Library or written-out optimiser"). This line search instead shortens such a step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ctuq.inference.priors.tv_predcp.blocks import LENGTHSCALE_MAX, LENGTHSCALE_MIN
from ctuq.inference.priors.tv_predcp.steps import CONVERGENCE_PATIENCE, convergence, mackay, record

if TYPE_CHECKING:
    from ctuq.inference.priors.tv_predcp.mll import GradientOracle
    from ctuq.inference.priors.tv_predcp.model import TVPredCPModel

__all__ = ["fit_lbfgs", "mackay_warm_start", "variance_floor", "MACKAY_WARMUP", "LBFGS_MEMORY", "LINE_SEARCH_TRIES"]

VARIANCE_FLOOR = 1.0  # a block's largest negligible share of tr C, in units of σ² (variance_floor)
MACKAY_WARMUP = 10  # at most this many global-scale steps before L-BFGS
LBFGS_MEMORY = 10  # curvature pairs kept
LBFGS_FIRST_STEP = 0.1  # largest coordinate change of the first (gradient) step, in log units
LINE_SEARCH_TRIES = 6


@dataclasses.dataclass
class _Point:
    """An iterate ``x = (θ[, log σ²])`` with what the oracle returned there."""

    x: torch.Tensor
    g: torch.Tensor
    info: dict
    hp: float
    details: list


def variance_floor(prior: TVPredCPModel, g_var: torch.Tensor, *, a: float, sigma2: float) -> torch.Tensor:
    """Lower bounds ``(n_blocks,)`` float64 of ``log σ²_b``: the variance at which block ``b`` adds
    ``VARIANCE_FLOOR σ²`` (``σ²``) to the trace of ``C`` (its ``tr Ψ₀_b Ψ₀_bᵀ σ²_b / a``, with independent taps), so
    that it changes ``log det C`` by at most 1. The evidence of the U-Net's 1×1 skip blocks has its optimum at
    ``σ²_b → 0``, which a log-parametrised fit approaches without end (and slowly: the gradient vanishes with
    ``σ²_b``); at the floor the coordinate stops. Measured on a 32² walnut case: the exact MAP objective at the
    floor is 0.09 nats below the one at ``σ²_b → 0`` (0.009 at a 10× lower floor, which left the 64² fit still
    walking down after 100 steps), well inside the 4-nat bias of 8 fixed Hutchinson probes.
    ``g_var``: :func:`~ctuq.inference.priors.tv_predcp.mll.block_gprior_variances` (``1 / mean ‖Ψ₀[:, i]‖²`` per
    block)."""
    n = torch.tensor([float(b.n_weights) for b in prior.blocks], dtype=torch.float64)
    return torch.log(VARIANCE_FLOOR * a * sigma2 * g_var / n)


def fit_lbfgs(prior, oracle, *, a, sigma2, c, learn_noise, g_var, emit) -> float:
    """The MacKay warm start (:func:`mackay_warm_start`), then projected L-BFGS on ``x = (θ[, log σ²])`` until the
    convergence criterion holds or ``prior.steps`` steps are taken; ``emit(record)`` after every step. Returns the
    final ``σ²``; raises ``FloatingPointError`` when no step works."""
    s2, steps = mackay_warm_start(prior, oracle, a=a, sigma2=sigma2, c=c, learn_noise=learn_noise, emit=emit)
    return _projected_lbfgs(prior, oracle, a=a, s2=s2, learn_noise=learn_noise, g_var=g_var, emit=emit, steps=steps)


def mackay_warm_start(prior, oracle, *, a, sigma2, c, learn_noise, emit) -> tuple[float, int]:
    """Steps that move only the *global* scale of the variances and ``σ²`` (:func:`~.steps.mackay`), until both change
    by less than 10 % (at most :data:`MACKAY_WARMUP`): the evidence's global scale is often orders of magnitude from
    any initial guess. Returns ``(σ², steps taken)``."""
    m, n = len(prior.matern), prior.n_hyper
    s2 = sigma2
    steps = 0
    for _ in range(min(MACKAY_WARMUP, prior.steps)):
        t0 = time.perf_counter()
        theta = prior.theta()
        g, info, hp, details = oracle(theta, s2)
        scale, s2_new = mackay(info, a=a, c=c, s2=s2, learn_noise=learn_noise)
        theta[m:] += math.log(scale)
        oracle.since *= scale
        change = max(abs(math.log(scale)), abs(math.log(s2_new / s2)))
        prior.set_theta(theta)
        emit(record(prior, info, hp, details, s2_new, g[:n], "mackay", scale, change, 1, t0))
        s2 = s2_new
        steps += 1
        if change < 0.1:
            break
    return s2, steps


def _box(prior, g_var, *, a, s2, learn_noise) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` of ``x``: ``log ℓ_b ∈ [log LENGTHSCALE_MIN, log LENGTHSCALE_MAX]``, ``log σ²_b ≥``
    :func:`variance_floor`, ``log σ²`` free."""
    m, n = len(prior.matern), prior.n_hyper
    f64 = torch.float64
    lo = torch.cat(
        [torch.full((m,), math.log(LENGTHSCALE_MIN), dtype=f64), variance_floor(prior, g_var, a=a, sigma2=s2)]
    )
    hi = torch.cat([torch.full((m,), math.log(LENGTHSCALE_MAX), dtype=f64), torch.full((n - m,), math.inf, dtype=f64)])
    if learn_noise:
        lo, hi = torch.cat([lo, torch.tensor([-math.inf])]), torch.cat([hi, torch.tensor([math.inf])])
    return lo, hi


def _free(point: _Point, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The coordinates not held at a bound that the gradient pushes against."""
    x, g = point.x, point.g
    return ~(((x <= lo) & (g < 0)) | ((x >= hi) & (g > 0)))


def _projected_lbfgs(prior, oracle, *, a, s2, learn_noise, g_var, emit, steps) -> float:
    m, n = len(prior.matern), prior.n_hyper
    lo, hi = _box(prior, g_var, a=a, s2=s2, learn_noise=learn_noise)

    def split(x):
        return x[:n], (math.exp(float(x[n])) if learn_noise else s2)

    x = prior.theta()
    x[m:] = torch.maximum(x[m:], lo[m:n])
    if learn_noise:
        x = torch.cat([x, torch.tensor([math.log(s2)], dtype=torch.float64)])
    point = _Point(x, *oracle(*split(x)))
    s2 = split(x)[1]
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    while steps < prior.steps:
        t0 = time.perf_counter()
        free = _free(point, lo, hi)
        gf = torch.where(free, point.g, torch.zeros_like(point.g))
        if float(gf.abs().max()) == 0.0:
            break  # every coordinate at a bound it is pushed against: a stationary point of the box problem
        new, evaluations = _search(prior, oracle, split, point, gf, free, pairs, lo, hi, steps)
        s_vec, y_vec = new.x - point.x, -(new.g - point.g)
        if float(s_vec @ y_vec) > 1e-10 * float(s_vec.norm() * y_vec.norm()):
            pairs.append((s_vec, y_vec))
            del pairs[:-LBFGS_MEMORY]
        point = new
        theta, s2 = split(point.x)
        prior.set_theta(theta)
        gfree = torch.where(_free(point, lo, hi), point.g, torch.zeros_like(point.g))
        change = float(s_vec.abs().max())
        emit(record(prior, point.info, point.hp, point.details, s2, gfree, "lbfgs", 1.0, change, evaluations, t0))
        steps += 1
        recent = prior.trace[-CONVERGENCE_PATIENCE:]
        if all(r["phase"] == "lbfgs" for r in recent) and convergence(recent, prior.tol)["converged"]:
            break
    return s2


def _direction(gf: torch.Tensor, free: torch.Tensor, pairs: list, max_step: float) -> torch.Tensor:
    """The L-BFGS ascent direction on the free coordinates (a gradient step without curvature pairs, or when the
    pairs do not give an ascent direction: then they are forgotten), capped at ``max_step`` per coordinate."""
    p = _two_loop(gf, pairs) if pairs else _gradient_step(gf)
    p = torch.where(free, p, torch.zeros_like(p))
    if float(gf @ p) <= 0:  # the curvature pairs do not give an ascent direction: restart
        pairs.clear()
        p = _gradient_step(gf)
    p *= min(1.0, max_step / float(p.abs().max()))
    return p


def _search(prior, oracle, split, point, gf, free, pairs, lo, hi, step) -> tuple[_Point, int]:
    """The next iterate by a line search along :func:`_direction`, else along a short gradient step with the
    curvature pairs forgotten; ``(point, gradients computed)``. ``FloatingPointError`` (the prior set back to
    ``point``) when both fail."""
    p = _direction(gf, free, pairs, prior.max_step)
    found, evaluations, alpha = _line_search(oracle, split, point, p, lo, hi)
    if found is None and pairs:
        # the curvature pairs can point far off once the objective's curvature has changed (a block variance
        # moved by orders of magnitude): forget them and take a short gradient step, as at the start, before
        # giving up (measured: a per-ray 64² walnut fit stopped here at step 36 with 10 pairs)
        pairs.clear()
        p = _gradient_step(gf)
        found, more, alpha = _line_search(oracle, split, point, p, lo, hi)
        evaluations += more
    if found is None:
        prior.set_theta(point.x[: prior.n_hyper])
        raise FloatingPointError(
            f"TV-PredCP fit step {step}: no step along the L-BFGS direction or the gradient gave a finite "
            f"gradient that does not overshoot (last step size {alpha:.3g})"
        )
    return found, evaluations


def _two_loop(g: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """L-BFGS direction ``H g`` (``H``: the inverse-Hessian estimate of ``−J`` from ``pairs`` ``(s, y)``, with
    ``y = −Δ∂J``), an ascent direction of ``J`` (Nocedal & Wright, Algorithm 7.4)."""
    q = g.clone()
    alphas = []
    for s_, y_ in reversed(pairs):
        rho = 1.0 / float(y_ @ s_)
        al = rho * float(s_ @ q)
        q -= al * y_
        alphas.append((rho, al))
    s_, y_ = pairs[-1]
    q *= float(s_ @ y_) / float(y_ @ y_)
    for (s_, y_), (rho, al) in zip(pairs, reversed(alphas)):
        q += (al - rho * float(y_ @ q)) * s_
    return q


def _gradient_step(gf: torch.Tensor) -> torch.Tensor:
    """The short steepest-ascent step along the projected gradient ``gf`` (zero on coordinates held at a bound) that
    starts and restarts L-BFGS: its largest coordinate change is :data:`LBFGS_FIRST_STEP` log units."""
    return gf * (LBFGS_FIRST_STEP / float(gf.abs().max()))


def _line_search(
    oracle: GradientOracle, split: Callable, point: _Point, p: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[_Point | None, int, float]:
    """Backtracking along the ascent direction ``p`` from ``point`` inside the box ``[lo, hi]``: the first step whose
    gradient is finite and has not turned below ``−0.9×`` the initial directional derivative. Returns
    ``(found, evaluations, alpha)``, ``found`` ``None`` when :data:`LINE_SEARCH_TRIES` steps all failed."""
    x, g = point.x, point.g
    alpha = 1.0
    for tries in range(1, LINE_SEARCH_TRIES + 1):
        x_new = torch.minimum(torch.maximum(x + alpha * p, lo), hi)
        try:
            g_new, info_new, hp_new, details_new = oracle(*split(x_new))
        except (FloatingPointError, torch.linalg.LinAlgError):
            alpha *= 0.25
            continue
        dx = x_new - x
        d0, d1 = float(g @ dx), float(g_new @ dx)
        if d1 >= -0.9 * d0:
            return _Point(x_new, g_new, info_new, hp_new, details_new), tries, alpha
        alpha *= min(0.5, max(0.1, d0 / (d0 - d1)))  # secant zero of ∂J along the step
    return None, LINE_SEARCH_TRIES, alpha
