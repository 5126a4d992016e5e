"""``uq.calibration: heldout``: the posterior std × the global scale ``k`` that explains the held-out rows best.

``k`` is the maximum-likelihood factor on the image part of the held-out predictive variance, ``var_i(k) = k² v_i +
σ²_i`` (:func:`ctuq.metrics.heldout.fit_variance_scale`, fitted when the check scores its rows:
``report["scale"]``). The recalibrated posterior is the posterior with every sample × ``k``: std × ``k``, every
covariance × ``k²`` (:func:`scaled_moments`).
"""

from __future__ import annotations

import math

import numpy as np

from ctuq.calibration.base import CalibrationMethod, moments_with_sums, recorded_scores
from ctuq.metrics import SampleMoments
from ctuq.registry import CALIBRATIONS

__all__ = ["HeldoutScale", "scaled_moments", "joint_ll_at_scale"]


def scaled_moments(moments: SampleMoments, k: float) -> SampleMoments:
    """A copy of ``moments`` whose samples are ``k ×`` those fed to it (covariances × ``k²``): the statistics of the
    recalibrated posterior."""
    return moments_with_sums(moments, lambda t, _key: t * (k * k))


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
        """``k`` of the check's report (``rows.report["scale"]["k"]``); ``None`` without rows."""
        if rows is None:
            return None
        return cls(float(rows.report["scale"]["k"]))

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

    def recorded_joint_ll(self, uq: dict, posterior_ll: float | None, patch: str) -> float | None:
        """From the posterior's own joint LL and the one recorded for a (possibly other) ``k0``, by
        :func:`joint_ll_at_scale`; ``None`` when either is missing."""
        recorded, params = recorded_scores(self, uq)
        j0 = ((recorded or {}).get("joint_ll") or {}).get(patch)
        k0 = params.get("k")
        if posterior_ll is None or j0 is None or k0 is None:
            return None
        return joint_ll_at_scale(posterior_ll, j0, float(k0), self.k)
