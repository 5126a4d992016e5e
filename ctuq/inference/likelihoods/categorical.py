"""The categorical likelihood of classification (linearised Laplace), a fixed unit-noise Gaussian in the whitened
coordinates of the softmax Hessian (package docstring)."""

from __future__ import annotations

from ctuq.inference.likelihoods.base import Likelihood
from ctuq.registry import LIKELIHOODS

__all__ = ["CategoricalLikelihood"]


@LIKELIHOODS.register
class CategoricalLikelihood(Likelihood):
    """A categorical likelihood in the whitened coordinates of linearised Laplace: unit noise, never learned.

    The front end (:mod:`ctuq.classify`) replaces ``Σ_i log Cat(y_i | softmax(f_i))`` by its second-order
    expansion at the trained network's logits ``f̃_i``; with ``B_i = L_i L_iᵀ`` the softmax Hessian there, that
    expansion is ``−½‖ỹ − Ψw‖²`` + const for features ``Ψ = blockdiag(L_iᵀ) J diag(s)`` and pseudo-targets ``ỹ``
    (see :mod:`ctuq.classify.laplace`), i.e. a Gaussian with ``σ² = 1`` in these coordinates. So the solvers, the
    sampler and the EM need no branch: this object only pins ``σ² = 1`` (setting anything else raises) and
    tells the EM not to learn it.
    """

    name = "categorical"

    def __init__(self) -> None:
        self._sigma2 = 1.0

    @property
    def sigma2(self) -> float:  # type: ignore[override]
        """Always 1 (whitened coordinates)."""
        return self._sigma2

    @sigma2.setter
    def sigma2(self, value: float) -> None:
        if float(value) != 1.0:
            raise ValueError(f"CategoricalLikelihood: the noise variance is 1 in whitened coordinates; got {value}")

    @property
    def learn_noise(self) -> bool:  # type: ignore[override]
        """Always False."""
        return False

    def noise_update(self, residual_norm_sq: float, n_outputs: int, gamma: float) -> float:
        return 1.0

    def __repr__(self) -> str:
        return "CategoricalLikelihood(sigma2=1)"
