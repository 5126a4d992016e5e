"""The likelihood contract of the inference core (:class:`Likelihood`): what a noise model owns in the whitened
linear model the solvers, the sampler and the EM see (package docstring, :mod:`ctuq.inference.likelihoods`)."""

from __future__ import annotations

import abc
import copy
import math

import torch

from ctuq.registry import LIKELIHOODS

__all__ = ["Likelihood", "positive"]


class Likelihood(abc.ABC):
    """Noise model of the whitened linear model (module docstring).

    Attributes
    ----------
    sigma2 : float
        Current noise variance ``σ²`` (> 0) in squared target units.
    learn_noise : bool
        Whether the EM updates ``σ²``.
    """

    #: Registry name (:data:`ctuq.registry.LIKELIHOODS`), recorded in :meth:`state_dict`.
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

    def row_scales(self) -> torch.Tensor | None:
        """The whitening ``D^(−1/2)`` ``(c,)`` the posterior applies to the rows of ``Ψ₀`` and ``ỹ``; ``None``: the
        model is already white (``D = I``)."""
        return None

    def log_evidence_correction(self) -> float:
        """What turns the whitened model's log evidence into the measurement-space one (nats): ``−½ log det D``."""
        return 0.0

    def noise_variance_of(self, variances: torch.Tensor | None = None, *, target_scale: float = 1.0):
        """The noise variance this model assigns to other rows (rows it was not fitted on, e.g. held-out ones):
        ``σ² / target_scale²``, the same for every row, whatever their measurement ``variances`` (ignored here).

        Parameters
        ----------
        variances : torch.Tensor, optional
            The rows' own measurement variances, in the units the likelihood's per-row variances were derived from
            (used by likelihoods with per-row noise, :class:`DiagonalGaussianLikelihood`).
        target_scale : float
            The targets are ``target_scale ×`` the rows' measurement units (a front end that scales its data);
            the answer is in the rows' units², i.e. ``σ²`` divided by ``target_scale²``.

        Returns
        -------
        float, or torch.Tensor ``(m,)`` float64 for a per-row model
        """
        return float(self.sigma2) / target_scale**2

    def restrict(self, rows: torch.Tensor) -> Likelihood:
        """This likelihood for the measurements ``rows`` (a 1-D integer index): a copy (nothing is per row)."""
        return copy.deepcopy(self)

    def extend(self, variances: torch.Tensor | None, n_new: int) -> Likelihood:
        """This likelihood with ``n_new`` measurements appended: a copy; per-row ``variances`` only belong to a
        likelihood that has them."""
        if variances is not None:
            raise ValueError(
                f"{type(self).__name__}: the appended rows have no per-row variances in this noise model; "
                f"pass variances=None (or use DiagonalGaussianLikelihood)"
            )
        return copy.deepcopy(self)

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
        self.sigma2 = positive(state["sigma2"], "sigma2")


def positive(v, name: str) -> float:
    v = float(v)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"likelihood: {name} must be positive and finite, got {v}")
    return v


LIKELIHOODS.set_base(Likelihood)
