"""Preconditioners for ``C = K̄/a + σ² I``, built once from ``K̄`` and reused for every ``(a, σ²)``.

Every preconditioner here is a low-rank approximation ``K̄ ≈ U Λ Uᵀ`` (``U`` ``c × r`` orthonormal, ``Λ ≥ 0``),
stored as a :class:`LowRankEig`. For given ``a`` and ``σ²``::

    P = U Λ Uᵀ / a + σ² I ,     P⁻¹ = U diag(1/(λ/a + σ²)) Uᵀ + (I − U Uᵀ)/σ²     (Woodbury, U orthonormal)

costs ``O(c r)`` per right-hand side and no Jacobian products, so EM steps that change ``a`` (and ``σ²``) reuse
the decomposition as it is (:class:`LowRankPreconditioner`).

Ways to get the decomposition:

* :func:`randomized_eig` ``method="nystrom"`` (default): single-pass randomised Nyström (Tropp, Yurtsever, Udell
  & Cevher 2017, "Fixed-rank approximation of a positive-semidefinite matrix from streaming data", alg. 3, with
  its stabilising shift; orthonormalised Gaussian test matrix): ``Y = K̄ Ω`` for ``Ω`` ``c × (r+p)``,
  ``r + p`` kernel products.
* :func:`randomized_eig` ``method="halko"``: Halko, Martinsson & Tropp 2011 alg. 5.6 (range finder ``Q = orth(K̄Ω)``,
  then the Nyström factorisation ``K̄Q (QᵀK̄Q)⁻¹ QᵀK̄``), ``2(r + p)`` kernel products.

  Which one is default, and why (measured: ``scripts/benchmark_cg.py --preset tiny --size 64
  --c 1024 --detectors 64``; CG iterations to rtol 1e-3, max over the right-hand sides, aσ² = 1,
  p = 10; kernel products of the preconditioner in brackets)::

      kernel                          rank r   single-pass r   alg. 5.6 r   single-pass 2r+p   piv. Cholesky r
      synthetic λ_i = 1e5·i⁻², c=400   50      27 (60)         23 (120)     15 (120)           27 (50 + 400 diag)
      synthetic λ_i = 1e5·i⁻², c=400  100      16 (110)        13 (220)      8 (220)           16 (100 + 400 diag)
      synthetic 1e5…1e-5 log, c=400   100      66 (110)        54 (220)      5 (220)           68 (100 + 400 diag)
      U-Net tiny 64², c=1024 (none: 54) 50     22 (60)         19 (120)     15 (120)           24 (50 + 1024 diag)
      U-Net tiny 64², c=1024          100      17 (110)        13 (220)     10 (220)           17 (100 + 1024 diag)
      U-Net tiny 64², c=1024          200      11 (210)         8 (420)      6 (420)           11 (200 + 1024 diag)

  At equal rank the single pass is *not* quite as good: 15-35 % more CG iterations than alg. 5.6 (whose second
  pass is a power iteration). At equal kernel products, which is what the preconditioner costs, the single
  pass at rank ``2r + p`` needs 1.3-10× fewer iterations than alg. 5.6 at rank ``r``. Products are the cost unit
  (memory ``c × r`` and the ``O(c r)`` Woodbury apply are negligible next to a Jacobian product), so the single
  pass is the default: spend the budget of alg. 5.6 on a single pass of twice the rank. ``"halko"`` remains
  available for comparison.
* :func:`pivoted_cholesky_eig`: linear_operator's greedy pivoted Cholesky ``K̄ ≈ L Lᵀ`` (Harbrecht et al. 2012)
  on the :class:`~ctuq.inference.kernel.KernelOperator`, turned into ``U Λ Uᵀ`` by a thin SVD of ``L``. Needs
  ``diag(K̄)`` (``c`` VJPs exact, or a stochastic estimate) plus ``r`` *sequential* single-row kernel products
  (each pivot depends on the previous one, so they cannot be batched). Measured above: about as good as the
  single-pass Nyström at the same rank, but the diagonal costs ``c`` extra VJPs and the one-row products forgo
  vmap batching (U-Net row: 2.9 s to build at rank 50 against 0.3 s for the single pass), so it is available
  but not the default.

Random matrices are drawn from the given ``torch.Generator`` (CPU generators reproduce across devices). The
small dense factorisations (QR, Cholesky, SVD of ``c × (r+p)`` matrices) run in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ctuq.inference.checks import check_hyper
from ctuq.inference.kernel import KernelOperator, kernel_diagonal

__all__ = [
    "LowRankEig",
    "LowRankPreconditioner",
    "randomized_eig",
    "adaptive_nystrom_eig",
    "pivoted_cholesky_eig",
]


@dataclasses.dataclass
class LowRankEig:
    """``K̄ ≈ U diag(λ) Uᵀ``.

    Attributes
    ----------
    U : torch.Tensor
        ``(c, r)`` orthonormal columns (kernel dtype/device).
    eigenvalues : torch.Tensor
        ``(r,)`` non-negative, descending (kernel units: measurement units² per unit prior precision).
    n_products : int
        Kernel products (each one VJP + one JVP) spent building it.
    method : str
        ``"nystrom"``, ``"halko"`` or ``"pivoted_cholesky"``.
    n_diag_products : int
        Extra single products spent on ``diag(K̄)`` (pivoted Cholesky: ``c`` VJPs exact, or JVPs stochastic).
    """

    U: torch.Tensor
    eigenvalues: torch.Tensor
    n_products: int
    method: str
    n_diag_products: int = 0

    @property
    def rank(self) -> int:
        return int(self.eigenvalues.numel())

    def state_dict(self) -> dict:
        """Plain tensors/ints/strs (loadable with ``torch.load(weights_only=True)``)."""
        return {
            "U": self.U.cpu(),
            "eigenvalues": self.eigenvalues.cpu(),
            "n_products": self.n_products,
            "method": self.method,
            "n_diag_products": self.n_diag_products,
        }

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device | str = "cpu") -> LowRankEig:
        """Inverse of :meth:`state_dict`."""
        missing = {"U", "eigenvalues", "n_products", "method"} - set(state)
        if missing:
            raise ValueError(f"LowRankEig.from_state_dict: missing keys {sorted(missing)}")
        U, lam = state["U"], state["eigenvalues"]
        if U.ndim != 2 or lam.ndim != 1 or U.shape[1] != lam.shape[0]:
            raise ValueError(
                f"LowRankEig.from_state_dict: U {tuple(U.shape)} and eigenvalues {tuple(lam.shape)} do not fit"
            )
        return cls(
            U.to(device),
            lam.to(device),
            int(state["n_products"]),
            str(state["method"]),
            int(state.get("n_diag_products", 0)),
        )


class LowRankPreconditioner:
    """``P⁻¹`` for ``P = U Λ Uᵀ/a + σ² I`` from a :class:`LowRankEig` (Woodbury; no Jacobian products).

    ``inverse(a, σ²)`` returns a callable on rows ``(k, c)`` → ``(k, c)``.
    """

    def __init__(self, eig: LowRankEig):
        self.eig = eig

    def inverse(self, a: float, sigma2: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """``R ↦ P⁻¹ R`` for rows ``R`` ``(k, c)`` at prior precision ``a`` and noise variance ``σ²``."""
        a_f, s2_f = check_hyper(a, sigma2, "LowRankPreconditioner.inverse")
        U = self.eig.U
        lam = self.eig.eigenvalues.to(U.dtype)
        # Coefficient on the captured subspace: 1/(λ/a + σ²) − 1/σ² (the complement keeps 1/σ²).
        coef = 1.0 / (lam / a_f + s2_f) - 1.0 / s2_f

        def apply(R: torch.Tensor) -> torch.Tensor:
            return R / s2_f + ((R @ U) * coef) @ U.T

        return apply


def _orthonormal(Y: torch.Tensor) -> torch.Tensor:
    Q, _ = torch.linalg.qr(Y, mode="reduced")
    return Q


def _nystrom_from(Y: torch.Tensor, Omega: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stabilised Nyström ``Y (ΩᵀY)⁻¹ Yᵀ`` → top-``rank`` ``(U, λ)``, all float64 (``Y = K̄ Ω``)."""
    # Shift by a tiny multiple of ‖Y‖ so the Cholesky of ΩᵀY succeeds when K̄ is (numerically) rank deficient
    # (Tropp et al. 2017, alg. 3); the shift is removed from the eigenvalues afterwards.
    nu = math.sqrt(Y.shape[0]) * torch.finfo(torch.float64).eps * float(torch.linalg.matrix_norm(Y, ord=2))
    nu = max(nu, torch.finfo(torch.float64).tiny)
    Y_nu = Y + nu * Omega
    B = Omega.T @ Y_nu
    B = 0.5 * (B + B.T)
    L, info = torch.linalg.cholesky_ex(B)
    if int(info) != 0:
        # Fall back to an eigen-decomposition based inverse square root (B is PSD up to round-off).
        evals, evecs = torch.linalg.eigh(B)
        evals = evals.clamp_min(nu)
        F = Y_nu @ (evecs * evals.rsqrt()) @ evecs.T
    else:
        F = torch.linalg.solve_triangular(L, Y_nu.T, upper=False).T  # Y_ν L⁻ᵀ
    U, S, _ = torch.linalg.svd(F, full_matrices=False)
    lam = (S**2 - nu).clamp_min(0.0)
    return U[:, :rank], lam[:rank]


