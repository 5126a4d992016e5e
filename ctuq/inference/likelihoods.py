"""Likelihoods of the linear model ``ỹ = Ψ w + ε`` seen by the inference core.

The core works with a Gaussian linear model in *whitened* target coordinates: the solvers, the Matheron sampler
and the EM see ``ε ~ N(0, σ² I)``. A likelihood object owns what depends on the noise model:

* its noise variance ``σ²`` in those coordinates and whether the EM learns it
  (:meth:`Likelihood.noise_update`, the M-step ``σ² ← ‖ỹ − Ψw*‖² / (c − γ̂)`` for a Gaussian);
* the draw of the noise part of a Matheron sample (:meth:`Likelihood.draw_noise`).

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
"""

from __future__ import annotations

import abc
import copy
import math

import torch

from ctuq.errors import CheckpointMismatch

__all__ = ["Likelihood", "GaussianLikelihood", "DiagonalGaussianLikelihood", "CategoricalLikelihood", "LIKELIHOODS"]


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

    def row_scales(self) -> torch.Tensor | None:
        """The whitening ``D^(−1/2)`` ``(c,)`` the posterior applies to the rows of ``Ψ₀`` and ``ỹ``; ``None``: the
        model is already white (``D = I``)."""
        return None

    def log_evidence_correction(self) -> float:
        """What turns the whitened model's log evidence into the measurement-space one (nats): ``−½ log det D``."""
        return 0.0

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


def check_variances(variances, n_outputs: int | None, where: str) -> torch.Tensor:
    """Relative per-row noise variances ``d`` ``(c,)``: float, finite and positive (float64 copy, detached);
    ``ValueError`` naming the shape or the first bad value otherwise."""
    if not isinstance(variances, torch.Tensor) or variances.ndim != 1:
        got = tuple(variances.shape) if isinstance(variances, torch.Tensor) else type(variances).__name__
        want = f"({n_outputs},)" if n_outputs is not None else "(c,)"
        raise ValueError(f"{where}: variances must be a 1-D tensor of shape {want}, got {got}")
    if n_outputs is not None and variances.numel() != n_outputs:
        raise ValueError(f"{where}: variances must have shape ({n_outputs},), got {tuple(variances.shape)}")
    if not variances.is_floating_point():
        raise ValueError(f"{where}: variances must be a float tensor, got {variances.dtype}")
    v = variances.detach().to(torch.float64)
    bad = ~(torch.isfinite(v) & (v > 0))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"{where}: variances must be finite and positive; {int(bad.sum())} are not (first at row {i}: "
            f"{float(v[i])})"
        )
    return v.clone()


class DiagonalGaussianLikelihood(GaussianLikelihood):
    """``ỹ | w ~ N(Ψw, σ² D)``, ``D = diag(d)`` with known relative variances ``d`` ``(c,)`` and a scale ``σ²``
    that the EM may learn (module docstring).

    The posterior works in the whitened coordinates ``D^(−1/2) ỹ = D^(−1/2) Ψ w + ε'``, ``ε' ~ N(0, σ² I)``:
    :meth:`row_scales` is ``d^(−1/2)``, :meth:`draw_noise` and :meth:`noise_update` act on whitened rows (the
    latter is MacKay's update of the scale, ``σ² ← (ỹ − Ψw*)ᵀ D⁻¹ (ỹ − Ψw*) / (c − γ)``), and the evidence of the
    measurements is the whitened one plus :meth:`log_evidence_correction` ``= −½ Σ log d_i``. The per-measurement
    noise variance in measurement units is ``σ² d_i`` (:meth:`noise_variances`). With ``d ≡ 1`` every number
    equals :class:`GaussianLikelihood`'s bitwise.

    Parameters
    ----------
    sigma2 : float
        Initial (or fixed) scale ``σ²`` (> 0): the noise variance of a row with ``d_i = 1``, squared target units.
    learn_noise : bool
        Update ``σ²`` in the EM.
    variances : torch.Tensor
        ``d`` ``(c,)``, finite and positive; only their ratios matter next to a learned ``σ²`` (a front end may
        normalise them to mean 1 so that ``σ²`` stays the mean noise variance).
    """

    name = "diagonal_gaussian"

    def __init__(self, sigma2: float = 1.0, learn_noise: bool = False, *, variances: torch.Tensor):
        super().__init__(sigma2, learn_noise)
        self.variances = check_variances(variances, None, "DiagonalGaussianLikelihood")

    @property
    def n_outputs(self) -> int:
        """``c``, the number of rows the variances are for."""
        return int(self.variances.numel())

    def row_scales(self) -> torch.Tensor:
        """``d^(−1/2)`` ``(c,)`` float64."""
        return self.variances.rsqrt()

    def log_evidence_correction(self) -> float:
        """``−½ Σ log d_i`` (nats): ``log N(ỹ; 0, C_D) = log N(D^(−1/2)ỹ; 0, D^(−1/2) C_D D^(−1/2)) − ½ log det D``."""
        return float(-0.5 * self.variances.log().sum())

    def noise_variances(self) -> torch.Tensor:
        """``σ² d`` ``(c,)`` float64: each measurement's noise variance in target units."""
        return self.sigma2 * self.variances

    def restrict(self, rows: torch.Tensor) -> DiagonalGaussianLikelihood:
        """The likelihood of the measurements ``rows`` (1-D integer index): ``d[rows]``, same ``σ²``."""
        idx = torch.as_tensor(rows).long().cpu()
        return DiagonalGaussianLikelihood(self.sigma2, self.learn_noise, variances=self.variances[idx])

    def extend(self, variances: torch.Tensor | None, n_new: int) -> DiagonalGaussianLikelihood:
        """The likelihood with ``n_new`` rows of relative variances ``variances`` ``(n_new,)`` appended."""
        if variances is None:
            raise ValueError(
                f"DiagonalGaussianLikelihood: the {n_new} appended rows need their relative noise variances "
                f"(variances of shape ({n_new},))"
            )
        new = check_variances(variances, n_new, "DiagonalGaussianLikelihood.extend")
        return DiagonalGaussianLikelihood(self.sigma2, self.learn_noise, variances=torch.cat([self.variances, new]))

    def state_dict(self) -> dict:
        """``{"name", "sigma2", "learn_noise", "variances"}`` (plain values and a float64 CPU tensor)."""
        return {**super().state_dict(), "variances": self.variances.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``σ²``; the stored relative variances must be this likelihood's (they are data, not state)."""
        super().load_state_dict(state)
        stored = state.get("variances")
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != tuple(self.variances.shape):
            got = tuple(stored.shape) if isinstance(stored, torch.Tensor) else type(stored).__name__
            raise CheckpointMismatch(
                f"DiagonalGaussianLikelihood.load_state_dict: the state's variances have shape {got}, this "
                f"likelihood's {tuple(self.variances.shape)}"
            )
        if not torch.equal(stored.to(torch.float64), self.variances):
            raise CheckpointMismatch(
                "DiagonalGaussianLikelihood.load_state_dict: the state's relative noise variances differ from "
                "this likelihood's (another scan or noise model)"
            )

    def __repr__(self) -> str:
        return (
            f"DiagonalGaussianLikelihood(sigma2={self.sigma2:.4g}, learn_noise={self.learn_noise}, "
            f"c={self.n_outputs}, d in [{float(self.variances.min()):.3g}, {float(self.variances.max()):.3g}])"
        )


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


LIKELIHOODS = {
    "gaussian": GaussianLikelihood,
    "diagonal_gaussian": DiagonalGaussianLikelihood,
    "categorical": CategoricalLikelihood,
}
