"""A calibration method defined here, outside ``ctuq/``, and registered with one line: it passes the shipped
contract and runs through the command line as ``--set uq.calibration=white`` (``ctuq uq``) and ``--set
design.calibration=white`` (``ctuq design``), touching no file of the package."""

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

# the module needs the shared finished run (~10 s) and a tiny design: left out of `make test-fast`
pytestmark = pytest.mark.slow

_FEATURE = "white_ones"  # the image feature of the toy: every pixel


class WhiteCalibration(CalibrationMethod):
    """The posterior std with a white error of std ``c`` added on every pixel, ``sqrt(std² + c²)``. The held-out
    rows see it through the row weights of an all-ones map, ``W_i = Σ_j T_ij²``; ``c`` is a moment estimate,
    ``c² = max(0, mean(r² − v − σ²)) / mean(W)``."""

    name = "white"
    summary = "sqrt(std² + c²): a white error of std c on every pixel, fitted on the held-out rows by moments"
    report_keys = ("c",)
    summary_fields = ("c",)
    parameters = ("c",)

    def __init__(self, c: float):
        self.c = float(c)

    @classmethod
    def image_features(cls, reconstruction, companions=None):
        return {_FEATURE: np.ones(np.shape(reconstruction))}

    @classmethod
    def fit(cls, rows, reconstruction=None):
        if rows is None or _FEATURE not in rows.feature_weights:
            return None
        excess = float(np.mean(rows.residual**2 - rows.variance - rows.noise_variance))
        return cls(np.sqrt(max(excess, 0.0) / float(np.mean(rows.feature_weights[_FEATURE]))))

    @classmethod
    def from_state(cls, state):
        return cls(state["c"])

    def row_variance(self, rows):
        v = np.asarray(rows.variance, np.float64) + np.asarray(rows.noise_variance, np.float64)
        return v + self.c**2 * np.asarray(rows.feature_weights[_FEATURE], np.float64)

    def apply_std(self, std):
        if isinstance(std, torch.Tensor):  # numpy's arithmetic for both: the same numbers from either
            return torch.from_numpy(self.apply_std(std.detach().cpu().double().numpy())).to(std.dtype)
        std = np.asarray(std)
        return np.sqrt(std.astype(np.float64) ** 2 + self.c**2).astype(std.dtype)

    def apply_moments(self, moments):
        return biased_moments(moments, torch.full(moments.image_shape, self.c**2, dtype=torch.float64))

    def report(self):
        return {"c": self.c}

    def describe(self):
        return f"sqrt(std² + {self.c:.3g}²)"


@pytest.fixture(scope="module", autouse=True)
def registered(tiny_run_none):  # the shared runs first: made without the toy
    CALIBRATIONS.register(WhiteCalibration)  # the one registry line
    yield
    CALIBRATIONS.unregister(WhiteCalibration.name)


class TestWhiteContract(CalibrationContract):
    """Rows with an extra variance c² W on half of them (c = 4e-3, W ~ U(5, 15)): the moment estimate recovers c
    (its s.e. is about 5 % on these 40000 rows, seed 0: 15 % is 3 s.e.)."""

    def make_case(self):
        yy, xx = np.mgrid[:24, :24]
        disk = 0.05 * (((yy - 11.5) ** 2 + (xx - 11.5) ** 2) < 64).astype(np.float64)
        rows = synthetic_heldout_rows(tau=4e-3)
        rows.features = {_FEATURE: np.ones(disk.shape)}
        rows.feature_weights = {_FEATURE: rows.bias_weight}  # the extra variance's weights, as the rows were drawn
        return CalibrationCase(WhiteCalibration, rows, disk, {"c": 4e-3}, 0.15)


def test_the_toy_runs_through_ctuq_uq(tiny_run_none, tmp_path):
    out = shutil.copytree(tiny_run_none, tmp_path / "white")
    assert main(["uq", str(out), "--set", "uq.calibration=white", "--no-progress"]) == 0
    m = json.loads((out / rf.METRICS_NAME).read_text())
    cal = m["uq"]["calibration"]
    assert cal["mode"] == cal["setting"] == "white" and cal["c"] > 0
    std, raw = tifffile.imread(out / rf.STD_NAME), tifffile.imread(out / rf.STD_UNCALIBRATED_NAME)
    want = np.sqrt(raw.astype(np.float64) ** 2 + cal["c"] ** 2).astype(np.float32)
    assert np.array_equal(std, want)  # what the toy says, pixel for pixel
    # the built-in methods are scored beside it from the same posterior, as beside any applied method
    assert {"summary_uncalibrated", "summary_recalibrated", "summary_bias"} <= set(m["uq"])
    # its feature's row weights were computed by the check and saved with the rows
    with np.load(out / rf.HELDOUT_ROWS_NAME) as z:
        assert f"feature_weight_{_FEATURE}" in z.files


def test_the_toy_runs_through_ctuq_design(tmp_path):
    """A tiny design (tests/pipeline/test_design_run.py's setting, 2 acquisitions) with the toy as the forecast's
    calibration: fitted at the pilot and after every acquired angle, each angle's rows scored by its row variances."""
    out = tmp_path / "design"
    tiny = ["--candidates", "24", "--pilot", "4", "--acquire", "2", "--samples", "32", "--no-progress"]
    sets = [
        "data.image_shape=[32, 32]",
        "data.detector_subsampling=8",
        "dip.iterations=10",
        "tv.enabled=false",
        "design.std_samples=16",
        "design.dense=never",
        "design.reconstruct=false",
        "output.figure=false",
        "design.calibration=white",
    ]
    assert main(["design", "--out", str(out), *tiny, *[a for s in sets for a in ("--set", s)]]) == 0
    fc = json.loads((out / "design.json").read_text())["forecast"]
    assert fc["calibration"] == "white" and fc["calibration_at_pilot"]["method"] == "white"
    assert fc["calibration_at_pilot"]["c"] >= 0 and fc["calibration_at_pilot"]["n_rows"] > 0
    assert len(fc["online"]) == 2
    for rec in fc["online"]:
        assert rec["calibration"]["method"] == "white" and 0.0 <= rec["coverage_90"] <= 1.0
        assert np.isfinite(rec["ll"])
