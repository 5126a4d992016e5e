"""The calibration study's scores of the held-out bias model (τ alone, posterior kept): ``score_run``'s ``bias``,
its summary in ``aggregate`` and its table in ``markdown_table``."""

import json

import numpy as np
import pytest
import tifffile

from ctuq.calibration import HeldoutRows
from ctuq.pipeline import run_folder as rf
from ctuq.studies.calibration import aggregate, markdown_table, score_run


def _report(tau: float) -> HeldoutRows:
    """Scored held-out rows whose bias model fit is ``tau`` (mm⁻¹): ``r_i² = v_i + τ² w_i + σ²`` on every row, the
    root of the score equation (exact to rounding), or, for ``tau = 0``, residuals half as large as the posterior's
    predictive (no room for a bias: τ = 0 exactly)."""
    m = 200
    v, w, s2 = np.linspace(1.0, 2.0, m) * 1e-4, np.linspace(0.5, 1.5, m), 1e-4
    r = np.sqrt(v + tau**2 * w + s2) if tau > 0 else np.sqrt(0.5 * (v + s2))
    rows = HeldoutRows(r, v, s2, np.arange(m) // 5, bias_weight=w, n_bootstrap=0)
    rows.score()
    return rows


def _run(folder, seed: int):
    """A disk of 0.05 mm⁻¹ on an empty background; the error is N(0, 0.005²) everywhere plus N(0, 0.01²) inside the
    disk, and the std map says 0.005 everywhere: too narrow inside the object only."""
    folder.mkdir()
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:128, :128]
    disk = ((yy - 63.5) ** 2 + (xx - 63.5) ** 2 < 40**2).astype(np.float64)
    gt = 0.05 * disk
    rec = gt + rng.normal(0, 0.005, gt.shape) + disk * rng.normal(0, 0.01, gt.shape)
    for name, a in ((rf.GROUND_TRUTH_NAME, gt), (rf.RECONSTRUCTION_NAME, rec), (rf.STD_NAME, np.full(gt.shape, 0.005))):
        tifffile.imwrite(folder / name, a.astype(np.float32))
    (folder / rf.METRICS_NAME).write_text(json.dumps({"joint_ll": {"10": 1.0}}))
    return folder


def test_the_bias_map_is_scored_beside_the_posterior(tmp_path):
    """With the true τ (0.01) the map sqrt(std² + τ² M) is right: right scale 1 ± 0.03 (8100 inner-square pixels,
    seed 0), coverage@0.9 0.90 ± 0.015, a higher LL than the posterior's (right scale ≈ 1.9, too narrow)."""
    s = score_run(_run(tmp_path / "a", 0), heldout=_report(0.01))
    assert s["right_scale"] > 1.5
    b = s["bias"]
    assert b["tau"] == pytest.approx(0.01, rel=1e-12) and b["right_scale"] == pytest.approx(1.0, abs=0.03)
    assert b["coverage_0.9"] == pytest.approx(0.90, abs=0.015) and b["marginal_ll"] > s["marginal_ll"]
    # τ = 0 (no room on the held-out rows) leaves the posterior's map; a recalibrated score has no bias entry
    z = score_run(tmp_path / "a", heldout=_report(0.0))["bias"]
    assert z["right_scale"] == pytest.approx(s["right_scale"], rel=1e-12)
    assert score_run(tmp_path / "a", "heldout", heldout=_report(0.01))["bias"] is None
    without = _report(0.01)
    without.bias_weight = None
    assert score_run(tmp_path / "a", heldout=without)["bias"] is None  # rows without bias weights


def test_aggregate_and_table_summarise_the_bias_model(tmp_path):
    records = [
        {"scan": f"s{i}", "kind": "walnut", "angles": 60, "combination": "c", "scores": score_run(
            _run(tmp_path / f"r{i}", i), heldout=_report(tau)), "settings": {"uq.calibration": "none"}}
        for i, tau in enumerate((0.01, 0.0))
    ]  # fmt: skip
    rows = aggregate(records, {"right_scale": [0.85, 1.15]})
    b = rows[0]["bias"]
    assert b["n"] == 2 and b["n_tau_positive"] == 1 and b["n_ll_at_least_posterior"] == 2
    assert b["n_right_scale_in_target"] == 1  # τ = 0.01 is right; τ = 0 keeps the posterior's 1.9
    assert b["tau"][0] == pytest.approx(0.005, rel=1e-9)
    text = markdown_table(rows, [], {}, "cmd", targets={"right_scale": [0.85, 1.15]})
    assert "Held-out bias inside the object" in text and "| 60 | c | 2 | 1 |" in text
    assert "right scale ∈ [0.85, 1.15]" in text and "## Targets" not in text  # no gates: no targets table
    # without a target nothing is counted against one, and the table shows the measured numbers only
    plain = aggregate(records)
    assert "n_right_scale_in_target" not in plain[0]["bias"]
    assert "∈ [" not in markdown_table(plain, [], {}, "cmd")
