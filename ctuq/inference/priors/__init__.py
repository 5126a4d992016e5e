"""Weight priors of the linearised model: what the prior over the network weights ``v`` is in units of standard
weights ``w ~ N(0, a⁻¹ I)``, ``v − ṽ = L w``, as one interface for diagonal and block priors.

* :mod:`.base`: the contract (:class:`WeightPrior`: make, prepare, set up = fit + build ``Ψ = Ψ₀ L``, state,
  summary, figures; its options section, set-up cost, timing key and label), :class:`DiagonalPrior`
  (``L = diag(s)``, also given scales), :class:`PriorCost`, :class:`PriorError`;
* :mod:`.gprior`: the g-prior (exact or stochastic column norms) and the scale functions other front ends use
  (:func:`gprior_scales`, :func:`scales_from_sq_norms`, :func:`isotropic_scales`, :func:`column_sq_norms`);
* :mod:`.isotropic`: ``s = 1``;
* :mod:`.tv_predcp`: the TV-PredCP block prior (Matérn-½ over the taps of 3×3 filters, one lengthscale and variance
  per block), its hyperprior and its type-II MAP (docs/tv_predcp.md).

Every prior class registers itself in :data:`ctuq.registry.PRIORS` (``@PRIORS.register``): its name is then a value
of ``LinearizedPosterior(prior=...)`` and of ``uq.prior``. A new prior is one module with such a class, plus, for a
built-in one, its import line below; ``ctuq.testing.PriorContract`` is its test.
"""

from ctuq.inference.priors.base import DiagonalPrior, PriorCost, PriorError, PriorProblem, PriorSetup, WeightPrior
from ctuq.registry import PRIORS

# The registry lines: importing a prior module registers its class, in this order (the order of PRIORS.names()).
# isort: off
from ctuq.inference.priors.gprior import GPrior, column_sq_norms, gprior_scales, isotropic_scales, scales_from_sq_norms
from ctuq.inference.priors.isotropic import IsotropicPrior
from ctuq.inference.priors.tv_predcp import TVPredCPPrior, fit_block_prior, mll_gradient
# isort: on

__all__ = [
    "PRIORS",
    "WeightPrior",
    "DiagonalPrior",
    "PriorError",
    "PriorProblem",
    "PriorSetup",
    "PriorCost",
    "GPrior",
    "IsotropicPrior",
    "TVPredCPPrior",
    "fit_block_prior",
    "mll_gradient",
    "column_sq_norms",
    "gprior_scales",
    "isotropic_scales",
    "scales_from_sq_norms",
]
