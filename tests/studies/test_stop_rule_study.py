"""The stop-rule study (``scripts/stop_rule_study.py --tiny``): every part runs, the report has its gates, and a
rerun resumes without recomputing a design or a reconstruction."""

import json

import pytest
from tiny import load_script

from ctuq.studies.stop_rule import UPDATES, stop_counts


def _script():
    return load_script("stop_rule_study")


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path):
    out = tmp_path / "study"
    assert _script().main(["--tiny", "--out", str(out)]) == 0
    rec = json.loads((out / "walnut_0" / "result.json").read_text())
    assert set(rec["online"]) == set(UPDATES)
    for strategy in ("designed", "equidistant"):
        assert set(rec["actual"][strategy]) == {str(c) for c in rec["counts"]}
        assert all(v > 0 for v in rec["actual"][strategy].values())
    # the pilot is equidistant: both strategies reconstruct the same angles at the pilot's count
    assert rec["actual"]["designed"]["4"] == rec["actual"]["equidistant"]["4"]
    md = (out / "results.md").read_text()
    assert "## Gate 1" in md and "## Gate 2" in md and "| plan, designed |" in md
    for s in stop_counts(rec, [0.4, 0.8]):
        assert rec["counts"][0] <= s["oracle"] <= rec["counts"][-1]
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.tif")}
    assert _script().main(["--tiny", "--out", str(out)]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.tif")} == stamps
