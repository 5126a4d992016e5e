"""The type-II MAP of the TV-PredCP hyperparameters (thesis Algorithm 5; ``docs/tv_predcp.md``): the set-up every
optimiser shares (an assembled ``Ψ₀``, the start at the block-averaged g-prior, the tap Gram matrices, one fixed set
of Hutchinson probes, the gradient oracle), the optimiser's run and the convergence record.

The objective, with the measurement covariance ``C(θ) = Ψ₀ L Lᵀ Ψ₀ᵀ / a + σ² I``,

    J(θ, σ²) = log N(ỹ; 0, C) + Σ_b log p_TV(t_b),

is maximised over ``θ = (log ℓ_b, log σ²_b)`` (and ``log σ²`` when the likelihood learns it) by a MacKay warm start
of the global scale, then projected L-BFGS with one fixed set of Hutchinson probes (:mod:`.lbfgs`), until a recorded
convergence criterion holds (:func:`fit_block_prior`). Its gradient: :mod:`.mll` (marginal likelihood) and
:mod:`.hyperprior`; the log-determinant itself is never computed: the trace records the hyperparameters, the data fit
``−½ ỹᵀ C⁻¹ ỹ``, the log hyperprior and the gradient norm.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ctuq.inference.features import DenseFeatures, FeatureOperator
from ctuq.inference.kernel import assemble_features
from ctuq.inference.priors.base import PriorError
from ctuq.inference.priors.tv_predcp.adam import fit_adam
from ctuq.inference.priors.tv_predcp.blocks import ASSEMBLE_LIMIT
from ctuq.inference.priors.tv_predcp.hyperprior import tap_grams
from ctuq.inference.priors.tv_predcp.lbfgs import fit_lbfgs
from ctuq.inference.priors.tv_predcp.mll import GradientOracle, block_gprior_variances, rademacher
from ctuq.inference.priors.tv_predcp.steps import CONVERGENCE_PATIENCE, convergence
from ctuq.utils import progress as _progress_bar

if TYPE_CHECKING:
    from ctuq.inference.priors.tv_predcp.model import TVPredCPModel

__all__ = ["fit_block_prior"]

RUNS = {"lbfgs": fit_lbfgs, "adam": fit_adam}  # uq.tv_predcp.optimizer (options.PriorFitOptimizer) → its run


def fit_block_prior(
    prior: TVPredCPModel,
    base: FeatureOperator,
    targets: torch.Tensor,
    *,
    a: float,
    sigma2: float,
    image_map: Callable[[torch.Tensor], torch.Tensor],
    learn_noise: bool = False,
    seed: int = 0,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    callback: Callable[[dict], None] | None = None,
) -> float:
    """Type-II MAP of ``prior``'s hyperparameters (module docstring); sets them, appends one record per step to
    ``prior.trace``, sets ``prior.convergence``, marks the prior fitted and returns the final ``σ²``.

    The variances start at ``prior``'s initial variance times :func:`~.mll.block_gprior_variances`. One set of
    ``prior.probes`` Rademacher probes serves every step, so the gradient is a deterministic function of the
    hyperparameters (fresh probes make it a random one whose noise keeps the iterates moving). Then, for
    ``prior.optimizer``:

    * ``"lbfgs"`` (default): (1) a MacKay warm start: steps that move only the *global* scale of the variances
      (all ``σ²_b`` by one factor) and, with ``learn_noise``, ``σ²`` by the updates the EM uses (``γ = c − σ² tr
      C⁻¹`` by Hutchinson, ``‖w*‖² = ‖Lᵀ Ψ₀ᵀ u‖²/a²``, variances × ``a γ⁻¹ ‖w*‖²``, ``σ² ← σ⁴‖u‖²/(c − γ)``),
      until both change by less than 10 % (at most 10 steps): the evidence's global scale is often orders of
      magnitude from any initial guess; (2) projected L-BFGS on ``x = (log ℓ_b, log σ²_b[, log σ²])`` in the box
      ``log ℓ_b ∈ [log LENGTHSCALE_MIN, log LENGTHSCALE_MAX]``, ``σ²_b ≥`` :func:`~.lbfgs.variance_floor` (below
      it a block changes ``log det C`` by less than 1; the 1×1 skip blocks' evidence optimum is at ``σ²_b → 0``),
      steps capped at ``prior.max_step`` per coordinate, a line search on the directional derivative only (no
      log-determinant value is computed): a step is halved (secant) while ``∂J`` along it turned to below ``−0.9``
      times its initial value (:mod:`.lbfgs`).
    * ``"adam"``: the first method: every step an Adam step (size ``prior.lr``, ``torch.optim.Adam``) on ``θ`` plus
      the MacKay updates (:mod:`.adam`).

    Convergence (:attr:`TVPredCPPrior.convergence`): every log-hyperparameter (and ``log σ²``) changed by at most
    ``prior.tol`` in each of the last ``CONVERGENCE_PATIENCE`` steps (relative changes below ``tol``); the fit
    stops there, or after ``prior.steps`` steps (then ``converged`` is false).

    ``base``: the (whitened) unscaled features ``Ψ₀`` (``c × d``, dense or matrix-free; a matrix-free one with
    ``c·d ≤ ASSEMBLE_LIMIT`` is assembled for the fit, ``min(c, d)`` products); ``targets``: ``ỹ``
    ``(c,)`` (whitened alike); ``a``: the global prior precision (held fixed; the variances carry the scale);
    ``image_map``: rows of network weights ``(B, d)`` → network outputs ``(B, prod(prior.image_shape))`` (``Φ``);
    ``seed``: probes, tap-Gram samples and preconditioner sketches. ``callback(record)`` after every step.
    Record keys: ``step``, ``phase`` (``"mackay"``, ``"lbfgs"`` or ``"adam"``), ``lengthscale`` / ``variance``
    (lists, :attr:`TVPredCPPrior.blocks` order of Matérn / all blocks), ``sigma2``, ``data_fit``,
    ``log_hyperprior``, ``kappa`` (per Matérn block), ``gamma``, ``mackay_scale``, ``grad_norm`` (of the free
    coordinates), ``max_change`` (largest change of a log-hyperparameter in the step), ``evaluations`` (gradients
    computed in the step), ``cg_max_iterations``, ``cg_max_residual``, ``time_s``.
    """
    say = log or (lambda _m: None)
    start = len(prior.trace)
    base = _assembled(base, say)
    oracle, g_var = _prepare(
        prior, base, targets, a=a, image_map=image_map, learn_noise=learn_noise, seed=seed, say=say
    )
    run = RUNS[prior.optimizer]
    bar = _progress_bar(total=prior.steps, desc="TV-PredCP fit", disable=not progress)
    emit = _emitter(prior, bar, callback, say)
    try:
        c = base.n_outputs
        s2 = run(prior, oracle, a=a, sigma2=float(sigma2), c=c, learn_noise=learn_noise, g_var=g_var, emit=emit)
    except FloatingPointError as exc:
        raise PriorError(
            f"uq.tv_predcp: the type-II MAP failed after {len(prior.trace) - start} steps: {exc}; a larger "
            f"uq.tv_predcp.precond_rank (now {prior.precond_rank}) makes its CG solves converge"
        ) from exc
    finally:
        bar.close()
    _record_convergence(prior, oracle, prior.trace[start:], say)
    prior.fitted = True
    return s2


def _assembled(base: FeatureOperator, say: Callable[[str], None]) -> FeatureOperator:
    """``base`` as :class:`DenseFeatures` when it is matrix-free with ``c·d ≤`` :data:`ASSEMBLE_LIMIT`: a fit takes
    ~100 gradients of ``1 + probes`` CG solves (~10 iterations each) plus preconditioner sketches, far more products
    than the ``min(c, d)`` that assemble ``Ψ₀`` once."""
    c = base.n_outputs
    if isinstance(base, DenseFeatures) or c * base.n_features > ASSEMBLE_LIMIT:
        return base
    t0 = time.perf_counter()
    base = DenseFeatures(assemble_features(base, by="auto").to(base.dtype))
    say(f"TV-PredCP: Ψ₀ ({c} × {base.n_features}) assembled for the fit: {time.perf_counter() - t0:.1f} s")
    return base


def _prepare(prior, base, targets, *, a, image_map, learn_noise, seed, say) -> tuple[GradientOracle, torch.Tensor]:
    """The start (variances × the block-averaged g-prior, for a fresh fit), the tap Gram matrices, the fixed probes
    (both drawn from one generator seeded with ``seed``, in that order) and the gradient oracle; returns ``(oracle,
    g_var)``, ``g_var`` from :func:`~.mll.block_gprior_variances`."""
    gen = torch.Generator().manual_seed(int(seed))
    g_var = block_gprior_variances(prior, base, seed=seed)
    if not prior.trace:
        theta = prior.theta()
        theta[len(prior.matern) :] += g_var.log()
        prior.set_theta(theta)
    t0 = time.perf_counter()
    grams = tap_grams(prior, image_map, n_samples=prior.tv_samples, generator=gen, dtype=base.dtype, device=base.device)
    say(
        f"TV-PredCP: tap Gram matrices of {len(grams)} blocks from {9 * prior.tv_samples} JVPs each: "
        f"{time.perf_counter() - t0:.1f} s"
    )
    probes = rademacher(prior.probes, base.n_outputs, gen, base.dtype, base.device)
    oracle = GradientOracle(prior, base, targets, a=a, grams=grams, probes=probes, learn_noise=learn_noise, seed=seed)
    return oracle, g_var


def _emitter(prior, bar, callback, say) -> Callable[[dict], None]:
    """``emit(record)``: numbers the record, appends it to ``prior.trace``, advances ``bar``, calls ``callback`` and
    logs one line every 10 steps (and at step 0)."""
    state = {"last_log": -10}

    def emit(record: dict) -> None:
        record["step"] = len(prior.trace)
        prior.trace.append(record)
        bar.update(1)
        if callback is not None:
            callback(record)
        k = record["step"]
        if k - state["last_log"] >= 10 or k == 0:
            state["last_log"] = k
            say(
                f"TV-PredCP step {k} ({record['phase']}): ℓ {', '.join(f'{v:.3g}' for v in record['lengthscale'])}; "
                f"σ²_b {', '.join(f'{v:.3g}' for v in record['variance'])}; σ² {record['sigma2']:.4g}; −½ỹᵀC⁻¹ỹ "
                f"{record['data_fit']:.5g}; log p_TV {record['log_hyperprior']:.4g}; γ {record['gamma']:.4g}; "
                f"max |Δ log| {record['max_change']:.2g}; CG ≤ {record['cg_max_iterations']} it."
            )

    return emit


def _record_convergence(prior, oracle: GradientOracle, trace: list[dict], say) -> None:
    """``prior.convergence``: the criterion over this fit's ``trace`` (:func:`~.steps.convergence`), its steps,
    gradients, optimiser and dense-fallback gradients; one log line."""
    conv = convergence(trace, prior.tol)
    conv.update(
        steps=len(trace),
        evaluations=oracle.evaluations,
        optimizer=prior.optimizer,
        # gradients solved again with the dense C⁻¹ after the low-rank preconditioner failed (EXACT_FALLBACK_ROWS)
        exact_fallbacks=oracle.exact_fallbacks,
    )
    prior.convergence = conv
    say(
        f"TV-PredCP fit {'converged' if conv['converged'] else 'did NOT converge'} after {len(trace)} steps "
        f"({oracle.evaluations} gradients): largest change of a log-hyperparameter over the last "
        f"{CONVERGENCE_PATIENCE} steps {'n/a' if conv['max_change'] is None else format(conv['max_change'], '.2g')} "
        f"(tolerance {prior.tol:g})"
    )
