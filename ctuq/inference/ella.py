"""ELLA's subspace: the Nyström eigenbasis of the tangent kernel from sampled rows of ``Ψ`` (Deng, Zhou & Zhu,
NeurIPS 2022, "Accelerated Linearized Laplace Approximation").

The kernel of the Gaussian linear model ``ỹ = Ψ w + ε`` (``Ψ``: ``c × d``, any :class:`FeatureOperator`: CT's
``T Φ diag(s)`` or a classifier's ``B^(1/2) Φ diag(s)``) is ``K̄ = Ψ Ψᵀ``. ELLA samples ``M`` of its ``c`` rows
(the *landmarks* ``R``), eigendecomposes the landmark kernel ``Ψ_R Ψ_Rᵀ = U Λ Uᵀ`` (``M × M``), and keeps the top
``K`` eigenpairs. Then

    ``V = Ψ_Rᵀ U_K Λ_K^(−1/2)``  (``d × K``, orthonormal columns: ``VᵀV = I_K``)

spans the directions of weight space the sampled rows see most, and ``Ψ V`` (``c × K``, ``K`` products with ``Ψ``,
one Jacobian-vector product per column) are ELLA's features: the Nyström kernel is ``Ψ V Vᵀ Ψᵀ``. The posterior
restricted to ``w = V u`` with ``u ~ N(0, a⁻¹ I_K)`` is the Gaussian linear model with features ``Ψ V`` and ``K``
weights, so the core's :class:`~ctuq.inference.LinearizedPosterior` with an exact solver gives its mean,
covariance ``(VᵀΨᵀΨV + a I_K)⁻¹``, samples (lifted by :meth:`NystromBasis.lift`), evidence and EM unchanged. When
``V`` spans all of weight space (``K = d``, which needs ``c ≥ d`` rows of full rank) it is the exact posterior.

Cost: ``M`` vector-Jacobian products for the landmark rows (``M × d`` numbers), an ``M × M`` eigendecomposition,
``K`` Jacobian-vector products over the data for ``Ψ V``; nothing of size ``d × d`` or ``c × d``.
"""

from __future__ import annotations

import dataclasses

import torch

from ctuq.inference.features import DenseFeatures, FeatureOperator, ScaledFeatures

__all__ = ["NystromBasis", "nystrom_basis", "ProjectedFeatures", "ella_features"]


@dataclasses.dataclass
class NystromBasis:
    """The top-``K`` Nyström eigenbasis of ``Ψ Ψᵀ`` from landmark rows (:func:`nystrom_basis`).

    Attributes
    ----------
    V : torch.Tensor
        ``(d, K)`` orthonormal columns, the weight-space directions.
    eigenvalues : torch.Tensor
        ``(K,)`` the landmark kernel's top eigenvalues, descending (in ``Ψ``'s units²).
    rows : torch.Tensor
        ``(M,)`` the landmark rows (indices into the ``c`` outputs), in the order drawn.
    rank_found : int
        How many eigenvalues of the landmark kernel exceed ``rtol`` × the largest: the most ``K`` can be.
    """

    V: torch.Tensor
    eigenvalues: torch.Tensor
    rows: torch.Tensor
    rank_found: int

    @property
    def rank(self) -> int:
        """``K``."""
        return int(self.V.shape[1])

    def leading(self, rank: int) -> NystromBasis:
        """The basis of the top ``rank`` eigenpairs alone: the same as :func:`nystrom_basis` with that ``rank`` on the
        same rows (the QR that orthonormalises ``V`` is nested in its columns), without forming the rows again.
        ``ValueError`` unless ``1 ≤ rank ≤ K``."""
        if not 1 <= rank <= self.rank:
            raise ValueError(f"NystromBasis.leading: rank must lie in [1, {self.rank}], got {rank}")
        return NystromBasis(self.V[:, :rank], self.eigenvalues[:rank], self.rows, self.rank_found)

    def lift(self, U: torch.Tensor) -> torch.Tensor:
        """Weights ``w = V u`` ``(B, d)`` of subspace coordinates ``U`` ``(B, K)``."""
        if U.ndim != 2 or U.shape[1] != self.rank:
            raise ValueError(f"NystromBasis.lift: U must be (B, {self.rank}), got {tuple(U.shape)}")
        return U.to(self.V) @ self.V.T

    def project(self, W: torch.Tensor) -> torch.Tensor:
        """Subspace coordinates ``u = Vᵀ w`` ``(B, K)`` of weights ``W`` ``(B, d)``."""
        if W.ndim != 2 or W.shape[1] != self.V.shape[0]:
            raise ValueError(f"NystromBasis.project: W must be (B, {self.V.shape[0]}), got {tuple(W.shape)}")
        return W.to(self.V) @ self.V


