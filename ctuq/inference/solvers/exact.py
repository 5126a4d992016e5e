"""Exact solvers: one eigendecomposition ``K̄ = Q diag(λ) Qᵀ`` (float64) — of ``K̄`` itself (``c`` VJPs, ``O(c³)``)
or, for small networks (``d < c``), of the ``d × d`` Gram matrix ``ΨᵀΨ`` (``d`` JVPs, ``O(cd² + d³)``) — after
which ``C⁻¹``, the effective dimension ``γ``, ``‖w*‖²`` and the log evidence are exact for every ``a, σ²`` at no
further Jacobian cost (:class:`ExactEigSolver`; registry names ``"exact_primal"`` and ``"exact_dual"``).
"""

from __future__ import annotations

import dataclasses
import math

import scipy.linalg
import torch

from ctuq.inference.checks import check_hyper
from ctuq.inference.features import FeatureOperator
from ctuq.inference.kernel import assemble_features, assemble_kernel
from ctuq.inference.solvers.base import (
    ExactSolver,
    SolverCostEstimate,
    SolveStats,
    Workload,
    cost_estimate,
    relative_residual,
)
from ctuq.options import ExactSide, option, values
from ctuq.registry import SOLVERS

__all__ = ["ExactOptions", "ExactEigSolver", "ExactPrimalSolver", "ExactDualSolver"]


