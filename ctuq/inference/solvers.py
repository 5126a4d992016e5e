"""Solvers for ``C X = R`` with ``C = K̄/a + σ² I`` (rows: ``R`` ``(k, c)``), and the choice between them.

* :class:`CGSolver`: batched preconditioned conjugate gradients (:func:`pcg`) with relative tolerance (default
  ``1e-3``) and an iteration cap (default 150); each iteration costs one kernel product (one VJP + one JVP) per
  *unconverged* right-hand side. The preconditioner (low-rank Nyström/Halko eigendecomposition, pivoted
  Cholesky, or none) is built from ``K̄`` once, on first use, and reused for every ``(a, σ²)``.
* :class:`ExactEigSolver`: one eigendecomposition ``K̄ = Q diag(λ) Qᵀ`` (float64) — of ``K̄`` itself (``c`` VJPs,
  ``O(c³)``) or, for small networks (``d < c``), of the ``d × d`` Gram matrix ``ΨᵀΨ`` (``d`` JVPs, ``O(cd² + d³)``)
  — after which ``C⁻¹``, the effective dimension ``γ``, ``‖w*‖²`` and the log evidence are exact for every
  ``a, σ²`` at no further Jacobian cost.
* :class:`~ctuq.inference.sdd.SDDSolver` (stochastic dual descent) and :class:`~ctuq.inference.sgd.SGDSolver`
  (primal sample-then-optimise), first-order solvers for large ``c`` in their own modules; registered here.
* :func:`choose_solver` / :func:`make_solver`: pick the cheapest for a workload (EM steps, samples, prediction
  samples) from estimated Jacobian products, dense flops and memory.

Why not linear_operator's ``linear_cg`` (measured:
``tests/test_inference.py::test_pcg_uses_fewer_products_than_linear_cg`` and
``scripts/benchmark_inference.py --compare-cg``): ``linear_cg``

1. always runs at least 11 iterations (it only tests convergence from iteration 10 on), while with a rank-400
   preconditioner the published problems converge in ≤ 10; on a preconditioned test problem (c = 200, 5
   right-hand sides) that :func:`pcg` solves in 4 iterations (20 kernel products) it spends 60 (one initial
   residual product and 11 iterations per right-hand side); on the small U-Net with c = 7680 and 17 right-hand
   sides (16 iterations) it spends 289 kernel products against 272;
2. stops on the *mean* residual over right-hand sides, so single columns may end above the tolerance
   unreported, and it keeps multiplying converged columns (every column costs a VJP + JVP per iteration);
3. returns neither iteration counts nor residuals.

:func:`pcg` is the textbook preconditioned CG (Saad 2003, alg. 9.1) run on all columns at once, with a
per-column relative-residual test ``‖r_j‖ ≤ rtol ‖b_j‖`` and *deflation*: converged columns are frozen and no
longer multiplied. ``backend="linear_cg"`` on :class:`CGSolver` still runs ``linear_cg`` (statistics then come
from one extra product per column) for comparison.

The residuals reported are CG's recursively updated residuals (equal to the true ones in exact arithmetic;
measured in float32 on a U-Net kernel at rtol 1e-3: recursive 9.820e-4 vs true 9.818e-4 after 17 iterations,
9.305e-4 vs 9.310e-4 after 72).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time
import warnings
from typing import Callable

import torch

from ctuq.inference.features import FeatureOperator
from ctuq.inference.kernel import (
    KernelOperator,
    _check_hyper,
    assemble_features,
    assemble_kernel,
    measurement_covariance,
)
from ctuq.inference.preconditioners import (
    LowRankEig,
    LowRankPreconditioner,
    adaptive_nystrom_eig,
    pivoted_cholesky_eig,
    randomized_eig,
)

__all__ = [
    "ConvergenceWarning",
    "SolveStats",
    "pcg",
    "Solver",
    "CGSolver",
    "ExactEigSolver",
    "Workload",
    "SolverCostEstimate",
    "estimate_solver_costs",
    "choose_solver",
    "make_solver",
    "SolverSpec",
    "SOLVERS",
    "SOLVER_CHOICES",
    "PRECONDITIONERS",
    "resolve_solver",
    "dense_memory_budget",
    "dense_features_fit",
]


PRECONDITIONERS = ("nystrom", "halko", "pivoted_cholesky", "none")
"""CG preconditioners (:class:`CGSolver`)."""


class ConvergenceWarning(RuntimeWarning):
    """An iterative solve stopped at its iteration cap above its tolerance."""


@dataclasses.dataclass
class SolveStats:
    """What one batched solve cost and how well it converged.

    Attributes
    ----------
    iterations : torch.Tensor
        ``(k,)`` int, iterations each right-hand side needed (0 for direct solves).
    relative_residual : torch.Tensor
        ``(k,)`` float64, ``‖C x_j − b_j‖ / ‖b_j‖`` at exit (0 for a zero right-hand side).
    converged : torch.Tensor
        ``(k,)`` bool, ``relative_residual ≤ rtol``.
    n_products : int
        Kernel products (one VJP + one JVP each) spent.
    method : str
        ``"pcg"``, ``"linear_cg"`` or ``"eig"``.
    """

    iterations: torch.Tensor
    relative_residual: torch.Tensor
    converged: torch.Tensor
    n_products: int
    method: str

    @property
    def max_iterations(self) -> int:
        return int(self.iterations.max()) if self.iterations.numel() else 0

    @property
    def all_converged(self) -> bool:
        return bool(self.converged.all())

    def summary(self) -> dict:
        """JSON-friendly digest: method, max/mean iterations, max residual, converged count, products."""
        k = int(self.iterations.numel())
        return {
            "method": self.method,
            "n_rhs": k,
            "max_iterations": self.max_iterations,
            "mean_iterations": float(self.iterations.double().mean()) if k else 0.0,
            "max_relative_residual": float(self.relative_residual.max()) if k else 0.0,
            "n_converged": int(self.converged.sum()),
            "n_products": int(self.n_products),
        }


def pcg(
    matmul: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    *,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    rtol: float = 1e-3,
    max_iter: int = 150,
    x0: torch.Tensor | None = None,
    warn: bool = True,
) -> tuple[torch.Tensor, SolveStats]:
    """Batched preconditioned CG for SPD ``A``: solves ``A x_j = b_j`` for every row of ``rhs``.

    Parameters
    ----------
    matmul : callable
        ``X`` ``(m, c)`` → ``A X`` rows ``(m, c)``; called only on unconverged rows.
    rhs : torch.Tensor
        ``(k, c)`` right-hand sides.
    preconditioner : callable, optional
        ``R`` ``(m, c)`` → ``M⁻¹ R`` (SPD ``M ≈ A``); identity when omitted.
    rtol : float
        Per-row stopping rule ``‖b_j − A x_j‖ ≤ rtol ‖b_j‖``.
    max_iter : int
        Iteration cap; rows still above ``rtol`` then trigger a :class:`ConvergenceWarning` (when ``warn``).
    x0 : torch.Tensor, optional
        ``(k, c)`` initial guess (zeros by default).

    Returns
    -------
    (X, stats) : ``(k, c)`` solutions and :class:`SolveStats`.
    """
    if rhs.ndim != 2:
        raise ValueError(f"pcg: rhs must be (k, c), got shape {tuple(rhs.shape)}")
    if not (rtol > 0 and math.isfinite(rtol)):
        raise ValueError(f"pcg: rtol must be positive, got {rtol}")
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"pcg: max_iter must be a positive int, got {max_iter!r}")
    k = rhs.shape[0]
    precond = preconditioner if preconditioner is not None else (lambda R: R)
    bnorm = torch.linalg.vector_norm(rhs.double(), dim=1)
    X = torch.zeros_like(rhs) if x0 is None else x0.clone()
    if x0 is not None and x0.shape != rhs.shape:
        raise ValueError(f"pcg: x0 has shape {tuple(x0.shape)}, rhs {tuple(rhs.shape)}")
    n_products = 0
    if x0 is None:
        R = rhs.clone()
    else:
        R = rhs - matmul(X)
        n_products += k
    iterations = torch.zeros(k, dtype=torch.long)
    safe_b = torch.where(bnorm > 0, bnorm, torch.ones_like(bnorm))
    rel = torch.where(bnorm > 0, torch.linalg.vector_norm(R.double(), dim=1) / safe_b, torch.zeros_like(bnorm))
    active = (rel > rtol).nonzero().flatten()
    if active.numel():
        Z = precond(R[active])
        P = Z.clone()
        rz = (R[active] * Z).sum(1)
    for it in range(1, max_iter + 1):
        if active.numel() == 0:
            break
        AP = matmul(P)
        n_products += int(active.numel())
        pAp = (P * AP).sum(1)
        if not torch.all(pAp > 0):
            bad = active[~(pAp > 0)].tolist()
            raise FloatingPointError(
                f"pcg: pᵀAp <= 0 for right-hand side(s) {bad[:10]} at iteration {it}: the operator is not positive "
                f"definite in this precision (check a, σ² > 0 and the kernel's dtype)"
            )
        alpha = rz / pAp
        X[active] += alpha[:, None] * P
        R_act = R[active] - alpha[:, None] * AP
        R[active] = R_act
        iterations[active.cpu()] = it
        rel_act = torch.linalg.vector_norm(R_act.double(), dim=1) / safe_b[active]
        rel[active] = rel_act
        keep = rel_act > rtol
        if not torch.any(keep):
            active = active[keep]
            break
        # Deflation: drop converged rows so they cost no further products.
        active, P, rz, R_act = active[keep], P[keep], rz[keep], R_act[keep]
        Z = precond(R_act)
        rz_new = (R_act * Z).sum(1)
        beta = rz_new / rz
        P = Z + beta[:, None] * P
        rz = rz_new
    converged = rel <= rtol
    stats = SolveStats(iterations, rel.cpu(), converged.cpu(), n_products, "pcg")
    if warn and not stats.all_converged:
        _warn_not_converged(stats, rtol, max_iter)
    return X, stats


def _warn_not_converged(stats: SolveStats, rtol: float, max_iter: int) -> None:
    n_bad = int((~stats.converged).sum())
    warnings.warn(
        f"CG did not converge for {n_bad} of {stats.converged.numel()} right-hand side(s) within {max_iter} "
        f"iterations: largest relative residual {float(stats.relative_residual.max()):.3e} > rtol {rtol:.1e}. "
        f"Raise max_iter, use (a higher-rank) preconditioner, or loosen rtol; results are inaccurate.",
        ConvergenceWarning,
        stacklevel=3,
    )


# ----------------------------------------------------------------------------------------------- solvers
class Solver(abc.ABC):
    """Common interface: ``solve(rhs, a, sigma2) -> (X, SolveStats)`` for rows ``rhs`` ``(k, c)``.

    Attributes: ``features`` (Ψ), ``kernel`` (:class:`KernelOperator` K̄), ``exact`` (whether γ, ‖w*‖² and the
    evidence are available exactly via :meth:`ExactEigSolver.gamma` etc.).
    """

    exact: bool = False
    features: FeatureOperator
    kernel: KernelOperator

    warm_starts: bool = False
    """Whether :class:`~ctuq.inference.em.SampledEM` should pass the previous step's solutions as ``x0`` (the
    first-order solvers ``sdd``/``sgd``; CG and the exact solvers keep their numbers independent of earlier
    calls)."""

    @abc.abstractmethod
    def solve(self, rhs: torch.Tensor, a: float, sigma2: float, *,
              x0: torch.Tensor | None = None) -> tuple[torch.Tensor, SolveStats]:
        """``C⁻¹ rhs`` for rows ``rhs`` ``(k, c)`` at prior precision ``a`` and noise variance ``σ²``; ``x0``
        ``(k, c)`` is an initial guess for iterative solvers (ignored by direct ones)."""

    def covariance(self, a: float, sigma2: float):
        """``C = K̄/a + σ² I`` as a LinearOperator sharing this solver's kernel."""
        return measurement_covariance(self.kernel, a, sigma2)

    def _check_rhs(self, rhs: torch.Tensor) -> torch.Tensor:
        c = self.features.n_outputs
        if not isinstance(rhs, torch.Tensor) or rhs.ndim != 2 or rhs.shape[1] != c:
            got = tuple(rhs.shape) if isinstance(rhs, torch.Tensor) else type(rhs).__name__
            raise ValueError(f"{type(self).__name__}.solve: rhs has shape {got}; expected (k, {c})")
        return rhs.to(device=self.features.device, dtype=self.features.dtype)


