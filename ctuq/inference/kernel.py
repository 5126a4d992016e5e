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

from collections.abc import Callable

import torch
from linear_operator.operators import LinearOperator

from ctuq.inference.checks import check_hyper
from ctuq.inference.features import DenseFeatures, FeatureOperator
from ctuq.options import GPriorMethod, values
from ctuq.utils import progress as _progress_bar

__all__ = [
    "KernelOperator",
    "measurement_covariance",
    "assemble_features",
    "assemble_kernel",
    "kernel_diagonal",
    "column_sq_norms",
]


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


# ---------------------------------------------------------------------------------------------- Gram diagonals
# The squared column norms of an operator from products with its transpose: the g-prior's diag(Ψ₀ᵀΨ₀)
# (ctuq.inference.priors.gprior) and, applied to Ψᵀ, the kernel diagonal below. They live here, below the
# priors package, because that package imports this module (the TV-PredCP fit builds KernelOperators).
def _draw_rademacher(shape, generator: torch.Generator, dtype, device) -> torch.Tensor:
    z = torch.randint(0, 2, shape, generator=generator, device=generator.device, dtype=torch.int8)
    return (2 * z - 1).to(device=device, dtype=dtype)


def _apply(A_rmatvec, R: torch.Tensor, n_rows: int, d: int | None) -> torch.Tensor:
    out = A_rmatvec(R)
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != R.shape[0]:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"A_rmatvec must map (B, {n_rows}) to (B, d); for input {tuple(R.shape)} it returned {got}")
    if d is not None and out.shape[1] != d:
        raise ValueError(f"A_rmatvec returned {out.shape[1]} columns for one chunk but {d} for an earlier one")
    return out


def column_sq_norms(
    A_rmatvec: Callable[[torch.Tensor], torch.Tensor],
    n_rows: int,
    *,
    method: str = "exact",
    n_probes: int = 256,
    chunk_size: int = 64,
    generator: torch.Generator | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """Squared column norms ``‖A_{:,i}‖²`` ``(d,)`` float64 of ``A`` (``n_rows × d``) from products with ``Aᵀ``.

    Parameters
    ----------
    A_rmatvec : callable
        ``R`` ``(B, n_rows)`` → ``Aᵀ R`` rows ``(B, d)``.
    n_rows : int
        ``c``, the number of rows of ``A``.
    method : {"exact", "stochastic"}
        ``n_rows`` products with unit vectors (exact), or ``n_probes`` Rademacher probes ``z ∈ {±1}^c``:
        ``n̂_i = (1/m) Σ_k (Aᵀ z_k)_i²`` is unbiased (``E[z zᵀ] = I``) with relative standard deviation at most
        ``√(2/m)`` (:mod:`ctuq.inference.priors.gprior` derives it).
    n_probes : int
        Probes for ``"stochastic"``.
    chunk_size : int
        Rows handed to ``A_rmatvec`` per call (bounds the ``(chunk, d)`` result held at once).
    generator, seed
        Random source of the probes (``seed`` seeds a fresh CPU generator when ``generator`` is None).
    dtype, device
        Of the unit vectors / probes handed to ``A_rmatvec``; the result is accumulated in float64.
    progress : bool
        Show a progress bar over chunks.
    """
    if method not in values(GPriorMethod):
        raise ValueError(f"column_sq_norms: method must be 'exact' or 'stochastic', got {method!r}")
    if not isinstance(n_rows, int) or n_rows < 1:
        raise ValueError(f"column_sq_norms: n_rows must be a positive int, got {n_rows!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"column_sq_norms: chunk_size must be a positive int, got {chunk_size!r}")
    device = torch.device(device)
    total: torch.Tensor | None = None
    d: int | None = None
    if method == GPriorMethod.EXACT:
        n = n_rows
    else:
        if not isinstance(n_probes, int) or n_probes < 1:
            raise ValueError(f"column_sq_norms: n_probes must be a positive int, got {n_probes!r}")
        n = n_probes
        if generator is None:
            generator = torch.Generator(device="cpu").manual_seed(int(seed))
    starts = range(0, n, chunk_size)
    for start in _progress_bar(starts, total=len(starts), desc=f"column norms ({method})", disable=not progress):
        stop = min(n, start + chunk_size)
        if method == "exact":
            R = torch.zeros((stop - start, n_rows), dtype=dtype, device=device)
            R[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
        else:
            R = _draw_rademacher((stop - start, n_rows), generator, dtype, device)
        G = _apply(A_rmatvec, R, n_rows, d)
        d = G.shape[1]
        part = G.double().pow(2).sum(0)
        total = part if total is None else total + part
    assert total is not None
    return total if method == "exact" else total / n


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
    :func:`column_sq_norms`, whose estimator this is applied to ``Ψᵀ``).
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
