"""Type-II MAP of a block prior's hyperparameters: log marginal likelihood plus the TV-PredCP hyperprior, with
log-determinant gradients by preconditioned CG and Hutchinson probes (thesis Algorithm 5).

The linearised model with a block prior ``v = L(θ) w``, ``w ~ N(0, a⁻¹ I)`` (:mod:`ctuq.priors.tv_predcp`) has the
measurement covariance ``C(θ) = Ψ₀ L Lᵀ Ψ₀ᵀ / a + σ² I`` (``Ψ₀`` whitened where the noise is per-ray) and the
objective

    J(θ, σ²) = log N(ỹ; 0, C) + Σ_b log p_TV(t_b),

maximised by Adam on ``θ = (log ℓ_b, log σ²_b)``, with the global scale of the variances and (when the likelihood
learns it) ``σ²`` moved by MacKay's updates from the same solves (:func:`fit_block_prior`). With
``u = C⁻¹ ỹ`` its marginal-likelihood gradient is ``∂ log N = ½ uᵀ ∂C u − ½ tr(C⁻¹ ∂C)``, and for the prior
hyperparameters ``∂C = Ψ₀ ∂(L Lᵀ) Ψ₀ᵀ / a``, so with ``r = Ψ₀ᵀ u`` and Rademacher probes ``z_k``
(``E[z zᵀ] = I``), ``p_k = Ψ₀ᵀ C⁻¹ z_k``, ``q_k = Ψ₀ᵀ z_k``::

    ∂ log N / ∂θ ≈ ∂/∂θ [ ½ ‖Lᵀ r‖² / a − (1/2m) Σ_k (Lᵀ p_k)·(Lᵀ q_k) / a ]   (r, p_k, q_k held fixed),

which autograd evaluates through the ``9 × 9`` factors of ``L`` at no Jacobian cost; ``∂ log N / ∂ log σ² =
½ σ² ‖u‖² − (σ²/2m) Σ_k z_kᵀ C⁻¹ z_k``. A step is one batched CG solve of ``1 + m`` right-hand sides (the core's
:func:`~ctuq.inference.solvers.cg.pcg` with a Nyström preconditioner of ``K̄(θ)``, :func:`~ctuq.inference.solvers.
preconditioners.randomized_eig`, rebuilt every ``precond_every`` steps because ``K̄`` moves with ``θ``; in between its
eigenvalues follow the global scale of the variances exactly),
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
from ctuq.inference.kernel import KernelOperator
from ctuq.inference.solvers.cg import pcg
from ctuq.inference.solvers.preconditioners import LowRankEig, LowRankPreconditioner, randomized_eig
from ctuq.priors import column_sq_norms
from ctuq.priors.tv_predcp import TVPredCPPrior, tap_grams, tv_predcp_terms
from ctuq.utils import progress as _progress_bar

__all__ = ["mll_gradient", "fit_block_prior", "block_gprior_variances"]


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
    generator: torch.Generator,
    learn_noise: bool = False,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rtol: float = 1e-3,
    max_iter: int = 300,
) -> tuple[torch.Tensor, dict]:
    """Stochastic gradient of ``log N(ỹ; 0, C(θ))`` (module docstring) at the prior's current hyperparameters.

    Returns ``(g, info)``: ``g`` ``(n_hyper [+ 1],)`` float64 in :meth:`TVPredCPPrior.theta` order, then
    ``∂/∂ log σ²`` when ``learn_noise``; ``info``: ``data_fit`` (``−½ ỹᵀC⁻¹ỹ``), MacKay's ``gamma``
    (``c − σ² tr C⁻¹``), ``weight_norm_sq`` (``‖w*‖²``) and ``residual_norm_sq`` (``‖ỹ − Ψw*‖²``),
    ``cg_max_iterations``, ``cg_max_residual``. ``base``: the (whitened) ``Ψ₀``; ``targets`` ``(c,)``; probes drawn
    from ``generator`` (CPU).
    """
    c = base.n_outputs
    F = BlockFeatures(base, prior)
    y = targets.to(device=base.device, dtype=base.dtype)
    Z = _rademacher(n_probes, c, generator, base.dtype, base.device)

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
    ``prior.trace``, marks the prior fitted and returns the final ``σ²``.

    A fresh fit starts the variances at ``prior``'s initial variance times :func:`block_gprior_variances`. Every step
    then (1) takes an Adam step (size ``prior.lr``) on ``θ = (log ℓ_b, log σ²_b)`` along ``∂J/∂θ``, and (2) moves
    the *global* scale of the variances (all ``σ²_b`` by one factor) and, with ``learn_noise``, ``σ²`` by the MacKay
    updates that the EM uses, from the same solves: ``γ = c − σ² tr C⁻¹`` (Hutchinson), ``‖w*‖² = ‖Lᵀ Ψ₀ᵀ u‖²/a²``,
    ``a* = γ/‖w*‖²`` (variances × ``a/a*``), ``σ² ← σ⁴‖u‖²/(c − γ)``. Adam alone moves ``log σ²_b`` by about
    ``lr`` per step, while the evidence's global scale is often orders of magnitude away from any initial guess
    (the demo's g-prior EM moves ``a`` from 100 to 0.17); MacKay's fixed point gets there in a few steps and Adam
    shapes the rest. The EM of the posterior runs on top afterwards (``a`` then starts at its fixed point).

    ``base``: the (whitened) unscaled features ``Ψ₀`` (``c × d``, dense or matrix-free); ``targets``: ``ỹ``
    ``(c,)`` (whitened alike); ``a``: the global prior precision (held fixed; the variances carry the scale);
    ``image_map``: rows of network weights ``(B, d)`` → network outputs ``(B, prod(prior.image_shape))`` (``Φ``);
    ``seed``: probes, tap-Gram samples and preconditioner sketches. ``callback(record)`` after every step.
    Record keys: ``step``, ``lengthscale`` / ``variance`` (lists, :attr:`TVPredCPPrior.blocks` order of Matérn /
    all blocks), ``sigma2``, ``data_fit``, ``log_hyperprior``, ``kappa`` (per Matérn block), ``gamma``,
    ``mackay_scale`` (the factor of step 2), ``grad_norm``, ``cg_max_iterations``, ``cg_max_residual``, ``time_s``.
    """
    say = log or (lambda _m: None)
    gen = torch.Generator().manual_seed(int(seed))
    m = len(prior.matern)
    c = base.n_outputs
    start = len(prior.trace)
    if start == 0:
        theta = prior.theta()
        theta[m:] += block_gprior_variances(prior, base, seed=seed).log()
        prior.set_theta(theta)
    x = prior.theta()
    s2 = float(sigma2)
    # Adam (Kingma & Ba, default betas) written out: torch.optim's first use imports torch._dynamo, measured 20 s
    # on the 2-core CI machine, longer than a small fit itself.
    m1, m2 = torch.zeros_like(x), torch.zeros_like(x)
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    features = BlockFeatures(base, prior)
    eig = None
    rank = min(prior.precond_rank, c)
    t0 = time.perf_counter()
    grams = tap_grams(prior, image_map, n_samples=prior.tv_samples, generator=gen, dtype=base.dtype, device=base.device)
    say(
        f"TV-PredCP: tap Gram matrices of {len(grams)} blocks from {9 * prior.tv_samples} JVPs each: "
        f"{time.perf_counter() - t0:.1f} s"
    )
    bar = _progress_bar(range(prior.steps), total=prior.steps, desc="TV-PredCP fit", disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        if step % prior.precond_every == 0:
            eig = randomized_eig(KernelOperator(features=features), rank, seed=int(seed) + start + step)
            since = 1.0  # the global variance factor applied since: K̄ scales by it exactly
        precond = LowRankEig(eig.U, eig.eigenvalues * since, eig.n_products, eig.method)
        g, info = mll_gradient(
            prior,
            base,
            targets,
            a=a,
            sigma2=s2,
            n_probes=prior.probes,
            generator=gen,
            preconditioner=LowRankPreconditioner(precond).inverse(a, s2),
            rtol=prior.cg_tol,
            max_iter=prior.cg_max_iter,
        )
        hp, g_hp, details = tv_predcp_terms(prior, grams, a=a)
        g = g + g_hp
        record = {
            "step": start + step,
            "lengthscale": prior.log_lengthscale.exp().tolist(),
            "variance": prior.log_variance.exp().tolist(),
            "sigma2": s2,
            "data_fit": info["data_fit"],
            "log_hyperprior": hp,
            "kappa": [dd["kappa"] for dd in details],
            "gamma": info["gamma"],
            "grad_norm": float(g.norm()),
            "cg_max_iterations": info["cg_max_iterations"],
            "cg_max_residual": info["cg_max_residual"],
        }
        if not torch.isfinite(g).all():
            raise FloatingPointError(f"TV-PredCP fit step {start + step}: the gradient is not finite ({record})")
        k = step + 1  # Adam's bias correction counts the steps of this fit
        m1 = beta1 * m1 + (1 - beta1) * g
        m2 = beta2 * m2 + (1 - beta2) * g * g
        x = x + prior.lr * (m1 / (1 - beta1**k)) / ((m2 / (1 - beta2**k)).sqrt() + eps)  # ascent: J is maximised
        # MacKay's updates of the global scale and the noise (docstring), where γ is a usable estimate
        gamma, wnorm = info["gamma"], info["weight_norm_sq"]
        scale = 1.0
        if 0 < gamma < c and wnorm > 0:
            scale = a / (gamma / wnorm)
            x[m:] += math.log(scale)
            since *= scale
            if learn_noise:
                s2 = info["residual_norm_sq"] / (c - gamma)
        record["mackay_scale"] = scale
        prior.set_theta(x)
        x = prior.theta()  # lengthscales clipped to their range
        record["time_s"] = time.perf_counter() - t0
        prior.trace.append(record)
        if callback is not None:
            callback(record)
        if step % 10 == 0 or step == prior.steps - 1:
            say(
                f"TV-PredCP step {start + step}: ℓ {', '.join(f'{v:.3g}' for v in record['lengthscale'])}; σ²_b "
                f"{', '.join(f'{v:.3g}' for v in record['variance'])}; σ² {record['sigma2']:.4g}; −½ỹᵀC⁻¹ỹ "
                f"{info['data_fit']:.5g}; log p_TV {hp:.4g}; γ {gamma:.4g}; CG ≤ {info['cg_max_iterations']} it."
            )
    prior.fitted = True
    return s2
