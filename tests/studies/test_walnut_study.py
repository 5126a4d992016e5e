"""scripts/walnut_study.py end to end at its --tiny size (tiny simulated scan, 8 angles, 32² grid): every file, every
(setting, method) row with finite numbers, resuming without recomputation (also from DIP model files written before
the versioned model file format), and clear errors. The study machinery lives in ctuq.studies; the script is its
command line."""

import dataclasses
import json
import math

import numpy as np
import pytest
import tifffile
import torch
from tiny import load_script

from ctuq import load_run
from ctuq.studies import exact_decision
from ctuq.studies.walnut import DEFAULTS, METHODS
from ctuq.studies.walnut import TINY as TINY_OPTIONS

# the whole module shares one tiny study run (~10 s): left out of `make test-fast`
pytestmark = pytest.mark.slow

# --tiny with one of its two angle counts (4 and 8): one setting shows every per-setting file and row, in half the time
SETTINGS = (8,)
TINY = ["--tiny", "--settings", *map(str, SETTINGS), "--no-progress"]


def _load_script():
    return load_script("walnut_study")


study = _load_script()


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    threads = torch.get_num_threads()
    # One thread: the tiny problem gains nothing from two, and a second thread slows it down several-fold when
    # other jobs share the cores. The study restores the caller's thread count.
    rc = study.main([*TINY, "--out", str(out), "--threads", "1"])
    assert rc == 0
    assert torch.get_num_threads() == threads
    return out


def test_tiny_study_writes_every_file(study_run):
    out = study_run
    for name in ("results.json", "results.md", "study.json", "scan/ctuq_simulation.json"):
        assert (out / name).is_file(), name
    for n in SETTINGS:
        for kind in ("uq", "joint_ll", "calibration", "error_vs_std"):
            png = out / f"{kind}_{n}.png"
            assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        sdir = out / f"angles_{n}"
        gt = tifffile.imread(sdir / "ground_truth.tif")
        assert gt.shape == (32, 32) and (sdir / "reconstruction.tif").is_file()
        # the DIP and every method are run folders of the public API
        dip = load_run(sdir / "dip")
        np.testing.assert_array_equal(dip.images["dip"], tifffile.imread(sdir / "reconstruction.tif"))
        np.testing.assert_array_equal(dip.ground_truth, gt)
        for method in METHODS:
            run = load_run(sdir / method)
            assert run.std.shape == (32, 32) and np.all(np.isfinite(run.std)) and run.std.min() > 0, (n, method)
            mean = run.mean
            if method == "mc_dropout":
                assert run.config.uq.method == "mc_dropout" and not np.array_equal(mean, dip.images["dip"])
            else:  # the linearised posterior's mean is the shared DIP
                np.testing.assert_array_equal(mean, dip.images["dip"])


