"""The TV-PredCP block prior: a Matérn-½ covariance over the taps of every 3×3 convolution filter, one lengthscale and
one variance per block, with the total-variation predictive-complexity hyperprior on the lengthscales.

Method (Antorán, Barbano, Leuschner, Hernández-Lobato, Jin, "Uncertainty estimation for computed tomography with a
linearised deep image prior", TMLR 2023; Barbano's thesis §7.2.3 / §7.3.1, Algorithm 5).

The weights ``v`` (``d``, the linearised parameters in their flattening order) are split into *blocks*
(:func:`block_layout`): by default one block per top-level network block (``inc``, ``down.0``, ``up.1``, ...: the
module path up to its first list index) and kind of weight. A block of 3×3 weights (``(c_out, c_in, 3, 3)``) has a
Matérn-½ prior over the nine taps of each filter, independently per filter::

    v_f ~ N(0, a⁻¹ σ²_b K(ℓ_b)),     K(ℓ)_pq = exp(−‖x_p − x_q‖ / ℓ)     (x_p: tap positions on the 3×3 grid),

and every other weight (1×1 convolutions, linear layers) a normal prior ``N(0, a⁻¹ σ²_b)`` with the block's own
variance. ``a`` is the posterior's global prior precision, which the EM keeps learning on top.

In the core a prior is the map from standard weights to network weights: ``v = L w`` with ``w ~ N(0, a⁻¹ I)`` and
``L = blockdiag(σ_b chol K(ℓ_b) per filter, σ_b I)``, so the features are ``Ψ = Ψ₀ L``
(:class:`~ctuq.inference.block_features.BlockFeatures`); the g-prior is the diagonal case ``L = diag(s)``. Every
solver, the Matheron sampler, the EM and the checkpoints therefore work unchanged on the block prior.
:meth:`TVPredCPPrior.apply` and :meth:`TVPredCPPrior.apply_t` are ``L`` and ``Lᵀ`` on rows, differentiable in the
hyperparameters.

Hyperparameters ``θ = (log ℓ_b, log σ²_b)`` are set by type-II MAP, run by the posterior before its solver is set up:
the linearised model's log marginal likelihood plus, for every Matérn block, the TV-PredCP log hyperprior on
``t_b = log ℓ_b`` (the expected total variation of the block's prior image samples, in closed form).

The lengthscales are kept in ``[LENGTHSCALE_MIN, LENGTHSCALE_MAX]`` (tap spacing 1): below, ``K`` is the identity
to machine precision, above, it is the all-ones matrix (rank one; a jitter of ``1e-6`` keeps its Cholesky factor).

Nothing here is CT: the image shape and the map ``Φ`` from weights to network outputs are passed in
(:meth:`TVPredCPPrior.prepare` takes the image shape and the rate ``λ = scale / TV(g(ṽ))`` from the network output).

Modules, one concept each:

* :mod:`.blocks`: the weight blocks (:func:`block_layout`), the tap geometry, the Matérn-½ factor, TV differences;
* :mod:`.prior`: :class:`TVPredCPPrior` (options, ``L`` and ``Lᵀ``, hyperparameters, state, summary, figure);
* :mod:`.hyperprior`: the TV-PredCP hyperprior (:func:`tap_grams`, :func:`expected_tv`, :func:`tv_predcp_terms`);
* :mod:`.mll`: the marginal-likelihood gradient (:func:`mll_gradient`) and the fit's gradient oracle;
* :mod:`.fit`: the type-II MAP (:func:`fit_block_prior`): set-up, the optimiser's run, the convergence record;
* :mod:`.steps`: what every step shares (MacKay's update, the trace record, the convergence criterion);
* :mod:`.lbfgs`: the default optimiser, MacKay warm start + projected L-BFGS (written out: see its docstring);
* :mod:`.adam`: the first method, ``torch.optim.Adam`` + MacKay;
* :mod:`.figure`: the fit's trace figure (:func:`plot_prior_trace`).
"""

from ctuq.inference.priors.tv_predcp.blocks import (
    LENGTHSCALE_MAX,
    LENGTHSCALE_MIN,
    PriorBlock,
    anisotropic_tv,
    block_layout,
    default_block_name,
    matern12_cholesky,
    tap_distances,
)
from ctuq.inference.priors.tv_predcp.figure import plot_prior_trace
from ctuq.inference.priors.tv_predcp.fit import fit_block_prior
from ctuq.inference.priors.tv_predcp.hyperprior import expected_tv, tap_grams, tv_predcp_terms
from ctuq.inference.priors.tv_predcp.lbfgs import variance_floor
from ctuq.inference.priors.tv_predcp.mll import block_gprior_variances, mll_gradient
from ctuq.inference.priors.tv_predcp.prior import TVPredCPPrior
from ctuq.inference.priors.tv_predcp.steps import CONVERGENCE_PATIENCE

__all__ = [
    "PriorBlock",
    "TVPredCPPrior",
    "block_layout",
    "default_block_name",
    "tap_distances",
    "matern12_cholesky",
    "tv_predcp_terms",
    "tap_grams",
    "expected_tv",
    "anisotropic_tv",
    "fit_block_prior",
    "mll_gradient",
    "block_gprior_variances",
    "variance_floor",
    "plot_prior_trace",
    "CONVERGENCE_PATIENCE",
    "LENGTHSCALE_MIN",
    "LENGTHSCALE_MAX",
]
