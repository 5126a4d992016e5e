"""The held-out calibration check of a CT run (:mod:`ctuq.pipeline.calibration`), ``uq.calibration: heldout`` and
``ctuq uq RUN --check``, end to end on a tiny simulated scan."""

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch

from ctuq.cli import main
from ctuq.config import load_config
from ctuq.metrics import heldout_check
from ctuq.pipeline import calibration as calib
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.phases import RunState, phase_load, phase_restore_dip
from ctuq.studies.calibration import score_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tiny_scan, tiny_uq_args, tmp_path_factory):
    # uq.calibration = none: this module checks the check and what each recalibration would score beside the
    # posterior's own map (the default, auto, applies the bias model: test_uq_phase_bias.py)
    out = tmp_path_factory.mktemp("runs") / "run"
    args = [*tiny_uq_args, "--set", "uq.calibration=none"]
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *args]) == 0
    return out


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_every_run_with_uq_records_the_check(run):
    m = json.loads((run / "metrics.json").read_text())
    h = m["uq"]["heldout"]
    assert h["n_angles"] == h["n_used_angles"] == m["data"]["measurement_shape"][0]  # every 2nd angle held out
    assert h["n_rows"] == h["n_angles"] * m["data"]["measurement_shape"][1]
    assert set(h["coverage_headline"]) == {"0.5", "0.9", "0.95"} and len(h["coverage"]) == len(h["levels"]) == 20
    assert h["scale"]["k"] > 0 and h["scale"]["se_bootstrap"] > 0 and 0 < h["image_variance_fraction"] < 1
    assert h["command"] == f"ctuq uq {run} --check"
    # the bias model (τ alone, posterior kept): reported, not applied with uq.calibration = none; its weights saved
    assert h["bias"]["tau"] >= 0 and (h["bias"]["zero"] or h["bias"]["se_curvature"] > 0)
    with np.load(run / rf.HELDOUT_ROWS_NAME) as z:
        assert z["bias_weight"].shape == (h["n_rows"],) and z["bias_weight"].min() >= 0 and z["bias_weight"].max() > 0
    assert m["uq"]["calibration"] == {"mode": "none", "setting": "none", "k": None}
    # uq.noise = auto on a scan with counts: per-ray noise, and the held-out rows' noise follows it
    assert m["uq"]["stats"]["noise"]["model"] == "per_ray" and m["uq"]["stats"]["noise"]["setting"] == "auto"
    assert (run / rf.HELDOUT_FIGURE).is_file() and not (run / rf.STD_UNCALIBRATED_NAME).exists()
    # what uq.calibration = heldout would score, from the same posterior (std × k: mean std × k)
    recal = m["uq"]["summary_recalibrated"]
    assert recal["k"] == h["scale"]["k"]
    assert recal["mean_std"] == pytest.approx(h["scale"]["k"] * m["uq"]["summary"]["mean_std"], rel=1e-3)
    # the rows are saved, and rescoring them reproduces the run's check
    rows, meta = calib.read_heldout_rows(run)
    assert rows.residual.shape == rows.variance.shape == rows.noise_variance.shape == (h["n_rows"],)
    assert rows.photon_variance.shape == (h["n_rows"],) and np.all(rows.photon_variance > 0)  # simulated counts
    assert meta["n_angles"] == h["n_angles"] and meta["n_samples"] == h["n_samples"] == 64  # ≤ uq.samples
    again = calib.score_rows(rows, meta, seed=1)
    assert again["scale"]["k"] == pytest.approx(h["scale"]["k"], rel=1e-9)
    assert again["scale_photon"]["k"] == pytest.approx(h["scale_photon"]["k"], rel=1e-9)