def test_table_has_every_method_and_setting_with_finite_numbers(study_run):
    res = json.loads((study_run / "results.json").read_text())
    rows = res["table"]
    assert [(r["setting"], r["method"]) for r in rows] == [(n, m) for n in SETTINGS for m in METHODS]
    expected_samples = {
        "linearised_sampled": TINY_OPTIONS.samples,
        "linearised_exact": TINY_OPTIONS.exact_samples,
        "linearised_tv_predcp": TINY_OPTIONS.exact_samples,
        "mc_dropout": TINY_OPTIONS.mc_passes,
    }
    for r in rows:
        assert r["status"] == "done", r
        for key in ("psnr", "marginal_ll", "joint_ll_10", "coverage_90", "time_prediction_s", "time_fit_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]), (r["setting"], r["method"], key)
        assert 0.0 <= r["coverage_90"] <= 1.0 and r["time_prediction_s"] >= 0
        assert r["n_samples"] == expected_samples[r["method"]]
        if r["method"] == "mc_dropout":
            assert r["time_hyperparameters_s"] is None  # nothing learned: fixed dropout rate
        else:
            assert r["time_hyperparameters_s"] > 0
    for n in SETTINGS:
        s = res["settings"][str(n)]
        assert s["c"] == n * 24  # 96 detector columns, every 4th kept
        sampled, exact = s["methods"]["linearised_sampled"], s["methods"]["linearised_exact"]
        # both linearised methods share the one DIP: same mean, same PSNR
        assert sampled["image"]["psnr"] == exact["image"]["psnr"] == s["dip"]["psnr"]
        assert sampled["solver"] == "cg" and exact["solver"] == "exact"
        assert s["methods"]["mc_dropout"]["summary"]["centering"] == "empirical"
        assert len(sampled["summary"]["joint_ll"]) == 10
    md = (study_run / "results.md").read_text()
    for n in SETTINGS:
        for label in METHODS.values():
            assert f"| {n} | {label} |" in md


def test_rerun_skips_finished_parts(study_run, capsys):
    before = {p: p.stat().st_mtime_ns for p in study_run.glob("angles_*/*/metrics.json")}
    table = json.loads((study_run / "results.json").read_text())["table"]
    assert study.main([*TINY, "--out", str(study_run)]) == 0
    log = capsys.readouterr().err
    assert "reusing the simulated scan" in log
    assert log.count("skipping the DIP fit") == len(SETTINGS)
    for label in METHODS.values():
        assert log.count(f"skipping {label} for") == len(SETTINGS), label
    assert {p: p.stat().st_mtime_ns for p in study_run.glob("angles_*/*/metrics.json")} == before
    assert json.loads((study_run / "results.json").read_text())["table"] == table


def test_a_method_whose_run_lost_its_result_is_redone_from_its_checkpoints(study_run, capsys):
    # The study's state is its run folders: a method run without metrics.json is not reused but resumed
    # (ctuq.reconstruct(resume=True)): the MC-dropout DIP continues from its kept checkpoint, no iteration is
    # repeated, and the passes give the same numbers.
    sdir = study_run / f"angles_{SETTINGS[0]}"
    record = json.loads((study_run / "results.json").read_text())["settings"][str(SETTINGS[0])]["methods"]
    before = record["mc_dropout"]
    (sdir / "mc_dropout" / "metrics.json").unlink()
    assert study.main([*TINY, "--out", str(study_run), "--threads", "1"]) == 0
    log = capsys.readouterr().err
    assert log.count("skipping the DIP fit") == len(SETTINGS)
    assert "skipping MC dropout" not in log
    assert json.loads((sdir / "mc_dropout" / "metrics.json").read_text())["dip"]["resumed_from_iteration"] == 20
    after = json.loads((study_run / "results.json").read_text())["settings"][str(SETTINGS[0])]["methods"]
    for key in ("image", "image_dropout_off", "summary", "n_samples"):
        assert after["mc_dropout"][key] == before[key], key


def test_other_options_in_the_same_folder_are_refused(study_run, capsys):
    assert study.main([*TINY, "--out", str(study_run), "--dropout", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "other options" in err and "dropout: 0.05 there, 0.1 now" in err


def test_bad_input_is_named(study_run, tmp_path, capsys):
    scan = study_run / "scan"  # 33 projection files: 32 distinct angles
    assert study.main(["--tiny", "--data", str(scan), "--settings", "5", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "5 angles" in err and "32 distinct angles" in err and "[1, 2, 4, 8, 16, 32]" in err
    assert study.main(["--tiny", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "b")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert study.main(["--tiny", "--samples", "1", "--out", str(tmp_path / "c")]) == 2
    assert "--samples must be >= 2" in capsys.readouterr().err


def test_exact_reference_decision_follows_memory():
    opts = dataclasses.replace(DEFAULTS, exact_samples=1024)
    cpu = torch.device("cpu")
    assert exact_decision("never", 10, 10, opts, cpu) == (False, "--exact never")
    assert exact_decision("always", 10**7, 10**8, opts, cpu)[0]
    ok, why = exact_decision("auto", 7680, 5000, opts, cpu)  # the CPU demo: dense TΦ, ~0.8 GB
    assert ok and "dense" in why
    ok, why = exact_decision("auto", 2_000_000, 3_000_000, opts, cpu)  # a 3D scan: c × c is 96 TB
    assert not ok and "GiB" in why
