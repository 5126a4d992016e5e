"""``uq.calibration: bias``: the posterior kept, plus a white bias of std ``τ`` inside the object mask ``M``:
``std.tif = sqrt(std² + τ² M)`` (docs/calibration.md, "τ alone").

The held-out rows see such a bias with per-row weights ``w_i = Σ_j T_ij² M_j`` (:func:`bias_weight`: the squared
held-out operator applied to the mask), computed when the check projects its samples; ``τ`` is the maximum-likelihood
std of ``var_i(τ) = v_i + τ² w_i + σ²_i`` (:func:`ctuq.metrics.heldout.fit_bias_variance`, fitted when the check
scores its rows: ``report["bias"]``). ``M`` is the :func:`object_mask` of the reconstruction the check used.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
from scipy import ndimage

from ctuq.calibration.base import CalibrationMethod, moments_with_sums
from ctuq.metrics import SampleMoments
from ctuq.registry import CALIBRATIONS

__all__ = ["BiasModel", "object_mask", "bias_weight", "biased_moments"]

# the object of the bias model (docs/calibration.md, "τ alone"): x̂ smoothed by 1 px above 10 % of its maximum;
# measured with these values on 24 runs, not tuned
_MASK_FRACTION = 0.1
_MASK_SMOOTH_PX = 1.0
_BIAS_PROBES = 64  # Rademacher probes of diag(T M Tᵀ) for operators without an assembled matrix


def object_mask(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """The object of the bias model: ``image`` ``(H, W)`` (mm⁻¹) smoothed by a Gaussian of 1 px, above 10 % of its
    maximum. Returns ``(H, W)`` float64 0/1."""
    x = image.detach().to("cpu", torch.float64).numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    smooth = ndimage.gaussian_filter(np.asarray(x, np.float64), _MASK_SMOOTH_PX)
    return (smooth > _MASK_FRACTION * smooth.max()).astype(np.float64)


def bias_weight(op, mask: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """``w_i = Σ_j T_ij² M_j`` ``(op.c,)`` float64 (mm²): the variance of held-out row ``i`` per unit ``τ²`` of a
    bias independent from pixel to pixel inside ``mask`` (``op.image_shape``). Exact from the assembled matrix of
    the sparse backend; otherwise the mean of ``(T(√M ⊙ ξ))²`` over 64 Rademacher probes ``ξ`` (unbiased)."""
    m = torch.as_tensor(np.asarray(mask, np.float64).reshape(-1))
    csr = getattr(op, "csr", None)
    if isinstance(csr, torch.Tensor):
        squared = sp.csr_matrix(
            (
                csr.values().detach().to("cpu", torch.float64).pow(2).numpy(),
                csr.col_indices().cpu().numpy(),
                csr.crow_indices().cpu().numpy(),
            ),
            shape=tuple(csr.shape),
        )
        return np.asarray(squared @ m.numpy(), np.float64)
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(op.c, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(_BIAS_PROBES):
            xi = (torch.randint(0, 2, m.shape, generator=gen) * 2 - 1).to(torch.float64) * m.sqrt()
            total += op.forward_flat(xi.reshape(1, -1).to(op.device, op.dtype))[0].double().cpu().pow(2)
    return (total / _BIAS_PROBES).numpy()


def biased_moments(moments: SampleMoments, variance: torch.Tensor) -> SampleMoments:
    """A copy of ``moments`` whose covariance has ``diag(variance)`` added (``variance``: ``image_shape``, mm⁻²,
    e.g. the bias model's ``τ² M``): pixel variances and every patch covariance of the joint LL gain it on their
    diagonal, as if the samples had an independent pixel noise of that variance. ``moments`` is left unchanged.

    The sums are exact, not sampled: fed through :meth:`SampleMoments.update` as ``P²`` deterministic images
    (``P`` the largest patch size) that each carry ``sqrt(k · variance)`` on one residue class of (row, column)
    modulo ``P``; two pixels of one patch never share a class, so no cross term appears."""
    k = moments.n_samples
    var = torch.as_tensor(variance, dtype=torch.float64)
    if tuple(var.shape) != moments.image_shape or not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise ValueError(
            f"biased_moments: variance must be finite, ≥ 0 and of shape {moments.image_shape}, got {tuple(var.shape)}"
        )
    extra = moments_with_sums(moments, lambda t, _key: torch.zeros_like(t), n_samples=0)
    period = max(moments.patch_sizes)
    amp = (var * k).sqrt()
    rows = torch.arange(amp.shape[-2]) % period
    cols = torch.arange(amp.shape[-1]) % period
    for a in range(period):
        on_row = (rows == a).to(torch.float64)[:, None]
        extra.update(torch.stack([amp * (on_row * (cols == b).to(torch.float64)[None, :]) for b in range(period)]))
    ed = extra.state_dict()
    return moments_with_sums(moments, lambda t, key: t + (ed["sum_sq"] if key == "sum_sq" else ed["patch_sums"][key]))


@CALIBRATIONS.register
class BiasModel(CalibrationMethod):
    """The held-out bias model (module docstring).

    Parameters
    ----------
    tau : float
        The bias std per pixel inside the object (mm⁻¹), ≥ 0; 0 leaves the posterior's map bit for bit.
    mask : np.ndarray
        ``M``: the object mask (the reconstruction's shape, 0/1).
    tau_se : float, optional
        Its standard error (bootstrap, else curvature); ``None`` when ``τ = 0``.
    tau_interval_95 : list of float, optional
        Its 95 % bootstrap interval.
    """

    name = "bias"
    #: where the held-out check's report scores this method on the check's own rows (the verdict's coverage)
    heldout_report_key = "bias"
    summary = "sqrt(std² + τ² M): a white bias of std τ inside the object mask M, fitted on the held-out rows"
    report_keys = ("k", "tau", "tau_se", "tau_interval_95", "mask_fraction")
    summary_key = "summary_bias"
    summary_fields = ("tau", "tau_se", "mask_fraction")
    parameters = ("tau",)

    def __init__(self, tau: float, mask, *, tau_se: float | None = None, tau_interval_95=None):
        tau = float(tau)
        if not (tau >= 0 and np.isfinite(tau)):
            raise ValueError(f"BiasModel: tau must be finite and ≥ 0, got {tau}")
        mask = np.asarray(mask, np.float64)
        if mask.ndim not in (2, 3) or not np.all((mask == 0) | (mask == 1)):
            raise ValueError(f"BiasModel: mask must be a 2D or 3D array of 0/1, got shape {mask.shape}")
        self.tau, self.mask = tau, mask
        self.tau_se = None if tau_se is None else float(tau_se)
        self.tau_interval_95 = None if tau_interval_95 is None else [float(x) for x in tau_interval_95]
        # τ² M (mm⁻²): the pixel variance the model adds, float64
        self.variance = (tau**2) * mask

    @classmethod
    def fit(cls, rows, reconstruction=None) -> BiasModel | None:
        """``τ`` of the check's report (``rows.report["bias"]``, present when the rows carry bias weights) and the
        :func:`object_mask` of ``reconstruction``; ``None`` without rows or without a bias fit."""
        fit = rows.report.get("bias") if rows is not None else None
        if fit is None:
            return None
        se = fit["se_bootstrap"] if fit.get("se_bootstrap") is not None else fit.get("se_curvature")
        return cls(float(fit["tau"]), object_mask(reconstruction), tau_se=se, tau_interval_95=fit.get("interval_95"))

    @classmethod
    def from_state(cls, state: dict) -> BiasModel:
        return cls(state["tau"], state["mask"], tau_se=state["tau_se"], tau_interval_95=state["tau_interval_95"])

    @property
    def mask_fraction(self) -> float:
        """The share of pixels inside the object."""
        return float(self.mask.mean())

    def apply_std(self, std):
        """``sqrt(std² + τ² M)`` computed in float64, returned in ``std``'s type and dtype; ``std`` itself when
        ``τ = 0``."""
        if self.tau == 0:
            return std
        if isinstance(std, torch.Tensor):
            return (std.double().pow(2) + torch.from_numpy(self.variance)).sqrt().to(std.dtype)
        std = np.asarray(std)
        return np.sqrt(std.astype(np.float64) ** 2 + self.variance).astype(std.dtype, copy=False)

    def apply_moments(self, moments: SampleMoments) -> SampleMoments:
        """:func:`biased_moments` with ``τ² M``; ``moments`` itself when ``τ = 0``."""
        if self.tau == 0:
            return moments
        return biased_moments(moments, torch.from_numpy(self.variance))

    def row_variance(self, rows) -> np.ndarray:
        """``v_i + τ² w_i + σ²_i`` (``ValueError`` for rows without bias weights)."""
        if rows.bias_weight is None:
            raise ValueError("BiasModel.row_variance: the rows carry no bias weights")
        v = np.asarray(rows.variance, np.float64) + np.asarray(rows.noise_variance, np.float64)
        return v + self.tau**2 * np.asarray(rows.bias_weight, np.float64)

    def report(self) -> dict:
        """``k`` (``None``), ``tau``, ``tau_se``, ``tau_interval_95`` and ``mask_fraction``."""
        return {
            "k": None,
            "tau": self.tau,
            "tau_se": self.tau_se,
            "tau_interval_95": self.tau_interval_95,
            "mask_fraction": self.mask_fraction,
        }

    def describe(self) -> str:
        return f"sqrt(std² + τ² M), τ = {self.tau:.3g} mm⁻¹"

    def log_line(self) -> str:
        return (
            f"uq.calibration = bias: std.tif = sqrt(posterior std² + τ² M), τ = {self.tau:.3g} mm⁻¹ inside "
            f"{100 * self.mask_fraction:.0f} % of the pixels"
        )

    def state_dict(self) -> dict:
        """The report plus the mask (float64 array)."""
        return {**super().state_dict(), "mask": self.mask.copy()}
