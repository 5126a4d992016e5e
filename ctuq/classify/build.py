"""Building blocks of :meth:`LinearizedLaplace.fit <ctuq.classify.LinearizedLaplace.fit>`: the whitened features
``Ψ₀ = blockdiag(L_iᵀ) J`` and the prior scales ``s``.

* Features: a :class:`~ctuq.inference.LinearizedFeatures` of the network on all training inputs with the output
  map ``Lᵀ`` (adjoint ``L``) per example — Jacobian products over all ``n`` inputs per product — or ``Ψ₀``
  assembled densely from per-example Jacobians (:mod:`ctuq.classify.jacobians`; ``C`` backward passes over the
  data), after which every product is a GEMM: for the exact solvers when twice its ``n·C·d`` float64 numbers fit
  the dense budget (:func:`~ctuq.inference.dense_features_fit`); for the iterative solvers when one copy fits and
  a product over the data costs more than a GEMM with ``Ψ₀`` (:func:`assembly_pays`: weight sharing, as in a
  CNN); for any solver with ``dense_features="always"``.
* Scales: of a diagonal prior of :data:`ctuq.registry.PRIORS` made by name
  (:meth:`~ctuq.inference.priors.DiagonalPrior.compute_scales`), which gets the exact squared column norms of
  ``Ψ₀`` the classifier's way (:attr:`~ctuq.inference.priors.PriorProblem.column_norms`: the GGN diagonal from
  per-example Jacobians, ``C`` backward passes over the data; free when ``Ψ₀`` is dense). The g-prior
  ``s_j = ‖Ψ₀[:, j]‖⁻¹`` takes them (``method="exact"``) or ``probes`` Rademacher probes through ``Ψ₀ᵀ``
  (``"stochastic"``, :func:`ctuq.inference.priors.gprior_scales`); ones for ``"isotropic"``; or given. Zero columns
  get ``s_j = 0``.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from ctuq.classify.hessian import SoftmaxHessianRoot
from ctuq.classify.jacobians import (
    DenseJacobian,
    assemble_jacobian,
    assemble_whitened_jacobian,
    example_jacobians,
    ggn_diagonal,
    rows_per_chunk,
)
from ctuq.inference import DenseFeatures, FeatureOperator, LinearizedFeatures, RowSubsetFeatures
from ctuq.inference.priors import DiagonalPrior, PriorProblem
from ctuq.linearize import eval_mode
from ctuq.registry import PRIORS

__all__ = [
    "whitened_features",
    "prior_scales",
    "forward_flops_per_example",
    "assembly_pays",
    "whitened_matrix",
    "WhitenedProducts",
]


class WhitenedProducts(LinearizedFeatures):
    """``Ψ₀ = blockdiag(L_iᵀ) J`` through Jacobian products over the ``n`` training inputs, whose row ``i·C + k``
    depends on example ``i`` alone: :meth:`restrict` assembles the rows asked for from the per-example Jacobians of
    the examples they belong to (``C`` backward passes each), not by one product over all ``n`` inputs per row
    (ELLA's ``M`` landmark rows: at most ``M`` examples' Jacobians instead of ``M`` passes over the data).

    Parameters
    ----------
    net : LinearizedNetwork
        ``J`` on the training inputs ``X`` (products).
    root : SoftmaxHessianRoot
        ``L_i`` of the ``n`` examples.
    model, X, names :
        The network, its training inputs ``(n, ...)`` and the linearised parameters (per-example Jacobians).
    chunk_size : int
        Examples per batch of per-example Jacobians.
    progress : bool
        A progress bar over those batches (on a CNN, ELLA's 1000 landmark rows take seconds to tens of seconds).
    """

    def __init__(
        self, net, root: SoftmaxHessianRoot, model, X: torch.Tensor, names, chunk_size: int = 32, progress=False
    ):
        super().__init__(net, output_map=root.apply_transpose, output_adjoint=root.apply, n_outputs=net.d_out)
        self._root, self._model, self._X, self._names, self._chunk = root, model, X, list(names), int(chunk_size)
        self._progress = bool(progress)

    def restrict(self, rows) -> DenseFeatures:
        """``Ψ₀[rows]`` ``(len(rows), d)`` assembled (rows: an integer index or a boolean mask over the ``n·C``
        outputs, no duplicates)."""
        idx = RowSubsetFeatures(self, rows).rows.cpu()  # checked as every restriction is
        C = self._root.C
        examples, position = torch.unique(idx // C, return_inverse=True)
        root = SoftmaxHessianRoot(self._root.p[examples], self._root.root, self._root.prob_floor, self._root.eig_floor)
        out = torch.empty((idx.numel(), self.n_features), dtype=self.dtype)
        chunks = example_jacobians(
            self._model, self._X[examples], self._names, chunk_size=self._chunk, progress=self._progress
        )
        for start, J in chunks:
            whitened = root.transpose_blocks(J.double(), start)  # (m, C, d)
            mine = (position >= start) & (position < start + J.shape[0])
            out[mine] = whitened[position[mine] - start, idx[mine] % C].to(self.dtype)
        return DenseFeatures(out)


def forward_flops_per_example(model, X: torch.Tensor, batch: int = 64) -> float:
    """Floating-point operations of one forward pass per example (matrix products and convolutions, as counted by
    :class:`torch.utils.flop_counter.FlopCounterMode` on the first ``batch`` rows of ``X`` ``(n, ...)``, in eval
    mode; the model's modes and buffers are left as they were); ``0.0`` when its operations cannot be counted."""
    Xb = X[:batch]
    if Xb.shape[0] == 0:
        return 0.0
    try:
        # eval mode, as linearised: a training-mode pass would update batch-norm running statistics
        with torch.no_grad(), eval_mode(model), FlopCounterMode(display=False) as counter:
            model(Xb)
    except Exception:  # an op the counter does not know: fall back to products (the conservative route)
        return 0.0
    return float(counter.get_total_flops()) / Xb.shape[0]


def assembly_pays(flops_per_example: float, n_classes: int, n_params: int) -> bool:
    """Whether assembling ``Ψ₀`` pays for an iterative solver: a forward pass of ``F`` flops per example against
    ``2·C·d``.

    A JVP/VJP pair over the data costs about ``3F`` flops per example, the GEMM pair with ``Ψ₀`` ``4·C·d``, so
    GEMMs win per product when ``F > 4/3·C·d``; with ``F ≥ 2·C·d`` the assembly (``C`` backward passes, about
    ``3·C·F`` per example) is repaid after ``2C`` product pairs, and an iterative solver runs hundreds (the rank of
    its preconditioner alone). An MLP uses each weight once (``F = 2d < 2·C·d``): products; a CNN uses each
    filter weight at every position (``F ≫ C·d`` on images): assembled.
    """
    return flops_per_example >= 2.0 * n_classes * n_params


def whitened_features(
    model,
    net,
    X: torch.Tensor,
    names,
    root: SoftmaxHessianRoot,
    *,
    dense: bool,
    dtype: torch.dtype,
    chunk_size: int = 32,
    keep_jacobian: bool = False,
    progress: bool = False,
) -> tuple[FeatureOperator, torch.Tensor | None, object]:
    """``(Ψ₀, squared column norms or None, the network of the mode finder)``.

    ``dense`` and not ``keep_jacobian`` (the exact solvers): ``Ψ₀`` assembled as a matrix, products through
    ``net``. ``dense`` and ``keep_jacobian`` (the iterative solvers): ``J`` assembled (:class:`DenseJacobian`), and
    both ``Ψ₀ = blockdiag(L_iᵀ) J`` and the mode finder multiply by it. Otherwise: products through ``net``.
    """
    if dense and keep_jacobian:
        jac = DenseJacobian(
            assemble_jacobian(model, X, names, chunk_size=chunk_size, progress=progress, dtype=dtype), net
        )
        sq = torch.zeros(jac.d, dtype=torch.float64)
        for _, rows in jac.whitened_chunks(root):  # float64 column norms of Ψ₀
            sq += rows.pow(2).sum((0, 1))
        features = LinearizedFeatures(
            jac, output_map=root.apply_transpose, output_adjoint=root.apply, n_outputs=jac.d_out
        )
        return features, sq, jac
    if dense:
        P0 = assemble_whitened_jacobian(model, X, names, root, chunk_size=chunk_size, progress=progress, dtype=dtype)
        sq = torch.zeros(P0.shape[1], dtype=torch.float64)
        step = rows_per_chunk(P0.shape[1] * 8)
        for lo in range(0, P0.shape[0], step):  # float64 sums without a float64 copy of Ψ₀
            sq += P0[lo : lo + step].double().pow(2).sum(0)
        return DenseFeatures(P0), sq, net
    return WhitenedProducts(net, root, model, X, names, chunk_size, progress), None, net


def whitened_matrix(jac: DenseJacobian, root: SoftmaxHessianRoot) -> torch.Tensor:
    """``Ψ₀ = blockdiag(L_iᵀ) J`` ``(n·C, d)`` from an assembled Jacobian (no Jacobian products), in ``J``'s dtype."""
    out = torch.empty_like(jac.matrix)
    for start, rows in jac.whitened_chunks(root):
        out[start * root.C : (start + rows.shape[0]) * root.C] = rows.reshape(-1, jac.d)
    return out


def prior_scales(
    prior,
    options: dict,
    *,
    base: FeatureOperator,
    model,
    X: torch.Tensor,
    names,
    root: SoftmaxHessianRoot,
    n_params: int,
    sq_norms: torch.Tensor | None = None,
    a: float = 1.0,
    seed: int = 0,
    chunk_size: int = 32,
    progress: bool = False,
) -> tuple[torch.Tensor, DiagonalPrior | None]:
    """``(s, prior)``: the scales ``(d,)`` float64 of ``prior`` (a diagonal prior's registry name, made with
    ``options`` on ``base`` = ``Ψ₀``; or a tensor of scales, then ``prior`` is ``None``). The prior is handed the
    exact squared column norms ``sq_norms`` (those of an assembled ``Ψ₀``) or, computed only if it asks, the GGN
    diagonal from per-example Jacobians (:func:`~ctuq.classify.jacobians.ggn_diagonal`)."""
    if isinstance(prior, torch.Tensor):
        if tuple(prior.shape) != (n_params,):
            raise ValueError(f"LinearizedLaplace: prior scales must have shape ({n_params},), got {tuple(prior.shape)}")
        if not torch.isfinite(prior).all() or (prior < 0).any():
            raise ValueError("LinearizedLaplace: prior scales must be finite and >= 0")
        return prior.detach().double(), None

    def exact_norms() -> torch.Tensor:
        if sq_norms is not None:
            return sq_norms
        return ggn_diagonal(model, X, names, root, chunk_size=chunk_size, progress=progress)

    made = PRIORS[prior].create(base, **options)
    # no targets yet: the pseudo-targets come from the linearised mode, which needs these scales
    problem = PriorProblem(base, None, a=float(a), sigma2=1.0, seed=seed, progress=progress, column_norms=exact_norms)
    return made.compute_scales(problem).double(), made
