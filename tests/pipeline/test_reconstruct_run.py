"""``ctuq reconstruct`` end to end on a tiny simulated scan, and its argument/config errors."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tifffile
import torch
import yaml
from tiny import NO_FIGURES, TINY_DATA, sets, tiny_args

from ctuq.cli import main
from ctuq.config import load_config
from ctuq.registry import PRIORS, SOLVERS


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["reconstruct", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--data", "--config", "--set", "--out", "--device", "--seed", "--resume", "--no-uq"):
        assert opt in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--set", "dip.learning_rate=1"], "valid keys of section 'dip': iterations, lr"),
        (["--set", "dip.lr=-1"], "dip.lr must be > 0"),
        (["--config", "no_such_config"], "bundled: demo"),
        (["--resume"], "--resume: needs --out"),
    ],
)
def test_config_errors_exit_2_with_clear_message(argv, fragment, capsys, tmp_path):
    rc = main(["reconstruct", "--no-uq", *argv])
    assert rc == 2
    assert fragment in capsys.readouterr().err


def test_refuses_to_overwrite_a_finished_run(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text("{}")
    assert main(["reconstruct", "--no-uq", "--out", str(tmp_path)]) == 2
    assert "already holds a finished run" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_entry_point():
    res = subprocess.run(
        [sys.executable, "-m", "ctuq.cli", "reconstruct", "--set", "x=1"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 2 and "unknown config key 'x'" in res.stderr


# ------------------------------------------------------------------------------------------------ end to end
def test_reconstruct_with_uncertainty_writes_the_run_folder(tiny_run):
    out = tiny_run
    for name in (
        "reconstruction.tif",
        "fbp.tif",
        "tv.tif",
        "ground_truth.tif",
        "std.tif",
        "std_uncalibrated.tif",
        "reconstruction.png",
        "uncertainty.png",
        "calibration.png",
        "reliability.png",
        "em_trace.png",
        "error_vs_std.png",
        "joint_ll.png",
        "heldout_calibration.png",
        "heldout_rows.npz",
        "metrics.json",
        "config.yaml",
        "ctuq.log",
        "dip_model.pt",
        "dip_checkpoint.pt",
    ):
        assert (out / name).is_file(), name
    assert not (out / "uq_moments.pt").exists()  # the running sums of the prediction go once the run is finished
    assert not (out / "samples").exists()  # no image sample is written unless asked (--save-samples)
    m = json.loads((out / "metrics.json").read_text())
    assert set(m["psnr"]) == {"fbp", "tv", "dip"} and all(v is not None for v in m["psnr"].values())
    assert set(m["joint_ll"]) == {str(p) for p in range(1, 11)}
    # one stabilised variance throughout (ctuq.metrics): the two sums agree to the last bits (their order of summation
    # differs with the CPU's vector width: equal on one CPU type, 4e-16 apart on another)
    assert m["marginal_ll"] == pytest.approx(m["joint_ll"]["1"], rel=1e-12, abs=0)
    assert set(m["coverage"]) == {"0.5", "0.9", "0.95"} and 0 <= m["coverage"]["0.9"] <= 1
    assert len(m["em_trace"]) == 3 and all(r["a_new"] > 0 for r in m["em_trace"])
    assert m["uq"]["n_samples"] == 64 and m["uq"]["solver"] == "exact"  # c = 16 × 32 = 512 < d: dual exact route
    assert {"gprior", "em", "prediction"} <= set(m["uq"]["timings"])
    assert {"load", "fbp", "tv", "dip", "uq"} <= set(m["timings"])
    assert m["config"]["uq"]["samples"] == 64 and m["config"]["dip"]["iterations"] == 60
    # the sections of what ran: config.yaml (written first) none of a solver, as uq.solver is auto; metrics.json the
    # one the run resolved to; both the chosen prior's (where it has options), no other registered one's
    written, route = yaml.safe_load((out / "config.yaml").read_text())["uq"], m["uq"]["stats"]["route"]
    assert written["solver"] == "auto" and not set(written) & set(SOLVERS)
    assert set(written) & set(PRIORS) <= {written["prior"]}
    assert set(m["config"]["uq"]) & {*SOLVERS, *PRIORS} == {route} | (set(written) & set(PRIORS))
    assert load_config(out / "config.yaml").to_dict(resolved={"uq.solver": route}) == m["config"]
    # the default calibration on a scan with unused angles: the held-out bias model
    assert m["uq"]["calibration"]["mode"] == "bias" and m["uq"]["calibration"]["setting"] == "auto"
    std = tifffile.imread(out / "std.tif")
    assert std.shape == (32, 32) and std.dtype.name == "float32" and (std > 0).all()
    # the contrast scores inside the object (DESIGN.md §8), for std.tif and the posterior's own map
    for where in (m["uq"]["summary"]["localisation"], m["uq"]["summary_uncalibrated"]["localisation"]):
        assert where["ence"] >= 0 and len(where["reliability"]["rmv"]) == len(where["conditional_coverage_0.9"]) == 10
        assert where["spearman_ratio"] == pytest.approx(where["spearman_inside"] / where["spearman_reference"])
    assert "ENCE" in (out / "ctuq.log").read_text()


@pytest.mark.slow
def test_uq_command_reruns_only_the_inference(tiny_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    before = json.loads((out / "metrics.json").read_text())
    rerun = ["uq", str(out), *sets("uq.samples=32", "uq.em_steps=2", *NO_FIGURES), "--no-progress", "--save-samples"]
    assert main(rerun) == 0
    after = json.loads((out / "metrics.json").read_text())
    assert after["uq"]["n_samples"] == 32 and len(after["em_trace"]) == 2
    # --save-samples writes the image samples (one chunk of 32 here), whose RMS is the posterior's std map: the
    # default calibration (auto: the held-out bias model on this scan's unused angles) moved it to std_uncalibrated.tif
    saved = torch.load(out / "samples" / "samples_0000.pt", weights_only=True)
    assert saved.shape == (32, 32, 32) and sorted(p.name for p in (out / "samples").iterdir()) == ["samples_0000.pt"]
    assert after["uq"]["calibration"]["mode"] == "bias"
    rms = saved.double().pow(2).mean(0).sqrt().numpy()
    np.testing.assert_allclose(rms, tifffile.imread(out / "std_uncalibrated.tif"), rtol=1e-6)
    assert after["dip"] == before["dip"]  # the DIP was restored, not refitted
    assert after["psnr"]["dip"] == pytest.approx(before["psnr"]["dip"], rel=1e-6)
    assert "restore_dip" in after["timings"] and "dip" not in after["timings"]
    assert main(["uq", str(out.parent / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_of_a_finished_run_does_not_refit(tiny_run, tiny_scan, tmp_path, capsys):
    # Resume a copy of the finished run: the DIP checkpoint is complete, so no iteration runs again.
    out = tmp_path / "copy"
    shutil.copytree(tiny_run, out)
    resume = ["reconstruct", "--data", str(tiny_scan), "--out", str(out), "--resume", *tiny_args()]
    assert main([*resume, *sets(*NO_FIGURES)]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["dip"]["resumed_from_iteration"] == 60
    # Resuming the inference with other settings is refused with a message naming the setting (exit 2).
    capsys.readouterr()
    assert main([*resume, *sets("uq.samples=80")]) == 2
    err = capsys.readouterr().err
    assert "its samples is 64 but this run has 80" in err


def test_pretrain_then_educated_dip(tiny_scan, tmp_path):
    weights = tmp_path / "pre.pt"
    pretrain = ["pretrain", "--data", str(tiny_scan), "--out", str(weights), "--phantoms", "2", "--slices-per-phantom"]
    pretrain += ["2", "--iterations", "5", "--batch-size", "2", "--no-progress", *sets(*TINY_DATA)]
    assert main(pretrain) == 0
    blob = torch.load(weights, weights_only=True)
    assert blob["input"] == "fbp" and blob["meta"]["phantom_seeds"] == [1000, 1001]
    assert blob["meta"]["image_shape"] == [32, 32]
    out = tmp_path / "run"
    educated = tiny_args(
        f"model.pretrained={weights}", "model.input=fbp", "dip.iterations=3", "tv.enabled=false", uq=False
    )
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *educated]) == 0
    assert json.loads((out / "metrics.json").read_text())["config"]["model"]["pretrained"] == str(weights)
    assert main(["pretrain", "--out", str(tmp_path / "x.pt"), "--seed", "0"]) == 2  # seed 0 is the test walnut
