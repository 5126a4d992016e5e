"""Likelihoods of the linear model ``ỹ = Ψ w + ε`` seen by the inference core.

The core works with a Gaussian linear model in *whitened* target coordinates: the solvers, the Matheron sampler
and the EM see ``ε ~ N(0, σ² I)``. A likelihood object owns what depends on the noise model:

* its noise variance ``σ²`` in those coordinates and whether the EM learns it
  (:meth:`Likelihood.noise_update`, the M-step ``σ² ← ‖ỹ − Ψw*‖² / (c − γ̂)`` for a Gaussian);
* the draw of the noise part of a Matheron sample (:meth:`Likelihood.draw_noise`);
* the noise variance of rows it was not fitted on (:meth:`Likelihood.noise_variance_of`: a front end's held-out
  rows, given their own measurement variances).

:class:`GaussianLikelihood` is CT's (``σ²`` in squared scaled data units, optionally learned).
:class:`DiagonalGaussianLikelihood` is ``ε ~ N(0, σ² D)`` with known relative per-row variances ``D = diag(d)``
(CT: from the scan's photon statistics) and a global scale ``σ²``: the posterior whitens the rows by
``D^(−1/2)`` (:class:`~ctuq.inference.features.RowScaledFeatures`, targets ``D^(−1/2) ỹ``), so in whitened
coordinates it is again ``N(0, σ² I)`` — the EM's noise update then learns the scale ``σ²`` from the whitened
residual — and only what is reported in measurement space changes (the log evidence gains ``−½ Σ log d_i``,
:meth:`Likelihood.log_evidence_correction`). A categorical
likelihood (classification, linearised Laplace) enters the same core by whitening with the softmax Hessian:
features ``B^(1/2) Φ diag(s)``, pseudo-targets chosen so that the posterior mode is the trained network, and
unit noise (``σ² = 1``, not learned) — so it is a fixed-noise Gaussian in these coordinates and adds no
branch to the solvers, the sampler or the EM.

Every likelihood class is registered by name in :data:`ctuq.registry.LIKELIHOODS` (``@LIKELIHOODS.register``; the
name is also what :meth:`Likelihood.state_dict` records); the shipped contract every one passes is
:class:`ctuq.testing.LikelihoodContract`. A new likelihood is one module of this package (a :class:`Likelihood`
subclass with ``@LIKELIHOODS.register``) plus its import line below.
"""

# isort: off
# The registry lines: importing a likelihood module registers its classes, in this order (LIKELIHOODS.names()).
from ctuq.inference.likelihoods.base import Likelihood
from ctuq.inference.likelihoods.gaussian import DiagonalGaussianLikelihood, GaussianLikelihood, check_variances
from ctuq.inference.likelihoods.categorical import CategoricalLikelihood

# isort: on
from ctuq.registry import LIKELIHOODS

__all__ = [
    "Likelihood",
    "GaussianLikelihood",
    "DiagonalGaussianLikelihood",
    "CategoricalLikelihood",
    "check_variances",
    "LIKELIHOODS",
]
