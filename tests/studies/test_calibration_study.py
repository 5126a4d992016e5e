"""The calibration study (``scripts/calibration_study.py``, :mod:`ctuq.studies.calibration`): ``--tiny`` end to end
(the combinations the config knows), resume skips finished work, bad options are one-line errors, and the scoring
against an oracle on synthetic numbers (seed 0; tolerances stated per check)."""

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import tifffile
from tiny import load_script

from ctuq.calibration import HeldoutRows, joint_ll_at_scale
from ctuq.config import ConfigError, load_config
from ctuq.metrics import uq_summary
from ctuq.pipeline import run_folder as rf
from ctuq.studies import calibration as cal
from ctuq.studies.calibration import (
    DEFAULTS,
    LEVELS,
    TINY,
    Combination,
    aggregate,
    check_combinations,
    gate_report,
    parse_target,
    run_study,
    score_run,
)


def _script():
    return load_script("calibration_study")


def _known(key: str, value: str) -> bool:
    try:
        load_config("demo", [f"{key}={value}"])
        return True
    except ConfigError:
        return False


def test_score_run_against_known_numbers(tmp_path):
    """err ~ N(0, 0.01²) and std = 0.005 everywhere: coverage@0.9 = P(|z| ≤ 0.822) = 0.589 and right scale 2
    (± 0.02 over 8100 inner-square pixels, seed 0); the constant-std oracle is the best constant, so it beats a
    std that is too small."""
    rng = np.random.default_rng(0)
    gt = rng.uniform(0, 0.05, (128, 128))
    rec = gt + rng.normal(0, 0.01, gt.shape)
    for name, a in ((rf.GROUND_TRUTH_NAME, gt), (rf.RECONSTRUCTION_NAME, rec), (rf.STD_NAME, np.full(gt.shape, 0.005))):
        tifffile.imwrite(tmp_path / name, a.astype(np.float32))
    (tmp_path / rf.METRICS_NAME).write_text(json.dumps({"joint_ll": {"10": 1.0}}))
    s = score_run(tmp_path)
    assert abs(s["right_scale"] - 2.0) < 0.04
    assert abs(s["coverage_0.9"] - 0.589) < 0.02 and abs(s["coverage_0.5"] - 0.261) < 0.02
    assert s["oracle_ll"] > s["marginal_ll"] and s["joint_ll_10"] == 1.0 and len(s["calibration"]) == 20
    assert abs(s["rmse"] - 0.01) < 2e-4 and s["spearman"] is None  # a constant std ranks nothing
    # inside the object every decile claims half its error (ENCE 1); the truth's best c·std^γ is the RMS error
    # itself (ENCE ≈ the deciles' sampling error, ~3 % each over ~650 pixels), and a constant map has no reference
    assert s["ence"] == pytest.approx(1.0, abs=0.05) and s["power_ence"] < 0.06
    assert s["spearman_reference"] is None and s["spearman_ratio"] is None