def randomized_eig(
    kernel: KernelOperator,
    rank: int,
    *,
    oversampling: int = 10,
    method: str = "nystrom",
    generator: torch.Generator | None = None,
    seed: int = 0,
) -> LowRankEig:
    """Randomised low-rank eigendecomposition of ``K̄`` (see the module docstring for the two methods).

    Parameters
    ----------
    kernel : KernelOperator
        ``K̄`` (``c × c``).
    rank : int
        ``r``, eigenpairs kept (clipped to ``c``).
    oversampling : int
        ``p``, extra random directions (``r + p`` clipped to ``c``).
    method : {"nystrom", "halko"}
        Single-pass Nyström (``r + p`` kernel products) or Halko alg. 5.6 (``2(r + p)``).
    generator, seed
        Source of the Gaussian test matrix ``Ω`` (``seed`` seeds a fresh CPU generator when omitted).
    """
    if method not in ("nystrom", "halko"):
        raise ValueError(f"randomized_eig: method must be 'nystrom' or 'halko', got {method!r}")
    c = kernel.n_outputs
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"randomized_eig: rank must be a positive int, got {rank!r}")
    if not isinstance(oversampling, int) or oversampling < 0:
        raise ValueError(f"randomized_eig: oversampling must be an int >= 0, got {oversampling!r}")
    rank = min(rank, c)
    k = min(c, rank + oversampling)
    if generator is None:
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
    dtype, device = kernel.dtype, kernel.device
    Omega = torch.randn((c, k), generator=generator, device=generator.device, dtype=torch.float64).to(device)
    Omega = _orthonormal(Omega)  # orthonormal test matrix: better conditioned ΩᵀY, same distribution of span
    Y = kernel.matmul_rows(Omega.T.to(dtype)).T.double()
    n_products = k
    if method == "halko":
        Q = _orthonormal(Y)
        Y = kernel.matmul_rows(Q.T.to(dtype)).T.double()
        n_products += k
        Omega = Q
    U, lam = _nystrom_from(Y, Omega, rank)
    return LowRankEig(U.to(dtype), lam.to(dtype), n_products, method)


