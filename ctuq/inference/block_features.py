"""``Ψ = Ψ₀ L``: features under any weight prior ``v = L w`` (:mod:`ctuq.inference.priors`).

The general counterpart of :class:`~ctuq.inference.features.ScaledFeatures` (``L = diag(s)``): a weight prior is
the map from standard weights ``w ~ N(0, a⁻¹ I)`` to network weights, so with ``L`` the linear model is the usual one
in ``w`` and every solver, the sampler and the EM run on ``Ψ = Ψ₀ L`` unchanged. ``L`` is given as an object with
``apply`` (rows ``W`` ``(B, d)`` → ``L w``) and ``apply_t`` (rows → ``Lᵀ r``), e.g. a
:class:`~ctuq.inference.priors.WeightPrior` such as :class:`~ctuq.inference.priors.TVPredCPPrior` (whose ``L`` is
block diagonal with ``9 × 9`` blocks); products cost what ``Ψ₀``'s cost plus ``L``'s, and both operators count them.
"""

from __future__ import annotations

import torch

from ctuq.inference.features import FeatureOperator

__all__ = ["BlockFeatures"]


class BlockFeatures(FeatureOperator):
    """``Ψ = Ψ₀ L`` for a base operator ``Ψ₀`` (``c × d``) and a weight map ``L`` (``d × d``, module docstring).

    ``L`` is read at every product, so after its hyperparameters change the operator is the new ``Ψ₀ L``.
    """

    def __init__(self, base: FeatureOperator, weight_map):
        super().__init__()
        if not (hasattr(weight_map, "apply") and hasattr(weight_map, "apply_t")):
            raise TypeError(f"BlockFeatures: weight_map needs apply and apply_t, got {type(weight_map).__name__}")
        if getattr(weight_map, "d", None) not in (None, base.n_features):
            raise ValueError(
                f"BlockFeatures: the weight map is for d = {weight_map.d}, the features have d = {base.n_features}"
            )
        self.base = base
        self.weight_map = weight_map
        self.n_features, self.n_outputs = base.n_features, base.n_outputs
        self.dtype, self.device = base.dtype, base.device

    def _matvec(self, W: torch.Tensor) -> torch.Tensor:
        return self.base.matvec(self.weight_map.apply(W).to(self.dtype))

    def _rmatvec(self, R: torch.Tensor) -> torch.Tensor:
        return self.weight_map.apply_t(self.base.rmatvec(R)).to(self.dtype)

    def network_matvec(self, W: torch.Tensor) -> torch.Tensor:
        """``Φ (L w)`` for rows ``W`` ``(B, d)`` → ``(B, d_out)`` (needs a base with ``network_matvec``)."""
        W = self._rows(W, self.n_features, "W", "network_matvec")
        return self.base.network_matvec(self.weight_map.apply(W).to(self.dtype))
