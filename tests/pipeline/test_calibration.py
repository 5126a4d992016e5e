"""The held-out calibration check of a CT run (:mod:`ctuq.calibration` driven by :mod:`ctuq.pipeline.uq_phase`),
``uq.calibration: heldout`` and ``ctuq uq RUN --check``, end to end on a tiny simulated scan; after loading, neither
the uncertainty phase nor ``--check`` opens the scan again."""

import ast
import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from tiny import restored_state

from ctuq import calibration as cal
from ctuq.cli import main
from ctuq.config import load_config
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline import runner
from ctuq.pipeline import uq as pipeline_uq
from ctuq.pipeline.phases import phase_load
from ctuq.pipeline.runner import fitted_posterior
from ctuq.pipeline.scan import load_scan
from ctuq.pipeline.uq_phase import phase_uq


@pytest.fixture
def run(tiny_run_none):
    """conftest's tiny run with uq.calibration = none: this module checks the check and what each recalibration would
    score beside the posterior's own map (the default, auto, applies the bias model: test_uq_phase_bias.py). Tests
    that change it work on a copy."""
    return tiny_run_none


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_every_run_with_uq_records_the_check(run):
    m = json.loads((run / "metrics.json").read_text())
    h = m["uq"]["heldout"]
    # every 2nd angle held out; half of those tuned TV and the DIP, the other half is the check's
    assert h["n_used_angles"] == m["data"]["measurement_shape"][0] == 2 * h["n_angles"]
    assert m["data"]["heldout_split"] == {"tuning_angles": h["n_angles"], "check_angles": h["n_angles"]}
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
    assert not (run / rf.STD_UNCALIBRATED_NAME).exists()  # the rerun without recalibration removed tiny_run's
    # what uq.calibration = heldout would score, from the same posterior (std × k: mean std × k)
    recal = m["uq"]["summary_recalibrated"]
    assert recal["k"] == h["scale"]["k"]
    assert recal["mean_std"] == pytest.approx(h["scale"]["k"] * m["uq"]["summary"]["mean_std"], rel=1e-3)
    # the rows are saved, and rescoring them reproduces the run's check
    rows = cal.read_rows(run / rf.HELDOUT_ROWS_NAME)
    assert rows.residual.shape == rows.variance.shape == rows.noise_variance.shape == (h["n_rows"],)
    assert rows.photon_variance.shape == (h["n_rows"],) and np.all(rows.photon_variance > 0)  # simulated counts
    assert rows.meta["n_angles"] == h["n_angles"] and rows.meta["n_samples"] == h["n_samples"] == 64  # ≤ uq.samples
    again = rows.score(seed=1)
    assert again["scale"]["k"] == pytest.approx(h["scale"]["k"], rel=1e-9)
    assert again["scale_photon"]["k"] == pytest.approx(h["scale_photon"]["k"], rel=1e-9)