def nystrom_basis(
    features: FeatureOperator,
    landmarks: int,
    rank: int | None,
    *,
    seed: int = 0,
    rows: torch.Tensor | None = None,
    rtol: float | None = None,
    chunk_size: int = 256,
) -> NystromBasis:
    """ELLA's basis from ``landmarks`` rows of ``features`` (module docstring).

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``); ``landmarks`` rows of it are formed with vector-Jacobian products (``Ψᵀ e_r``).
    landmarks : int
        ``M``, rows drawn uniformly without replacement from the ``c`` outputs (seeded by ``seed``), or the
        length of ``rows``. At most ``c``.
    rank : int or None
        ``K ≤ M``: the eigenpairs kept; ``None``: all that the landmark rows span (``K`` = the rank found).
    rows : torch.Tensor, optional
        ``(M,)`` the landmark rows themselves (e.g. stratified by class), in place of the seeded draw.
    rtol : float, optional
        Eigenvalues below ``rtol`` × the largest count as zero: ``K`` may not exceed the number above it. Default
        ``1e-12`` for float64 features (round-off leaves null eigenvalues near ``1e-16`` × the largest), ``1e-5``
        for float32.
    chunk_size : int
        Rows per batch of products.

    Raises
    ------
    ValueError
        ``M < K``, ``M > c``, ``K < 1``, repeated or out-of-range ``rows``, or ``K`` larger than the rank found
        among the landmark rows (the message gives that rank).
    """
    c = features.n_outputs
    if rank is not None and rank < 1:
        raise ValueError(f"ELLA: rank K must be >= 1, got {rank}")
    least = 1 if rank is None else rank  # the fewest landmark rows that can hold the eigenpairs asked for
    if rows is None:
        if not least <= landmarks <= c:
            raise ValueError(
                f"ELLA: landmarks M = {landmarks} must lie between the rank K = {least} and the {c} outputs of Ψ"
            )
        g = torch.Generator().manual_seed(int(seed))
        rows = torch.randperm(c, generator=g)[:landmarks]
    else:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        if rows.numel() < least or len(torch.unique(rows)) != rows.numel() or rows.min() < 0 or rows.max() >= c:
            raise ValueError(
                f"ELLA: rows must be at least K = {least} distinct indices in [0, {c}), got {rows.numel()} of them"
            )
    m = int(rows.numel())
    PsiR = _landmark_rows(features, rows.to(features.device), chunk_size).double()
    if rtol is None:
        rtol = 1e-12 if features.dtype == torch.float64 else 1e-5
    lam, U = torch.linalg.eigh(PsiR @ PsiR.T)
    lam, U = lam.flip(0), U.flip(1)  # descending
    top = float(lam[0]) if m else 0.0
    found = int((lam > rtol * max(top, 0.0)).sum()) if top > 0 else 0
    if rank is None:
        if found == 0:
            raise ValueError(f"ELLA: the {m} landmark rows of Ψ are all zero: there is no subspace to keep")
        rank = found
    if rank > found:
        raise ValueError(
            f"ELLA: rank K = {rank} exceeds the rank {found} of the {m} landmark rows of Ψ (eigenvalues above "
            f"{rtol:g} × the largest); use K ≤ {found} or more landmarks"
        )
    # V = Ψ_Rᵀ U Λ^(−1/2) has orthonormal columns in exact arithmetic; the QR keeps its span and removes the
    # round-off that 1/√λ amplifies in the weakest directions kept
    V, R = torch.linalg.qr(PsiR.T @ (U[:, :rank] / lam[:rank].sqrt()))
    V = V * torch.sign(torch.diagonal(R))  # the column signs of the un-orthonormalised basis
    return NystromBasis(V.to(features.dtype), lam[:rank].to(features.dtype), rows.cpu(), found)


def _landmark_rows(features: FeatureOperator, rows: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``Ψ[rows]`` ``(M, d)``: by the operator's own row restriction (a dense matrix slices its rows, with the prior
    scales applied after), else by ``M`` vector-Jacobian products."""
    if isinstance(features, ScaledFeatures):
        return _landmark_rows(features.base, rows, chunk_size) * features.scales
    if isinstance(features, DenseFeatures):
        return features.restrict(rows).matrix
    return features.restrict(rows).to_dense(chunk_size)


class ProjectedFeatures(FeatureOperator):
    """``Ψ V`` (``c × K``) through products with ``Ψ``: the features of the weights ``u`` with ``w = V u``.

    Parameters
    ----------
    base : FeatureOperator
        ``Ψ`` (``c × d``).
    basis : NystromBasis or torch.Tensor
        ``V`` ``(d, K)`` (any matrix; a :class:`NystromBasis`'s has orthonormal columns).
    """

    def __init__(self, base: FeatureOperator, basis: NystromBasis | torch.Tensor):
        super().__init__()
        V = basis.V if isinstance(basis, NystromBasis) else basis
        if V.ndim != 2 or V.shape[0] != base.n_features:
            raise ValueError(f"ProjectedFeatures: V must be ({base.n_features}, K), got {tuple(V.shape)}")
        self.base = base
        self.V = V.to(device=base.device, dtype=base.dtype)
        self.n_outputs, self.n_features = base.n_outputs, int(V.shape[1])
        self.dtype, self.device = base.dtype, base.device

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return self.base.matvec(W @ self.V.T)

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        return self.base.rmatvec(R) @ self.V


def ella_features(features: FeatureOperator, basis: NystromBasis, chunk_size: int = 64) -> DenseFeatures:
    """``Ψ V`` assembled (``c × K``, ``K`` products with ``Ψ``, batched ``chunk_size`` at a time): the dense features
    of ELLA's ``K``-dimensional model, for an exact solver of the core."""
    Vt = basis.V.T.to(device=features.device, dtype=features.dtype)
    cols = [features.matvec(Vt[k : k + chunk_size]) for k in range(0, basis.rank, chunk_size)]
    return DenseFeatures(torch.cat(cols, 0).T.contiguous())
