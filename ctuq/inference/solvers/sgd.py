"""Primal sample-then-optimise: ``C⁻¹R`` through gradient descent over the weights (Antorán, Padhy et al.,
"Sampling-based inference for large linear models", objective ``L′``).

For a right-hand side ``r`` (``c``), the weight-space problem

    z* = argmin_z  f(z) = ½ ‖Ψ z − r‖² / σ² + ½ a ‖z‖²       (``d`` weights; Hessian ``ΨᵀΨ/σ² + aI``)

has ``z* = a⁻¹ Ψᵀ C⁻¹ r`` (push-through identity), hence ``Ψ z* = r − σ² C⁻¹ r`` and

    C⁻¹ r = (r − Ψ z*) / σ²,

so a primal optimiser fits the dual :class:`~ctuq.inference.solvers.base.Solver` interface and the sampler and EM use
it unchanged. For the Matheron right-hand side ``r = ε − Ψ w₀`` the shifted variable ``ζ = w₀ + z`` minimises the
paper's ``L′(ζ) = ½‖Ψζ‖²/σ² … + ½ a ‖ζ − θⁿ‖²`` with ``θⁿ = w₀ + a⁻¹Ψᵀε/σ²``: ``ζ*`` is the posterior sample. When
``a`` (or ``σ²``) changes, :class:`~ctuq.inference.em.SampledEM` with ``fixed_probes=True`` rebuilds the same
probes' right-hand side in closed form (``w₀ = a^(−1/2) ξ``, ``ε = σ η``: no products) and passes the previous
solution as the warm start.

One iteration (rows batched, full-batch gradients as the authors used for the 3D walnut)::

    ℓ = z + ρ v;   g = Ψᵀ(Ψℓ − r)/σ² + a ℓ          (one JVP + one VJP per row)
    g ← g · min(1, clip·‖g₁‖/‖g‖)                     (optional clipping, relative to the first step's gradient)
    v ← ρ v − η_t g,   z ← z + v,   η_t = η₀ (1 − (t−1)/T)  (linear decay; ``lr_decay="none"`` keeps η₀)

with ``η₀ = lr / λ_max(ΨᵀΨ/σ² + aI)`` and ``λ_max(ΨᵀΨ) = λ_max(K̄)`` from Lanczos (scale free, as for SDD).
The dual residual of the iterate, ``C u − r = −Ψ g(ℓ)/a`` for ``u = (r − Ψℓ)/σ²``, costs one JVP: it is checked
every ``check_every`` iterations (early stop per row at ``rtol``) and at exit, so the residuals reported in
:class:`~ctuq.inference.solvers.base.SolveStats` are exact, as for CG. ``n_products`` counts (JVPs + VJPs)/2.

Warm start: a dual guess ``x0`` becomes ``z₀ = a⁻¹ Ψᵀ x0`` (one VJP per row).

Cost per solve and row: ``T`` JVPs + ``T`` VJPs, plus ``T/check_every + 1`` JVPs for residuals, plus one VJP for
a warm start. Conditioning equals the dual problem's (``κ = 1 + λ_max(K̄)/(aσ²)`` both ways); in exact arithmetic
the iterates *are* those of full-batch :class:`~ctuq.inference.solvers.sdd.SDDSolver` mapped by
``u = (r − Ψz)/σ²`` (same step, same momentum, SDD started at ``r/σ²``; float64 runs agree to round-off). The
published 3D-walnut budgets were 4000 (mean) and 3000 (samples) iterations.

Precision: in float32 (the networks' dtype) the primal route has an accuracy floor. At convergence the two terms of
``g = Ψᵀ(Ψℓ − r)/σ² + aℓ`` cancel and ``u = (r − Ψℓ)/σ²`` subtracts nearly equal vectors, so the dual residual
cannot fall below about ``ε₃₂ · κ(C)`` (``ε₃₂ ≈ 1.2e-7``). Measured on the CPU benchmark problem (small U-Net
kernel, ``κ = 1.4·10⁶``): SGD stalls at a relative residual of 0.14–0.41 in float32 and reaches 7e-3 in float64,
while SDD reaches 7e-3 in both (``scripts/benchmark_solvers.py``; docs/NOTES.md). Prefer
``sdd`` when ``κ`` is large and the products run in float32.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ctuq.inference.checks import check_hyper
from ctuq.inference.features import FeatureOperator
from ctuq.inference.solvers.base import SolverCostEstimate, SolveStats, Workload, cost_estimate, relative_residual
from ctuq.inference.solvers.first_order import FirstOrderOptions, FirstOrderSolver
from ctuq.options import LRDecay, option, values
from ctuq.registry import SOLVERS

__all__ = ["SGDSolver"]


@SOLVERS.register
class SGDSolver(FirstOrderSolver):
    """Primal gradient descent with Nesterov momentum on ``f(z)`` (module docstring), batched over rows.

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``).
    **options
        The fields of :class:`SGDSolver.Options` (defaults, bounds and meaning there): ``lr``
        (``η₀ · λ_max(ΨᵀΨ/σ² + aI)``, scale free; ≲ 1.34 is stable with the default ``ρ = 0.99``), ``lr_decay``
        (``"linear"``: the step decays to 0 over ``max_iter``, as published; ``"none"``: constant), ``clip`` (clip
        each row's gradient norm to ``clip ×`` its first-iteration norm; ``None``: no clipping), ``check_every``
        (iterations between exact residual checks, one JVP per unconverged row each), and those of
        :class:`~ctuq.inference.solvers.first_order.FirstOrderOptions` (``momentum``, ``max_iter``, ``rtol``,
        ``seed``, ``lanczos_steps``, ``lambda_max``).
    """

    name = "sgd"
    summary = "primal sample-then-optimise: Nesterov gradient descent over the weights, C⁻¹r = (r − Ψz*)/σ²; large c"

    @dataclasses.dataclass
    class Options(FirstOrderOptions):
        """The options of :class:`SGDSolver` (the config section ``uq.sgd``), from the CPU tuning table in
        docs/notebook/engineering.md."""

        lr: float = option(1.0, gt=0.0, help="step in units of 1/λ_max(ΨᵀΨ/σ² + aI) (scale free)")
        lr_decay: str = option(LRDecay.NONE.value, choices=values(LRDecay), help="learning-rate schedule")
        clip: float | None = option(None, gt=0.0, help="gradient clip (× the first step's gradient norm); null: none")
        check_every: int = option(
            10, ge=1, help="iterations between exact residual checks (one JVP per unconverged row each)"
        )

    def __init__(
        self,
        features: FeatureOperator,
        *,
        lr: float = Options.lr,
        momentum: float = Options.momentum,
        lr_decay: str = Options.lr_decay,
        clip: float | None = Options.clip,
        check_every: int = Options.check_every,
        max_iter: int = Options.max_iter,
        rtol: float = Options.rtol,
        seed: int = Options.seed,
        lanczos_steps: int = Options.lanczos_steps,
        lambda_max: float | None = Options.lambda_max,
    ):
        super().__init__(
            features,
            max_iter=max_iter,
            rtol=rtol,
            momentum=momentum,
            seed=seed,
            lanczos_steps=lanczos_steps,
            lambda_max=lambda_max,
        )
        if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
            raise ValueError(f"SGDSolver: lr must be positive and finite, got {lr!r}")
        if lr_decay not in values(LRDecay):
            raise ValueError(f"SGDSolver: lr_decay must be one of {list(values(LRDecay))}, got {lr_decay!r}")
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0 and math.isfinite(clip)):
            raise ValueError(f"SGDSolver: clip must be positive or None, got {clip!r}")
        if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
            raise ValueError(f"SGDSolver: check_every must be a positive int, got {check_every!r}")
        self.lr = float(lr)
        self.lr_decay = str(lr_decay)
        self.clip = None if clip is None else float(clip)
        self.check_every = int(check_every)

    def solve(
        self, rhs: torch.Tensor, a: float, sigma2: float, *, x0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, SolveStats]:
        """``C⁻¹ rhs = (rhs − Ψz*)/σ²`` for rows ``rhs`` ``(k, c)``; ``x0`` ``(k, c)``: dual warm start."""
        rhs = self._check_rhs(rhs)
        x0 = self._check_x0(x0, rhs)
        a_f, s2_f = check_hyper(a, sigma2, "SGDSolver.solve")
        f = self.features
        k, _ = rhs.shape
        j0, v0 = f.n_matvec, f.n_rmatvec
        L_max = self.lambda_max / s2_f + a_f
        eta0 = self.lr / L_max
        rho = self.momentum
        bnorm = torch.linalg.vector_norm(rhs.double(), dim=1)
        out = torch.zeros_like(rhs)
        rel = torch.zeros(k, dtype=torch.float64, device=rhs.device)
        iterations = torch.zeros(k, dtype=torch.long)
        active = (bnorm > 0).nonzero().flatten()
        R = rhs[active]
        if x0 is not None and active.numel():
            Z = f.rmatvec(x0[active]) / a_f
        else:
            Z = torch.zeros((active.numel(), f.n_features), dtype=rhs.dtype, device=rhs.device)
        Vel = torch.zeros_like(Z)
        g_first: torch.Tensor | None = None
        P = G = Lz = None
        for it in range(1, self.max_iter + 1):
            if active.numel() == 0:
                break
            Lz = Z + rho * Vel
            P = f.matvec(Lz)  # Ψℓ
            G = f.rmatvec((P - R) / s2_f) + a_f * Lz
            iterations[active.cpu()] = it
            check = it % self.check_every == 0 or it == self.max_iter
            if check:
                # exact dual residual of u = (r − Ψℓ)/σ²:  C u − r = −Ψ g(ℓ)/a  (one JVP per row)
                rel_it = relative_residual(f.matvec(G) / a_f, bnorm[active])
                done = rel_it <= self.rtol
                if it == self.max_iter:
                    done = torch.ones_like(done)
                if bool(done.any()):
                    idx = active[done]
                    out[idx] = (R[done] - P[done]) / s2_f
                    rel[idx] = rel_it[done]
                    keep = ~done
                    active, R, Z, Vel, G = active[keep], R[keep], Z[keep], Vel[keep], G[keep]
                    if g_first is not None:
                        g_first = g_first[keep]
                    if active.numel() == 0:
                        break
            if self.clip is not None:
                gn = torch.linalg.vector_norm(G, dim=1)
                if g_first is None:
                    g_first = gn.clone()
                factor = torch.clamp(self.clip * g_first / gn.clamp_min(1e-300), max=1.0)
                G = G * factor[:, None]
            eta = eta0 * (1.0 - (it - 1) / self.max_iter) if self.lr_decay == "linear" else eta0
            Vel = rho * Vel - eta * G
            Z = Z + Vel
        n_products = math.ceil(((f.n_matvec - j0) + (f.n_rmatvec - v0)) / 2)
        return out, self._finish(rel, iterations, n_products, "sgd")

    @classmethod
    def estimate_cost(
        cls,
        c: int,
        d: int,
        workload: Workload,
        *,
        t_jvp: float,
        t_vjp: float,
        flop_rate: float,
        memory_budget: float,
        itemsize: int,
    ) -> SolverCostEstimate:
        """``λ_max`` by ``lanczos_steps`` kernel products; every solve ``T`` kernel products per column
        (``T = workload.sgd_iterations``), ``T/10 + 1`` JVPs for the residual checks and one VJP for a warm start;
        memory four ``chunk × d`` buffers and the Lanczos basis
        (:func:`~ctuq.inference.solvers.cost.estimate_solver_costs`)."""
        k, n, S = workload.em_samples, workload.prediction_samples, workload.em_steps
        n_solves, L, T = workload.n_solves, workload.lanczos_steps, workload.sgd_iterations
        prods = L + n_solves * T
        jvp = prods + n_solves * (T / 10.0 + 1) + S * k + n
        vjp = prods + n_solves + (n + 1)
        m = max(k + 1, workload.chunk)
        flops = n_solves * 10.0 * c * T * d / max(c, 1)
        mem = 4.0 * m * d * itemsize + L * c * 8.0
        return cost_estimate(
            "sgd", jvp, vjp, flops, mem, t_jvp=t_jvp, t_vjp=t_vjp, flop_rate=flop_rate, memory_budget=memory_budget
        )