def test_check_writes_heldout_json_and_touches_nothing_else(run, tmp_path, capsys):
    run = shutil.copytree(run, tmp_path / "run")
    before = _digests(run)
    assert main(["uq", str(run), "--check", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "held-out check" in out and "intervals cover" in out and "look" in out  # the table and the verdict
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
        self.posterior, self.factor, self.likelihood = posterior, factor, posterior.likelihood

    def sample_outputs(self, n, **kwargs):
        for i, images, ps in self.posterior.sample_outputs(n, **kwargs):
            yield i, images * self.factor, ps


@pytest.mark.slow
def test_a_scaled_std_is_detected_and_the_recalibration_undoes_it(run):
    state = restored_state(run)  # fitted_posterior resumes a temporary copy of the run's uq_state.pt
    cfg = state.cfg
    run_ = fitted_posterior(state)
    held = state.data.heldout
    assert held is not None and state.data.heldout_reason == ""
    recon = state.images["dip"].detach().cpu()
    kw = dict(noise_model=run_.noise.model, n_samples=128, seed=cfg.seed + 1)
    base = cal.run_heldout_check(run_.posterior, recon, cfg.dip.scale, held, **kw)
    assert not base.report["scale"]["at_bound"]
    k0 = base.report["scale"]["k"]
    for factor in (0.5, 2.0):
        res = cal.run_heldout_check(_Scaled(run_.posterior, factor), recon, cfg.dip.scale, held, **kw)
        k = res.report["scale"]["k"]  # the heldout method's entry, as its own fit gives it
        assert cal.HeldoutScale.fit(res, recon).k == k
        # the check reports the scaled std as too narrow (×0.5) or too wide (×2) by the factor ...
        assert k == pytest.approx(k0 / factor, rel=0.10)
        # ... and the recalibrated std (factor × k × std) is the unscaled run's k × std to within 10 %
        assert factor * k == pytest.approx(k0, rel=0.10)
        again = cal.HeldoutScale.fit(dataclasses.replace(res, variance=k**2 * res.variance, report={}), recon)
        assert again.k == pytest.approx(1.0, rel=0.10)


@pytest.mark.slow
def test_calibration_heldout_rescales_std_and_keeps_the_evidence(run, tmp_path):
    copy = shutil.copytree(run, tmp_path / "recal")
    state = restored_state(copy, "uq.calibration=heldout")
    phase_uq(state)
    m = state.metrics
    k = m["uq"]["calibration"]["k"]
    assert m["uq"]["calibration"]["mode"] == "heldout" and k == pytest.approx(m["uq"]["heldout"]["scale"]["k"])
    std, raw = tifffile.imread(copy / "std.tif"), tifffile.imread(copy / rf.STD_UNCALIBRATED_NAME)
    np.testing.assert_allclose(std, raw * k, rtol=1e-6)
    before, after = m["uq"]["summary_uncalibrated"], m["uq"]["summary"]
    assert after["mean_std"] == pytest.approx(k * before["mean_std"], rel=1e-3)  # η is relative: scales with k²
    assert m["coverage"] == after["coverage"] and m["marginal_ll"] == after["marginal_ll"]  # top level: std.tif's
    assert set(before) == set(after)


def test_per_ray_held_out_rows_get_their_own_noise_variance(run):
    """uq.noise = per_ray (what auto resolves to on this scan with counts): the held-out rows' noise is σ² d_h with d
    normalised like the fitted rows' (mean 1 over the used rows: the posterior's likelihood answers it), so rows of
    more photons get less noise; a per-ray run's check says which noise model it used."""
    m = json.loads((run / "metrics.json").read_text())
    rep = m["uq"]["heldout"]
    assert rep["noise_model"] == "per_ray" and np.isfinite(rep["scale"]["k"])
    cfg = load_config(run / "config.yaml")
    rows = cal.read_rows(run / rf.HELDOUT_ROWS_NAME)
    d = rows.noise_variance / (m["uq"]["sigma2"] / cfg.dip.scale**2)  # σ² d_h in sinogram units, over σ²
    assert d.shape == (rep["n_rows"],)
    assert d.min() > 0 and d.max() / d.min() > 1.05  # the rows differ: a per-row noise, not one σ²
    assert 0.5 < d.mean() < 2.0  # held-out and used rows come from the same scan: comparable variances


def test_check_refuses_what_is_not_a_finished_uq_run(run, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((run / "config.yaml").read_text())
    assert main(["uq", str(unfinished), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a finished run (no metrics.json)" in err and str(unfinished) in err and "\n" not in err
    no_uq = shutil.copytree(run, tmp_path / "no_uq")  # what `ctuq reconstruct --no-uq` leaves: no std.tif
    (no_uq / rf.STD_NAME).unlink()
    assert main(["uq", str(no_uq), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no uncertainty phase (no std.tif)" in err and "\n" not in err


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
    data = load_scan(cfg, torch.device("cpu"), progress=False)[0]
    reason = data.heldout_reason
    assert data.heldout is None and "no unused angles" in reason and "K-fold" in reason and "\n" not in reason


def test_bad_calibration_value_names_the_key(capsys):
    assert main(["reconstruct", "--no-uq", "--set", "uq.calibration=sometimes"]) == 2
    err = capsys.readouterr().err
    assert "uq.calibration" in err and "heldout" in err


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
    held = load_scan(cfg, torch.device("cpu"), progress=False)[0].heldout
    mask = cal.object_mask(tifffile.imread(run / rf.RECONSTRUCTION_NAME))
    assert 0 < mask.mean() < 1
    exact = cal.bias_weight(held.op, mask)
    probed = cal.bias_weight(_NoMatrix(held.op), mask, seed=0)
    dense = held.op.csr.to_dense().double().numpy()
    np.testing.assert_allclose(exact, (dense**2) @ mask.ravel(), rtol=1e-10)
    assert probed.mean() == pytest.approx(exact.mean(), rel=0.03)
    assert np.corrcoef(probed, exact)[0, 1] > 0.9


def _hide_the_scan_after_loading(monkeypatch, scan, hidden):
    """``phase_load`` as the runner calls it, then the scan folder moved away: any later read of it fails."""

    def load_then_hide(state):
        phase_load(state)
        scan.rename(hidden)

    monkeypatch.setattr(runner, "phase_load", load_then_hide)


def _count_noise_resolutions(monkeypatch):
    calls = []
    real = pipeline_uq.resolve_noise

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_uq, "resolve_noise", counted)
    return calls


@pytest.mark.slow
def test_after_loading_neither_the_uq_phase_nor_check_opens_the_scan(run, tiny_scan, tmp_path, monkeypatch):
    """The held-out rows come with the loaded problem: ``ctuq uq RUN`` whose scan disappears right after its load
    phase still makes its check (and resolves uq.noise once), and so does ``--check`` on its folder without
    ``heldout_rows.npz`` (a run made before the file existed): it loads the scan itself, once, then rebuilds the
    posterior from uq_state.pt (per-ray: with the scan's variances) and projects onto it; it reproduces the run's k
    and saves the rows for the next check."""
    scan, hidden = tmp_path / "scan" / "Walnut1", tmp_path / "hidden"
    shutil.copytree(tiny_scan, scan)
    out = shutil.copytree(run, tmp_path / "run")
    cfg = load_config(out / rf.CONFIG_NAME, [f"data.path={scan}", "uq.calibration=auto"])
    _hide_the_scan_after_loading(monkeypatch, scan, hidden)
    calls = _count_noise_resolutions(monkeypatch)
    runner.rerun_uq(cfg, out, progress=False)
    assert not scan.exists() and len(calls) == 1
    m = json.loads((out / rf.METRICS_NAME).read_text())
    assert m["uq"]["heldout"]["n_angles"] > 0 and m["uq"]["calibration"]["mode"] == "bias"
    hidden.rename(scan)
    (out / rf.HELDOUT_ROWS_NAME).unlink()
    runner.check_run(cfg, out, progress=False)
    assert not scan.exists() and (out / rf.HELDOUT_ROWS_NAME).is_file()
    again = json.loads((out / rf.HELDOUT_NAME).read_text())
    assert again["noise_model"] == "per_ray"
    assert again["scale"]["k"] == pytest.approx(m["uq"]["heldout"]["scale"]["k"], rel=1e-6)


def _noise_reads(path: Path) -> list[tuple[str, str]]:
    """``(innermost enclosing function, source)`` of every ``NoiseModel(...)`` call and every ``<settings>.noise``
    read in ``path``."""
    found = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            parsed = isinstance(child, ast.Call) and ast.unparse(child.func).split(".")[-1] == "NoiseModel"
            read = isinstance(child, ast.Attribute) and child.attr == "noise"
            if read and ast.unparse(child.value).split(".")[-1] in ("settings", "uq", "st"):
                found.append((where, ast.unparse(child)))
            elif parsed:
                found.append((where, ast.unparse(child)))
            visit(child, inner)

    visit(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def test_uq_noise_is_read_in_one_function_only():
    """``uq.noise`` is resolved in exactly one function (:func:`ctuq.pipeline.noise.resolve_noise`): no other code of
    the package parses it (``NoiseModel(...)``) or reads it from a config section (``settings.noise``,
    ``cfg.uq.noise``)."""
    package = Path(cal.__file__).resolve().parents[1]
    found = {
        (path.relative_to(package.parent).as_posix(), where, text)
        for path in sorted(package.rglob("*.py"))
        for where, text in _noise_reads(path)
    }
    assert found == {
        ("ctuq/pipeline/noise.py", "resolve_noise", "NoiseModel(settings.noise)"),
        ("ctuq/pipeline/noise.py", "resolve_noise", "settings.noise"),
    }
