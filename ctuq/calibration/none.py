"""``uq.calibration: none``: the posterior's std map as it is."""

from __future__ import annotations

import numpy as np

from ctuq.calibration.base import NONE, CalibrationMethod
from ctuq.registry import CALIBRATIONS

__all__ = ["NoCalibration"]


@CALIBRATIONS.register
class NoCalibration(CalibrationMethod):
    """The identity: ``std.tif`` is the posterior's std and its moments are the posterior's. Needs no held-out rows;
    never applied as a recalibration nor scored beside one (``changes_std = False``)."""

    name = NONE
    summary = "the posterior's std map as it is"
    changes_std = False
    report_keys = ("k",)

    @classmethod
    def fit(cls, rows=None, reconstruction=None) -> NoCalibration:
        """Nothing to fit: the identity, with or without rows."""
        return cls()

    @classmethod
    def from_state(cls, state: dict) -> NoCalibration:
        return cls()

    def apply_std(self, std):
        """``std`` itself."""
        return std

    def apply_moments(self, moments):
        """``moments`` itself."""
        return moments

    def row_variance(self, rows) -> np.ndarray:
        """``v_i + σ²_i``: the posterior predictive as it is."""
        return np.asarray(rows.variance, np.float64) + np.asarray(rows.noise_variance, np.float64)

    def report(self) -> dict:
        """``{"k": None}``: no global scale applied."""
        return {"k": None}

    def describe(self) -> str:
        return "posterior std"

    def recorded_joint_ll(self, uq: dict, posterior_ll: float | None, patch: str) -> float | None:
        """The posterior's own, ``posterior_ll``."""
        return posterior_ll

    @classmethod
    def verdict_action(cls, calibration: dict, call: str) -> str:
        hint = " (--set uq.calibration=bias adds a bias term fitted on these angles)" if call == "too narrow" else ""
        return f"std.tif is the posterior's own std{hint}; details: heldout.json."

    @classmethod
    def predicted_rms(cls, report: dict, rms_std: float) -> float:
        """``rms_std`` itself."""
        return rms_std
