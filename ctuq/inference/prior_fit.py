"""Type-II MAP of a block prior's hyperparameters: log marginal likelihood plus the TV-PredCP hyperprior, with
log-determinant gradients by preconditioned CG and Hutchinson probes (thesis Algorithm 5).

The linearised model with a block prior ``v = L(θ) w``, ``w ~ N(0, a⁻¹ I)`` (:mod:`ctuq.priors.tv_predcp`) has the
measurement covariance ``C(θ) = Ψ₀ L Lᵀ Ψ₀ᵀ / a + σ² I`` (``Ψ₀`` whitened where the noise is per-ray) and the
objective

    J(θ, σ²) = log N(ỹ; 0, C) + Σ_b log p_TV(t_b),

maximised over ``θ = (log ℓ_b, log σ²_b)`` (and ``log σ²`` when the likelihood learns it) by a MacKay warm start of
the global scale, then projected L-BFGS with one fixed set of Hutchinson probes, until a recorded convergence
criterion holds (:func:`fit_block_prior`; ``docs/tv_predcp.md`` has the measurements behind it). With
``u = C⁻¹ ỹ`` its marginal-likelihood gradient is ``∂ log N = ½ uᵀ ∂C u − ½ tr(C⁻¹ ∂C)``, and for the prior
hyperparameters ``∂C = Ψ₀ ∂(L Lᵀ) Ψ₀ᵀ / a``, so with ``r = Ψ₀ᵀ u`` and Rademacher probes ``z_k``
(``E[z zᵀ] = I``), ``p_k = Ψ₀ᵀ C⁻¹ z_k``, ``q_k = Ψ₀ᵀ z_k``::

    ∂ log N / ∂θ ≈ ∂/∂θ [ ½ ‖Lᵀ r‖² / a − (1/2m) Σ_k (Lᵀ p_k)·(Lᵀ q_k) / a ]   (r, p_k, q_k held fixed),

which autograd evaluates through the ``9 × 9`` factors of ``L`` at no Jacobian cost; ``∂ log N / ∂ log σ² =
½ σ² ‖u‖² − (σ²/2m) Σ_k z_kᵀ C⁻¹ z_k``. A step is one batched CG solve of ``1 + m`` right-hand sides (the core's
:func:`~ctuq.inference.solvers.cg.pcg` with a Nyström preconditioner of ``K̄(θ)``, :func:`~ctuq.inference.solvers.
preconditioners.randomized_eig`, rebuilt every ``precond_every`` gradients because ``K̄`` moves with ``θ``; during
the MacKay warm start its eigenvalues follow the global scale of the variances exactly),
and ``1 + 2m`` VJPs of ``Ψ₀``; the hyperprior costs ``9 n`` JVPs per Matérn block once, for its tap Gram matrices
(:func:`~ctuq.priors.tv_predcp.tap_grams`), and nothing per step (:func:`~ctuq.priors.tv_predcp.tv_predcp_terms`).
The log-determinant itself is never computed: the trace records the hyperparameters, the data fit ``−½ ỹᵀ C⁻¹ ỹ``,
the log hyperprior and the gradient norm.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from ctuq.inference.block_features import BlockFeatures
from ctuq.inference.features import DenseFeatures, FeatureOperator
from ctuq.inference.kernel import KernelOperator, assemble_features
from ctuq.inference.solvers.cg import pcg
from ctuq.inference.solvers.preconditioners import LowRankEig, LowRankPreconditioner, randomized_eig
from ctuq.priors import column_sq_norms
from ctuq.priors.tv_predcp import (
    LENGTHSCALE_MAX,
    LENGTHSCALE_MIN,
    PriorError,
    TVPredCPPrior,
    tap_grams,
    tv_predcp_terms,
)
from ctuq.utils import progress as _progress_bar

__all__ = ["mll_gradient", "fit_block_prior", "block_gprior_variances", "variance_floor", "CONVERGENCE_PATIENCE"]


def _rademacher(m: int, c: int, generator: torch.Generator, dtype, device) -> torch.Tensor:
    z = torch.randint(0, 2, (m, c), generator=generator, dtype=torch.int8)
    return (2 * z - 1).to(device=device, dtype=dtype)


def mll_gradient(
    prior: TVPredCPPrior,
    base: FeatureOperator,
    targets: torch.Tensor,
    *,
    a: float,
    sigma2: float,
    n_probes: int,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    learn_noise: bool = False,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rtol: float = 1e-3,
    max_iter: int = 300,
) -> tuple[torch.Tensor, dict]:
    """Stochastic gradient of ``log N(ỹ; 0, C(θ))`` (module docstring) at the prior's current hyperparameters.

    Returns ``(g, info)``: ``g`` ``(n_hyper [+ 1],)`` float64 in :meth:`TVPredCPPrior.theta` order, then
    ``∂/∂ log σ²`` when ``learn_noise``; ``info``: ``data_fit`` (``−½ ỹᵀC⁻¹ỹ``), MacKay's ``gamma``
    (``c − σ² tr C⁻¹``), ``weight_norm_sq`` (``‖w*‖²``) and ``residual_norm_sq`` (``‖ỹ − Ψw*‖²``),
    ``cg_max_iterations``, ``cg_max_residual``. ``base``: the (whitened) ``Ψ₀``; ``targets`` ``(c,)``; the
    Rademacher probes ``probes`` ``(n_probes, c)`` when given (the fit keeps one set for all its steps: a
    deterministic gradient field), else drawn from ``generator`` (CPU).
    """
    c = base.n_outputs
    F = BlockFeatures(base, prior)
    y = targets.to(device=base.device, dtype=base.dtype)
    if probes is None:
        if generator is None:
            raise ValueError("mll_gradient: give probes or a generator to draw them from")
        Z = _rademacher(n_probes, c, generator, base.dtype, base.device)
    else:
        if tuple(probes.shape) != (n_probes, c):
            raise ValueError(f"mll_gradient: probes must be ({n_probes}, {c}), got {tuple(probes.shape)}")
        Z = probes.to(device=base.device, dtype=base.dtype)

    def matmul(X: torch.Tensor) -> torch.Tensor:
        return F.matvec(F.rmatvec(X)) / a + sigma2 * X

    V, stats = pcg(
        matmul, torch.cat([y[None], Z]), preconditioner=preconditioner, rtol=rtol, max_iter=max_iter, warn=False
    )
    U, Vz = V[0], V[1:]
    G = base.rmatvec(torch.cat([U[None], Vz, Z])).double()
    r, P, Q = G[0:1], G[1 : 1 + n_probes], G[1 + n_probes :]
    theta = prior.theta().requires_grad_(True)
    factors = prior.factors(theta)
    fit = 0.5 * prior.apply_t(r, factors).pow(2).sum() / a
    trace = 0.5 * (prior.apply_t(P, factors) * prior.apply_t(Q, factors)).sum() / (n_probes * a)
    (g,) = torch.autograd.grad(fit - trace, theta)
    g = g.detach()
    u = U.double()
    if learn_noise:
        g_noise = 0.5 * sigma2 * float(u @ u) - 0.5 * sigma2 * float((Z.double() * Vz.double()).sum()) / n_probes
        g = torch.cat([g, torch.tensor([g_noise], dtype=torch.float64)])
    info = {
        "data_fit": -0.5 * float(u @ y.double()),
        # for MacKay's updates: γ = c − σ² tr C⁻¹, ‖w*‖² = ‖Lᵀ Ψ₀ᵀ u‖²/a², ‖ỹ − Ψw*‖² = σ⁴‖u‖²
        "gamma": c - sigma2 * float((Z.double() * Vz.double()).sum()) / n_probes,
        "weight_norm_sq": float(prior.apply_t(r).pow(2).sum()) / a**2,
        "residual_norm_sq": sigma2**2 * float(u @ u),
        "cg_max_iterations": stats.max_iterations,
        "cg_max_residual": float(stats.relative_residual.max()),
    }
    return g, info


def block_gprior_variances(prior: TVPredCPPrior, base: FeatureOperator, *, seed: int = 0, probes: int = 64):
    """Initial variances ``σ²_b = 1 / mean_{i∈b} ‖Ψ₀[:, i]‖²`` ``(n_blocks,)`` float64: the g-prior averaged over each
    block (every weight's prior variance in units of its effect on the data). Exact column norms for dense ``Ψ₀``,
    else ``probes`` Rademacher probes (:func:`~ctuq.priors.column_sq_norms`, ``probes`` VJPs)."""
    if isinstance(base, DenseFeatures):
        sq = base.matrix.double().pow(2).sum(0)
    else:
        sq = column_sq_norms(
            base.rmatvec,
            base.n_outputs,
            method="stochastic",
            n_probes=probes,
            seed=seed,
            dtype=base.dtype,
            device=base.device,
        )
    sq = sq.double().cpu()
    out = []
    for b in prior.blocks:
        mean = float(torch.cat([sq[lo:hi] for lo, hi in b.segments]).mean())
        out.append(1.0 / mean if mean > 0 else 1.0)
    return torch.tensor(out, dtype=torch.float64)


class _GradientOracle:
    """``∂J/∂x`` of the MAP objective at ``x = (θ[, log σ²])`` (module docstring) with one fixed set of Hutchinson
    probes, the tap Gram matrices and a Nyström preconditioner rebuilt every ``precond_every`` evaluations; also
    what the MacKay updates and the trace need (``info``, the log hyperprior, ``κ_b``)."""

    def __init__(self, prior, base, targets, *, a, grams, probes, learn_noise, seed):
        self.prior, self.base, self.targets, self.a = prior, base, targets, a
        self.grams, self.probes, self.learn_noise, self.seed = grams, probes, learn_noise, int(seed)
        self.features = BlockFeatures(base, prior)
        self.rank = min(prior.precond_rank, base.n_outputs)
        self.evaluations = 0
        self.exact_fallbacks = 0
        self.eig = None
        self.since = 1.0  # global variance factor applied since the last rebuild: K̄ scales by it exactly

    def __call__(self, theta: torch.Tensor, sigma2: float):
        prior = self.prior
        prior.set_theta(theta)
        fresh = self.evaluations % prior.precond_every == 0
        if fresh:
            self._rebuild()
        self.evaluations += 1
        g, info = self._gradient(sigma2)
        if info["cg_max_residual"] > CG_FAILURE * prior.cg_tol and not fresh:
            # a preconditioner built for hyperparameters far from these can stall or derail CG (measured: rank 100
            # on the 64² walnut, residuals 10³ after a block variance grew ×1000): rebuild it here and solve again
            self._rebuild()
            g, info = self._gradient(sigma2)
        if info["cg_max_residual"] > CG_FAILURE * prior.cg_tol and self.base.n_outputs <= EXACT_FALLBACK_ROWS:
            # a fresh low-rank preconditioner that still fails leaves too much of K̄'s spectrum above σ² (measured:
            # per-ray 64² scans at 60 angles, rank 400 and 1000, CG at its cap from step ~35): with few rows, C⁻¹
            # itself by a dense Cholesky preconditions exactly, at the cost of c products of K̄ per gradient
            g, info = self._gradient(sigma2, preconditioner=self._exact_inverse(sigma2))
            self.exact_fallbacks += 1
        if info["cg_max_residual"] > CG_FAILURE * prior.cg_tol:
            raise FloatingPointError(
                f"TV-PredCP fit: CG did not converge (relative residual {info['cg_max_residual']:.3g} after "
                f"{info['cg_max_iterations']} iterations, tolerance {prior.cg_tol:g})"
            )
        hp, g_hp, details = tv_predcp_terms(prior, self.grams, a=self.a)
        g[: prior.n_hyper] += g_hp
        if not torch.isfinite(g).all():
            raise FloatingPointError(f"TV-PredCP fit: the gradient is not finite at θ = {theta.tolist()}")
        return g, info, hp, details

    def _rebuild(self) -> None:
        self.eig = randomized_eig(KernelOperator(features=self.features), self.rank, seed=self.seed + self.evaluations)
        self.since = 1.0

    def _exact_inverse(self, sigma2: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """``R ↦ C⁻¹ R`` for rows ``R`` ``(k, c)``, ``C = K̄/a + σ²I`` assembled from ``c`` products of ``K̄`` (unit
        rows) and factored by Cholesky in float64."""
        base = self.base
        eye = torch.eye(base.n_outputs, dtype=base.dtype, device=base.device)
        K = self.features.matvec(self.features.rmatvec(eye)).double()
        C = 0.5 * (K + K.T) / self.a + sigma2 * torch.eye(base.n_outputs, dtype=torch.float64, device=base.device)
        factor = torch.linalg.cholesky(C)

        def apply(R: torch.Tensor) -> torch.Tensor:
            return torch.cholesky_solve(R.double().T, factor).T.to(R.dtype)

        return apply

    def _gradient(self, sigma2: float, preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None):
        prior = self.prior
        if preconditioner is None:
            eig = LowRankEig(self.eig.U, self.eig.eigenvalues * self.since, self.eig.n_products, self.eig.method)
            preconditioner = LowRankPreconditioner(eig).inverse(self.a, sigma2)
        return mll_gradient(
            prior,
            self.base,
            self.targets,
            a=self.a,
            sigma2=sigma2,
            n_probes=prior.probes,
            probes=self.probes,
            learn_noise=self.learn_noise,
            preconditioner=preconditioner,
            rtol=prior.cg_tol,
            max_iter=prior.cg_max_iter,
        )


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


def fit_block_prior(
    prior: TVPredCPPrior,
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

    The variances start at ``prior``'s initial variance times :func:`block_gprior_variances`. One set of
    ``prior.probes`` Rademacher probes serves every step, so the gradient is a deterministic function of the
    hyperparameters (fresh probes make it a random one whose noise keeps the iterates moving). Then, for
    ``prior.optimizer``:

    * ``"lbfgs"`` (default): (1) a MacKay warm start: steps that move only the *global* scale of the variances
      (all ``σ²_b`` by one factor) and, with ``learn_noise``, ``σ²`` by the updates the EM uses (``γ = c − σ² tr
      C⁻¹`` by Hutchinson, ``‖w*‖² = ‖Lᵀ Ψ₀ᵀ u‖²/a²``, variances × ``a γ⁻¹ ‖w*‖²``, ``σ² ← σ⁴‖u‖²/(c − γ)``),
      until both change by less than 10 % (at most 10 steps): the evidence's global scale is often orders of
      magnitude from any initial guess; (2) projected L-BFGS on ``x = (log ℓ_b, log σ²_b[, log σ²])`` in the box
      ``log ℓ_b ∈ [log LENGTHSCALE_MIN, log LENGTHSCALE_MAX]``, ``σ²_b ≥`` :func:`variance_floor` (below it a block
      changes ``log det C`` by less than 1; the 1×1 skip blocks' evidence optimum is at ``σ²_b → 0``),
      steps capped at ``prior.max_step`` per coordinate, a line search on the directional derivative only (no
      log-determinant value is computed): a step is halved (secant) while ``∂J`` along it turned to below ``−0.9``
      times its initial value.
    * ``"adam"``: the first method: every step an Adam step (size ``prior.lr``) on ``θ`` plus the MacKay updates.

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
    gen = torch.Generator().manual_seed(int(seed))
    c = base.n_outputs
    start = len(prior.trace)
    if not isinstance(base, DenseFeatures) and c * base.n_features <= ASSEMBLE_LIMIT:
        # a fit takes ~100 gradients of 1 + probes CG solves (~10 iterations each) plus preconditioner sketches:
        # far more products than the min(c, d) that assemble Ψ₀ once
        t0 = time.perf_counter()
        base = DenseFeatures(assemble_features(base, by="auto").to(base.dtype))
        say(f"TV-PredCP: Ψ₀ ({c} × {base.n_features}) assembled for the fit: {time.perf_counter() - t0:.1f} s")
    g_var = block_gprior_variances(prior, base, seed=seed)
    if start == 0:
        theta = prior.theta()
        theta[len(prior.matern) :] += g_var.log()
        prior.set_theta(theta)
    t0 = time.perf_counter()
    grams = tap_grams(prior, image_map, n_samples=prior.tv_samples, generator=gen, dtype=base.dtype, device=base.device)
    say(
        f"TV-PredCP: tap Gram matrices of {len(grams)} blocks from {9 * prior.tv_samples} JVPs each: "
        f"{time.perf_counter() - t0:.1f} s"
    )
    probes = _rademacher(prior.probes, c, gen, base.dtype, base.device)
    oracle = _GradientOracle(prior, base, targets, a=a, grams=grams, probes=probes, learn_noise=learn_noise, seed=seed)
    run = _fit_adam if prior.optimizer == "adam" else _fit_lbfgs
    bar = _progress_bar(total=prior.steps, desc="TV-PredCP fit", disable=not progress)
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

    try:
        s2 = run(prior, oracle, a=a, sigma2=float(sigma2), c=c, learn_noise=learn_noise, g_var=g_var, emit=emit)
    except FloatingPointError as exc:
        raise PriorError(
            f"uq.tv_predcp: the type-II MAP failed after {len(prior.trace) - start} steps: {exc}; a larger "
            f"uq.tv_predcp.precond_rank (now {prior.precond_rank}) makes its CG solves converge"
        ) from exc
    finally:
        bar.close()
    trace = prior.trace[start:]
    conv = _convergence(trace, prior.tol)
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
    prior.fitted = True
    return s2


CONVERGENCE_PATIENCE = 3  # steps in a row whose changes must all be below the tolerance


def _convergence(trace: list[dict], tol: float) -> dict:
    """``converged`` when each of the last :data:`CONVERGENCE_PATIENCE` records changed every log-hyperparameter
    by at most ``tol``; ``max_change`` is the largest such change over those records (``None`` if too few)."""
    last = [r["max_change"] for r in trace[-CONVERGENCE_PATIENCE:]]
    worst = max(last) if len(last) == CONVERGENCE_PATIENCE else None
    return {
        "converged": worst is not None and worst <= tol,
        "criterion": f"max |Δ log hyperparameter| <= {tol:g} in each of the last {CONVERGENCE_PATIENCE} steps",
        "max_change": worst,
        "tolerance": tol,
    }


def variance_floor(prior: TVPredCPPrior, g_var: torch.Tensor, *, a: float, sigma2: float) -> torch.Tensor:
    """Lower bounds ``(n_blocks,)`` float64 of ``log σ²_b``: the variance at which block ``b`` adds
    ``VARIANCE_FLOOR σ²`` (``σ²``) to the trace of ``C`` (its ``tr Ψ₀_b Ψ₀_bᵀ σ²_b / a``, with independent taps), so
    that it changes ``log det C`` by at most 1. The evidence of the U-Net's 1×1 skip blocks has its optimum at
    ``σ²_b → 0``, which a log-parametrised fit approaches without end (and slowly: the gradient vanishes with
    ``σ²_b``); at the floor the coordinate stops. Measured on a 32² walnut case: the exact MAP objective at the
    floor is 0.09 nats below the one at ``σ²_b → 0`` (0.009 at a 10× lower floor, which left the 64² fit still
    walking down after 100 steps), well inside the 4-nat bias of 8 fixed Hutchinson probes.
    ``g_var``: :func:`block_gprior_variances` (``1 / mean ‖Ψ₀[:, i]‖²`` per block)."""
    n = torch.tensor([float(b.n_weights) for b in prior.blocks], dtype=torch.float64)
    return torch.log(VARIANCE_FLOOR * a * sigma2 * g_var / n)


def _record(prior, info, hp, details, s2, g, *, phase, scale, change, evaluations, t0) -> dict:
    return {
        "phase": phase,
        "lengthscale": prior.log_lengthscale.exp().tolist(),
        "variance": prior.log_variance.exp().tolist(),
        "sigma2": s2,
        "data_fit": info["data_fit"],
        "log_hyperprior": hp,
        "kappa": [dd["kappa"] for dd in details],
        "gamma": info["gamma"],
        "mackay_scale": scale,
        "grad_norm": float(g.norm()),
        "max_change": change,
        "evaluations": evaluations,
        "cg_max_iterations": info["cg_max_iterations"],
        "cg_max_residual": info["cg_max_residual"],
        "time_s": time.perf_counter() - t0,
    }


def _mackay(info: dict, *, a: float, c: int, s2: float, learn_noise: bool) -> tuple[float, float]:
    """MacKay's factor on all variances and the new ``σ²`` (``(1, σ²)`` where ``γ`` is not a usable estimate)."""
    gamma, wnorm = info["gamma"], info["weight_norm_sq"]
    if not (0 < gamma < c and wnorm > 0):
        return 1.0, s2
    return a / (gamma / wnorm), (info["residual_norm_sq"] / (c - gamma) if learn_noise else s2)


def _fit_lbfgs(prior, oracle, *, a, sigma2, c, learn_noise, g_var, emit) -> float:
    m, n = len(prior.matern), prior.n_hyper
    s2 = sigma2
    steps = 0
    # (1) MacKay warm start of the global scale and σ²
    for _ in range(min(MACKAY_WARMUP, prior.steps)):
        t0 = time.perf_counter()
        theta = prior.theta()
        g, info, hp, details = oracle(theta, s2)
        scale, s2_new = _mackay(info, a=a, c=c, s2=s2, learn_noise=learn_noise)
        theta[m:] += math.log(scale)
        oracle.since *= scale
        change = max(abs(math.log(scale)), abs(math.log(s2_new / s2)))
        prior.set_theta(theta)
        emit(
            _record(
                prior,
                info,
                hp,
                details,
                s2_new,
                g[:n],
                phase="mackay",
                scale=scale,
                change=change,
                evaluations=1,
                t0=t0,
            )
        )
        s2 = s2_new
        steps += 1
        if change < 0.1:
            break
    # (2) projected L-BFGS on x = (θ[, log σ²])
    lo = torch.cat(
        [
            torch.full((m,), math.log(LENGTHSCALE_MIN), dtype=torch.float64),
            variance_floor(prior, g_var, a=a, sigma2=s2),
        ]
    )
    hi = torch.cat(
        [
            torch.full((m,), math.log(LENGTHSCALE_MAX), dtype=torch.float64),
            torch.full((n - m,), math.inf, dtype=torch.float64),
        ]
    )
    if learn_noise:
        lo, hi = torch.cat([lo, torch.tensor([-math.inf])]), torch.cat([hi, torch.tensor([math.inf])])

    def split(x):
        return x[:n], (math.exp(float(x[n])) if learn_noise else s2)

    x = prior.theta()
    x[m:] = torch.maximum(x[m:], lo[m:n])
    if learn_noise:
        x = torch.cat([x, torch.tensor([math.log(s2)], dtype=torch.float64)])
    theta, s2 = split(x)
    g, info, hp, details = oracle(theta, s2)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    while steps < prior.steps:
        t0 = time.perf_counter()
        free = ~(((x <= lo) & (g < 0)) | ((x >= hi) & (g > 0)))
        gf = torch.where(free, g, torch.zeros_like(g))
        if float(gf.abs().max()) == 0.0:
            break  # every coordinate at a bound it is pushed against: a stationary point of the box problem
        p = _two_loop(gf, pairs) if pairs else _gradient_step(gf)
        p = torch.where(free, p, torch.zeros_like(p))
        if float(gf @ p) <= 0:  # the curvature pairs do not give an ascent direction: restart
            pairs.clear()
            p = _gradient_step(gf)
        p *= min(1.0, prior.max_step / float(p.abs().max()))
        found, evaluations, alpha = _line_search(oracle, split, x, g, p, lo, hi)
        if found is None and pairs:
            # the curvature pairs can point far off once the objective's curvature has changed (a block variance
            # moved by orders of magnitude): forget them and take a short gradient step, as at the start, before
            # giving up (measured: a per-ray 64² walnut fit stopped here at step 36 with 10 pairs)
            pairs.clear()
            p = _gradient_step(gf)
            found, more, alpha = _line_search(oracle, split, x, g, p, lo, hi)
            evaluations += more
        if found is None:
            prior.set_theta(x[:n])
            raise FloatingPointError(
                f"TV-PredCP fit step {steps}: no step along the L-BFGS direction or the gradient gave a finite "
                f"gradient that does not overshoot (last step size {alpha:.3g})"
            )
        x_new, g_new, info_new, hp_new, details_new = found
        s_vec, y_vec = x_new - x, -(g_new - g)
        if float(s_vec @ y_vec) > 1e-10 * float(s_vec.norm() * y_vec.norm()):
            pairs.append((s_vec, y_vec))
            del pairs[:-LBFGS_MEMORY]
        x, g, info, hp, details = x_new, g_new, info_new, hp_new, details_new
        theta, s2 = split(x)
        prior.set_theta(theta)
        gfree = torch.where(~(((x <= lo) & (g < 0)) | ((x >= hi) & (g > 0))), g, torch.zeros_like(g))
        emit(
            _record(
                prior,
                info,
                hp,
                details,
                s2,
                gfree,
                phase="lbfgs",
                scale=1.0,
                change=float(s_vec.abs().max()),
                evaluations=evaluations,
                t0=t0,
            )
        )
        steps += 1
        recent = prior.trace[-CONVERGENCE_PATIENCE:]
        if all(r["phase"] == "lbfgs" for r in recent) and _convergence(recent, prior.tol)["converged"]:
            break
    return s2


def _gradient_step(gf: torch.Tensor) -> torch.Tensor:
    """The short steepest-ascent step along the projected gradient ``gf`` (zero on coordinates held at a bound) that
    starts and restarts L-BFGS: its largest coordinate change is :data:`LBFGS_FIRST_STEP` log units."""
    return gf * (LBFGS_FIRST_STEP / float(gf.abs().max()))


def _line_search(oracle, split, x, g, p, lo, hi):
    """Backtracking along the ascent direction ``p`` from ``x`` (gradient ``g``) inside the box ``[lo, hi]``: the first
    step whose gradient is finite and has not turned below ``−0.9×`` the initial directional derivative.
    Returns ``(found, evaluations, alpha)`` with ``found = (x_new, g_new, info, hp, details)``, or ``None`` when
    :data:`LINE_SEARCH_TRIES` steps all failed."""
    alpha = 1.0
    for tries in range(1, LINE_SEARCH_TRIES + 1):
        x_new = torch.minimum(torch.maximum(x + alpha * p, lo), hi)
        theta_new, s2_new = split(x_new)
        try:
            g_new, info_new, hp_new, details_new = oracle(theta_new, s2_new)
        except (FloatingPointError, torch.linalg.LinAlgError):
            alpha *= 0.25
            continue
        dx = x_new - x
        d0, d1 = float(g @ dx), float(g_new @ dx)
        if d1 >= -0.9 * d0:
            return (x_new, g_new, info_new, hp_new, details_new), tries, alpha
        alpha *= min(0.5, max(0.1, d0 / (d0 - d1)))  # secant zero of ∂J along the step
    return None, LINE_SEARCH_TRIES, alpha


def _fit_adam(prior, oracle, *, a, sigma2, c, learn_noise, g_var, emit) -> float:
    m = len(prior.matern)
    x = prior.theta()
    s2 = sigma2
    # Adam (Kingma & Ba, default betas) written out: torch.optim's first use imports torch._dynamo, measured 20 s
    # on the 2-core CI machine, longer than a small fit itself.
    m1, m2 = torch.zeros_like(x), torch.zeros_like(x)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for step in range(prior.steps):
        t0 = time.perf_counter()
        g, info, hp, details = oracle(x, s2)
        g = g[: prior.n_hyper]
        k = step + 1
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta2 * m2 + (1 - beta2) * g * g
        old = x.clone()
        x = x + prior.lr * (m1 / (1 - beta1**k)) / ((m2 / (1 - beta2**k)).sqrt() + eps)  # ascent: J is maximised
        scale, s2_new = _mackay(info, a=a, c=c, s2=s2, learn_noise=learn_noise)
        x[m:] += math.log(scale)
        oracle.since *= scale
        prior.set_theta(x)
        x = prior.theta()  # lengthscales clipped to their range
        change = max(float((x - old).abs().max()), abs(math.log(s2_new / s2)))
        s2 = s2_new
        emit(_record(prior, info, hp, details, s2, g, phase="adam", scale=scale, change=change, evaluations=1, t0=t0))
        if _convergence(prior.trace, prior.tol)["converged"]:
            break
    return s2


CG_FAILURE = 10.0  # a gradient whose CG residual ends above this × cg_tol is refused (after one rebuild)
ASSEMBLE_LIMIT = 50_000_000  # entries of Ψ₀ (400 MB in float64 while assembling) up to which the fit assembles it
VARIANCE_FLOOR = 1.0  # a block's largest negligible share of tr C, in units of σ² (variance_floor)
MACKAY_WARMUP = 10  # at most this many global-scale steps before L-BFGS
LBFGS_MEMORY = 10  # curvature pairs kept
LBFGS_FIRST_STEP = 0.1  # largest coordinate change of the first (gradient) step, in log units
LINE_SEARCH_TRIES = 6
# rows of C up to which a gradient whose CG failed with a fresh low-rank preconditioner is solved again with C⁻¹
# itself (a dense c × c Cholesky: 128 MB and ~c²·d flops at c = 4096)
EXACT_FALLBACK_ROWS = 8192
