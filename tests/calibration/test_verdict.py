"""The held-out check's verdict in plain words: its call (too narrow / about right / too wide) and its numbers never
contradict each other, on rows whose image std is scaled by 0.5, 1 and 2, and on noise-dominated rows like the demo's
(image share ~15 %), where the image scale barely moves the coverage."""

import re
from statistics import NormalDist

import numpy as np
import pytest

from ctuq.calibration import HeldoutRows
from ctuq.calibration.report import assess, table, verdict

Z90 = NormalDist().inv_cdf(0.95)


def _rows(std_scale: float, *, image_share: float, m: int = 40000, n_groups: int = 400, seed: int = 0) -> HeldoutRows:
    """Rows whose residuals follow the predictive with the true image variance; the map's variance is the true one
    × ``std_scale²`` (a std map ``std_scale`` × the right one). Scored (seeded bootstrap)."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 1.5, m) * image_share
    s2 = np.full(m, 1.0 - image_share)
    r = rng.normal(0.0, np.sqrt(v + s2))
    groups = np.repeat(np.arange(n_groups), m // n_groups)
    meta = {"n_samples": 256, "n_angles": n_groups, "n_used_angles": 60, "noise_model": "per_ray"}
    rows = HeldoutRows(r, v * std_scale**2, s2, groups, meta=meta)
    rows.score(n_bootstrap=20, seed=1)
    return rows


def _percent(x: float) -> str:
    return f"{100 * x:.0f}"


@pytest.mark.parametrize("std_scale, call", [(0.5, "too narrow"), (1.0, "about right"), (2.0, "too wide")])
def test_an_image_dominated_check_calls_the_scale_it_sees(std_scale, call):
    rows = _rows(std_scale, image_share=0.9)
    a = assess(rows.report)
    assert a["call"] == call
    text = verdict(rows.report, {"mode": "none"})
    assert f"look {call}" in text
    cov = a["coverage"]
    # the numbers the sentence prints are the ones the call was made from
    assert f"{_percent(cov['0.5'])}/{_percent(cov['0.9'])}/{_percent(cov['0.95'])} %" in text
    if call == "about right":
        assert a["factor_90"] is None and "wider" not in text and "as wide" not in text
        return
    # the factor is what makes the 90 % intervals cover 90 % of these rows (to the coverage curve's resolution)
    z = np.abs(rows.residual) / np.sqrt(rows.variance + rows.noise_variance)
    assert np.mean(z <= Z90 * a["factor_90"]) == pytest.approx(0.9, abs=0.02)
    word = "wider" if call == "too narrow" else "as wide"
    assert re.search(rf"×{a['factor_90']:.2f} {word}", text)
    if call == "too narrow":  # std.tif is the posterior's own: the verdict points at the fix
        assert "--set uq.calibration=bias" in text


@pytest.mark.parametrize("std_scale", [0.5, 1.0, 2.0])
def test_the_call_agrees_with_the_coverage_on_noise_dominated_rows(std_scale):
    """The demo's situation: the image is ~15 % of the held-out predictive variance, so scaling its std by 0.5 or 2
    moves the coverage by a few per cent only; whatever the call, it is the one the printed coverage supports."""
    rows = _rows(std_scale, image_share=0.15, seed=2)
    a = assess(rows.report)
    low = [q for q in ("0.5", "0.9", "0.95") if a["coverage"][q] < float(q) - a["tolerance"][q]]
    high = [q for q in ("0.5", "0.9", "0.95") if a["coverage"][q] > float(q) + a["tolerance"][q]]
    assert a["call"] == ("too narrow" if len(low) >= 2 else "too wide" if len(high) >= 2 else "about right")
    if a["call"] == "too narrow":
        assert a["coverage"]["0.9"] < 0.9
    if a["call"] == "too wide":
        assert a["coverage"]["0.9"] > 0.9
    text = verdict(rows.report)
    assert "k =" not in text and "image part" not in text  # the jargon is heldout.json's


def test_the_verdict_reports_the_error_bars_the_run_ships():
    """A run that applied the bias model is judged on the coverage with τ, and says what it did."""
    rows = _rows(0.5, image_share=0.9, seed=3)
    report = dict(rows.report)
    report["bias"] = {"coverage_headline": {"0.5": 0.5, "0.9": 0.9, "0.95": 0.95}}
    text = verdict(report, {"mode": "bias", "tau": 2.1e-3})
    assert "look about right" in text and "calibrated 50/90/95 % intervals cover 50/90/95 %" in text
    assert "τ = 0.0021 mm⁻¹" in text
    lines = table(report, {"mode": "bias", "tau": 2.1e-3}).splitlines()
    assert "with the calibration" in lines[1] and "per-ray photon noise" in lines[0]
    assert not any("photon-statistics noise instead" in line for line in lines)