def symmetric_eigh(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(λ ascending, V)`` of the symmetric float64 matrix ``A`` ``(n, n)``: LAPACK's divide-and-conquer ``syevd``
    through SciPy on the CPU (measured on 2 cores for n = 5008, the demo's Gram matrix: 10.1 s against 14.7 s for
    ``torch.linalg.eigh``; eigenvalues equal to 1e-15 relative), ``torch.linalg.eigh`` on other devices. ``A`` is
    left unchanged."""
    if A.device.type != "cpu":
        return torch.linalg.eigh(A)
    lam, V = scipy.linalg.eigh(A.numpy(), driver="evd", check_finite=False)
    return torch.from_numpy(lam), torch.from_numpy(V)


@dataclasses.dataclass
class ExactOptions:
    """The options of the exact solvers (the config sections ``uq.exact_primal``, ``uq.exact_dual``)."""

    chunk_size: int = option(64, ge=1, help="rows per Jacobian-product call while assembling Ψ or K̄")
    memory_budget: int | None = option(
        None, ge=1, help="bytes for storing Ψᵀ while assembling K̄ (the dual side); null: automatic"
    )
    progress: bool = option(False, help="a progress bar while assembling (the posterior passes its own)")


class ExactEigSolver(ExactSolver):
    """Direct solves through one eigendecomposition ``K̄ = Q diag(λ) Qᵀ`` (float64), built on first use.

    After the decomposition, every quantity below is exact for any ``(a, σ²)`` with no Jacobian products:
    ``C⁻¹ = Q diag(1/(λ/a + σ²)) Qᵀ + (I − QQᵀ)/σ²``, :meth:`gamma`, :meth:`weight_norm_sq`,
    :meth:`residual_norm_sq`, :meth:`log_evidence`.

    Two ways to the same decomposition (``side``):

    * ``"dual"``: assemble ``K̄`` (``c × c``, see :func:`~ctuq.inference.kernel.assemble_kernel`) and
      ``eigh`` it: ``Q`` is ``c × c``. Cost ``O(c³)``.
    * ``"primal"``: assemble ``Ψ`` itself (``c × d``; ``d`` JVPs or ``c`` VJPs, whichever is fewer), ``eigh`` the
      ``d × d`` Gram matrix ``ΨᵀΨ = V diag(λ) Vᵀ`` and map ``Q = Ψ V diag(λ)^(−1/2)``: the non-zero spectrum of
      ``K̄ = ΨΨᵀ`` is that of ``ΨᵀΨ``, so this is the same decomposition restricted to ``range(Ψ)`` (``Q`` is
      ``c × r``, ``r ≤ d``), at ``O(cd² + d³)``: the cheap route for small networks (``d < c``).
    * ``"auto"``: ``"primal"`` when ``d < c``, else ``"dual"``.

    The registry holds the two sides as :class:`ExactPrimalSolver` (``"exact_primal"``) and
    :class:`ExactDualSolver` (``"exact_dual"``).

    Eigenvalues below ``1e-12·λ_max`` are dropped (their directions join the orthogonal complement, where
    ``C = σ²I``). Solves are written as ``C⁻¹b = b/σ² + Q diag(1/(λ/a + σ²) − 1/σ²) Qᵀ b`` so that directions
    with tiny ``λ`` — whose ``Q`` columns carry the most round-off in the primal route — contribute ~0.

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ``.
    **options
        The fields of :class:`ExactEigSolver.Options`: ``chunk_size``, ``memory_budget`` (bytes for storing ``Ψᵀ``
        during dual assembly, see :func:`~ctuq.inference.kernel.assemble_kernel`), ``progress``, and ``side``
        (which Gram matrix to decompose, above).
    """

    @dataclasses.dataclass
    class Options(ExactOptions):
        """The options of :class:`ExactEigSolver`: those of the registered sides, and the side."""

        side: str = option(ExactSide.AUTO.value, choices=values(ExactSide), help="which Gram matrix to decompose")

    def __init__(
        self,
        features: FeatureOperator,
        *,
        chunk_size: int = Options.chunk_size,
        memory_budget: int | None = Options.memory_budget,
        progress: bool = Options.progress,
        side: str = Options.side,
    ):
        if side not in values(ExactSide):
            raise ValueError(f"ExactEigSolver: side must be 'auto', 'dual' or 'primal', got {side!r}")
        super().__init__(features)
        self.chunk_size = int(chunk_size)
        self.memory_budget = memory_budget
        self.progress = progress
        self.side = str(side)
        self._Q: torch.Tensor | None = None
        self._lam: torch.Tensor | None = None
        self.n_setup_products = 0

    @property
    def resolved_side(self) -> str:
        """``"dual"`` or ``"primal"`` (``"auto"`` resolved by ``d < c``)."""
        if self.side != "auto":
            return self.side
        return "primal" if self.features.n_features < self.features.n_outputs else "dual"

    def decompose(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(λ (r,), Q (c, r))`` float64, ``λ > 0`` ascending, ``QᵀQ = I``; computed on first call."""
        if self._Q is None:
            before = self.features.n_rmatvec + self.features.n_matvec
            if self.resolved_side == "dual":
                K = assemble_kernel(
                    self.features, chunk_size=self.chunk_size, memory_budget=self.memory_budget, progress=self.progress
                )
                lam, Q = symmetric_eigh(K)
                del K
            else:
                P = assemble_features(self.features, chunk_size=self.chunk_size, progress=self.progress)
                lam, V = symmetric_eigh(P.T @ P)
                Q = P @ V
                del P, V
            # K̄ is PSD: drop round-off-level (and negative) eigenvalues into the σ²-only complement.
            keep = lam > 1e-12 * float(lam.abs().max().clamp_min(1e-300))
            lam, Q = lam[keep], Q[:, keep]
            if self.resolved_side == "primal":
                Q = Q / lam.sqrt()
            self._lam, self._Q = lam, Q
            self.n_setup_products = self.features.n_rmatvec + self.features.n_matvec - before
        assert self._lam is not None and self._Q is not None
        return self._lam, self._Q

    def load_decomposition(self, eigenvalues: torch.Tensor, eigenvectors: torch.Tensor) -> None:
        """Use a previously computed ``(λ (r,), Q (c, r))`` (e.g. from a checkpoint) instead of assembling."""
        c = self.features.n_outputs
        r = eigenvalues.shape[0] if eigenvalues.ndim == 1 else -1
        if eigenvalues.ndim != 1 or tuple(eigenvectors.shape) != (c, r) or r > c:
            raise ValueError(
                f"ExactEigSolver.load_decomposition: expected eigenvalues (r,) and eigenvectors ({c}, r) with "
                f"r <= {c}, got {tuple(eigenvalues.shape)} and {tuple(eigenvectors.shape)}"
            )
        self._lam = eigenvalues.to(self.features.device, torch.float64).clamp_min(0.0)
        self._Q = eigenvectors.to(self.features.device, torch.float64)

    def _coef(self, a: float, sigma2: float) -> torch.Tensor:
        lam, _ = self.decompose()
        return 1.0 / (lam / a + sigma2)

    def _apply_inverse(self, b: torch.Tensor, a: float, sigma2: float) -> torch.Tensor:
        # C⁻¹b = b/σ² + Q diag(coef − 1/σ²) Qᵀ b  (float64 rows (k, c))
        _, Q = self.decompose()
        return b / sigma2 + ((b @ Q) * (self._coef(a, sigma2) - 1.0 / sigma2)) @ Q.T

    def solve(
        self, rhs: torch.Tensor, a: float, sigma2: float, *, x0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, SolveStats]:
        """``C⁻¹ rhs`` for rows ``(k, c)`` (dense, no Jacobian products; ``x0`` is ignored); residual from the
        decomposition."""
        rhs = self._check_rhs(rhs)
        a_f, s2_f = check_hyper(a, sigma2, "ExactEigSolver.solve")
        lam, Q = self.decompose()
        b = rhs.double().to(Q.device)
        X = self._apply_inverse(b, a_f, s2_f)
        resid = s2_f * X + ((X @ Q) * (lam / a_f)) @ Q.T - b
        rel = relative_residual(resid, torch.linalg.vector_norm(b, dim=1))
        k = rhs.shape[0]
        stats = SolveStats(torch.zeros(k, dtype=torch.long), rel.cpu(), torch.ones(k, dtype=torch.bool), 0, "eig")
        return X.to(self.features.dtype), stats

    def gamma(self, a: float, sigma2: float) -> float:
        """Effective dimension ``γ = Σ_i λ_i / (λ_i + a σ²)`` (exact)."""
        a_f, s2_f = check_hyper(a, sigma2, "ExactEigSolver.gamma")
        lam, _ = self.decompose()
        return float((lam / (lam + a_f * s2_f)).sum())

    def weight_norm_sq(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``‖w*‖² = a⁻² Σ_i λ_i (q_iᵀỹ)² / (λ_i/a + σ²)²`` for the posterior mean ``w* = a⁻¹ΨᵀC⁻¹ỹ``."""
        a_f, s2_f = check_hyper(a, sigma2, "ExactEigSolver.weight_norm_sq")
        lam, Q = self.decompose()
        proj = self._project(y_tilde, Q)
        return float((lam * proj**2 / (lam / a_f + s2_f) ** 2).sum() / a_f**2)

    def residual_norm_sq(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``‖ỹ − Ψw*‖² = σ⁴ ‖C⁻¹ỹ‖²`` (exact)."""
        a_f, s2_f = check_hyper(a, sigma2, "ExactEigSolver.residual_norm_sq")
        u = self._apply_inverse(self._y(y_tilde)[None], a_f, s2_f)[0]
        return float(s2_f**2 * (u @ u))

    def log_evidence(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``log N(ỹ; 0, C) = −½ ỹᵀC⁻¹ỹ − ½ log det C − (c/2) log 2π`` (nats; exact)."""
        a_f, s2_f = check_hyper(a, sigma2, "ExactEigSolver.log_evidence")
        lam, _ = self.decompose()
        y = self._y(y_tilde)
        u = self._apply_inverse(y[None], a_f, s2_f)[0]
        c = self.features.n_outputs
        logdet = torch.log(lam / a_f + s2_f).sum() + (c - lam.numel()) * math.log(s2_f)
        return float(-0.5 * (y @ u) - 0.5 * logdet - 0.5 * c * math.log(2 * math.pi))

    def _y(self, y_tilde: torch.Tensor) -> torch.Tensor:
        c = self.features.n_outputs
        if not isinstance(y_tilde, torch.Tensor) or tuple(y_tilde.shape) != (c,):
            got = tuple(y_tilde.shape) if isinstance(y_tilde, torch.Tensor) else type(y_tilde).__name__
            raise ValueError(f"ExactEigSolver: y_tilde must have shape ({c},), got {got}")
        _, Q = self.decompose()
        return y_tilde.to(Q.device, torch.float64)

    def _project(self, y_tilde: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
        return Q.T @ self._y(y_tilde)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict | None:
        """``{"eigenvalues", "eigenvectors"}`` (CPU float64) for checkpointing the decomposition."""
        lam, Q = self.decompose()
        return {"eigenvalues": lam.cpu(), "eigenvectors": Q.cpu()}

    def load_state_dict(self, state: dict | None) -> None:
        """Reuse a stored decomposition (:meth:`state_dict`); ``None``: nothing stored, :meth:`setup` decomposes."""
        if state is None:
            return
        if not isinstance(state, dict) or not {"eigenvalues", "eigenvectors"} <= set(state):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected a dict with 'eigenvalues' and "
                f"'eigenvectors', got {got}"
            )
        self.load_decomposition(state["eigenvalues"], state["eigenvectors"])

    # ------------------------------------------------------------------------------------------ reporting
    def describe(self) -> str:
        """``", N non-zero eigenvalues of K̄"``."""
        return f", {int(self.decompose()[0].numel())} non-zero eigenvalues of K̄"

    # ------------------------------------------------------------------------------------------ cost
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
        """The one ``"exact"`` estimate of both sides: the primal route when ``d < c``, else the dual one with
        Gram assembly when ``Ψᵀ`` (``c·d·itemsize`` bytes) fits ``memory_budget``
        (:func:`~ctuq.inference.solvers.cost.estimate_solver_costs`)."""
        n = workload.prediction_samples
        r = min(c, d)
        if d < c:
            jvp, vjp = d + n, n + 1
            flops = 4.0 * c * d * d + 9.0 * d**3 + 4.0 * c * r * (n + 1)
            mem = 2.0 * c * d * 8 + d * d * 8
        else:
            gram = c * d * itemsize <= memory_budget
            vjp = c + (n + 1)
            jvp = (0 if gram else c) + n
            flops = 9.0 * c**3 + (2.0 * c * c * d if gram else 0.0) + 4.0 * c * c * (n + 1)
            mem = 3.0 * c * c * 8 + (c * d * itemsize if gram else 0.0)
        return cost_estimate(
            "exact", jvp, vjp, flops, mem, t_jvp=t_jvp, t_vjp=t_vjp, flop_rate=flop_rate, memory_budget=memory_budget
        )


@SOLVERS.register
class ExactPrimalSolver(ExactEigSolver):
    """:class:`ExactEigSolver` on the primal side: assemble ``Ψ`` (``d`` JVPs) and eigendecompose the ``d × d``
    Gram ``ΨᵀΨ``. The posterior assembles ``Ψ₀`` for it (so the exact g-prior comes free) and hands it dense
    features; its decomposition is recomputed from them on resume, so it stores no state."""

    name = "exact_primal"
    summary = "assemble Ψ (d JVPs) and eigendecompose the d × d Gram ΨᵀΨ; small networks (d < c)"
    assembles_features = True

    Options = ExactOptions

    def __init__(
        self,
        features: FeatureOperator,
        *,
        chunk_size: int = ExactOptions.chunk_size,
        memory_budget: int | None = ExactOptions.memory_budget,
        progress: bool = ExactOptions.progress,
    ):
        super().__init__(
            features, chunk_size=chunk_size, memory_budget=memory_budget, progress=progress, side=ExactSide.PRIMAL
        )

    def state_dict(self) -> dict | None:
        """``None``: the decomposition is recomputed from the assembled ``Ψ`` (dense flops, no products)."""
        return None


@SOLVERS.register
class ExactDualSolver(ExactEigSolver):
    """:class:`ExactEigSolver` on the dual side: assemble ``K̄ = ΨΨᵀ`` (``c`` VJPs) and eigendecompose it; the
    state is the eigendecomposition."""

    name = "exact_dual"
    summary = "assemble K̄ = ΨΨᵀ (c VJPs) and eigendecompose it (c × c); small c"

    Options = ExactOptions

    def __init__(
        self,
        features: FeatureOperator,
        *,
        chunk_size: int = ExactOptions.chunk_size,
        memory_budget: int | None = ExactOptions.memory_budget,
        progress: bool = ExactOptions.progress,
    ):
        super().__init__(
            features, chunk_size=chunk_size, memory_budget=memory_budget, progress=progress, side=ExactSide.DUAL
        )