def adaptive_nystrom_eig(
    kernel: KernelOperator,
    max_rank: int,
    *,
    a: float,
    sigma2: float,
    threshold: float = 1.0,
    initial_rank: int = 100,
    growth: float = 1.5,
    oversampling: int = 10,
    seed: int = 0,
) -> LowRankEig:
    """Single-pass Nyström whose rank grows until the spectrum left out no longer matters for ``C``.

    Rounds of ranks ``r₀ = initial_rank, r_{i+1} = ⌈growth · r_i⌉`` (capped at ``max_rank``): each round draws
    only the *new* Gaussian test directions, orthogonalises them against the old ones, multiplies them by ``K̄``
    (``r_{i+1} − r_i`` kernel products) and refits the Nyström approximation from the whole sketch ``(Ω, K̄Ω)``,
    so the final rank ``r`` costs ``r + oversampling`` products, as a fixed-rank single pass of that rank does
    (with one round — ``initial_rank ≥ max_rank`` — it *is* :func:`randomized_eig` with ``method="nystrom"``).
    Growth stops at the first round whose eigenvalue estimate at the previous round's rank ``r' = ⌈r/growth⌉``
    satisfies

        λ_r' / a < threshold · σ²

    (the trailing eigenvalues of a Nyström sketch are underestimated — its tail mixes in — so the rule reads them
    a round behind, where the current sketch is accurate; on a ``λ_i ∝ i⁻²`` spectrum the last retained estimate
    was 2.5× too small), i.e. once every direction the preconditioner misses has ``λ/a`` below
    ``threshold × σ²``, so that the
    preconditioned ``C`` has condition number ``≲ 1 + threshold`` up to the Nyström error (the published rank 400
    misses directions with ``λ/a`` up to ~10³ σ² on the walnut-size problem, whose effective dimension is
    ~1150–1250). ``a`` and ``σ²`` are those at build time (the EM usually raises ``a``, which only makes the rank
    more than enough); ``max_rank`` caps the products (``uq.cg.rank``).

    Memory: the sketch, ``2 · c · (r + oversampling)`` float64 numbers, while building.
    """
    a_f, s2_f = check_hyper(a, sigma2, "adaptive_nystrom_eig")
    for name, v in (("max_rank", max_rank), ("initial_rank", initial_rank)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"adaptive_nystrom_eig: {name} must be a positive int, got {v!r}")
    if not isinstance(oversampling, int) or oversampling < 0:
        raise ValueError(f"adaptive_nystrom_eig: oversampling must be an int >= 0, got {oversampling!r}")
    if not (threshold > 0 and math.isfinite(threshold)):
        raise ValueError(f"adaptive_nystrom_eig: threshold must be positive and finite, got {threshold!r}")
    if not (growth > 1 and math.isfinite(growth)):
        raise ValueError(f"adaptive_nystrom_eig: growth must be > 1, got {growth!r}")
    c = kernel.n_outputs
    dtype, device = kernel.dtype, kernel.device
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    max_rank = min(max_rank, c)
    rank = min(initial_rank, max_rank)
    Omega = torch.empty((c, 0), dtype=torch.float64, device=device)
    Y = torch.empty((c, 0), dtype=torch.float64, device=device)
    while True:
        k = min(c, rank + oversampling)
        W = torch.randn((c, k - Omega.shape[1]), generator=gen, dtype=torch.float64).to(device)
        if Omega.shape[1]:
            for _ in range(2):  # twice is enough (Kahan–Parlett)
                W = W - Omega @ (Omega.T @ W)
        W = _orthonormal(W)
        Y = torch.cat([Y, kernel.matmul_rows(W.T.to(dtype)).T.double()], dim=1)
        Omega = torch.cat([Omega, W], dim=1)
        U, lam = _nystrom_from(Y, Omega, rank)
        # Nyström underestimates its trailing eigenvalues (the sketch's tail mixes in), so the rule reads the
        # eigenvalue at the previous round's rank r/growth, estimated with the current, larger sketch.
        probe = float(lam[min(lam.numel(), math.ceil(rank / growth)) - 1])
        if probe / a_f < threshold * s2_f or rank >= max_rank or k >= c:
            break
        rank = min(max_rank, max(rank + 1, math.ceil(growth * rank)))
    return LowRankEig(U.to(dtype), lam.to(dtype), int(Omega.shape[1]), "nystrom_adaptive")


