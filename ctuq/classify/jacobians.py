"""Per-example Jacobians of a classifier: the exact g-prior (the GGN diagonal) and the dense whitened features.

The feature operator of :mod:`ctuq.classify.laplace` multiplies ``Ψ₀ = blockdiag(L_iᵀ) J`` (``n·C × d``) by a
whole batch of inputs at once; a *column* norm of ``Ψ₀`` through it costs ``n·C`` full-data VJPs (the generic
g-prior of :func:`ctuq.inference.priors.gprior_scales`). A classifier's rows are independent per example (eval
mode: batch norm uses running statistics), so the same numbers come from ``n`` single-example Jacobians ``J_i``
(``C × d``, ``C`` VJPs each, batched with ``torch.func.vmap`` over examples): ``‖Ψ₀[:, j]‖² =
Σ_i ‖(L_iᵀ J_i)[:, j]‖²`` — the diagonal of the GGN ``Σ_i J_iᵀ B_i J_i`` — at the cost of ``C`` backward passes over
the data instead of ``n·C``.
The same rows assemble ``Ψ₀`` densely for the exact solvers, and ``J`` itself (:class:`DenseJacobian`) for the
iterative solvers and the mode finder.

Memory: one chunk holds ``chunk_size · C · d`` numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from ctuq.classify.hessian import SoftmaxHessianRoot
from ctuq.classify.mode import scaled_weights
from ctuq.inference import DenseFeatures
from ctuq.linearize import eval_mode
from ctuq.utils import progress as _progress

__all__ = [
    "example_jacobians",
    "ggn_diagonal",
    "assemble_whitened_jacobian",
    "assemble_jacobian",
    "DenseJacobian",
    "CHUNK_BYTES",
    "rows_per_chunk",
]

#: Bytes of float64 rows one pass over an assembled Jacobian takes at a time (its temporaries are a few times this).
CHUNK_BYTES = 256 * 2**20


def rows_per_chunk(bytes_per_item: int, max_bytes: int = CHUNK_BYTES) -> int:
    """How many items of ``bytes_per_item`` bytes fit ``max_bytes`` (at least one)."""
    return max(1, int(max_bytes) // max(1, int(bytes_per_item)))


def example_jacobians(
    model: nn.Module, X: torch.Tensor, names: Sequence[str], *, chunk_size: int = 32, progress: bool = False
) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(start, J)`` with ``J`` ``(m, C, d)``: the logit Jacobians of examples ``start … start + m − 1`` with
    respect to the parameters ``names`` (flattened in that order, as :class:`ctuq.linearize.LinearizedNetwork`
    flattens them), evaluated in eval mode at the current weights."""
    params = dict(model.named_parameters())
    lin = {n: params[n].detach() for n in names}
    fixed = {n: p.detach() for n, p in params.items() if n not in lin}
    buffers = dict(model.named_buffers())

    def logits(lin_params, x):
        return functional_call(model, ({**fixed, **lin_params}, buffers), (x.unsqueeze(0),))[0]

    jac = vmap(jacrev(logits), in_dims=(None, 0))
    starts = range(0, X.shape[0], chunk_size)
    with eval_mode(model):
        for start in _progress(starts, total=len(starts), desc="per-example Jacobians", disable=not progress):
            parts = jac(lin, X[start : start + chunk_size])
            m = X[start : start + chunk_size].shape[0]
            yield start, torch.cat([parts[n].reshape(m, parts[n].shape[1], -1) for n in names], dim=2)


def ggn_diagonal(
    model: nn.Module,
    X: torch.Tensor,
    names: Sequence[str],
    root: SoftmaxHessianRoot,
    *,
    chunk_size: int = 32,
    progress: bool = False,
) -> torch.Tensor:
    """``diag(Σ_i J_iᵀ B_i J_i)`` ``(d,)`` float64 = the squared column norms of ``Ψ₀`` (exact g-prior)."""
    total = None
    for start, J in example_jacobians(model, X, names, chunk_size=chunk_size, progress=progress):
        part = root.transpose_blocks(J.double(), start).pow(2).sum((0, 1))
        total = part if total is None else total + part
    assert total is not None
    return total


