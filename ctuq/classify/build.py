"""Building blocks of :meth:`LinearizedLaplace.fit <ctuq.classify.LinearizedLaplace.fit>`: the whitened features
``Ψ₀ = blockdiag(L_iᵀ) J`` and the prior scales ``s``.

* Features: a :class:`~ctuq.inference.LinearizedFeatures` of the network on all training inputs with the output
  map ``Lᵀ`` (adjoint ``L``) per example — Jacobian products over all ``n`` inputs per product — or ``Ψ₀``
  assembled densely from per-example Jacobians (:mod:`ctuq.classify.jacobians`; ``C`` backward passes over the
  data), after which every product is a GEMM: for the exact solvers when twice its ``n·C·d`` float64 numbers fit
  the dense budget (:func:`~ctuq.inference.dense_features_fit`), for any solver with ``dense_features="always"``.
* Scales: the g-prior ``s_j = ‖Ψ₀[:, j]‖⁻¹`` exactly (the GGN diagonal from per-example Jacobians, ``C`` backward
  passes over the data; free when ``Ψ₀`` is dense) or stochastically (``gprior_probes`` Rademacher probes through
  ``Ψ₀ᵀ``, :func:`ctuq.priors.gprior_scales`); ones for ``"isotropic"``; or given. Zero columns get ``s_j = 0``.
"""

from __future__ import annotations

import torch

from ctuq.classify.hessian import SoftmaxHessianRoot
from ctuq.classify.jacobians import assemble_whitened_jacobian, ggn_diagonal
from ctuq.inference import DenseFeatures, FeatureOperator, LinearizedFeatures

__all__ = ["whitened_features", "prior_scales"]


def whitened_features(model, net, X: torch.Tensor, names, root: SoftmaxHessianRoot, *, dense: bool,
                      dtype: torch.dtype, chunk_size: int = 32,
                      progress: bool = False) -> tuple[FeatureOperator, torch.Tensor | None]:
    """``(Ψ₀, squared column norms or None)``: dense from per-example Jacobians, or through ``net``'s products."""
    if dense:
        P0 = assemble_whitened_jacobian(model, X, names, root, chunk_size=chunk_size, progress=progress, dtype=dtype)
        sq = torch.zeros(P0.shape[1], dtype=torch.float64)
        for lo in range(0, P0.shape[0], 4096):  # float64 sums without a float64 copy of Ψ₀
            sq += P0[lo:lo + 4096].double().pow(2).sum(0)
        return DenseFeatures(P0), sq
    ones = torch.ones(net.d, dtype=dtype)
    return LinearizedFeatures(net, ones, output_map=root.apply_transpose, output_adjoint=root.apply,
                              n_outputs=net.d_out), None


def prior_scales(prior, *, base: FeatureOperator, model, X: torch.Tensor, names, root: SoftmaxHessianRoot,
                 n_params: int, sq_norms: torch.Tensor | None = None, gprior_method: str = "exact",
                 gprior_probes: int = 256, seed: int = 0, chunk_size: int = 32, progress: bool = False) -> torch.Tensor:
    """The scales ``s`` ``(d,)`` float64 for ``prior`` (``"gprior"``, ``"isotropic"`` or a tensor)."""
    from ctuq.priors import gprior_scales, scales_from_sq_norms

    if isinstance(prior, torch.Tensor):
        if tuple(prior.shape) != (n_params,):
            raise ValueError(f"LinearizedLaplace: prior scales must have shape ({n_params},), got {tuple(prior.shape)}")
        if not torch.isfinite(prior).all() or (prior < 0).any():
            raise ValueError("LinearizedLaplace: prior scales must be finite and >= 0")
        return prior.detach().double()
    if prior == "isotropic":
        return torch.ones(n_params, dtype=torch.float64)
    if gprior_method == "stochastic":
        return gprior_scales(base.rmatvec, base.n_outputs, method="stochastic", n_probes=gprior_probes, seed=seed,
                             dtype=base.dtype, progress=progress).double()
    if sq_norms is None:
        sq_norms = ggn_diagonal(model, X, names, root, chunk_size=chunk_size, progress=progress)
    return scales_from_sq_norms(sq_norms)
