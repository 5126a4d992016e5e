"""The reconstruction study (``scripts/reconstruction_study.py --tiny``): both runs of a setting, the oracles from
the same fits, the report's gates, and a rerun that recomputes nothing; plus what a tuned run records."""

import json

import pytest
from tiny import load_script

from ctuq.pipeline import run_folder as rf


def _script():
    return load_script("reconstruction_study")


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path):
    out = tmp_path / "study"
    assert _script().main(["--tiny", "--out", str(out)]) == 0
    setting = out / "walnut_0" / "32_008"
    rec = json.loads((setting / "result.json").read_text())
    fixed = json.loads((setting / "fixed" / rf.METRICS_NAME).read_text())
    tuned = json.loads((setting / "tuned" / rf.METRICS_NAME).read_text())
    # the fixed run is the settings before tuning: no split, the loss-selected DIP from noise, tv.weight
    assert "heldout_split" not in fixed["data"] and fixed["dip"]["selection"] == "loss"
    assert fixed["tv"]["weight"] == fixed["config"]["tv"]["weight"] and "tuning" not in fixed["tv"]
    # the tuned run: the held-out angles of 8 of 48 split 20/20, TV's whole path recorded, the DIP selected on them
    assert tuned["data"]["heldout_split"] == {"tuning_angles": 20, "check_angles": 20}
    path = tuned["tv"]["tuning"]
    assert len(path["weights"]) == len(path["heldout_error"]) == len(path["psnr"])
    assert path["path_weight"] == path["weights"][path["heldout_error"].index(min(path["heldout_error"]))]
    assert tuned["dip"]["selection"] == "heldout" and tuned["uq"]["heldout"]["n_angles"] == 20
    trace = dict((int(i), e) for i, e in tuned["dip"]["heldout_trace"])
    assert tuned["dip"]["best_iteration"] == min(trace, key=trace.get)
    # the oracles come from the same fits' ground-truth PSNR
    assert rec["oracle"]["tuned"]["dip"]["psnr"] == pytest.approx(max(tuned["dip"]["psnr_trace"]))
    assert rec["oracle"]["tuned"]["tv"]["psnr"] == pytest.approx(max(path["psnr"]))
    assert rec["psnr"]["dip_tuned"] == tuned["psnr"]["dip"] and rec["psnr"]["dip_fixed"] == fixed["psnr"]["dip"]
    assert 0 < rec["uq"]["right_scale"] and 0 <= rec["uq"]["coverage_0.9"] <= 1
    assert rec["uq"]["ence"] >= 0 and rec["uq"]["power_ence"] >= 0 and len(rec["uq"]["decile_coverage"]) == 10
    md = (out / "results.md").read_text()
    assert "## Gates" in md and "DIP ≥ max(FBP, TV) − 0.3 dB" in md and "| walnut_0 | 32² | 8 |" in md
    assert "| ENCE (best c·std^γ on the truth) |" in md
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.tif")}
    assert _script().main(["--tiny", "--out", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.tif")} == stamps


def test_bad_options_are_one_line(tmp_path, capsys):
    assert _script().main(["--tiny", "--sizes", "48", "--out", str(tmp_path / "s")]) == 2
    assert "--sizes 48: each must be one of [32, 64, 128]" in capsys.readouterr().err


def test_tuned_run_draws_its_tuning(tiny_run):
    """The shared tiny run (defaults: both tunings) records the split, the path and the trace, and draws them."""
    m = json.loads((tiny_run / rf.METRICS_NAME).read_text())
    assert m["data"]["heldout_split"]["tuning_angles"] + m["data"]["heldout_split"]["check_angles"] == 16
    assert m["tv"]["tuning"]["weight"] == m["tv"]["weight"] and m["dip"]["heldout_trace"]
    assert (tiny_run / rf.TUNING_FIGURE).is_file()