def test_gates_report_margins():
    def rec(scan, cov9, scale, ll):
        sc = {"coverage_0.5": 0.5, "coverage_0.9": cov9, "coverage_0.95": cov9 + 0.04, "right_scale": scale,
              "marginal_ll": ll, "oracle_ll": 5.0, "joint_ll_10": 5.0, "oracle_joint_ll_10": 5.0, "spearman": 0.5,
              "rmse": 0.01, "mean_std": 0.01, "calibration": [0.5] * 20}  # fmt: skip
        return {"scan": scan, "kind": "walnut", "angles": 60, "combination": "c", "scores": sc,
                "settings": {"uq.calibration": "none"}}  # fmt: skip

    records = [rec("a", 0.90, 1.0, 5.5), rec("b", 0.90, 1.2, 4.9)]
    records[0]["scores"]["heldout"] = {"k": 1.0, "k_image_rows": 2.0}
    records[1]["scores"]["heldout"] = {"k": 1.5, "k_image_rows": 1.2}
    rows = aggregate(records)
    assert rows[0]["content"] == "all" and rows[0]["n_scans"] == 2
    # right scale after std × k: (1.0/1.0, 1.2/1.5) and (1.0/2.0, 1.2/1.2); within 10 % of 1: one scan and one scan
    st = rows[0]["statistics"]
    assert math.isclose(st["k"]["after"][0], 0.9) and st["k"]["within_10pc"] == 1 and st["k"]["n"] == 2
    assert math.isclose(st["k_image_rows"]["after"][0], 0.75) and st["k_image_rows"]["within_10pc"] == 1
    assert "k_photon" not in st
    assert math.isclose(rows[0]["right_scale"][0], 1.1) and math.isclose(rows[0]["right_scale"][1], 0.1)
    assert gate_report(rows) == [] and gate_report(rows, {}) == []  # no target is built in
    targets = dict(parse_target(t) for t in ("right_scale=0.85:1.15", "coverage_0.9=:0.89", "min_ll_margin=0:"))
    assert targets == {"right_scale": [0.85, 1.15], "coverage_0.9": [None, 0.89], "min_ll_margin": [0.0, None]}
    g = gate_report(rows, targets)[0]["gates"]
    assert list(g) == list(targets)
    assert g["right_scale"]["pass"] and math.isclose(g["right_scale"]["margin"], 0.05)
    assert not g["coverage_0.9"]["pass"] and math.isclose(g["coverage_0.9"]["margin"], -0.01)
    assert not g["min_ll_margin"]["pass"] and math.isclose(g["min_ll_margin"]["margin"], -0.1)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("right_scale", "expected METRIC=LOW:HIGH"),
        ("right_scale=a:1", "expected METRIC=LOW:HIGH"),
        ("sharpness=0:1", "the metric must be one of coverage_0.5"),
        ("right_scale=:", "give at least one bound"),
        ("right_scale=2:1", "low ≤ high"),
    ],
)
def test_bad_targets_are_one_line_errors(tmp_path, capsys, text, fragment):
    assert _script().main(["--tiny", "--out", str(tmp_path / "s"), "--target", text]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"calibration_study.py: --target {text}: ") and fragment in err[0]