def pivoted_cholesky_eig(
    kernel: KernelOperator,
    rank: int,
    *,
    diagonal: torch.Tensor | str = "exact",
    error_tol: float | None = None,
    n_probes: int = 256,
    seed: int = 0,
) -> LowRankEig:
    """Pivoted Cholesky ``K̄ ≈ L Lᵀ`` (linear_operator) as a :class:`LowRankEig` (``L = U S Vᵀ`` → ``λ = S²``).

    Parameters
    ----------
    kernel : KernelOperator
        ``K̄``.
    rank : int
        Maximum number of pivots (kernel rows, one product each, sequential).
    diagonal : tensor or {"exact", "stochastic"}
        ``diag(K̄)`` ``(c,)``, or how to get it: ``c`` VJPs, or ``n_probes`` JVPs (Rademacher, seeded by
        ``seed``; pivots then follow an estimate and the stopping error is approximate).
    error_tol : float, optional
        Stop early when the relative trace error of the residual falls below it (linear_operator's rule).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"pivoted_cholesky_eig: rank must be a positive int, got {rank!r}")
    features = kernel.features
    n_diag = 0
    if isinstance(diagonal, str):
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        counts = features.n_matvec + features.n_rmatvec
        diag = kernel_diagonal(features, method=diagonal, n_probes=n_probes, generator=gen)
        n_diag = features.n_matvec + features.n_rmatvec - counts
    else:
        diag = diagonal
    if tuple(diag.shape) != (kernel.n_outputs,):
        raise ValueError(
            f"pivoted_cholesky_eig: diagonal must have shape ({kernel.n_outputs},), got {tuple(diag.shape)}"
        )
    # A fresh operator carrying the diagonal: linear_operator rebuilds the operator from its arguments, so a
    # diagonal cached on the instance would be lost (and recomputed with c VJPs).
    op = KernelOperator(features=features, diagonal=diag.clamp_min(0))
    before = features.n_rmatvec
    with torch.no_grad():
        L = op.pivoted_cholesky(rank=min(rank, kernel.n_outputs), error_tol=error_tol)
    n_products = features.n_rmatvec - before
    U, S, _ = torch.linalg.svd(L.double(), full_matrices=False)
    return LowRankEig(U.to(kernel.dtype), (S**2).to(kernel.dtype), n_products, "pivoted_cholesky", n_diag)
