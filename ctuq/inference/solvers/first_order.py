"""What the first-order solvers (:mod:`~ctuq.inference.solvers.sdd`, :mod:`~ctuq.inference.solvers.sgd`) share.

Both solve ``C X = R`` (rows, ``C = K̄/a + σ²I``) with gradient steps, so both need

* the spectral scale of the problem: ``λ_max(K̄)`` (built once, reused for every ``(a, σ²)`` like a
  preconditioner, since ``λ_max(C) = λ_max(K̄)/a + σ²`` and the primal Hessian ``ΨᵀΨ/σ² + aI`` has
  ``λ_max = λ_max(K̄)/σ² + a``): :func:`lanczos_top_eigenvalue`, ``lanczos_steps`` kernel products;
* exact residuals ``‖C x_j − b_j‖/‖b_j‖`` of what they return (one kernel product per right-hand side), reported
  in :class:`~ctuq.inference.solvers.base.SolveStats` like :func:`~ctuq.inference.solvers.cg.pcg` reports CG's,
  with a :class:`~ctuq.inference.solvers.base.ConvergenceWarning` when a solve stops at its iteration budget above
  ``rtol``;
* warm starts: :attr:`FirstOrderSolver.warm_starts` tells :class:`~ctuq.inference.em.SampledEM` to pass the
  previous step's solutions as ``x0`` (the same right-hand sides at new ``a``, ``σ²`` with
  ``fixed_probes=True``; the mean's row ``ỹ`` always).

Step sizes are scale free: a step size ``η`` means ``η / λ_max`` of the objective's Hessian, so the same value
works for any network, g-prior and ``(a, σ²)``. Random numbers (Lanczos start, coordinate blocks) come from CPU
generators seeded by ``seed``: results do not depend on the device.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from ctuq.inference.features import FeatureOperator
from ctuq.inference.kernel import KernelOperator
from ctuq.inference.solvers.base import ConvergenceWarning, Solver, SolveStats
from ctuq.options import option

__all__ = ["FirstOrderOptions", "lanczos_top_eigenvalue", "FirstOrderSolver"]


def lanczos_top_eigenvalue(kernel: KernelOperator, n_steps: int = 20, *, seed: int = 0) -> tuple[float, int]:
    """Estimate ``λ_max(K̄)`` with ``n_steps`` Lanczos steps (full reorthogonalisation, float64 basis).

    Returns ``(λ̂, products)``: the largest Ritz value plus the norm of its Ritz residual (``θ + β_m|s_m|``,
    an upper estimate: ``λ_max ≥ θ`` always, and an eigenvalue lies within the residual of ``θ``), and the kernel
    products spent (``≤ n_steps``; fewer when the Krylov space becomes invariant). Memory: ``n_steps × c``
    float64.
    """
    if not isinstance(n_steps, int) or n_steps < 1:
        raise ValueError(f"lanczos_top_eigenvalue: n_steps must be a positive int, got {n_steps!r}")
    c = kernel.n_outputs
    dev, dt = kernel.device, kernel.dtype
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    q = torch.randn(c, generator=gen, dtype=torch.float64).to(dev)
    q /= torch.linalg.vector_norm(q)
    Q = [q]
    alphas: list[float] = []
    betas: list[float] = []
    products = 0
    for j in range(min(n_steps, c)):
        w = kernel.matmul_rows(Q[-1][None].to(dt))[0].double()
        products += 1
        alpha = float(Q[-1] @ w)
        alphas.append(alpha)
        basis = torch.stack(Q, dim=1)
        w = w - basis @ (basis.T @ w)  # full reorthogonalisation (twice is enough)
        w = w - basis @ (basis.T @ w)
        beta = float(torch.linalg.vector_norm(w))
        betas.append(beta)
        if beta <= 1e-12 * max(abs(alpha), 1e-300) or j == min(n_steps, c) - 1:
            break
        Q.append(w / beta)
    m = len(alphas)
    Tm = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        Tm += torch.diag(off, 1) + torch.diag(off, -1)
    theta, S = torch.linalg.eigh(Tm)
    top = float(theta[-1])
    resid = abs(betas[m - 1] * float(S[-1, -1]))
    return max(top + resid, 0.0), products


@dataclasses.dataclass
class FirstOrderOptions:
    """The options every first-order solver takes (the fields its ``Options`` inherits; defaults from the CPU
    tuning table in docs/notebook/engineering.md)."""

    momentum: float = option(0.99, ge=0.0, lt=1.0, help="Nesterov momentum ρ")
    max_iter: int = option(
        1000, ge=1, help="iteration budget per solve (each iteration: one VJP + one JVP per unconverged row)"
    )
    rtol: float = option(
        1e-2,
        gt=0.0,
        lt=1.0,
        help="relative residual at which a solve stops early (above it at the budget: a warning)",
    )
    seed: int = option(0, ge=0, help="seeds the Lanczos start vector and any random coordinate blocks")
    lanczos_steps: int = option(20, ge=1, help="kernel products spent on λ_max(K̄)")
    lambda_max: float | None = option(
        None, gt=0.0, help="a known λ_max(K̄) (e.g. from a checkpoint): no Lanczos products; null: estimate it"
    )


class FirstOrderSolver(Solver):
    """Base of the gradient-based solvers: ``λ_max(K̄)`` once, warm starts, exact residuals, warnings.

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``).
    max_iter : int
        Iteration budget per solve (each iteration: one VJP + one JVP per unconverged right-hand side).
    rtol : float
        Early stop per right-hand side when its relative residual falls below it; above it at ``max_iter`` a
        :class:`~ctuq.inference.solvers.base.ConvergenceWarning` is raised.
    momentum : float
        Nesterov momentum ``ρ ∈ [0, 1)`` of the iteration.
    seed : int
        Seeds the Lanczos start vector and any random coordinate blocks (CPU generators).
    lanczos_steps : int
        Kernel products spent on ``λ_max(K̄)`` (default 20).
    lambda_max : float, optional
        A known ``λ_max(K̄)`` (e.g. from a checkpoint): no Lanczos products.
    """

    warm_starts = True

    def __init__(
        self,
        features: FeatureOperator,
        *,
        max_iter: int,
        rtol: float,
        momentum: float,
        seed: int = 0,
        lanczos_steps: int = 20,
        lambda_max: float | None = None,
    ):
        cls = type(self).__name__
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"{cls}: momentum must lie in [0, 1), got {momentum!r}")
        if not isinstance(max_iter, int) or isinstance(max_iter, bool) or max_iter < 1:
            raise ValueError(f"{cls}: max_iter must be a positive int, got {max_iter!r}")
        if not (isinstance(rtol, (int, float)) and rtol > 0 and math.isfinite(rtol)):
            raise ValueError(f"{cls}: rtol must be positive and finite, got {rtol!r}")
        if not isinstance(lanczos_steps, int) or lanczos_steps < 1:
            raise ValueError(f"{cls}: lanczos_steps must be a positive int, got {lanczos_steps!r}")
        if lambda_max is not None and not (float(lambda_max) > 0 and math.isfinite(float(lambda_max))):
            raise ValueError(f"{cls}: lambda_max must be positive and finite, got {lambda_max!r}")
        super().__init__(features)
        self.max_iter = int(max_iter)
        self.rtol = float(rtol)
        self.momentum = float(momentum)
        self.seed = int(seed)
        self.lanczos_steps = int(lanczos_steps)
        self._lambda_max = None if lambda_max is None else float(lambda_max)
        self.n_setup_products = 0

    # ------------------------------------------------------------------------------------------ set-up
    @property
    def lambda_max(self) -> float:
        """``λ_max(K̄)`` estimate (Lanczos on first use; independent of ``a`` and ``σ²``)."""
        if self._lambda_max is None:
            self.build()
        assert self._lambda_max is not None
        return self._lambda_max

    def build(self) -> float:
        """Estimate ``λ_max(K̄)`` now (otherwise the first solve does); idempotent. Returns it."""
        if self._lambda_max is None:
            lam, n = lanczos_top_eigenvalue(self.kernel, self.lanczos_steps, seed=self.seed)
            if not lam > 0:
                raise FloatingPointError(
                    f"{type(self).__name__}: K̄ = ΨΨᵀ is zero (λ_max estimate {lam}); the features carry no information"
                )
            self._lambda_max, self.n_setup_products = lam, n
        return self._lambda_max

    def setup(self, a: float, sigma2: float) -> None:
        """``λ_max(K̄)`` (independent of ``a`` and ``σ²``; the step sizes follow from it at every solve)."""
        self.build()

    def state_dict(self) -> dict | None:
        """``{"lambda_max", "n_setup_products"}`` for checkpoints (plain floats/ints)."""
        return {"lambda_max": float(self.lambda_max), "n_setup_products": int(self.n_setup_products)}

    def load_state_dict(self, state: dict | None) -> None:
        """Reuse a stored ``λ_max(K̄)`` (:meth:`state_dict`) instead of running Lanczos; ``None``: nothing stored."""
        if state is None:
            return
        if not isinstance(state, dict) or "lambda_max" not in state:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected a dict with 'lambda_max', got {type(state).__name__}"
            )
        lam = float(state["lambda_max"])
        if not (lam > 0 and math.isfinite(lam)):
            raise ValueError(f"{type(self).__name__}.load_state_dict: lambda_max must be positive, got {lam}")
        self._lambda_max = lam
        self.n_setup_products = int(state.get("n_setup_products", 0))

    def report(self) -> dict:
        """``{"lambda_max": λ_max(K̄)}``."""
        return {"lambda_max": float(self.lambda_max)}

    # ------------------------------------------------------------------------------------------ helpers
    def _check_x0(self, x0: torch.Tensor | None, rhs: torch.Tensor) -> torch.Tensor | None:
        if x0 is None:
            return None
        if not isinstance(x0, torch.Tensor) or tuple(x0.shape) != tuple(rhs.shape):
            got = tuple(x0.shape) if isinstance(x0, torch.Tensor) else type(x0).__name__
            raise ValueError(f"{type(self).__name__}.solve: x0 has shape {got}; rhs has {tuple(rhs.shape)}")
        if not torch.isfinite(x0).all():
            raise ValueError(f"{type(self).__name__}.solve: x0 contains NaN or Inf")
        return x0.to(device=rhs.device, dtype=rhs.dtype)

    def _cov_rows(self, X: torch.Tensor, a: float, sigma2: float) -> torch.Tensor:
        """``C x`` for rows ``X`` ``(m, c)``: one kernel product (VJP + JVP) per row."""
        return self.kernel.matmul_rows(X) / a + sigma2 * X

    def _finish(self, rel: torch.Tensor, iterations: torch.Tensor, n_products: int, method: str) -> SolveStats:
        stats = SolveStats(iterations.cpu(), rel.cpu(), (rel <= self.rtol).cpu(), int(n_products), method)
        if not stats.all_converged:
            n_bad = int((~stats.converged).sum())
            warnings.warn(
                f"{method.upper()} stopped short for {n_bad} of {stats.converged.numel()} right-hand side(s) after "
                f"{self.max_iter} iterations: largest relative residual {float(stats.relative_residual.max()):.3e} "
                f"> rtol {self.rtol:.1e}. Raise max_iter, tune the step size, or loosen "
                f"the tolerance; samples then carry a solver bias (mostly in low-variance directions).",
                ConvergenceWarning,
                stacklevel=3,
            )
        return stats
