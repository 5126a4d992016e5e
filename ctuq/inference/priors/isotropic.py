"""The isotropic prior ``v − ṽ ~ N(0, a⁻¹ I)``: the diagonal prior with ``s = 1`` (no products)."""

from __future__ import annotations

import torch

from ctuq.inference.priors.base import DiagonalPrior, PriorProblem
from ctuq.inference.priors.gprior import isotropic_scales
from ctuq.registry import PRIORS

__all__ = ["IsotropicPrior"]


@PRIORS.register
class IsotropicPrior(DiagonalPrior):
    """``s = 1``: the same prior variance ``a⁻¹`` on every weight, whatever its effect on the data."""

    name = "isotropic"
    label = "isotropic prior"
    summary_key = "gprior"  # metrics.json has kept the diagonal priors' summary under uq.stats.gprior

    def __init__(self):
        super().__init__()

    @property
    def method(self) -> str:
        return "isotropic"

    def compute_scales(self, problem: PriorProblem) -> torch.Tensor:
        b = problem.features
        return isotropic_scales(b.n_features, dtype=b.dtype, device=b.device)

    def dense_scales(self, problem: PriorProblem) -> torch.Tensor:
        return self.compute_scales(problem)  # ones need no matrix
