"""Likelihoods of the linear model ``ỹ = Ψ w + ε`` seen by the inference core.

The core works with a Gaussian linear model in *whitened* target coordinates: the solvers, the Matheron sampler
and the EM see ``ε ~ N(0, σ² I)``. A likelihood object owns what depends on the noise model:

* its noise variance ``σ²`` in those coordinates and whether the EM learns it
  (:meth:`Likelihood.noise_update`, the M-step ``σ² ← ‖ỹ − Ψw*‖² / (c − γ̂)`` for a Gaussian);
* the draw of the noise part of a Matheron sample (:meth:`Likelihood.draw_noise`).

:class:`GaussianLikelihood` is CT's (``σ²`` in squared scaled data units, optionally learned). A categorical
likelihood (classification, linearised Laplace) enters the same core by whitening with the softmax Hessian:
features ``B^(1/2) Φ diag(s)``, pseudo-targets chosen so that the posterior mode is the trained network, and
unit noise (``σ² = 1``, not learned) — so it is a fixed-noise Gaussian in these coordinates and adds no
branch to the solvers, the sampler or the EM.
"""

from __future__ import annotations

import abc
import math

import torch

__all__ = ["Likelihood", "GaussianLikelihood", "CategoricalLikelihood", "LIKELIHOODS"]


class Likelihood(abc.ABC):
    """Noise model of the whitened linear model (module docstring).

    Attributes
    ----------
    sigma2 : float
        Current noise variance ``σ²`` (> 0) in squared target units.
    learn_noise : bool
        Whether the EM updates ``σ²``.
    """

    name: str = ""
    sigma2: float
    learn_noise: bool

    def draw_noise(self, n: int, c: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
        """``ε`` ``(n, c)`` ~ ``N(0, σ² I)`` on the generator's device (the sampler moves it)."""
        eps = torch.randn((n, c), generator=generator, device=generator.device, dtype=dtype)
        return eps.mul_(float(self.sigma2) ** 0.5)

    @abc.abstractmethod
    def noise_update(self, residual_norm_sq: float, n_outputs: int, gamma: float) -> float:
        """The EM's new ``σ²`` from ``‖ỹ − Ψw*‖²``, ``c`` and the effective dimension ``γ``."""

    def state_dict(self) -> dict:
        """``{"name", "sigma2", "learn_noise"}`` (plain values)."""
        return {"name": self.name, "sigma2": float(self.sigma2), "learn_noise": bool(self.learn_noise)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``σ²`` (the noise model itself must match)."""
        if not isinstance(state, dict) or state.get("name") != self.name:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: state is for likelihood "
                f"{state.get('name') if isinstance(state, dict) else state!r}, not {self.name!r}"
            )
        self.sigma2 = _positive(state["sigma2"], "sigma2")


def _positive(v, name: str) -> float:
    v = float(v)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"likelihood: {name} must be positive and finite, got {v}")
    return v


class GaussianLikelihood(Likelihood):
    """``ỹ | w ~ N(Ψw, σ² I)``; the EM may learn ``σ²`` (MacKay: ``σ² ← ‖ỹ − Ψw*‖² / (c − γ)``).

    Parameters
    ----------
    sigma2 : float
        Initial (or fixed) noise variance (> 0), squared target units (CT: scaled data units², i.e. × scale²).
    learn_noise : bool
        Update ``σ²`` in the EM.
    """

    name = "gaussian"

    def __init__(self, sigma2: float = 1.0, learn_noise: bool = False):
        self.sigma2 = _positive(sigma2, "sigma2")
        self.learn_noise = bool(learn_noise)

    def noise_update(self, residual_norm_sq: float, n_outputs: int, gamma: float) -> float:
        if not self.learn_noise:
            return self.sigma2
        if not n_outputs - gamma > 0:
            raise FloatingPointError(
                f"SampledEM: c − γ = {n_outputs - gamma:.3e} <= 0; cannot update the noise variance"
            )
        return residual_norm_sq / (n_outputs - gamma)

    def __repr__(self) -> str:
        return f"GaussianLikelihood(sigma2={self.sigma2:.4g}, learn_noise={self.learn_noise})"


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


LIKELIHOODS = {"gaussian": GaussianLikelihood, "categorical": CategoricalLikelihood}
