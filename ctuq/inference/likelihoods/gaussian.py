"""Gaussian noise: one variance ``σ²`` for every row (:class:`GaussianLikelihood`), or ``σ² D`` with known relative
per-row variances ``D = diag(d)`` (:class:`DiagonalGaussianLikelihood`, CT's per-ray photon noise)."""

from __future__ import annotations

import torch

from ctuq.errors import CheckpointMismatch
from ctuq.inference.likelihoods.base import Likelihood, positive
from ctuq.registry import LIKELIHOODS

__all__ = ["GaussianLikelihood", "DiagonalGaussianLikelihood", "check_variances"]


@LIKELIHOODS.register
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
        self.sigma2 = positive(sigma2, "sigma2")
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


@LIKELIHOODS.register
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
    normaliser : float
        What the rows' measurement variances were divided by to give ``d`` (``d_i = v_i / normaliser``; the CT
        front end: the mean of the fitted rows' variances), > 0; :meth:`noise_variance_of` divides other rows'
        variances by the same number. Data, not state: :meth:`restrict` and :meth:`extend` keep it.
    """

    name = "diagonal_gaussian"

    def __init__(
        self, sigma2: float = 1.0, learn_noise: bool = False, *, variances: torch.Tensor, normaliser: float = 1.0
    ):
        super().__init__(sigma2, learn_noise)
        self.variances = check_variances(variances, None, "DiagonalGaussianLikelihood")
        self.normaliser = positive(normaliser, "normaliser")

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

    def noise_variance_of(self, variances: torch.Tensor | None = None, *, target_scale: float = 1.0) -> torch.Tensor:
        """The noise variance of other rows with measurement variances ``variances`` (any shape, flattened; the
        units of :attr:`normaliser`): ``(σ² / target_scale²) · (v / normaliser)`` ``(m,)`` float64 CPU, the scale
        ``σ²`` fitted on this likelihood's rows applied to their relative variances. ``ValueError`` without
        ``variances`` (a per-row model cannot guess them)."""
        if variances is None:
            raise ValueError(
                "DiagonalGaussianLikelihood.noise_variance_of: per-row noise needs the rows' own measurement "
                "variances (got None)"
            )
        v = torch.as_tensor(variances).detach().to("cpu", torch.float64).reshape(-1)
        return (float(self.sigma2) / target_scale**2) * (v / self.normaliser)

    def restrict(self, rows: torch.Tensor) -> DiagonalGaussianLikelihood:
        """The likelihood of the measurements ``rows`` (1-D integer index): ``d[rows]``, same ``σ²`` and normaliser."""
        idx = torch.as_tensor(rows).long().cpu()
        return DiagonalGaussianLikelihood(
            self.sigma2, self.learn_noise, variances=self.variances[idx], normaliser=self.normaliser
        )

    def extend(self, variances: torch.Tensor | None, n_new: int) -> DiagonalGaussianLikelihood:
        """The likelihood with ``n_new`` rows of relative variances ``variances`` ``(n_new,)`` appended."""
        if variances is None:
            raise ValueError(
                f"DiagonalGaussianLikelihood: the {n_new} appended rows need their relative noise variances "
                f"(variances of shape ({n_new},))"
            )
        new = check_variances(variances, n_new, "DiagonalGaussianLikelihood.extend")
        return DiagonalGaussianLikelihood(
            self.sigma2, self.learn_noise, variances=torch.cat([self.variances, new]), normaliser=self.normaliser
        )

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
