"""Bayesian experimental design of CT scan angles with the linearised DIP (and isotropic / Matérn-½ priors).

A sparse pilot scan is taken; the design chooses, one at a time, the candidate angles whose measurements are
expected to tell the most about the image (``docs/design.md``). Pieces, read top to bottom:

* :mod:`.candidates` — candidate sets, pilot selection, the equidistant and random baselines, input checks
  (:class:`DesignError`).
* :mod:`.factors` — image-space prior factors ``L`` (``K = L diag(s)² Lᵀ / a``): identity, Matérn-½ by circulant
  embedding, an assembled network Jacobian; a :class:`ctuq.linearize.LinearizedNetwork` is one too.
* :mod:`.model` — :class:`DesignModel`: candidates' operator, factor, scales, ``a``, ``σ²``; the core's feature
  operators ``Ψ = T_B L diag(s)`` for any candidate set.
* :mod:`.priors`, :mod:`.dip_prior` — building the priors on the pilot (EM / evidence with the core's
  :class:`ctuq.inference.LinearizedPosterior`; the DIP's g-prior refreshed every few angles, optional retraining).
* :mod:`.criteria` — EIG, ESE, diagonal EIG from candidate blocks or samples; the dense reference.
* :mod:`.bordered` — :class:`BorderedCholesky`: the measurement covariance of the chosen angles grown by bordering
  (a core solver, so the core sampler draws with it).
* :mod:`.engine` — :class:`DesignEngine`: conditioning on one more angle, exact block downdates or
  pathwise-conditioned samples drawn by the core sampler.
* :mod:`.greedy` — the greedy loop with per-step records and checkpoint/resume; baselines.
* :mod:`.run` — ``ctuq design`` (:func:`run_design`); :mod:`.plots` — its figures.

Names are imported lazily so that :mod:`ctuq.config` can take the option vocabularies from here.
"""

from __future__ import annotations

from ctuq.utils import lazy_exports

_LAZY = {
    "DesignError": "candidates", "BASELINES": "candidates", "equidistant_indices": "candidates",
    "equidistant_angles": "candidates", "random_indices": "candidates", "match_angles": "candidates",
    "check_design_sizes": "candidates",
    "IdentityFactor": "factors", "MaternFactor": "factors", "DenseFactor": "factors", "kernel_apply": "factors",
    "DesignModel": "model",
    "PRIOR_KINDS": "priors", "PRIOR_SCALES": "priors", "isotropic_model": "priors", "matern_model": "priors",
    "fit_precision": "priors", "energy_precision": "priors", "DIPPrior": "dip_prior", "DENSE_CHOICES": "dip_prior",
    "CRITERIA": "criteria", "DEFAULT_JITTER": "criteria", "criteria_from_blocks": "criteria",
    "criteria_from_samples": "criteria", "dense_posterior_blocks": "criteria",
    "information_gain_bruteforce": "criteria",
    "BorderedCholesky": "bordered", "DesignEngine": "engine", "ROUTES": "engine", "auto_route": "engine",
    "DesignResult": "greedy", "greedy_design": "greedy", "baseline_design": "greedy", "STRATEGIES": "greedy",
    "DesignCheckpointMismatch": "greedy",
    "run_design": "run", "read_angles_file": "run",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