class CGSolver(Solver):
    """Preconditioned CG on ``C = K̄/a + σ² I`` with a ``K̄``-only preconditioner built once.

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ``.
    preconditioner : {"nystrom", "halko", "pivoted_cholesky", "none"} or LowRankEig
        How to build ``K̄ ≈ U Λ Uᵀ`` (see :mod:`ctuq.inference.preconditioners`), or a ready decomposition
        (e.g. restored from a checkpoint with ``LowRankEig.from_state_dict``).
    rank, oversampling : int
        Preconditioner rank ``r`` and oversampling ``p`` (published: 400, 5-10).
    rtol, max_iter
        CG tolerance (relative, per right-hand side) and iteration cap.
    backend : {"pcg", "linear_cg"}
        :func:`pcg` (default) or linear_operator's ``linear_cg`` (comparison only; module docstring).
    seed : int
        Seeds the random test matrix of the randomised preconditioner (a CPU generator).
    pivoted_diagonal : {"exact", "stochastic"}
        How pivoted Cholesky gets ``diag(K̄)``.
    adaptive_rank : bool
        Grow a single-pass Nyström preconditioner in rounds until its smallest eigenvalue ``λ_r`` satisfies
        ``λ_r/a < rank_threshold · σ²`` at the ``(a, σ²)`` of the first solve (or of
        :meth:`build_preconditioner`), with ``rank`` as the cap (:func:`~ctuq.inference.preconditioners.
        adaptive_nystrom_eig`); ``preconditioner`` must be ``"nystrom"``. Off by default (fixed rank).
    rank_threshold : float
        The stated multiple of ``σ²`` of the adaptive rule (default 1).
    initial_rank : int
        First round of the adaptive rule (default 100; rounds grow by 1.5×).
    """

    def __init__(
        self,
        features: FeatureOperator,
        *,
        preconditioner: str | LowRankEig = "nystrom",
        rank: int = 400,
        oversampling: int = 10,
        rtol: float = 1e-3,
        max_iter: int = 150,
        backend: str = "pcg",
        seed: int = 0,
        pivoted_diagonal: str = "exact",
        adaptive_rank: bool = False,
        rank_threshold: float = 1.0,
        initial_rank: int = 100,
    ):
        if isinstance(preconditioner, str) and preconditioner not in PRECONDITIONERS:
            raise ValueError(
                f"CGSolver: preconditioner must be one of {list(PRECONDITIONERS)} or a LowRankEig, "
                f"got {preconditioner!r}"
            )
        if adaptive_rank and isinstance(preconditioner, str) and preconditioner != "nystrom":
            raise ValueError(f"CGSolver: adaptive_rank grows a single-pass Nyström preconditioner; it does not "
                             f"apply to preconditioner {preconditioner!r} (use 'nystrom')")
        if not (rank_threshold > 0 and math.isfinite(rank_threshold)):
            raise ValueError(f"CGSolver: rank_threshold must be positive, got {rank_threshold!r}")
        if not isinstance(initial_rank, int) or initial_rank < 1:
            raise ValueError(f"CGSolver: initial_rank must be a positive int, got {initial_rank!r}")
        self.adaptive_rank = bool(adaptive_rank)
        self.rank_threshold = float(rank_threshold)
        self.initial_rank = int(initial_rank)
        if backend not in ("pcg", "linear_cg"):
            raise ValueError(f"CGSolver: backend must be 'pcg' or 'linear_cg', got {backend!r}")
        if not (rtol > 0 and math.isfinite(rtol)):
            raise ValueError(f"CGSolver: rtol must be positive, got {rtol}")
        if not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"CGSolver: max_iter must be a positive int, got {max_iter!r}")
        self.features = features
        self.kernel = KernelOperator(features=features)
        self.rank = int(rank)
        self.oversampling = int(oversampling)
        self.rtol = float(rtol)
        self.max_iter = int(max_iter)
        self.backend = backend
        self.seed = int(seed)
        self.pivoted_diagonal = pivoted_diagonal
        self._eig: LowRankEig | None = None
        if isinstance(preconditioner, LowRankEig):
            if preconditioner.U.shape[0] != features.n_outputs:
                raise ValueError(
                    f"CGSolver: the given LowRankEig has {preconditioner.U.shape[0]} rows, the features have "
                    f"c = {features.n_outputs}"
                )
            self._eig = LowRankEig(
                preconditioner.U.to(features.device, features.dtype),
                preconditioner.eigenvalues.to(features.device, features.dtype),
                preconditioner.n_products, preconditioner.method, preconditioner.n_diag_products,
            )
            self.preconditioner_kind = preconditioner.method
        else:
            self.preconditioner_kind = preconditioner
        self.setup_time_s = 0.0

    @property
    def low_rank(self) -> LowRankEig | None:
        """The preconditioner's decomposition (built on first use; ``None`` for ``"none"``)."""
        if self._eig is None and self.preconditioner_kind != "none":
            self.build_preconditioner()
        return self._eig

    def build_preconditioner(self, a: float | None = None, sigma2: float | None = None) -> LowRankEig | None:
        """Build the ``K̄`` decomposition now (otherwise the first solve does); idempotent.

        ``a``, ``σ²`` set the stopping rule of ``adaptive_rank`` (required then; ignored otherwise)."""
        if self._eig is not None or self.preconditioner_kind == "none":
            return self._eig
        t0 = time.perf_counter()
        if self.adaptive_rank:
            if a is None or sigma2 is None:
                raise ValueError("CGSolver.build_preconditioner: adaptive_rank needs the (a, σ²) at which to stop "
                                 "growing the rank: pass build_preconditioner(a, sigma2)")
            self._eig = adaptive_nystrom_eig(self.kernel, self.rank, a=a, sigma2=sigma2,
                                             threshold=self.rank_threshold, initial_rank=self.initial_rank,
                                             oversampling=self.oversampling, seed=self.seed)
        elif self.preconditioner_kind in ("nystrom", "halko"):
            self._eig = randomized_eig(
                self.kernel, self.rank, oversampling=self.oversampling, method=self.preconditioner_kind,
                seed=self.seed,
            )
        else:
            self._eig = pivoted_cholesky_eig(self.kernel, self.rank, diagonal=self.pivoted_diagonal, seed=self.seed)
        self.setup_time_s = time.perf_counter() - t0
        return self._eig

    def preconditioner_inverse(self, a: float, sigma2: float) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``R ↦ P⁻¹ R`` at ``(a, σ²)`` (``None`` without a preconditioner); reuses the ``K̄`` decomposition."""
        eig = self.build_preconditioner(a, sigma2) if self._eig is None else self._eig
        return None if eig is None else LowRankPreconditioner(eig).inverse(a, sigma2)

    def solve(
        self, rhs: torch.Tensor, a: float, sigma2: float, *, x0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, SolveStats]:
        """Solve ``C X = rhs`` for rows ``rhs`` ``(k, c)``; returns ``(X, SolveStats)``; warns if unconverged."""
        rhs = self._check_rhs(rhs)
        a_f, s2_f = _check_hyper(a, sigma2, "CGSolver.solve")
        C = self.covariance(a_f, s2_f)
        precond = self.preconditioner_inverse(a_f, s2_f)

        def matmul(X: torch.Tensor) -> torch.Tensor:
            return C.matmul(X.mT).mT

        if self.backend == "pcg":
            return pcg(matmul, rhs, preconditioner=precond, rtol=self.rtol, max_iter=self.max_iter, x0=x0)
        return self._solve_linear_cg(matmul, rhs, precond, x0)

    def _solve_linear_cg(self, matmul, rhs, precond, x0):
        from linear_operator.utils.linear_cg import linear_cg
        from linear_operator.utils.warnings import NumericalWarning

        calls = [0]

        def closure(Xc: torch.Tensor) -> torch.Tensor:  # linear_cg works on columns (c, k)
            calls[0] += Xc.shape[-1]
            return matmul(Xc.mT).mT

        pre = None if precond is None else (lambda Rc: precond(Rc.mT).mT)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NumericalWarning)  # we warn ourselves, with per-column numbers
            Xc = linear_cg(closure, rhs.mT.contiguous(), tolerance=self.rtol, max_iter=self.max_iter,
                           preconditioner=pre, initial_guess=None if x0 is None else x0.mT.contiguous())
        X = Xc.mT.contiguous()
        n_loop = calls[0]
        resid = rhs - matmul(X)
        bnorm = torch.linalg.vector_norm(rhs.double(), dim=1)
        rel = torch.where(bnorm > 0, torch.linalg.vector_norm(resid.double(), dim=1) / bnorm.clamp_min(1e-300),
                          torch.zeros_like(bnorm))
        k = rhs.shape[0]
        # linear_cg multiplies every column every iteration (after one initial residual product).
        iters = max(0, n_loop // max(k, 1) - 1)
        stats = SolveStats(torch.full((k,), iters, dtype=torch.long), rel.cpu(), (rel <= self.rtol).cpu(),
                           n_loop + k, "linear_cg")
        if not stats.all_converged:
            _warn_not_converged(stats, self.rtol, self.max_iter)
        return X, stats


class ExactEigSolver(Solver):
    """Direct solves through one eigendecomposition ``K̄ = Q diag(λ) Qᵀ`` (float64), built on first use.

    After the decomposition, every quantity below is exact for any ``(a, σ²)`` with no Jacobian products:
    ``C⁻¹ = Q diag(1/(λ/a + σ²)) Qᵀ + (I − QQᵀ)/σ²``, :meth:`gamma`, :meth:`weight_norm_sq`, :meth:`log_evidence`,
    :meth:`sample_Psi_w0` (draws of ``Ψ w₀`` with ``w₀ ~ N(0, a⁻¹ I)``, in distribution).

    Two ways to the same decomposition (``side``):

    * ``"dual"``: assemble ``K̄`` (``c × c``, see :func:`~ctuq.inference.kernel.assemble_kernel`) and
      ``eigh`` it: ``Q`` is ``c × c``. Cost ``O(c³)``.
    * ``"primal"``: assemble ``Ψ`` itself (``c × d``; ``d`` JVPs or ``c`` VJPs, whichever is fewer), ``eigh`` the
      ``d × d`` Gram matrix ``ΨᵀΨ = V diag(λ) Vᵀ`` and map ``Q = Ψ V diag(λ)^(−1/2)``: the non-zero spectrum of
      ``K̄ = ΨΨᵀ`` is that of ``ΨᵀΨ``, so this is the same decomposition restricted to ``range(Ψ)`` (``Q`` is
      ``c × r``, ``r ≤ d``), at ``O(cd² + d³)``: the cheap route for small networks (``d < c``).
    * ``"auto"``: ``"primal"`` when ``d < c``, else ``"dual"``.

    Eigenvalues below ``1e-12·λ_max`` are dropped (their directions join the orthogonal complement, where
    ``C = σ²I``). Solves are written as ``C⁻¹b = b/σ² + Q diag(1/(λ/a + σ²) − 1/σ²) Qᵀ b`` so that directions
    with tiny ``λ`` — whose ``Q`` columns carry the most round-off in the primal route — contribute ~0.

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ``.
    chunk_size : int
        Rows per product call while assembling.
    memory_budget : int, optional
        Bytes for storing ``Ψᵀ`` during dual assembly (see :func:`~ctuq.inference.kernel.assemble_kernel`).
    progress : bool
        Progress bar while assembling.
    side : {"auto", "dual", "primal"}
        Which Gram matrix to decompose (above).
    """

    exact = True

    def __init__(self, features: FeatureOperator, *, chunk_size: int = 64, memory_budget: int | None = None,
                 progress: bool = False, side: str = "auto"):
        if side not in ("auto", "dual", "primal"):
            raise ValueError(f"ExactEigSolver: side must be 'auto', 'dual' or 'primal', got {side!r}")
        self.features = features
        self.kernel = KernelOperator(features=features)
        self.chunk_size = int(chunk_size)
        self.memory_budget = memory_budget
        self.progress = progress
        self.side = side
        self._Q: torch.Tensor | None = None
        self._lam: torch.Tensor | None = None
        self.setup_time_s = 0.0
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
            t0 = time.perf_counter()
            before = self.features.n_rmatvec + self.features.n_matvec
            if self.resolved_side == "dual":
                K = assemble_kernel(self.features, chunk_size=self.chunk_size, memory_budget=self.memory_budget,
                                    progress=self.progress)
                lam, Q = torch.linalg.eigh(K)
                del K
            else:
                P = assemble_features(self.features, chunk_size=self.chunk_size, progress=self.progress)
                lam, V = torch.linalg.eigh(P.T @ P)
                Q = P @ V
                del P, V
            # K̄ is PSD: drop round-off-level (and negative) eigenvalues into the σ²-only complement.
            keep = lam > 1e-12 * float(lam.abs().max().clamp_min(1e-300))
            lam, Q = lam[keep], Q[:, keep]
            if self.resolved_side == "primal":
                Q = Q / lam.sqrt()
            self._lam, self._Q = lam, Q
            self.n_setup_products = self.features.n_rmatvec + self.features.n_matvec - before
            self.setup_time_s = time.perf_counter() - t0
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

    def solve(self, rhs: torch.Tensor, a: float, sigma2: float, *,
              x0: torch.Tensor | None = None) -> tuple[torch.Tensor, SolveStats]:
        """``C⁻¹ rhs`` for rows ``(k, c)`` (dense, no Jacobian products; ``x0`` is ignored); residual from the
        decomposition."""
        rhs = self._check_rhs(rhs)
        a_f, s2_f = _check_hyper(a, sigma2, "ExactEigSolver.solve")
        lam, Q = self.decompose()
        b = rhs.double().to(Q.device)
        X = self._apply_inverse(b, a_f, s2_f)
        resid = s2_f * X + ((X @ Q) * (lam / a_f)) @ Q.T - b
        bnorm = torch.linalg.vector_norm(b, dim=1)
        rel = torch.where(bnorm > 0, torch.linalg.vector_norm(resid, dim=1) / bnorm.clamp_min(1e-300),
                          torch.zeros_like(bnorm))
        k = rhs.shape[0]
        stats = SolveStats(torch.zeros(k, dtype=torch.long), rel.cpu(), torch.ones(k, dtype=torch.bool), 0, "eig")
        return X.to(self.features.dtype), stats

    def gamma(self, a: float, sigma2: float) -> float:
        """Effective dimension ``γ = Σ_i λ_i / (λ_i + a σ²)`` (exact)."""
        a_f, s2_f = _check_hyper(a, sigma2, "ExactEigSolver.gamma")
        lam, _ = self.decompose()
        return float((lam / (lam + a_f * s2_f)).sum())

    def weight_norm_sq(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``‖w*‖² = a⁻² Σ_i λ_i (q_iᵀỹ)² / (λ_i/a + σ²)²`` for the posterior mean ``w* = a⁻¹ΨᵀC⁻¹ỹ``."""
        a_f, s2_f = _check_hyper(a, sigma2, "ExactEigSolver.weight_norm_sq")
        lam, Q = self.decompose()
        proj = self._project(y_tilde, Q)
        return float((lam * proj**2 / (lam / a_f + s2_f) ** 2).sum() / a_f**2)

    def residual_norm_sq(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``‖ỹ − Ψw*‖² = σ⁴ ‖C⁻¹ỹ‖²`` (exact)."""
        a_f, s2_f = _check_hyper(a, sigma2, "ExactEigSolver.residual_norm_sq")
        u = self._apply_inverse(self._y(y_tilde)[None], a_f, s2_f)[0]
        return float(s2_f**2 * (u @ u))

    def log_evidence(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``log N(ỹ; 0, C) = −½ ỹᵀC⁻¹ỹ − ½ log det C − (c/2) log 2π`` (nats; exact)."""
        a_f, s2_f = _check_hyper(a, sigma2, "ExactEigSolver.log_evidence")
        lam, _ = self.decompose()
        y = self._y(y_tilde)
        u = self._apply_inverse(y[None], a_f, s2_f)[0]
        c = self.features.n_outputs
        logdet = torch.log(lam / a_f + s2_f).sum() + (c - lam.numel()) * math.log(s2_f)
        return float(-0.5 * (y @ u) - 0.5 * logdet - 0.5 * c * math.log(2 * math.pi))

    def sample_Psi_w0(self, n: int, a: float, generator: torch.Generator) -> torch.Tensor:
        """``n`` draws of ``Ψ w₀ ~ N(0, K̄/a)`` ``(n, c)`` from the decomposition (no products).

        Uses ``n·r`` standard normals from ``generator`` (``r`` retained eigenvalues).
        """
        lam, Q = self.decompose()
        xi = torch.randn((n, lam.numel()), generator=generator, device=generator.device, dtype=torch.float64)
        return ((xi.to(Q.device) * (lam / float(a)).sqrt()) @ Q.T).to(self.features.dtype)

    def _y(self, y_tilde: torch.Tensor) -> torch.Tensor:
        c = self.features.n_outputs
        if not isinstance(y_tilde, torch.Tensor) or tuple(y_tilde.shape) != (c,):
            got = tuple(y_tilde.shape) if isinstance(y_tilde, torch.Tensor) else type(y_tilde).__name__
            raise ValueError(f"ExactEigSolver: y_tilde must have shape ({c},), got {got}")
        _, Q = self.decompose()
        return y_tilde.to(Q.device, torch.float64)

    def _project(self, y_tilde: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
        return Q.T @ self._y(y_tilde)

    def state_dict(self) -> dict:
        """``{"eigenvalues", "eigenvectors"}`` (CPU float64) for checkpointing the decomposition."""
        lam, Q = self.decompose()
        return {"eigenvalues": lam.cpu(), "eigenvectors": Q.cpu()}


# ----------------------------------------------------------------------------------------------- choice
@dataclasses.dataclass
class Workload:
    """What the inference will do, to estimate solver costs.

    Attributes
    ----------
    em_steps : int
        Sampled-EM steps (default 5).
    em_samples : int
        Posterior samples per EM step (default 16).
    prediction_samples : int
        Weight-space posterior samples for prediction (default 1024).
    cg_iterations : float
        Expected preconditioned CG iterations per solve (published: ≤ 10 with a rank-400 preconditioner).
    rank, oversampling : int
        CG preconditioner rank (the cap with an adaptive rank) and oversampling.
    sdd_iterations, sgd_iterations : float
        Iterations per solve of the first-order solvers (their budgets, ``uq.sdd_iterations`` /
        ``uq.sgd_iterations``).
    chunk : int
        Prediction samples solved together (``uq.sample_chunk``): the first-order solvers hold a few
        ``chunk × c`` (SDD) or ``chunk × d`` (SGD) buffers.
    lanczos_steps : int
        Kernel products of the first-order solvers' ``λ_max(K̄)`` estimate.
    """

    em_steps: int = 5
    em_samples: int = 16
    prediction_samples: int = 1024
    cg_iterations: float = 10.0
    rank: int = 400
    oversampling: int = 10
    sdd_iterations: float = 1000.0
    sgd_iterations: float = 1000.0
    chunk: int = 64
    lanczos_steps: int = 20


@dataclasses.dataclass
class SolverCostEstimate:
    """Estimated cost of one solver for a :class:`Workload`.

    ``jvp``/``vjp``: Jacobian products; ``dense_flops``: dense linear algebra; ``memory_bytes``: peak extra
    memory of the solver; ``seconds``: ``jvp·t_jvp + vjp·t_vjp + dense_flops/flop_rate``; ``feasible``: fits the
    memory budget.
    """

    solver: str
    jvp: float
    vjp: float
    dense_flops: float
    memory_bytes: float
    seconds: float
    feasible: bool


def estimate_solver_costs(
    c: int,
    d: int,
    workload: Workload = Workload(),
    *,
    t_jvp: float = 1.0,
    t_vjp: float = 1.0,
    flop_rate: float = 1e10,
    memory_budget: float = 4 * 1024**3,
    itemsize: int = 4,
) -> dict[str, SolverCostEstimate]:
    """Cost model of ``"exact"``, ``"cg"``, ``"sdd"`` and ``"sgd"`` for ``c`` outputs, ``d`` features and a workload.

    Products (per sample; one kernel product = 1 VJP + 1 JVP), with ``k`` EM samples, ``n`` prediction samples,
    ``S`` EM steps, ``i`` CG iterations, rank ``r + p``:

    * exact, dual route (``d ≥ c``): assembly ``c`` VJPs (+ ``c`` JVPs when ``Ψᵀ`` (``c·d`` values) exceeds the
      memory budget); dense ``9c³`` (eigh) + ``2c²d`` (Gram GEMM, if used). Primal route (``d < c``, see
      :class:`ExactEigSolver`): ``d`` JVPs; dense ``2cd²`` (Gram) + ``9d³`` (eigh) + ``2cd²`` (``Q = ΨV``).
      Either way EM with exact ``γ`` costs nothing; prediction ``n`` JVPs (``Ψw₀``) + ``n + 1`` VJPs and
      ``4c·r·(n+1)`` dense flops for the solves (``r = min(c, d)``).
    * cg: preconditioner ``r + p`` kernel products; EM ``S·(k JVPs + (k+1)·i kernel products)``; prediction
      ``n JVPs + (n+1)(i + 1) VJPs + (n+1)·i JVPs``. Dense: ``4c(r+p)`` per CG iteration and column. Memory
      ``2c(r+p)`` float64 (the sketch and the basis).
    * sdd / sgd (``T`` = ``sdd_iterations`` / ``sgd_iterations``, the budget: early stops make it an upper
      bound): ``λ_max`` by ``lanczos_steps`` kernel products; every solve ``T`` kernel products per column plus
      one for the exact final residual (SDD) or ``T/10 + 1`` JVPs for the residual checks and one VJP for a warm
      start (SGD); otherwise as cg. Memory: five ``chunk × c`` buffers (SDD) or four ``chunk × d`` (SGD), plus
      the Lanczos basis ``lanczos_steps × c`` float64.

    Image-space prediction JVPs (``x = Φ(s ⊙ ζ)``) are the same for both and not included. ``t_jvp``/``t_vjp``
    are seconds per sample; ``flop_rate`` dense flops per second.
    """
    k, n, S, it = workload.em_samples, workload.prediction_samples, workload.em_steps, workload.cg_iterations
    rp = min(c, workload.rank + workload.oversampling)
    r = min(c, d)
    if d < c:
        ex_jvp, ex_vjp = d + n, n + 1
        ex_flops = 4.0 * c * d * d + 9.0 * d**3 + 4.0 * c * r * (n + 1)
        ex_mem = 2.0 * c * d * 8 + d * d * 8
    else:
        gram = c * d * itemsize <= memory_budget
        ex_vjp = c + (n + 1)
        ex_jvp = (0 if gram else c) + n
        ex_flops = 9.0 * c**3 + (2.0 * c * c * d if gram else 0.0) + 4.0 * c * c * (n + 1)
        ex_mem = 3.0 * c * c * 8 + (c * d * itemsize if gram else 0.0)
    cg_prods = rp + S * (k + 1) * it + (n + 1) * it
    cg_jvp = cg_prods + S * k + n
    cg_vjp = cg_prods + (n + 1)
    cg_flops = (S * (k + 1) + (n + 1)) * it * 4.0 * c * rp + 2.0 * c * rp * rp
    cg_mem = 2.0 * c * rp * 8
    n_solves = S * (k + 1) + (n + 1)
    L = workload.lanczos_steps
    T_sdd, T_sgd = workload.sdd_iterations, workload.sgd_iterations
    sdd_prods = L + n_solves * (T_sdd + 1)
    sdd_jvp, sdd_vjp = sdd_prods + S * k + n, sdd_prods + (n + 1)
    sgd_prods = L + n_solves * T_sgd
    sgd_jvp = sgd_prods + n_solves * (T_sgd / 10.0 + 1) + S * k + n
    sgd_vjp = sgd_prods + n_solves + (n + 1)
    m = max(k + 1, workload.chunk)
    fo_flops = n_solves * 10.0 * c
    sdd_mem = 5.0 * m * c * itemsize + L * c * 8.0
    sgd_mem = 4.0 * m * d * itemsize + L * c * 8.0
    out = {}
    for name, jv, vj, fl, mem in (
        ("exact", ex_jvp, ex_vjp, ex_flops, ex_mem),
        ("cg", cg_jvp, cg_vjp, cg_flops, cg_mem),
        ("sdd", sdd_jvp, sdd_vjp, fo_flops * T_sdd, sdd_mem),
        ("sgd", sgd_jvp, sgd_vjp, fo_flops * T_sgd * d / max(c, 1), sgd_mem),
    ):
        out[name] = SolverCostEstimate(name, float(jv), float(vj), float(fl), float(mem),
                                       jv * t_jvp + vj * t_vjp + fl / flop_rate, mem <= memory_budget)
    return out


def _measure_rates(features: FeatureOperator) -> tuple[float, float, float]:
    """(seconds per JVP, seconds per VJP, dense flops/s) measured with a few products and one GEMM."""
    dev = features.device
    B = 4
    W = torch.zeros((B, features.n_features), dtype=features.dtype, device=dev)
    R = torch.zeros((B, features.n_outputs), dtype=features.dtype, device=dev)
    features.matvec(W[:1])  # warm-up (tracing, allocation)
    features.rmatvec(R[:1])
    ts = []
    for fn, X in ((features.matvec, W), (features.rmatvec, R)):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn(X)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ts.append((time.perf_counter() - t0) / B)
    m = 512
    A = torch.randn((m, m), dtype=torch.float64, device=dev)
    A @ A
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    A @ A
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    flop_rate = 2.0 * m**3 / max(time.perf_counter() - t0, 1e-9)
    return ts[0], ts[1], flop_rate


def choose_solver(
    features: FeatureOperator,
    workload: Workload = Workload(),
    *,
    t_jvp: float | None = None,
    t_vjp: float | None = None,
    flop_rate: float | None = None,
    memory_budget: float | None = None,
) -> tuple[str, dict[str, SolverCostEstimate]]:
    """``("exact" | "cg" | "sdd" | "sgd", estimates)``: the cheapest feasible solver for ``workload`` by estimated
    seconds (:func:`estimate_solver_costs`; when none fits the memory budget, the one needing the least memory).

    Product times and the dense flop rate are measured (4 products of each kind, one 512² GEMM; counted by the
    features' counters) unless given. ``memory_budget`` defaults to 4 GiB on CPU, half the free memory on CUDA.
    """
    if t_jvp is None or t_vjp is None or flop_rate is None:
        mj, mv, mf = _measure_rates(features)
        t_jvp = mj if t_jvp is None else t_jvp
        t_vjp = mv if t_vjp is None else t_vjp
        flop_rate = mf if flop_rate is None else flop_rate
    if memory_budget is None:
        from ctuq.utils import free_memory_bytes

        memory_budget = (0.5 * free_memory_bytes(features.device) if features.device.type == "cuda"
                         else 4 * 1024**3)
    est = estimate_solver_costs(
        features.n_outputs, features.n_features, workload, t_jvp=t_jvp, t_vjp=t_vjp, flop_rate=flop_rate,
        memory_budget=memory_budget, itemsize=torch.empty((), dtype=features.dtype).element_size(),
    )
    feasible = [e for e in est.values() if e.feasible] or [min(est.values(), key=lambda e: e.memory_bytes)]
    best = min(feasible, key=lambda e: e.seconds)
    return best.solver, est


def make_solver(features: FeatureOperator, kind: str = "auto", workload: Workload = Workload(), **options) -> Solver:
    """A solver for ``features``, constructed (not yet decomposed or preconditioned): ``kind`` one of
    :data:`SOLVER_CHOICES` (``"auto"`` by :func:`choose_solver`, ``"exact"`` by :func:`resolve_solver`, or a
    :data:`SOLVERS` name). The one place solvers are built (:class:`~ctuq.inference.LinearizedPosterior` builds
    through it too).

    ``options`` go to the chosen solver's constructor: each :class:`SolverSpec` lists the ones its solver takes
    (``SOLVERS[name].options``); options of the other solvers are ignored (so ``"auto"`` can be given all), names
    no solver takes raise. ``side="primal"|"dual"`` with ``kind="exact"`` picks the exact side. For ``"auto"``,
    ``rank``/``oversampling`` given here also enter the cost model.
    """
    known = set().union(*(spec.options for spec in SOLVERS.values()))
    unknown = sorted(set(options) - known - {"side"})
    if unknown:
        raise ValueError(f"make_solver: unknown option(s) {unknown}; valid: {sorted(known | {'side'})}")
    if kind not in SOLVER_CHOICES:
        raise ValueError(f"make_solver: kind must be one of {list(SOLVER_CHOICES)}, got {kind!r}")
    side = options.pop("side", "auto")
    if kind == "exact" and side in ("primal", "dual"):
        kind = f"exact_{side}"
    wl = dataclasses.replace(workload, rank=int(options.get("rank", workload.rank)),
                             oversampling=int(options.get("oversampling", workload.oversampling)))
    name, _ = resolve_solver(kind, features, wl)
    spec = SOLVERS[name]
    kw = {k: v for k, v in options.items() if k in spec.options}
    if name in ("exact_primal", "exact_dual"):
        return ExactEigSolver(features, side=name[len("exact_"):], **kw)
    if name == "cg":
        return CGSolver(features, **kw)
    if name == "sdd":
        from ctuq.inference.sdd import SDDSolver

        return SDDSolver(features, **kw)
    from ctuq.inference.sgd import SGDSolver

    return SGDSolver(features, **kw)


# ----------------------------------------------------------------------------------------------- registry
@dataclasses.dataclass(frozen=True)
class SolverSpec:
    """One entry of :data:`SOLVERS`: a way to apply ``C⁻¹``.

    Attributes
    ----------
    name : str
        The option value (``uq.solver``).
    exact : bool
        Exact ``γ``, ``‖w*‖²`` and log evidence (EM at no Jacobian cost).
    assembles_features : bool
        Assembles ``Ψ`` itself (``d`` JVPs; needs ``c·d`` floats): the exact g-prior then comes free.
    summary : str
        One line for ``--help`` and docs.
    options : frozenset of str
        The constructor options of its solver (:func:`make_solver` passes these and drops the others').
    """

    name: str
    exact: bool
    assembles_features: bool
    summary: str
    options: frozenset = frozenset()


_EXACT_OPTIONS = frozenset({"chunk_size", "memory_budget", "progress"})
_FIRST_ORDER_OPTIONS = frozenset({"momentum", "max_iter", "rtol", "seed", "lanczos_steps", "lambda_max"})


SOLVERS: dict[str, SolverSpec] = {
    "exact_primal": SolverSpec("exact_primal", True, True,
                               "assemble Ψ (d JVPs) and eigendecompose the d × d Gram ΨᵀΨ; small networks (d < c)",
                               _EXACT_OPTIONS),
    "exact_dual": SolverSpec("exact_dual", True, False,
                             "assemble K̄ = ΨΨᵀ (c VJPs) and eigendecompose it (c × c); small c", _EXACT_OPTIONS),
    "cg": SolverSpec("cg", False, False,
                     "preconditioned conjugate gradients on C = K̄/a + σ²I with a low-rank K̄ preconditioner "
                     "(fixed or adaptive rank)",
                     frozenset({"preconditioner", "rank", "oversampling", "rtol", "max_iter", "backend", "seed",
                                "pivoted_diagonal", "adaptive_rank", "rank_threshold", "initial_rank"})),
    "sdd": SolverSpec("sdd", False, False,
                      "stochastic dual descent on ½uᵀCu − uᵀb (Nesterov, iterate averaging; full batch or "
                      "coordinate blocks); large c",
                      _FIRST_ORDER_OPTIONS | {"step_size", "batch_size", "averaging"}),
    "sgd": SolverSpec("sgd", False, False,
                      "primal sample-then-optimise: Nesterov gradient descent over the weights, C⁻¹r = "
                      "(r − Ψz*)/σ²; large c",
                      _FIRST_ORDER_OPTIONS | {"lr", "lr_decay", "clip", "check_every"}),
}
"""Every solver ctuq has, by option name."""

SOLVER_CHOICES = ("auto", "exact", *SOLVERS)
"""Values of the ``uq.solver`` option: ``auto`` picks by estimated cost, ``exact`` the cheaper exact side."""

def resolve_solver(
    kind: str,
    features: FeatureOperator,
    workload: Workload = Workload(),
    *,
    memory_budget: float | None = None,
) -> tuple[str, dict[str, SolverCostEstimate] | None]:
    """The :data:`SOLVERS` name for option ``kind`` on ``features`` (``c × d``), and the cost estimates if any.

    ``"auto"``: exact, CG, SDD or SGD by :func:`choose_solver` (which measures product times); ``"exact"``:
    ``"exact_primal"`` when ``d < c`` and the assembled ``Ψ`` (twice, float64: ``2·c·d·8`` bytes) fits
    ``memory_budget`` (default: 40 % of the available host memory, at most 8 GiB; half the free GPU memory),
    else ``"exact_dual"``. Names in :data:`SOLVERS` pass through.
    """
    if kind not in SOLVER_CHOICES:
        raise ValueError(f"uq.solver must be one of {list(SOLVER_CHOICES)}, got {kind!r}")
    estimates = None
    if kind == "auto":
        kind, estimates = choose_solver(features, workload)
    if kind == "exact":
        c, d = features.n_outputs, features.n_features
        kind = ("exact_primal" if d < c and dense_features_fit(c, d, features.device, memory_budget)
                else "exact_dual")
    return kind, estimates


def dense_features_fit(c: int, d: int, device: torch.device | str, memory_budget: float | None = None) -> bool:
    """Whether an assembled ``Ψ`` (``c × d``) fits the dense budget: two float64 copies, ``2·c·d·8`` bytes, against
    ``memory_budget`` (bytes; default :func:`dense_memory_budget` of ``device``)."""
    if memory_budget is None:
        memory_budget = dense_memory_budget(device)
    return 2 * c * d * 8 <= memory_budget


def dense_memory_budget(device: torch.device | str) -> int:
    """Bytes a dense exact solver may use on ``device``: half the free GPU memory, or 40 % of the available host
    memory capped at 8 GiB (4 GiB where the OS does not say)."""
    from ctuq.utils import free_memory_bytes

    avail = free_memory_bytes(device)
    if torch.device(device).type == "cuda":
        return int(0.5 * avail)
    return int(min(8 * 1024**3, 0.4 * avail)) if avail else 4 * 1024**3