def test_check_writes_heldout_json_and_touches_nothing_else(run, capsys):
    before = _digests(run)
    assert main(["uq", str(run), "--check", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "held-out check: " in out and "coverage" in out
    assert "rescored the held-out rows the run saved" in err  # no posterior rebuilt
    after = _digests(run)
    changed = {n for n in after if before.get(n) != after[n]}
    assert changed <= {rf.HELDOUT_NAME, rf.HELDOUT_FIGURE} and rf.HELDOUT_NAME in changed
    rep = json.loads((run / rf.HELDOUT_NAME).read_text())
    m = json.loads((run / "metrics.json").read_text())
    # the posterior resumed from uq_state.pt and the same seeded samples: the run's own check, reproduced
    assert rep["scale"]["k"] == pytest.approx(m["uq"]["heldout"]["scale"]["k"], rel=1e-6)


class _Scaled:
    """A posterior whose image samples are ``factor ×`` another's: its std map is ``factor ×`` the original."""

    def __init__(self, posterior, factor):
        self.posterior, self.factor, self.sigma2 = posterior, factor, posterior.sigma2

    def sample_outputs(self, n, **kwargs):
        for i, images, ps in self.posterior.sample_outputs(n, **kwargs):
            yield i, images * self.factor, ps


def test_a_scaled_std_is_detected_and_the_recalibration_undoes_it(run):
    cfg = load_config(run / "config.yaml")
    state = RunState(cfg=cfg, out_dir=run, device=torch.device("cpu"), progress=False, command="uq")
    phase_load(state)
    phase_restore_dip(state)
    posterior = calib.fitted_posterior(state).posterior
    held, reason = calib.heldout_data(cfg, state.device)
    assert reason == ""
    recon = state.images["dip"].detach().cpu()
    base = calib.run_heldout_check(posterior, recon, cfg.dip.scale, held, n_samples=128, seed=cfg.seed + 1)
    assert not base.report["scale"]["at_bound"]
    for factor in (0.5, 2.0):
        res = calib.run_heldout_check(
            _Scaled(posterior, factor), recon, cfg.dip.scale, held, n_samples=128, seed=cfg.seed + 1
        )
        # the check reports the scaled std as too narrow (×0.5) or too wide (×2) by the factor ...
        assert res.k == pytest.approx(base.k / factor, rel=0.10)
        # ... and the recalibrated std (factor × k × std) is the unscaled run's k × std to within 10 %
        assert factor * res.k == pytest.approx(base.k, rel=0.10)
        again = heldout_check(
            res.residual,
            np.zeros_like(res.residual),
            variance=res.k**2 * res.variance,
            noise_variance=res.noise_variance,
            groups=res.groups,
            n_bootstrap=0,
        )
        assert again["scale"]["k"] == pytest.approx(1.0, rel=0.10)


def test_calibration_heldout_rescales_std_and_keeps_the_evidence(run, tmp_path):
    copy = tmp_path / "recal"
    shutil.copytree(run, copy)
    assert main(["uq", str(copy), "--set", "uq.calibration=heldout", "--no-progress"]) == 0
    m = json.loads((copy / "metrics.json").read_text())
    k = m["uq"]["calibration"]["k"]
    assert m["uq"]["calibration"]["mode"] == "heldout" and k == pytest.approx(m["uq"]["heldout"]["scale"]["k"])
    std, raw = tifffile.imread(copy / "std.tif"), tifffile.imread(copy / rf.STD_UNCALIBRATED_NAME)
    np.testing.assert_allclose(std, raw * k, rtol=1e-6)
    before, after = m["uq"]["summary_uncalibrated"], m["uq"]["summary"]
    assert after["mean_std"] == pytest.approx(k * before["mean_std"], rel=1e-3)  # η is relative: scales with k²
    assert m["coverage"] == after["coverage"] and m["marginal_ll"] == after["marginal_ll"]  # top level: std.tif's
    assert set(before) == set(after)


def test_per_ray_runs_check_with_each_held_out_rows_own_noise_variance(run, tmp_path):
    """uq.noise=per_ray: the held-out rows' noise is σ² d_h with d normalised like the fitted rows' (mean 1 over the
    used rows), so rows of more photons get less noise; a per-ray run's check says which noise model it used."""
    copy = tmp_path / "per_ray"
    shutil.copytree(run, copy)
    assert main(["uq", str(copy), "--set", "uq.noise=per_ray", "--no-progress"]) == 0
    m = json.loads((copy / "metrics.json").read_text())
    rep = m["uq"]["heldout"]
    assert rep["noise_model"] == "per_ray" and np.isfinite(rep["scale"]["k"])
    cfg = load_config(copy / "config.yaml")
    held, reason = calib.heldout_data(cfg, torch.device("cpu"))
    assert reason == "" and held.relative_variances.shape == (held.op.c,)
    d = held.relative_variances
    assert d.min() > 0 and d.max() / d.min() > 1.05  # the rows differ: a per-row noise, not one σ²
    assert 0.5 < d.mean() < 2.0  # held-out and used rows come from the same scan: comparable variances
    # --check on a per-ray run without saved rows rebuilds its posterior, which needs the scan's variances too
    (copy / rf.HELDOUT_ROWS_NAME).unlink()
    assert main(["uq", str(copy), "--check", "--no-progress"]) == 0
    again = json.loads((copy / rf.HELDOUT_NAME).read_text())
    assert again["noise_model"] == "per_ray" and again["scale"]["k"] == pytest.approx(rep["scale"]["k"], rel=1e-6)


def test_check_refuses_what_is_not_a_finished_uq_run(run, tiny_scan, tiny_uq_args, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((run / "config.yaml").read_text())
    assert main(["uq", str(unfinished), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a finished run (no metrics.json)" in err and str(unfinished) in err and "\n" not in err
    no_uq = tmp_path / "no_uq"
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(no_uq), "--no-uq", *tiny_uq_args]) == 0
    capsys.readouterr()
    assert main(["uq", str(no_uq), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no uncertainty phase (no std.tif)" in err and "\n" not in err


def test_check_without_saved_rows_refits_and_saves_them(run, tmp_path):
    """A run folder without heldout_rows.npz (made before the file existed): the posterior is resumed from
    uq_state.pt, the check reproduces the run's k, and the rows are saved for the next check."""
    copy = tmp_path / "old"
    shutil.copytree(run, copy)
    (copy / rf.HELDOUT_ROWS_NAME).unlink()
    assert main(["uq", str(copy), "--check", "--no-progress"]) == 0
    rep = json.loads((copy / rf.HELDOUT_NAME).read_text())
    m = json.loads((copy / "metrics.json").read_text())
    assert rep["scale"]["k"] == pytest.approx(m["uq"]["heldout"]["scale"]["k"], rel=1e-6)
    assert (copy / rf.HELDOUT_ROWS_NAME).is_file()


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"not an npz file", "unreadable held-out rows"),
        (None, "not a held-out rows file (no variance"),
        ("bias_weight", "bias_weight has shape (3,)"),
    ],
)
def test_a_broken_rows_file_is_a_one_line_error(run, tmp_path, capsys, content, fragment):
    copy = tmp_path / "broken"
    shutil.copytree(run, copy)
    path = copy / rf.HELDOUT_ROWS_NAME
    if content is None:  # an npz without the variance array
        with np.load(path) as z:
            kept = {k: z[k] for k in z.files if k != "variance"}
        with open(path, "wb") as fh:
            np.savez(fh, **kept)
    elif content == "bias_weight":  # bias weights that are not one per row
        with np.load(path) as z:
            kept = {**{k: z[k] for k in z.files}, "bias_weight": np.ones(3)}
        with open(path, "wb") as fh:
            np.savez(fh, **kept)
    else:
        path.write_bytes(content)
    assert main(["uq", str(copy), "--check", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert fragment in err and str(path) in err


def test_no_unused_angles_is_said_in_one_line(run):
    cfg = load_config(run / "config.yaml", ["data.angular_subsampling=1"])
    held, reason = calib.heldout_data(cfg, torch.device("cpu"))
    assert held is None and "no unused angles" in reason and "K-fold" in reason and "\n" not in reason


def test_bad_calibration_value_names_the_key(capsys):
    assert main(["reconstruct", "--no-uq", "--set", "uq.calibration=sometimes"]) == 2
    err = capsys.readouterr().err
    assert "uq.calibration" in err and "heldout" in err


def test_the_bias_model_experiment_runs_and_its_image_oracle_is_calibrated(run, tmp_path):
    """scripts/heldout_bias_experiment.py (docs/calibration.md) on the tiny run: every method scored, and the
    image-space oracle's (k, τ) fit is at a stationary point, where scaling both by c scales the std by c, so its
    right scale is 1 (to the Nelder–Mead tolerance)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "heldout_bias_experiment.py"
    spec = importlib.util.spec_from_file_location("heldout_bias_experiment", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(run), "--out", str(tmp_path / "exp")]) == 0
    (res,) = json.loads((tmp_path / "exp" / "results.json").read_text())
    methods = [s["method"] for s in res["scores"]]
    assert len(methods) == 5 and methods[0] == "posterior" and "oracle" in methods[-1]
    assert res["scores"][-1]["right_scale"] == pytest.approx(1.0, abs=2e-3)
    posterior = score_run(run)  # the study's scores of the same std map: the same inner square and numbers
    for key in ("right_scale", "coverage_0.9", "marginal_ll", "oracle_ll"):
        assert res["scores"][0][key] == pytest.approx(posterior[key], rel=1e-3)
    assert all(np.isfinite(v) for v in res["evidence"].values())
    assert "| posterior |" in (tmp_path / "exp" / "table.md").read_text()


class _NoMatrix:
    """The held-out operator without its assembled matrix: what an operator of another backend offers."""

    def __init__(self, op):
        self.op, self.c, self.device, self.dtype = op, op.c, op.device, op.dtype

    def forward_flat(self, x):
        return self.op.forward_flat(x)


def test_bias_weights_without_a_matrix_agree_with_the_exact_ones(run):
    """w = (T ∘ T) M: exact from the sparse matrix; 64 Rademacher probes otherwise (unbiased, per-row relative s.d.
    ≤ sqrt(2/64) ≈ 18 %): the mean over rows agrees within 3 % (its s.d. is under 1 % here), seed 0."""
    cfg = load_config(run / "config.yaml")
    held, _reason = calib.heldout_data(cfg, torch.device("cpu"))
    mask = calib.object_mask(tifffile.imread(run / rf.RECONSTRUCTION_NAME))
    assert 0 < mask.mean() < 1
    exact = calib.bias_weight(held.op, mask)
    probed = calib.bias_weight(_NoMatrix(held.op), mask, seed=0)
    dense = held.op.csr.to_dense().double().numpy()
    np.testing.assert_allclose(exact, (dense**2) @ mask.ravel(), rtol=1e-10)
    assert probed.mean() == pytest.approx(exact.mean(), rel=0.03)
    assert np.corrcoef(probed, exact)[0, 1] > 0.9
