"""``uq.calibration: heldout``: the posterior std × the global scale ``k`` that explains the held-out rows best.

``k`` is the maximum-likelihood factor on the image part of the held-out predictive variance, ``var_i(k) = k² v_i +
σ²_i``: the shared fit of :mod:`ctuq.calibration.likelihood` with ``base = σ²`` and the one column ``v`` (``θ =
k²``); its entry in the check's report is ``scale`` (with the block-bootstrap s.e. and interval of ``k``). The
recalibrated posterior is the posterior with every sample × ``k``: std × ``k``, every covariance × ``k²``
(:func:`ctuq.calibration.maps.scaled_moments`).
"""

from __future__ import annotations

import math

import numpy as np

from ctuq.calibration.base import CalibrationMethod, recorded_scores
from ctuq.calibration.likelihood import fit_linear_variance
from ctuq.calibration.maps import scaled_moments
from ctuq.metrics import SampleMoments
from ctuq.metrics.heldout import check_rows, headline_coverage
from ctuq.registry import CALIBRATIONS

__all__ = ["HeldoutScale", "joint_ll_at_scale", "fit_scale"]


def fit_scale(rows, *, n_bootstrap: int, seed: int) -> dict:
    """The maximum-likelihood ``k`` of ``var_i(k) = k² v_i + σ²_i`` on ``rows`` (:class:`~ctuq.calibration.rows.
    HeldoutRows`) with ``n_bootstrap`` block-bootstrap replicates seeded by ``seed``: the dict of
    :func:`ctuq.metrics.heldout.fit_variance_scale` (``k``, its s.e. and interval, ``at_bound``, the per-row
    ``log_likelihood``) plus the ``coverage_headline`` of the rows with ``k`` applied."""
    r, v, s2, g = check_rows(rows.residual, rows.variance, rows.noise_variance, rows.groups, "HeldoutScale.fit")
    _, scale = fit_linear_variance(r, s2, v[:, None], groups=g, n_bootstrap=n_bootstrap, seed=seed)
    k2 = scale["k"] ** 2
    scale["coverage_headline"] = headline_coverage(np.abs(r) / np.sqrt(k2 * v + s2))
    return scale


def joint_ll_at_scale(ll_1: float, ll_k0: float, k0: float, k: float) -> float:
    """The patch joint log-likelihood (nats/pixel) of the covariance ``k² Σ`` from its values at ``Σ`` (``ll_1``) and
    at ``k0² Σ`` (``ll_k0``): per patch of ``p²`` pixels, ``log N(e; 0, k²Σ) = log N(e; 0, Σ) − p² log k −
    (1/k² − 1) ½ eᵀΣ⁻¹e``, so per pixel ``ll(k) = ll(1) − log k + (1 − 1/k²) M`` with ``M`` fixed by ``ll(k0)``.
    Exact for the stabilised covariance of :func:`ctuq.metrics.uq_summary_from_moments` (its ``η`` is relative to
    the variance, so it scales with ``k²`` too) unless a patch needed extra jitter. ``k0`` must differ from 1."""
    if k == k0:
        return float(ll_k0)
    if abs(k0 - 1.0) < 1e-9:
        raise ValueError(f"joint_ll_at_scale: k0 must differ from 1 to fix the Mahalanobis term, got {k0}")
    m = (ll_k0 - ll_1 + math.log(k0)) / (1.0 - 1.0 / k0**2)
    return float(ll_1 - math.log(k) + (1.0 - 1.0 / k**2) * m)


@CALIBRATIONS.register
class HeldoutScale(CalibrationMethod):
    """The global scale ``k`` (module docstring).

    Parameters
    ----------
    k : float
        The factor on the posterior std, > 0 (``k > 1``: the posterior was too narrow).
    """

    name = "heldout"
    #: where the held-out check's report scores this method on the check's own rows (the verdict's coverage)
    heldout_report_key = "scale"
    summary = "the posterior std × the held-out maximum-likelihood scale k"
    report_keys = ("k",)
    summary_key = "summary_recalibrated"
    summary_fields = ("k",)
    parameters = ("k",)

    def __init__(self, k: float):
        k = float(k)
        if not (k > 0 and math.isfinite(k)):
            raise ValueError(f"HeldoutScale: k must be positive and finite, got {k}")
        self.k = k

    @classmethod
    def fit(cls, rows, reconstruction=None) -> HeldoutScale | None:
        """The maximum-likelihood ``k`` on ``rows`` (:func:`fit_scale`; no bootstrap: the method keeps ``k`` alone);
        ``None`` without rows."""
        if rows is None:
            return None
        return cls(float(fit_scale(rows, n_bootstrap=0, seed=rows.seed)["k"]))

    @classmethod
    def check_record(cls, rows) -> dict:
        """``scale``: :func:`fit_scale` with the rows' bootstrap."""
        return fit_scale(rows, n_bootstrap=rows.n_bootstrap, seed=rows.seed)

    @classmethod
    def from_state(cls, state: dict) -> HeldoutScale:
        return cls(state["k"])

    def apply_std(self, std):
        """``std × k`` (same type and dtype)."""
        return std * self.k

    def apply_moments(self, moments: SampleMoments) -> SampleMoments:
        """:func:`scaled_moments` by ``k``."""
        return scaled_moments(moments, self.k)

    def row_variance(self, rows) -> np.ndarray:
        """``k² v_i + σ²_i``."""
        return self.k**2 * np.asarray(rows.variance, np.float64) + np.asarray(rows.noise_variance, np.float64)

    def report(self) -> dict:
        """``{"k": k}``."""
        return {"k": self.k}

    def describe(self) -> str:
        return f"std × {self.k:.3g}"

    def label(self, applied: bool = True) -> str:
        return self.describe() if applied else f"{self.describe()} (held-out k, not applied)"

    def log_line(self) -> str:
        return f"uq.calibration = heldout: std.tif = posterior std × {self.k:.3f}"

    @classmethod
    def verdict_action(cls, calibration: dict, call: str) -> str:
        if calibration.get("k") is None:
            return super().verdict_action(calibration, call)
        return (
            f"std.tif is the posterior std × {calibration['k']:.3g} fitted on these angles (uq.calibration = heldout)."
        )

    @classmethod
    def predicted_rms(cls, report: dict, rms_std: float) -> float:
        """``rms_std × k``."""
        return rms_std * report["k"]

    def recorded_joint_ll(self, uq: dict, posterior_ll: float | None, patch: str) -> float | None:
        """From the posterior's own joint LL and the one recorded for a (possibly other) ``k0``, by
        :func:`joint_ll_at_scale`; ``None`` when either is missing."""
        recorded, params = recorded_scores(self, uq)
        j0 = ((recorded or {}).get("joint_ll") or {}).get(patch)
        k0 = params.get("k")
        if posterior_ll is None or j0 is None or k0 is None:
            return None
        return joint_ll_at_scale(posterior_ll, j0, float(k0), self.k)