def assemble_whitened_jacobian(
    model: nn.Module,
    X: torch.Tensor,
    names: Sequence[str],
    root: SoftmaxHessianRoot,
    *,
    chunk_size: int = 32,
    progress: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense ``Ψ₀ = blockdiag(L_iᵀ) J`` ``(n·C, d)`` in ``dtype`` (row ``i·C + k``: class ``k`` of example ``i``),
    written chunk by chunk into one tensor (no second copy: ``n·C·d`` numbers in all, 5.4 GB in float32 for
    MNIST-1D's 40,000 logits × 33,930 CNN weights). The whitening runs in float64 per chunk."""
    return _assemble(model, X, names, root, chunk_size=chunk_size, progress=progress, dtype=dtype)


def assemble_jacobian(
    model: nn.Module,
    X: torch.Tensor,
    names: Sequence[str],
    *,
    chunk_size: int = 32,
    progress: bool = False,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense logit Jacobian ``J`` ``(n·C, d)`` in ``dtype`` (row ``i·C + k``: class ``k`` of example ``i``), one
    tensor written chunk by chunk (``n·C·d`` numbers)."""
    return _assemble(model, X, names, None, chunk_size=chunk_size, progress=progress, dtype=dtype)


def _assemble(model, X, names, root, *, chunk_size, progress, dtype) -> torch.Tensor:
    out = None
    for start, J in example_jacobians(model, X, names, chunk_size=chunk_size, progress=progress):
        rows = (J if root is None else root.transpose_blocks(J.double(), start)).reshape(-1, J.shape[2])
        if out is None:
            out = torch.empty((X.shape[0] * J.shape[1], J.shape[2]), dtype=dtype)
        lo = start * J.shape[1]
        out[lo : lo + rows.shape[0]] = rows
    assert out is not None
    return out


class DenseJacobian:
    """A classifier's logit Jacobian on its training inputs, held densely: the product interface of
    :class:`ctuq.linearize.LinearizedNetwork` that the features and the mode finder use (``jvp``, ``vjp``,
    ``jvp_basis``, ``params``, ``d``, ``d_out``) as GEMMs and slices. ``J`` is held by the core's dense feature
    operator (:class:`ctuq.inference.DenseFeatures`, :attr:`dense`), whose products these are.

    Behind the whitened features ``Ψ₀ = blockdiag(L_iᵀ) J`` of the iterative solvers (the softmax roots applied
    per product, ``n·C²`` work) and behind the mode finder, whose objective needs ``J`` itself: the roots are
    singular (``B_i 1 = 0``, and ``B_i ≈ 0`` for confidently fitted examples), so ``J`` cannot be recovered from
    an assembled ``Ψ₀``. One JVP/VJP pair over the data becomes two GEMMs with ``J``.

    Parameters
    ----------
    matrix : torch.Tensor
        ``J`` ``(n·C, d)``.
    network : LinearizedNetwork
        The same network's product route (for its weights ``ṽ``; not used for products).
    """

    def __init__(self, matrix: torch.Tensor, network):
        if matrix.shape != (network.d_out, network.d):
            raise ValueError(
                f"DenseJacobian: matrix has shape {tuple(matrix.shape)}, the network's Jacobian is "
                f"({network.d_out}, {network.d})"
            )
        self.dense = DenseFeatures(matrix)
        self.d, self.d_out = int(network.d), int(network.d_out)
        self.dtype, self.device = matrix.dtype, matrix.device
        self._network = network
        self.n_jvp = self.n_vjp = 0

    @property
    def matrix(self) -> torch.Tensor:
        """``J`` ``(n·C, d)``."""
        return self.dense.matrix

    def params(self) -> torch.Tensor:
        """``ṽ`` ``(d,)`` (a copy)."""
        return self._network.params()

    def jvp(self, U: torch.Tensor) -> torch.Tensor:
        """``J u`` for rows ``U`` ``(B, d)`` → ``(B, n·C)``; counts ``B`` JVPs."""
        self.n_jvp += U.shape[0]
        return self.dense.matvec(U)

    def vjp(self, R: torch.Tensor) -> torch.Tensor:
        """``Jᵀ r`` for rows ``R`` ``(B, n·C)`` → ``(B, d)``; counts ``B`` VJPs."""
        self.n_vjp += R.shape[0]
        return self.dense.rmatvec(R)

    def whitened_chunks(
        self, root: SoftmaxHessianRoot, max_bytes: int = CHUNK_BYTES
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(start, L_iᵀ J_i)`` float64 ``(m, C, d)`` for examples ``start … start + m − 1``: ``Ψ₀ =
        blockdiag(L_iᵀ) J`` chunk by chunk, without a float64 copy of ``J``. A chunk's float64 rows take at most
        ``max_bytes`` (at least one example's): the root's arithmetic holds a few temporaries of that size, so a
        fixed row count would take gigabytes where ``d`` is large (117k weights: 3.8 GB per 4096 rows)."""
        C = root.C
        step = rows_per_chunk(C * self.d * 8, max_bytes)
        for start in range(0, root.n, step):
            J = self.matrix[start * C : (start + step) * C].double().reshape(-1, C, self.d)
            yield start, root.transpose_blocks(J, start)

    @classmethod
    def of_subspace(cls, network, scales: torch.Tensor, V: torch.Tensor, chunk_size: int = 64) -> DenseJacobian:
        """ELLA's Jacobian in its ``K`` coordinates ``u`` (``w = V u``): ``G = J diag(s) V`` ``(n·C, K)`` by ``K``
        Jacobian-vector products through ``network`` (``chunk_size`` at a time), held densely, with the trained
        weights' coordinates ``u₀ = Vᵀ(ṽ / s)`` as its :meth:`params` (zero where ``s = 0``): the mode finder of the
        ``K``-dimensional model starts there (and the affine model expands there). ``scales`` ``s`` ``(d,)``,
        ``V`` ``(d, K)``."""
        s = scales.double()
        tangents = (V.double() * s[:, None]).T.to(network.dtype)
        cols = [network.jvp(tangents[k : k + chunk_size]) for k in range(0, tangents.shape[0], chunk_size)]
        coordinates = _Coordinates(scaled_weights(network.params(), s) @ V.double(), int(network.d_out))
        return cls(torch.cat(cols, 0).T.contiguous(), coordinates)

    def jvp_basis(self, start: int, stop: int, values: torch.Tensor | None = None) -> torch.Tensor:
        """Columns ``start … stop − 1`` of ``J`` times ``values`` as rows ``(stop − start, n·C)`` (a slice, no
        products; what an exact solver's assembly of ``Ψ₀`` asks for); counts ``stop − start`` JVPs."""
        cols = self.matrix[:, start:stop].T
        self.n_jvp += stop - start
        return cols.clone() if values is None else cols * values.to(self.dtype)[:, None]


@dataclasses.dataclass
class _Coordinates:
    """The weights of a Jacobian held in subspace coordinates (:meth:`DenseJacobian.of_subspace`): what
    :class:`DenseJacobian` reads of a network (``d``, ``d_out``, ``params``)."""

    u0: torch.Tensor
    d_out: int

    @property
    def d(self) -> int:
        return int(self.u0.shape[0])

    def params(self) -> torch.Tensor:
        return self.u0.clone()