def test_unknown_keys_make_a_combination_unavailable_up_front():
    combos = check_combinations(
        DEFAULTS,
        [
            Combination({"uq.prior": "gprior", "uq.noise": "homoscedastic", "uq.calibration": "none"}),
            Combination({"uq.prior": "no_such_prior", "uq.noise": "homoscedastic", "uq.calibration": "none"}),
        ],
    )
    assert combos[0].error is None  # the baseline always runs (keys the config lacks are left out)
    assert "uq.prior" in combos[1].error and "\n" not in combos[1].error
    for key, value in (("uq.noise", "per_ray"), ("uq.calibration", "heldout")):
        c = check_combinations(DEFAULTS, [Combination({"uq.prior": "gprior", key: value})])[0]
        assert (c.error is None) == _known(key, value)
        if c.error is not None:
            assert "not available yet" in c.error


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--noises", "loud"], "--noises loud: each must be one of homoscedastic, per_ray"),
        (["--settings", "7"], "--settings 7: each angle count must divide the scans' 32 angles"),
        (["--walnut-seeds", "--textured-seeds"], "the study needs at least one scan"),
        (["--set", "dip.nope=1"], "unknown config key 'dip.nope'"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, message):
    assert _script().main(["--tiny", "--out", str(tmp_path / "s"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("calibration_study.py: ") and message in err[0]


@pytest.mark.slow
def test_tiny_study_end_to_end_and_resume(tmp_path, capsys):
    """--tiny with one noise model (uq.noise is passed through to each run like any other axis; the per-ray
    combination's bookkeeping is in the test below): a walnut and a textured scan, every calibration scored."""
    out = tmp_path / "study"
    script = _script()
    tiny = ["--tiny", "--noises", "homoscedastic", "--out", str(out)]
    assert script.main([*tiny, "--target", "right_scale=0.85:1.15"]) == 0
    res = json.loads((out / "results.json").read_text())
    combos = {r["combination"] for r in res["records"]}
    assert "gprior-homoscedastic-none" in combos
    assert {r["scan"] for r in res["records"]} == {"walnut_0", "textured_0"}
    for r in res["records"]:
        s = r["scores"]
        assert 0 <= s["coverage_0.9"] <= 1 and s["right_scale"] > 0 and math.isfinite(s["marginal_ll"])
        assert s["ence"] >= 0 and s["power_ence"] >= 0 and len(s["reliability"]["rmse"]) == 10
    assert any(r["content"] == "textured" for r in res["table"]) and res["options"]["targets"]
    assert [set(g["gates"]) for g in res["gates"]] == [{"right_scale"}] * len(res["gates"]) and res["gates"]
    md = (out / "results.md").read_text()
    assert (
        "| 8 | gprior-homoscedastic-none | all | 2 |" in md
        and "## Targets" in md
        and "right_scale ∈ [0.85, 1.15]" in md
        and "| ENCE (best c·std^γ on the truth, γ) |" in md
    )
    assert (out / "calibration.png").stat().st_size > 10_000
    for name in res["unavailable"]:
        assert f"`{name}`" in md

    # resume: nothing is recomputed (no DIP, no inference), the results are the same
    failed = set(res["unavailable"]) | set(res["failures"])

    def finished_files():  # DIP runs and finished combinations (a failed one is retried and may rewrite its own)
        return {p: p.stat().st_mtime_ns for p in out.rglob("*.tif") if p.parent.name not in failed}

    stamps = finished_files()
    capsys.readouterr()
    assert script.main([*tiny, "--resume"]) == 0  # the targets may change: no number does
    err = capsys.readouterr().err
    assert "fitted the DIP" not in err and "simulating" not in err
    # only combinations that failed (e.g. an option whose data the scan lacks) are tried again
    retried = {line.split("inference ")[1].split(":")[0] for line in err.splitlines() if "] inference " in line}
    assert retried <= failed
    assert stamps == finished_files()
    assert json.loads((out / "results.json").read_text())["records"] == res["records"]


def test_joint_ll_of_a_rescaled_covariance_from_two_evaluations():
    """The study scores uq.calibration = heldout without a second inference: the 10×10 joint LL of k²Σ̂ follows from
    its values at Σ̂ and k0²Σ̂ (η relative, so it scales too). Checked against uq_summary on samples × k (seed 0,
    64 samples of a 24×24 image; exact up to float64 round-off)."""
    rng = np.random.default_rng(0)
    truth = rng.uniform(0, 1, (24, 24))
    mean = truth + 0.1 * rng.standard_normal(truth.shape)
    samples = 0.08 * rng.standard_normal((64, 24, 24))

    def joint(k):
        return uq_summary(truth, mean, samples * k, None, patch_sizes=[10])["joint_ll"]["10"]

    ll_1, ll_k0 = joint(1.0), joint(1.7)
    for k in (0.5, 1.3, 2.0):
        assert joint_ll_at_scale(ll_1, ll_k0, 1.7, k) == pytest.approx(joint(k), abs=1e-9)
    with pytest.raises(ValueError, match="k0 must differ from 1"):
        joint_ll_at_scale(ll_1, ll_1, 1.0, 2.0)


def test_heldout_calibration_is_scored_from_the_same_run(tmp_path):
    """score_run(run, "heldout") scores std.tif × the held-out k (no second inference): right scale ÷ k, coverage
    of the wider map, the same Spearman; the joint LL from summary and summary_recalibrated."""
    rng = np.random.default_rng(1)
    gt = rng.uniform(0, 0.05, (64, 64))
    rec = gt + rng.normal(0, 0.01, gt.shape)
    std = np.full(gt.shape, 0.005) * rng.uniform(0.8, 1.2, gt.shape)
    for name, a in ((rf.GROUND_TRUTH_NAME, gt), (rf.RECONSTRUCTION_NAME, rec), (rf.STD_NAME, std)):
        tifffile.imwrite(tmp_path / name, a.astype(np.float32))
    summary = {"joint_ll": {"10": 2.0}}
    recal = {"joint_ll": {"10": 2.5}, "k": 1.5}
    (tmp_path / rf.METRICS_NAME).write_text(
        json.dumps({"uq": {"summary": summary, "summary_recalibrated": recal, "n_samples": 8}})
    )
    # held-out rows whose maximum-likelihood k is 2 (r² = k² v + σ² on every row: the score equation's root)
    v = np.linspace(0.5, 1.5, 200)
    heldout = HeldoutRows(np.sqrt(4.0 * v + 1.0), v, 1.0, np.arange(200) // 5, n_bootstrap=0)
    heldout.score()
    none = score_run(tmp_path, "none", heldout)
    cal = score_run(tmp_path, "heldout", heldout)
    assert none["k"] is None and cal["k"] == pytest.approx(2.0, rel=1e-12)
    assert cal["right_scale"] == pytest.approx(none["right_scale"] / 2.0, rel=1e-6)
    assert cal["coverage_0.9"] > none["coverage_0.9"] and cal["spearman"] == pytest.approx(none["spearman"])
    assert none["joint_ll_10"] == 2.0
    assert cal["joint_ll_10"] == pytest.approx(joint_ll_at_scale(2.0, 2.5, 1.5, 2.0))
    assert cal["heldout"]["k"] == cal["k"] and cal["heldout"]["image_variance_fraction"] == pytest.approx(0.5, rel=0.05)


def test_a_failed_run_leaves_its_combination_running_on_the_other_scans(tmp_path, monkeypatch):
    """A run that fails with a user error on one scan is listed with its scan; the combination still runs on the
    next scan, its rows count the scans it covers, and it fails the gates as a whole; a rerun takes the scores of
    the runs the API loads from their score.json. The scans, DIP fits, inferences and scores are replaced by
    stand-ins: what is checked is the study's bookkeeping."""
    options = dataclasses.replace(
        TINY,
        noises=["homoscedastic", "per_ray"],
        calibrations=["none"],
        targets={"coverage_0.9": [0.86, 0.94], "min_ll_margin": [0.0, None]},
    )
    assert options.noises == ("homoscedastic", "per_ray")  # lists given by a caller are frozen into tuples
    ran = []

    def fake_scans(options, out, log):
        return {name: out / "scans" / name for name, _, _ in cal.scan_names(options)}

    def fake_dip(options, scan, n_angles, folder):
        folder.mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(path=folder, reused=False)

    def fake_run(options, dip, combo):
        ran.append((dip.path.parts[-3], combo.name))
        if dip.path.parts[-3] == "walnut_0" and combo.name == "gprior-per_ray":
            raise ValueError("CG did not converge in 500 iterations")
        folder = dip.path.parent / combo.name
        reused = folder.is_dir()  # a rerun: the API loads the finished run (reuse=True) instead of computing it
        folder.mkdir(exist_ok=True)
        return SimpleNamespace(path=folder, reused=reused)

    scored = []

    def fake_score(run, calibration="none", heldout=None):
        scored.append((run.parts[-3], run.name))
        good = run.name == "gprior-homoscedastic"
        return {"coverage_0.5": 0.5, "coverage_0.9": 0.9 if good else 0.88, "coverage_0.95": 0.95,
                "right_scale": 1.0, "marginal_ll": 5.5, "oracle_ll": 5.0, "joint_ll_10": 5.0,
                "oracle_joint_ll_10": 5.0, "spearman": 0.5, "rmse": 0.01, "mean_std": 0.01,
                "calibration": [0.5] * len(LEVELS), "k": None, "tau": None}  # fmt: skip

    monkeypatch.setattr(cal, "prepare_scans", fake_scans)
    monkeypatch.setattr(cal, "dip_run", fake_dip)
    monkeypatch.setattr(cal, "inference_run", fake_run)
    monkeypatch.setattr(cal, "heldout_rows", lambda run: None)
    monkeypatch.setattr(cal, "score_run", fake_score)
    res = run_study(options, tmp_path / "study", "test")

    # walnut_0 comes first; the per-ray combination still runs on textured_0 after failing on walnut_0
    assert ("textured_0", "gprior-per_ray") in ran
    assert res["unavailable"] == {}
    assert res["failures"] == {"gprior-per_ray": ["walnut_0, 8 angles: CG did not converge in 500 iterations"]}
    scans = {r["combination"]: r["n_scans"] for r in res["table"] if r["content"] == "all"}
    assert scans == {"gprior-homoscedastic-none": 2, "gprior-per_ray-none": 1}
    gates = {g["combination"]: g for g in res["gates"]}
    assert gates["gprior-homoscedastic-none"]["pass"] and gates["gprior-homoscedastic-none"]["failed_runs"] == 0
    # its one scan is inside every gate, yet a combination that did not run on every scan does not pass
    assert all(v["pass"] for v in gates["gprior-per_ray-none"]["gates"].values())
    assert gates["gprior-per_ray-none"]["failed_runs"] == 1 and not gates["gprior-per_ray-none"]["pass"]
    md = (tmp_path / "study" / "results.md").read_text()
    assert "| FAIL (1 run failed) |" in md and "coverage_0.9 ∈ [0.86, 0.94]" in md
    assert "- `gprior-per_ray` on walnut_0, 8 angles: CG did not converge in 500 iterations" in md

    # a rerun resumes: the runs the API loads keep the scores of their score.json (none is recomputed), the failed
    # run is tried again, and the results are the same
    ran.clear()
    scored.clear()
    again = run_study(options, tmp_path / "study", "test")
    assert ("walnut_0", "gprior-per_ray") in ran and scored == []
    assert again["records"] == res["records"] and again["failures"] == res["failures"]
