"""Weight priors of the linearised model: what the prior over the network weights ``v`` is in units of standard
weights ``w ~ N(0, a⁻¹ I)``.

* :mod:`ctuq.priors.scaling`: diagonal priors ``v = diag(s) w``: the g-prior (exact or stochastic column norms) and
  the isotropic prior (``s = 1``);
* :mod:`ctuq.priors.tv_predcp`: the TV-PredCP block prior ``v = L w`` (Matérn-½ over the taps of 3×3 filters, one
  lengthscale and variance per block, hyperparameters by type-II MAP with the TV predictive-complexity hyperprior);
* :mod:`ctuq.priors.registry`: :data:`BLOCK_PRIORS`, name → class of the block priors.

A new block prior is one module here plus its import below (see :mod:`ctuq.priors.registry`).
"""

from ctuq.priors.registry import BLOCK_PRIORS, register_block_prior
from ctuq.priors.scaling import column_sq_norms, gprior_scales, isotropic_scales, scales_from_sq_norms
from ctuq.priors.tv_predcp import PriorError, TVPredCPPrior  # registers "tv_predcp"

__all__ = [
    "column_sq_norms",
    "gprior_scales",
    "isotropic_scales",
    "scales_from_sq_norms",
    "BLOCK_PRIORS",
    "register_block_prior",
    "PriorError",
    "TVPredCPPrior",
]
