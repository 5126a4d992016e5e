"""The kernel ``K̄ = Ψ Ψᵀ`` (``c × c``) and the measurement covariance ``C = K̄/a + σ² I`` as LinearOperators.

``K̄`` does not depend on the prior precision ``a`` or the noise variance ``σ²``: everything derived from it (a
low-rank eigendecomposition for the preconditioner, a full one for the exact solver, its diagonal) is computed
once and reused for every ``(a, σ²)``. :func:`measurement_covariance` wraps the *same* :class:`KernelOperator`
in linear_operator's ``ConstantMulLinearOperator`` + ``AddedDiagLinearOperator``, so changing ``a`` or ``σ²``
builds a new cheap wrapper and never touches K̄.

Layout: linear_operator works on columns (``K̄ @ X`` with ``X`` ``(c, k)``); the feature operators work on rows
(``(k, c)``). :meth:`KernelOperator.matmul_rows` is the row form used by the solvers.
"""

from __future__ import annotations

import torch
from linear_operator.operators import LinearOperator

from ctuq.inference.checks import check_hyper
from ctuq.inference.features import DenseFeatures, FeatureOperator
from ctuq.priors import column_sq_norms
from ctuq.utils import progress as _progress_bar

__all__ = ["KernelOperator", "measurement_covariance", "assemble_features", "assemble_kernel", "kernel_diagonal"]


