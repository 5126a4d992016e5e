"""Linearised Laplace for trained PyTorch classifiers, on the same inference core as CT (``ctuq.inference``).

::

    from ctuq.classify import LinearizedLaplace
    la = LinearizedLaplace(model, prior="gprior")          # any nn.Module returning logits (N, C); all weights
    la.fit(train_loader)                                   # linearise at the trained weights, softmax Hessians
    la.optimize_prior(method="sampled_em")                 # MacKay EM for the prior precision; la.em_trace
    probs = la.predict(x, link="mc", samples=64)           # or link="probit"; la.predict_logits, la.sample_logits
    la.log_evidence(); state = la.state_dict(); LinearizedLaplace.from_state_dict(model, state)

Modules: :mod:`~ctuq.classify.laplace` (the front end and its equations), :mod:`~ctuq.classify.hessian` (softmax
Hessian square roots and pseudo-target residuals), :mod:`~ctuq.classify.prior_fit` (EM, grid search and evidence
for the prior precision), :mod:`~ctuq.classify.mode` (the linearised model's categorical mode for the M-step),
:mod:`~ctuq.classify.jacobians` (per-example Jacobians: exact g-prior, dense features),
:mod:`~ctuq.classify.predictive` (MC / probit predictives), :mod:`~ctuq.classify.data` (input checks),
:mod:`~ctuq.classify.state` (save / load). Metrics: :mod:`ctuq.metrics.classification`. Docs:
docs/classification.md. Option vocabularies: :class:`ctuq.options.LinearModel`, :class:`~ctuq.options.PriorMethod`,
:class:`~ctuq.options.HessianAt`,
:class:`~ctuq.options.HessianRoot`, :class:`~ctuq.options.Link`, :class:`~ctuq.options.WeightSubset`.
"""

from ctuq.classify.data import resolve_weights
from ctuq.classify.hessian import HessianMismatchWarning, SoftmaxHessianRoot, mean_hessian_trace, softmax_hessian
from ctuq.classify.laplace import (
    DEFAULT_GRID,
    GPRIOR_FLOOR,
    HESSIAN_RATIO_WARNING,
    OVERFIT_WARNING,
    LinearizedLaplace,
    exact_solver,
)
from ctuq.classify.mode import LinearMode, ModeResult, OverfitWarning, mean_kl, overfit_fraction
from ctuq.classify.predictive import link_probabilities, logit_samples
from ctuq.classify.prior_fit import GUARD_TOLERANCE, GuardWarning
from ctuq.classify.state import ClassifierStateError

__all__ = [
    "LinearizedLaplace",
    "exact_solver",
    "DEFAULT_GRID",
    "GPRIOR_FLOOR",
    "GUARD_TOLERANCE",
    "GuardWarning",
    "HESSIAN_RATIO_WARNING",
    "HessianMismatchWarning",
    "OVERFIT_WARNING",
    "OverfitWarning",
    "overfit_fraction",
    "mean_kl",
    "ClassifierStateError",
    "mean_hessian_trace",
    "SoftmaxHessianRoot",
    "softmax_hessian",
    "LinearMode",
    "ModeResult",
    "link_probabilities",
    "logit_samples",
    "resolve_weights",
]
