"""The marginal-likelihood gradient of the TV-PredCP type-II MAP (thesis Algorithm 5; ``docs/tv_predcp.md``).

With the measurement covariance ``C(θ) = Ψ₀ L Lᵀ Ψ₀ᵀ / a + σ² I`` (``Ψ₀`` whitened where the noise is per-ray) and
``u = C⁻¹ ỹ``, ``∂ log N(ỹ; 0, C) = ½ uᵀ ∂C u − ½ tr(C⁻¹ ∂C)``. For the prior hyperparameters
``∂C = Ψ₀ ∂(L Lᵀ) Ψ₀ᵀ / a``, so with ``r = Ψ₀ᵀ u`` and Rademacher probes ``z_k`` (``E[z zᵀ] = I``),
``p_k = Ψ₀ᵀ C⁻¹ z_k``, ``q_k = Ψ₀ᵀ z_k``::

    ∂ log N / ∂θ ≈ ∂/∂θ [ ½ ‖Lᵀ r‖² / a − (1/2m) Σ_k (Lᵀ p_k)·(Lᵀ q_k) / a ]   (r, p_k, q_k held fixed),

which autograd evaluates through the ``9 × 9`` factors of ``L`` at no Jacobian cost; ``∂ log N / ∂ log σ² =
½ σ² ‖u‖² − (σ²/2m) Σ_k z_kᵀ C⁻¹ z_k`` (:func:`mll_gradient`). A gradient is one batched CG solve of ``1 + m``
right-hand sides (the core's :func:`~ctuq.inference.solvers.cg.pcg` with a Nyström preconditioner of ``K̄(θ)``,
:func:`~ctuq.inference.solvers.preconditioners.randomized_eig`, rebuilt every ``precond_every`` gradients because ``K̄``
moves with ``θ``; during the MacKay warm start its eigenvalues follow the global scale of the variances exactly) and
``1 + 2m`` VJPs of ``Ψ₀``. :class:`GradientOracle` adds the hyperprior's gradient (:mod:`.hyperprior`) and guards the
solves. The log-determinant itself is never computed: the fit has gradients, not values, of its objective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ctuq.inference.block_features import BlockFeatures
from ctuq.inference.features import DenseFeatures, FeatureOperator
from ctuq.inference.kernel import KernelOperator, column_sq_norms
from ctuq.inference.priors.tv_predcp.hyperprior import tv_predcp_terms
from ctuq.inference.solvers.cg import pcg
from ctuq.inference.solvers.preconditioners import LowRankEig, LowRankPreconditioner, randomized_eig

if TYPE_CHECKING:
    from ctuq.inference.priors.tv_predcp.model import TVPredCPModel

__all__ = [
    "mll_gradient",
    "block_gprior_variances",
    "rademacher",
    "GradientOracle",
    "CG_FAILURE",
    "EXACT_FALLBACK_ROWS",
]

CG_FAILURE = 10.0  # a gradient whose CG residual ends above this × cg_tol is refused (after one rebuild)
# rows of C up to which a gradient whose CG failed with a fresh low-rank preconditioner is solved again with C⁻¹
# itself (a dense c × c Cholesky: 128 MB and ~c²·d flops at c = 4096)
EXACT_FALLBACK_ROWS = 8192


def rademacher(m: int, c: int, generator: torch.Generator, dtype, device) -> torch.Tensor:
    """``(m, c)`` random signs ``±1`` from ``generator`` (CPU, int8), then in ``dtype`` on ``device``: the Hutchinson
    probes (``E[z zᵀ] = I``)."""
    z = torch.randint(0, 2, (m, c), generator=generator, dtype=torch.int8)
    return (2 * z - 1).to(device=device, dtype=dtype)


def mll_gradient(
    prior: TVPredCPModel,
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
        Z = rademacher(n_probes, c, generator, base.dtype, base.device)
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


def block_gprior_variances(prior: TVPredCPModel, base: FeatureOperator, *, seed: int = 0, probes: int = 64):
    """Initial variances ``σ²_b = 1 / mean_{i∈b} ‖Ψ₀[:, i]‖²`` ``(n_blocks,)`` float64: the g-prior averaged over each
    block (every weight's prior variance in units of its effect on the data). Exact column norms for dense ``Ψ₀``,
    else ``probes`` Rademacher probes (:func:`~ctuq.inference.kernel.column_sq_norms`, ``probes`` VJPs)."""
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


class GradientOracle:
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