class KernelOperator(LinearOperator):
    """``K̄ = Ψ Ψᵀ`` (``c × c``, symmetric PSD) as a linear_operator ``LinearOperator``.

    One product ``K̄ x`` costs one ``Ψᵀ`` row product (VJP) and one ``Ψ`` row product (JVP).

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``).
    diagonal : torch.Tensor, optional
        ``diag(K̄)`` ``(c,)`` if already known (e.g. from :func:`kernel_diagonal`); otherwise it is computed
        exactly (``c`` VJPs) the first time linear_operator asks for it (pivoted Cholesky does).

    Attributes
    ----------
    max_block_bytes : int
        Bound on the ``(rows, d)`` intermediate of one block of kernel products (default 256 MiB).
    """

    max_block_bytes: int = 256 * 1024**2

    def __init__(
        self, anchor: torch.Tensor | None = None, *, features: FeatureOperator, diagonal: torch.Tensor | None = None
    ):
        if not isinstance(features, FeatureOperator):
            raise TypeError(f"KernelOperator: features must be a FeatureOperator, got {type(features).__name__}")
        # linear_operator reads dtype/device from its first tensor argument and rebuilds operators from their
        # tensor arguments; the 0-dim anchor carries both without holding any data.
        if anchor is None:
            anchor = torch.zeros((), dtype=features.dtype, device=features.device)
        super().__init__(anchor, features=features, diagonal=diagonal)
        self.features = features
        c = features.n_outputs
        if diagonal is not None and tuple(diagonal.shape) != (c,):
            raise ValueError(f"KernelOperator: diagonal must have shape ({c},), got {tuple(diagonal.shape)}")
        self._diag = None if diagonal is None else diagonal.to(device=features.device, dtype=features.dtype)

    # ------------------------------------------------------------------ linear_operator interface
    def _size(self) -> torch.Size:
        c = self.features.n_outputs
        return torch.Size([c, c])

    def _transpose_nonbatch(self) -> KernelOperator:
        return self

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        if rhs.ndim == 1:
            return self.matmul_rows(rhs.unsqueeze(0)).squeeze(0)
        if rhs.ndim != 2:
            raise ValueError(
                f"KernelOperator: batched right-hand sides {tuple(rhs.shape)} are not supported; use (c, k)"
            )
        return self.matmul_rows(rhs.mT).mT

    def _diagonal(self) -> torch.Tensor:
        if self._diag is None:
            self._diag = kernel_diagonal(self.features, method="exact")
        return self._diag

    def _get_indices(self, row_index, col_index, *batch_indices):
        # The default builds an InterpolatedLinearOperator and may evaluate all of K̄; one product per
        # requested distinct row is what the entries really cost.
        if batch_indices:
            raise ValueError("KernelOperator has no batch dimensions")
        row_index, col_index = torch.broadcast_tensors(row_index, col_index)
        rows, inverse = torch.unique(row_index.reshape(-1), return_inverse=True)
        c = self.features.n_outputs
        E = torch.zeros((rows.numel(), c), dtype=self.dtype, device=self.device)
        E[torch.arange(rows.numel(), device=self.device), rows] = 1.0
        K_rows = self.matmul_rows(E)
        return K_rows[inverse, col_index.reshape(-1)].reshape(row_index.shape)

    # ------------------------------------------------------------------ row form
    def matmul_rows(self, X: torch.Tensor) -> torch.Tensor:
        """``K̄ x`` for each row of ``X`` ``(k, c)`` → ``(k, c)``: one VJP then one JVP per row.

        Rows go through in blocks whose ``(block, d)`` intermediate ``Ψᵀx`` stays under :attr:`max_block_bytes`
        (for a 3M-weight network a 410-row preconditioner sketch would otherwise hold ~5 GB at once).
        """
        d = self.features.n_features
        item = torch.empty((), dtype=self.features.dtype).element_size()
        block = max(1, int(self.max_block_bytes // (d * item)))
        if X.shape[0] <= block:
            return self.features.matvec(self.features.rmatvec(X))
        return torch.cat(
            [self.features.matvec(self.features.rmatvec(X[i : i + block])) for i in range(0, X.shape[0], block)]
        )

    @property
    def n_outputs(self) -> int:
        """``c``."""
        return self.features.n_outputs


def measurement_covariance(
    kernel: KernelOperator, a: float | torch.Tensor, sigma2: float | torch.Tensor
) -> LinearOperator:
    """``C = K̄/a + σ² I`` as a LinearOperator sharing ``kernel`` (nothing about K̄ is recomputed).

    ``a`` (prior precision, > 0) and ``σ²`` (noise variance, > 0) are floats or 0-dim tensors.
    """
    a_f, s2_f = check_hyper(a, sigma2, "measurement_covariance")
    scaled = kernel.mul(1.0 / a_f)
    return scaled.add_diagonal(torch.tensor(s2_f, dtype=kernel.dtype, device=kernel.device))


def kernel_diagonal(
    features: FeatureOperator,
    *,
    method: str = "exact",
    n_probes: int = 256,
    chunk_size: int = 64,
    generator: torch.Generator | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """``diag(K̄)_j = ‖Ψᵀ e_j‖²`` ``(c,)`` in the features' dtype.

    ``"exact"``: ``c`` rmatvecs (VJPs). ``"stochastic"``: ``n_probes`` matvecs (JVPs) with Rademacher
    ``z ∈ {±1}^d``: ``E[(Ψ z)_j²] = ‖Ψ_{j,:}‖²`` (unbiased; relative std ≤ ``√(2/n_probes)``, as for
    :func:`ctuq.priors.column_sq_norms`, whose estimator this is applied to ``Ψᵀ``).
    """
    c, d = features.n_outputs, features.n_features
    if method == "exact":
        out = torch.empty(c, dtype=torch.float64, device=features.device)
        for start in range(0, c, chunk_size):
            stop = min(c, start + chunk_size)
            out[start:stop] = features.row_range(start, stop).double().pow(2).sum(1)
        return out.to(features.dtype)
    if method == "stochastic":
        # Column norms of Ψᵀ (d × c) from products with (Ψᵀ)ᵀ = Ψ.
        return column_sq_norms(
            features.matvec,
            d,
            method="stochastic",
            n_probes=n_probes,
            chunk_size=chunk_size,
            generator=generator,
            seed=seed,
            dtype=features.dtype,
            device=features.device,
        ).to(features.dtype)
    raise ValueError(f"kernel_diagonal: method must be 'exact' or 'stochastic', got {method!r}")


def assemble_features(
    features: FeatureOperator, *, chunk_size: int = 64, by: str = "auto", progress: bool = False
) -> torch.Tensor:
    """Dense ``Ψ`` ``(c, d)`` in float64: ``d`` products ``Ψ e_i`` (JVPs) or ``c`` products ``Ψᵀ e_j`` (VJPs); a
    :class:`~ctuq.inference.features.DenseFeatures` hands over its matrix (no products).

    ``by``: ``"columns"`` (``d`` matvecs), ``"rows"`` (``c`` rmatvecs) or ``"auto"`` (the fewer). Memory: ``c·d``
    float64 numbers.
    """
    c, d = features.n_outputs, features.n_features
    if isinstance(features, DenseFeatures):  # already assembled: no products
        return features.matrix.to(torch.float64)
    if by == "auto":
        by = "columns" if d <= c else "rows"
    if by not in ("columns", "rows"):
        raise ValueError(f"assemble_features: by must be 'auto', 'columns' or 'rows', got {by!r}")
    n = d if by == "columns" else c
    out = torch.empty((c, d), dtype=torch.float64, device=features.device)
    starts = range(0, n, chunk_size)
    bar = _progress_bar(starts, total=len(starts), desc=f"assemble Ψ ({by})", disable=not progress)
    for start in bar:
        stop = min(n, start + chunk_size)
        if by == "columns":
            out[:, start:stop] = features.columns(start, stop).double().T
        else:
            out[start:stop] = features.row_range(start, stop).double()
    return out


def assemble_kernel(
    features: FeatureOperator,
    *,
    chunk_size: int = 64,
    memory_budget: int | None = None,
    strategy: str = "auto",
    progress: bool = False,
) -> torch.Tensor:
    """Dense ``K̄`` ``(c, c)`` in float64, for the exact solver and tests.

    Strategies:

    * ``"gram"``: all ``c`` rows ``Ψᵀ e_j`` (``c`` VJPs) are stored (``c·d`` numbers) and ``K̄ = Ψ Ψᵀ`` is one
      GEMM (``2c²d`` flops). Half the Jacobian products; needs ``c·d`` floats of memory.
    * ``"products"``: ``K̄ e_j = Ψ(Ψᵀ e_j)`` column by column (``c`` VJPs + ``c`` JVPs), memory ``O(c²)``.
    * ``"auto"``: ``"gram"`` when ``c·d`` elements of the features' dtype fit in ``memory_budget`` (default
      1 GiB), else ``"products"``.

    The result is symmetrised (``(K + Kᵀ)/2``) to remove round-off asymmetry of the product route.
    """
    c, d = features.n_outputs, features.n_features
    item = torch.empty((), dtype=features.dtype).element_size()
    budget = (1 << 30) if memory_budget is None else int(memory_budget)
    if strategy == "auto":
        strategy = "gram" if c * d * item <= budget else "products"
    if strategy not in ("gram", "products"):
        raise ValueError(f"assemble_kernel: strategy must be 'auto', 'gram' or 'products', got {strategy!r}")
    starts = range(0, c, chunk_size)
    bar = _progress_bar(starts, total=len(starts), desc=f"assemble K̄ ({strategy})", disable=not progress)
    if strategy == "gram":
        G = torch.empty((c, d), dtype=features.dtype, device=features.device)
        for start in bar:
            stop = min(c, start + chunk_size)
            G[start:stop] = features.row_range(start, stop)
        G64 = G.double()
        del G
        K = G64 @ G64.T
    else:
        K = torch.empty((c, c), dtype=torch.float64, device=features.device)
        for start in bar:
            stop = min(c, start + chunk_size)
            K[start:stop] = features.matvec(features.row_range(start, stop)).double()
    return 0.5 * (K + K.T)
