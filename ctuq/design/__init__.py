"""Bayesian experimental design of CT scan angles with the linearised DIP (and isotropic / Matérn-½ priors).

A sparse pilot scan is taken; the design chooses, one at a time, the candidate angles whose measurements are
expected to tell the most about the image (``docs/experimental_design.md``). Pieces, read top to bottom:

* :mod:`.candidates` — candidate sets, pilot selection, the equidistant and random baselines, input checks
  (:class:`DesignError`).
* :mod:`.factors` — image-space prior factors ``L`` (``K = L diag(s)² Lᵀ / a``): identity, Matérn-½ by circulant
  embedding, an assembled network Jacobian; a :class:`ctuq.linearize.LinearizedNetwork` is one too.
* :mod:`.model` — :class:`DesignModel`: candidates' operator, factor, scales, ``a``, ``σ²``; the core's feature
  operators ``Ψ = T_B L diag(s)`` for any candidate set.
* :mod:`.priors`, :mod:`.dip_prior` — building the image priors on the pilot (EM / evidence with the core's
  :class:`ctuq.inference.LinearizedPosterior`; the DIP's weight prior (``design.weight_prior``, the g-prior by
  default) refreshed every few angles, optional retraining).
* :mod:`.criteria` — EIG, ESE, diagonal EIG from candidate blocks or samples; the dense reference.
* :mod:`.bordered` — :class:`BorderedCholesky`: the measurement covariance of the chosen angles grown by bordering
  (a core solver, so the core sampler draws with it).
* :mod:`.engine` — :class:`DesignEngine`: conditioning on one more angle, exact block downdates or
  pathwise-conditioned samples drawn by the core sampler (its *route*: ``design.route``).
* :mod:`.greedy` — the greedy loop with per-step records and checkpoint/resume; baselines.
* :mod:`.plots` — the design's figures.

The ``ctuq design`` command's runner (scan, pilot DIP, outputs) is :func:`ctuq.pipeline.design.run_design`; the
option vocabularies are :class:`ctuq.options.Criterion`, :class:`~ctuq.options.Baseline`,
:class:`~ctuq.options.DesignPriorKind`, :class:`~ctuq.options.DesignPriorScale` and
:class:`~ctuq.options.DesignRoute`.
"""

from ctuq.design.bordered import BorderedCholesky
from ctuq.design.candidates import (
    DesignError,
    check_design_sizes,
    equidistant_angles,
    equidistant_indices,
    match_angles,
    random_indices,
)
from ctuq.design.criteria import (
    DEFAULT_JITTER,
    criteria_from_blocks,
    criteria_from_samples,
    dense_posterior_blocks,
    information_gain_bruteforce,
)
from ctuq.design.dip_prior import DIPPrior
from ctuq.design.engine import DesignEngine, auto_route
from ctuq.design.factors import DenseFactor, IdentityFactor, MaternFactor, kernel_apply
from ctuq.design.forecast import ErrorForecaster, OnlineCalibration, RowPredictor, StopRule, parse_target
from ctuq.design.greedy import STRATEGIES, DesignResult, baseline_design, greedy_design
from ctuq.design.model import DesignModel
from ctuq.design.plan import AcquisitionHooks, plan_curves
from ctuq.design.priors import (
    energy_precision,
    fit_precision,
    isotropic_model,
    matern_model,
)

__all__ = [
    "AcquisitionHooks",
    "ErrorForecaster",
    "OnlineCalibration",
    "RowPredictor",
    "StopRule",
    "parse_target",
    "plan_curves",
    "BorderedCholesky",
    "DIPPrior",
    "DEFAULT_JITTER",
    "DenseFactor",
    "DesignEngine",
    "DesignError",
    "DesignModel",
    "DesignResult",
    "IdentityFactor",
    "MaternFactor",
    "STRATEGIES",
    "auto_route",
    "baseline_design",
    "check_design_sizes",
    "criteria_from_blocks",
    "criteria_from_samples",
    "dense_posterior_blocks",
    "energy_precision",
    "equidistant_angles",
    "equidistant_indices",
    "fit_precision",
    "greedy_design",
    "information_gain_bruteforce",
    "isotropic_model",
    "kernel_apply",
    "match_angles",
    "matern_model",
    "random_indices",
]
