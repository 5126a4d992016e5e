"""Stochastic dual descent (SDD) for ``C X = R``, ``C = K̄/a + σ²I`` (Lin, Antorán et al. 2024, "Stochastic
gradient descent for Gaussian processes done right").

Each right-hand side ``b`` (a row of ``R``) minimises the dual objective ``½ uᵀ C u − uᵀ b`` (gradient
``C u − b``; minimiser ``u = C⁻¹ b``). One iteration, for all unconverged rows at once::

    ℓ = u + ρ v                                   (Nesterov look-ahead)
    g = C ℓ − b                                   (full batch), or
    g = (c/r) Σ_{i ∈ block} ((K̄_i/a + σ² e_i)ᵀ ℓ − b_i) e_i     (a random block of r coordinates per row)
    v ← ρ v − β g,   u ← u + v,   ū ← χ u + (1 − χ) ū          (geometric iterate averaging)

Published settings: ``ρ = 0.9`` with the gradient at the look-ahead point, ``βn ≈ 50`` for unit-diagonal kernels,
blocks of 128–512 coordinates, ``χ = 100/T`` for a budget of ``T`` iterations. Here the step is scale free,
``β = step_size / λ_max(C)`` with ``λ_max(C) = λ_max(K̄)/a + σ²`` (:mod:`~ctuq.inference.solvers.first_order`); the
published ``βn`` corresponds to ``step_size · tr(C)/λ_max(C)`` (the "stable rank" of ``C`` times the step).

Cost for CT. A GP kernel row ``K_i`` costs ``O(c)`` kernel evaluations, so a block of ``r`` coordinates costs
``r/c`` of a full gradient. ``K̄ = ΨΨᵀ`` of a linearised network has no cheap rows: ``K̄_{i,:} ℓ = Ψ_i (Ψᵀ ℓ)``
needs the full VJP ``Ψᵀℓ`` and a JVP whose output is every measurement, so **every step costs one VJP + one JVP
per right-hand side whatever the block size**. A block then only discards most of a gradient that was paid
for; the measured consequence (``scripts/benchmark_solvers.py``, table in docs/NOTES.md) is
that the full-batch form (``batch_size=None``, the default) needs the fewest products, and blocks are kept for the
comparison only. Because the full residual ``C ℓ − b`` is computed in every step anyway, the early stop on
``rtol`` (per row, at the look-ahead point) costs nothing.

Start: ``x0`` when given (warm start), else ``u₀ = b/σ²``, the dual image of the primal start ``z = 0``
(``u = (b − Ψz)/σ²``). From there, the full-batch iteration with step ``η/λ_max(C)`` produces *exactly* the
iterates of the primal :class:`~ctuq.inference.solvers.sgd.SGDSolver` with ``lr = η`` mapped to the dual (both are
gradient descent with momentum on the same quadratic in coordinates related by ``u = (b − Ψz)/σ²``; checked in
``tests/inference/test_first_order_solvers.py``): full-batch SDD and primal SGD differ only in averaging, clipping,
the learning-rate schedule and what a residual costs.

What a solve returns per row: the look-ahead iterate at which its residual first fell below ``rtol``; or, at the
iteration budget, whichever of the averaged iterate ``ū`` (residual computed: one more product) and the last
look-ahead point has the smaller residual. Residuals in :class:`~ctuq.inference.solvers.base.SolveStats` are exact
(``‖C x − b‖/‖b‖``), and a solve that stops short warns (:class:`~ctuq.inference.solvers.base.ConvergenceWarning`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import torch

from ctuq.inference.checks import check_hyper
from ctuq.inference.features import FeatureOperator
from ctuq.inference.solvers.base import SolverCostEstimate, SolveStats, Workload, cost_estimate, relative_residual
from ctuq.inference.solvers.first_order import FirstOrderOptions, FirstOrderSolver
from ctuq.options import option
from ctuq.registry import SOLVERS
from ctuq.utils import derived_seed_words

__all__ = ["SDDSolver"]


@SOLVERS.register
class SDDSolver(FirstOrderSolver):
    """Stochastic dual descent on ``½uᵀCu − uᵀb``, batched over right-hand sides (module docstring).

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``).
    **options
        The fields of :class:`SDDSolver.Options` (defaults, bounds and meaning there): ``step_size``
        (``β·λ_max(C)``, scale free; ``< (2+2ρ)/(1+2ρ)`` ≈ 1.34 is stable for the full batch with the default
        ``ρ = 0.99``), ``batch_size`` (coordinates per block ``r``, drawn uniformly with replacement, independently
        per row and step; ``None`` or ``≥ c``: the full gradient), ``averaging`` (``χ ∈ (0, 1]`` of the geometric
        average; ``None``: ``min(1, 100/max_iter)``; ``1``: no averaging), and those of
        :class:`~ctuq.inference.solvers.first_order.FirstOrderOptions` (``momentum``, ``max_iter``, ``rtol``,
        ``seed``, ``lanczos_steps``, ``lambda_max``).
    """

    name = "sdd"
    summary = (
        "stochastic dual descent on ½uᵀCu − uᵀb (Nesterov, iterate averaging; full batch or coordinate blocks); large c"
    )

    @dataclasses.dataclass
    class Options(FirstOrderOptions):
        """The options of :class:`SDDSolver` (the config section ``uq.sdd``); the step size and budget are from the
        CPU tuning table in docs/notebook/engineering.md (full batch)."""

        step_size: float = option(
            1.0, gt=0.0, help="step size in units of 1/λ_max(C) (scale free; ≲ 1.34 is stable with momentum 0.99)"
        )
        batch_size: int | None = option(
            None,
            ge=1,
            help="coordinate block size; null: full batch (every CT step costs a full JVP + VJP anyway)",
        )
        averaging: float | None = option(
            None, gt=0.0, le=1.0, help="χ of the geometric iterate average; null: min(1, 100/max_iter); 1: none"
        )

    def __init__(
        self,
        features: FeatureOperator,
        *,
        step_size: float = Options.step_size,
        momentum: float = Options.momentum,
        batch_size: int | None = Options.batch_size,
        averaging: float | None = Options.averaging,
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
        if not (isinstance(step_size, (int, float)) and step_size > 0 and math.isfinite(step_size)):
            raise ValueError(f"SDDSolver: step_size must be positive and finite, got {step_size!r}")
        if batch_size is not None and (
            not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1
        ):
            raise ValueError(f"SDDSolver: batch_size must be a positive int or None (full batch), got {batch_size!r}")
        if averaging is not None and not (isinstance(averaging, (int, float)) and 0 < averaging <= 1):
            raise ValueError(f"SDDSolver: averaging (χ) must lie in (0, 1], got {averaging!r}")
        self.step_size = float(step_size)
        c = features.n_outputs
        self.batch_size = None if batch_size is None or batch_size >= c else int(batch_size)
        self.averaging = min(1.0, 100.0 / self.max_iter) if averaging is None else float(averaging)

    def _block_generator(self, rhs: torch.Tensor) -> torch.Generator:
        # Seeded by the solver seed and the right-hand sides themselves: the same call gives the same blocks,
        # whatever was solved before (resumed runs reproduce uninterrupted ones).
        digest = hashlib.blake2b(rhs.detach().cpu().numpy().tobytes(), digest_size=7).digest()
        hi, lo = derived_seed_words(self.seed, int.from_bytes(digest, "little"))
        return torch.Generator(device="cpu").manual_seed((hi << 32 | lo) & 0x7FFF_FFFF_FFFF_FFFF)

    def solve(
        self, rhs: torch.Tensor, a: float, sigma2: float, *, x0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, SolveStats]:
        """``C⁻¹ rhs`` for rows ``rhs`` ``(k, c)``; ``x0`` ``(k, c)`` warm start (default zeros)."""
        rhs = self._check_rhs(rhs)
        x0 = self._check_x0(x0, rhs)
        a_f, s2_f = check_hyper(a, sigma2, "SDDSolver.solve")
        k, c = rhs.shape
        lam_C = self.lambda_max / a_f + s2_f
        beta = self.step_size / lam_C
        rho, chi = self.momentum, self.averaging
        bnorm = torch.linalg.vector_norm(rhs.double(), dim=1)
        # Default start u₀ = b/σ²: the dual image of the primal z = 0 (u = (b − Ψz)/σ²), exact on every direction
        # that K̄ misses (there C = σ²I). Measured: from u₀ = 0 the same budget leaves a 4-10× larger residual.
        out = rhs / s2_f if x0 is None else x0.clone()
        rel = torch.zeros(k, dtype=torch.float64, device=rhs.device)
        iterations = torch.zeros(k, dtype=torch.long)
        n_products = 0
        active = (bnorm > 0).nonzero().flatten()
        U = out[active].clone()
        V = torch.zeros_like(U)
        Ubar = U.clone()
        B = rhs[active]
        gen = self._block_generator(rhs) if self.batch_size is not None else None
        last_L = U
        last_rel = torch.full((active.numel(),), math.inf, dtype=torch.float64, device=rhs.device)
        for it in range(1, self.max_iter + 1):
            if active.numel() == 0:
                break
            L = U + rho * V
            G = self._cov_rows(L, a_f, s2_f) - B
            n_products += int(active.numel())
            rel_L = relative_residual(G, bnorm[active])
            iterations[active.cpu()] = it
            done = rel_L <= self.rtol
            if bool(done.any()):
                idx = active[done]
                out[idx] = L[done]
                rel[idx] = rel_L[done]
                keep = ~done
                active, U, V, Ubar, B, L, G, rel_L = (
                    active[keep],
                    U[keep],
                    V[keep],
                    Ubar[keep],
                    B[keep],
                    L[keep],
                    G[keep],
                    rel_L[keep],
                )
                if active.numel() == 0:
                    break
            if gen is not None:
                m, r = active.numel(), self.batch_size
                cols = torch.randint(0, c, (m, r), generator=gen).to(rhs.device)
                mask = torch.zeros((m, c), dtype=G.dtype, device=rhs.device)
                mask.scatter_add_(1, cols, torch.ones((m, r), dtype=G.dtype, device=rhs.device))
                G = G * mask * (c / r)
            V = rho * V - beta * G
            U = U + V
            Ubar = chi * U + (1.0 - chi) * Ubar
            last_L, last_rel = L, rel_L
        if active.numel():
            # Budget spent: the better of the averaged iterate (residual computed here) and the last look-ahead.
            if chi < 1.0:
                rel_bar = relative_residual(self._cov_rows(Ubar, a_f, s2_f) - B, bnorm[active])
                n_products += int(active.numel())
            else:
                rel_bar = torch.full_like(last_rel, math.inf)
                Ubar = last_L
            use_bar = rel_bar <= last_rel
            out[active] = torch.where(use_bar[:, None], Ubar, last_L)
            rel[active] = torch.where(use_bar, rel_bar, last_rel)
        return out, self._finish(rel, iterations, n_products, "sdd")

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
        """``λ_max`` by ``lanczos_steps`` kernel products; every solve ``T + 1`` kernel products per column
        (``T = workload.sdd_iterations``, plus the exact final residual); memory five ``chunk × c`` buffers and the
        Lanczos basis (:func:`~ctuq.inference.solvers.cost.estimate_solver_costs`)."""
        k, n, S = workload.em_samples, workload.prediction_samples, workload.em_steps
        n_solves, L, T = workload.n_solves, workload.lanczos_steps, workload.sdd_iterations
        prods = L + n_solves * (T + 1)
        jvp, vjp = prods + S * k + n, prods + (n + 1)
        m = max(k + 1, workload.chunk)
        flops = n_solves * 10.0 * c * T
        mem = 5.0 * m * c * itemsize + L * c * 8.0
        return cost_estimate(
            "sdd", jvp, vjp, flops, mem, t_jvp=t_jvp, t_vjp=t_vjp, flop_rate=flop_rate, memory_budget=memory_budget
        )
