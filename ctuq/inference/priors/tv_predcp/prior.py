"""The TV-PredCP block prior as registered (``tv_predcp``): :class:`~.model.TVPredCPModel` (its options, weight map,
hyperparameters, state, summary and figure) that fits itself by the type-II MAP of :mod:`.fit`."""

from __future__ import annotations

from ctuq.inference.features import DenseFeatures
from ctuq.inference.priors.base import PriorError, PriorProblem
from ctuq.inference.priors.tv_predcp.fit import fit_block_prior
from ctuq.inference.priors.tv_predcp.model import TVPredCPModel
from ctuq.registry import PRIORS

__all__ = ["TVPredCPPrior"]


@PRIORS.register
class TVPredCPPrior(TVPredCPModel):
    __doc__ = TVPredCPModel.__doc__

    def fit(self, problem: PriorProblem) -> float:
        """Type-II MAP of the hyperparameters (:func:`fit_block_prior`) on the whitened ``Ψ₀`` (the assembled one
        when there is one); returns ``σ²`` (learned with ``problem.learn_noise``)."""
        if self.image_map is None:
            raise ValueError(f"{type(self).__name__}.fit: no image_map (network weights → outputs) was given")
        if self.image_shape is None:
            raise PriorError(
                "TVPredCPPrior.fit: no image shape; give image_shape, or prepare(output=..., output_shape=...) first"
            )
        # an assembled Ψ₀ serves the fit's many products in the features' dtype (float32 is twice as fast; the
        # fit's CG stops at rtol 1e-3 anyway)
        base = problem.features if problem.dense is None else DenseFeatures(problem.dense.to(problem.features.dtype))
        problem.say(f"{self.name} prior: type-II MAP of {self.n_hyper} hyperparameters ({self.steps} steps)")
        return fit_block_prior(
            self,
            base,
            problem.targets,
            a=problem.a,
            sigma2=problem.sigma2,
            image_map=self.image_map,
            learn_noise=problem.learn_noise,
            seed=problem.seed,
            progress=problem.progress,
            log=problem.log,
        )
