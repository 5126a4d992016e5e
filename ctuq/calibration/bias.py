"""``uq.calibration: bias``: the posterior kept, plus a white bias of std ``τ`` inside the object mask ``M``:
``std.tif = sqrt(std² + τ² M)`` (docs/calibration.md, "τ alone").

The held-out rows see such a bias with per-row weights ``w_i = Σ_j T_ij² M_j`` (:func:`ctuq.calibration.maps.
bias_weight`: the squared held-out operator applied to the mask), computed when the check projects its samples;
``τ`` is the maximum-likelihood std of ``var_i(τ) = v_i + τ² w_i + σ²_i`` (:func:`fit_bias_variance`: the shared fit
of :mod:`ctuq.calibration.likelihood` with ``base = v + σ²`` and the one column ``w``, ``θ = τ²``); its entry in the
check's report is ``bias``. ``M`` is the :func:`~ctuq.calibration.maps.object_mask` of the reconstruction the check
used.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ctuq.calibration.base import CalibrationMethod, SideScore
from ctuq.calibration.likelihood import fit_linear_variance
from ctuq.calibration.maps import biased_moments, object_mask
from ctuq.metrics import SampleMoments
from ctuq.metrics.heldout import check_rows, headline_coverage
from ctuq.registry import CALIBRATIONS

__all__ = ["BiasModel", "fit_bias_variance"]

_LOG_2PI = math.log(2.0 * math.pi)


def fit_bias_variance(
    residual,
    variance,
    noise_variance,
    bias_weight,
    *,
    groups=None,
    n_bootstrap: int = 200,
    seed: int = 0,
) -> dict:
    """Maximum-likelihood variance ``τ²`` of an error the posterior does not contain, added to its predictive
    variance with known per-row weights: ``var_i(τ) = v_i + τ² w_i + σ²_i`` (docs/calibration.md, "τ alone").

    For a bias independent from pixel to pixel inside an object mask ``M``, ``w_i = Σ_j T_ij² M_j`` (the squared
    held-out operator applied to the mask) and ``τ`` is the bias std per pixel. The posterior part is kept as it
    is (``k = 1``), so the fit can only add variance where the rows have room for it; ``τ = 0`` (``zero``) when
    they have none. CT-free.

    Parameters
    ----------
    residual, variance, noise_variance, groups, n_bootstrap, seed
        As for :func:`ctuq.metrics.heldout.fit_variance_scale`.
    bias_weight : ``(m,)``
        ``w_i ≥ 0`` (measurement units² per unit of ``τ²``); all zero (an empty object mask) gives ``τ = 0`` with
        ``empty_mask``.

    Returns
    -------
    dict
        ``tau`` (units: sqrt(measurement units² / units of ``w``)); ``zero`` (the fit is at the lower end of the
        searched range: no room for a bias, ``tau`` is reported as 0); ``at_upper_bound``; ``se_curvature``,
        ``se_bootstrap``, ``interval_95`` of ``tau`` as for :func:`~ctuq.metrics.heldout.fit_variance_scale`
        (``None`` when ``zero``); ``log_likelihood`` per row at ``tau``; ``coverage_headline`` with ``tau`` applied;
        ``bias_variance_fraction`` ``mean τ² w_i / var_i``.
    """
    where = "fit_bias_variance"
    r, v, s2, g = check_rows(residual, variance, noise_variance, groups, where)
    w = np.asarray(bias_weight, np.float64)
    if w.shape != r.shape or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"{where}: bias_weight must be ({r.size},) finite values ≥ 0, got shape {w.shape}")
    empty = not np.any(w > 0)  # an empty object mask (e.g. an all-zero reconstruction): no bias to fit, τ = 0
    fit, c = None, 1.0
    if not empty:
        # w normalised to the rows' predictive variance, so the searched bracket of τ² is unit-free (as k's is)
        unit = float(np.mean(v + s2)) / float(np.mean(w))
        _, fit = fit_linear_variance(r, v + s2, (w * unit)[:, None], groups=g, n_bootstrap=n_bootstrap, seed=seed)
        c = math.sqrt(unit)
    zero = empty or (fit["at_bound"] and fit["k"] < 1.0)
    tau = 0.0 if zero else fit["k"] * c
    u = tau * tau * w + v + s2
    z = np.abs(r) / np.sqrt(u)
    out = {
        "tau": tau,
        "zero": bool(zero),
        "at_upper_bound": bool(not zero and fit["at_bound"]),
        "se_curvature": None if zero else fit["se_curvature"] * c,
        "se_bootstrap": None if zero or fit["se_bootstrap"] is None else fit["se_bootstrap"] * c,
        "interval_95": None if zero or fit["interval_95"] is None else [x * c for x in fit["interval_95"]],
        "n_bootstrap": 0 if empty else fit["n_bootstrap"],
        "log_likelihood": float(np.mean(-0.5 * (_LOG_2PI + np.log(u) + r * r / u))),
        "coverage_headline": headline_coverage(z),
        "bias_variance_fraction": float(np.mean(tau * tau * w / u)),
    }
    if empty:
        out["empty_mask"] = True
    return out


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
    #: this method's entry in the held-out check's report (its fit on the check's rows; the verdict's coverage)
    heldout_report_key = "bias"
    side_score = SideScore(
        key="bias",
        title="Held-out bias inside the object, posterior kept (τ alone; not applied by any run)",
        note="std map sqrt(std² + τ² M), τ fitted on the held-out rows (docs/calibration.md); mean ± s.e. over scans",
        columns={"tau": ("τ", "mm⁻¹")},
    )
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
        """``τ`` of :func:`fit_bias_variance` on ``rows`` (their bootstrap: ``tau_se`` the bootstrap s.e., else the
        curvature's; the very fit of the check's ``bias`` entry when the rows were scored:
        :meth:`HeldoutRows.check_record <ctuq.calibration.HeldoutRows.check_record>`) and the
        :func:`~ctuq.calibration.maps.object_mask` of ``reconstruction``; ``None`` without rows or without bias
        weights."""
        fit = rows.check_record(cls) if rows is not None else None
        if fit is None:
            return None
        se = fit["se_bootstrap"] if fit.get("se_bootstrap") is not None else fit.get("se_curvature")
        return cls(float(fit["tau"]), object_mask(reconstruction), tau_se=se, tau_interval_95=fit.get("interval_95"))

    @classmethod
    def check_record(cls, rows) -> dict | None:
        """``bias``: :func:`fit_bias_variance` with the rows' bootstrap; ``None`` for rows without bias weights."""
        if rows.bias_weight is None:
            return None
        return fit_bias_variance(
            rows.residual,
            rows.variance,
            rows.noise_variance,
            rows.bias_weight,
            groups=rows.groups,
            n_bootstrap=rows.n_bootstrap,
            seed=rows.seed,
        )

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
        """:func:`~ctuq.calibration.maps.biased_moments` with ``τ² M``; ``moments`` itself when ``τ = 0``."""
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

    @classmethod
    def verdict_action(cls, calibration: dict, call: str) -> str:
        if calibration.get("tau") is None:
            return super().verdict_action(calibration, call)
        return (
            f"std.tif includes a bias term fitted on these angles (uq.calibration = bias, τ = "
            f"{calibration['tau']:.2g} mm⁻¹ inside the object); details: heldout.json."
        )

    @classmethod
    def predicted_rms(cls, report: dict, rms_std: float) -> float:
        """``sqrt(rms_std² + τ²)``: the mask's pixels gain ``τ²`` each (``rms_std`` without a ``τ``)."""
        if report.get("tau") is None:
            return rms_std
        return math.sqrt(rms_std**2 + report["tau"] ** 2)

    def state_dict(self) -> dict:
        """The report plus the mask (float64 array)."""
        return {**super().state_dict(), "mask": self.mask.copy()}
