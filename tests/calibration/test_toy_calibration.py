"""A calibration method defined here, outside ``ctuq/``, and registered with one line: it passes the shipped
contract and runs through the command line as ``--set uq.calibration=floor``, touching no file of the package."""

import json
import shutil

import numpy as np
import pytest
import tifffile
import torch

from ctuq.calibration import CalibrationMethod, biased_moments
from ctuq.cli import main
from ctuq.pipeline import run_folder as rf
from ctuq.registry import CALIBRATIONS
from ctuq.testing import CalibrationCase, CalibrationContract, synthetic_heldout_rows

# the module needs the shared finished run (~10 s): left out of `make test-fast`
pytestmark = pytest.mark.slow


class FloorCalibration(CalibrationMethod):
    """The posterior std raised to at least a floor ``f``: the held-out rows' variance beyond the posterior's
    predictive, per unit of bias weight, ``f² = max(0, mean(r² − v − σ²)) / mean(w)`` (a moment estimate of a white
    error's std inside the object)."""

    name = "floor"
    summary = "the posterior std raised to at least a constant floor fitted on the held-out rows"
    report_keys = ("floor",)
    summary_fields = ("floor",)
    parameters = ("floor",)

    def __init__(self, floor: float):
        self.floor = float(floor)

    @classmethod
    def fit(cls, rows, reconstruction=None):
        if rows is None or rows.bias_weight is None:
            return None
        excess = float(np.mean(rows.residual**2 - rows.variance - rows.noise_variance))
        return cls(np.sqrt(max(excess, 0.0) / float(np.mean(rows.bias_weight))))

    @classmethod
    def from_state(cls, state):
        return cls(state["floor"])

    def apply_std(self, std):
        if isinstance(std, torch.Tensor):
            return std.clamp(min=self.floor)
        return np.maximum(std, np.asarray(self.floor, std.dtype))

    def apply_moments(self, moments):
        return biased_moments(moments, (self.floor**2 - moments.variance()).clamp(min=0.0))

    def report(self):
        return {"floor": self.floor}

    def describe(self):
        return f"max(std, {self.floor:.3g})"


@pytest.fixture(scope="module", autouse=True)
def registered(tiny_run_none):  # the shared runs first: made without the toy
    CALIBRATIONS.register(FloorCalibration)  # the one registry line
    yield
    CALIBRATIONS.unregister(FloorCalibration.name)


class TestFloorContract(CalibrationContract):
    """Rows with a bias of std 4e-3 inside the object: the floor's moment estimate recovers it (its s.e. is about
    5 % on these 40000 rows, seed 0: 15 % is 3 s.e.)."""

    def make_case(self):
        yy, xx = np.mgrid[:24, :24]
        disk = 0.05 * (((yy - 11.5) ** 2 + (xx - 11.5) ** 2) < 64).astype(np.float64)
        return CalibrationCase(FloorCalibration, synthetic_heldout_rows(tau=4e-3), disk, {"floor": 4e-3}, 0.15)


def test_the_toy_runs_through_the_command_line(tiny_run_none, tmp_path):
    out = shutil.copytree(tiny_run_none, tmp_path / "floor")
    assert main(["uq", str(out), "--set", "uq.calibration=floor", "--no-progress"]) == 0
    m = json.loads((out / rf.METRICS_NAME).read_text())
    cal = m["uq"]["calibration"]
    assert cal["mode"] == cal["setting"] == "floor" and cal["floor"] > 0
    std, raw = tifffile.imread(out / rf.STD_NAME), tifffile.imread(out / rf.STD_UNCALIBRATED_NAME)
    assert np.array_equal(std, np.maximum(raw, np.float32(cal["floor"])))  # what the toy says, pixel for pixel
    assert (std > raw).any()
    # the built-in methods are scored beside it from the same posterior, as beside any applied method
    assert {"summary_uncalibrated", "summary_recalibrated", "summary_bias"} <= set(m["uq"])
