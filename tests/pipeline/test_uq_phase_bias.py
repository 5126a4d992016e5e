"""``uq.calibration: bias`` (:mod:`ctuq.pipeline.uq_phase`, :class:`ctuq.calibration.BiasModel`): the held-out bias
model ``sqrt(std² + τ² M)`` applied to ``std.tif`` and scored, and rows without bias weights, end to end on the tiny
simulated scan."""

import json
import shutil

import numpy as np
import pytest
import tifffile
import torch
from tiny import restored_state

from ctuq.calibration import BiasModel, biased_moments, object_mask, resolve_calibration
from ctuq.cli import main
from ctuq.metrics import SampleMoments, inner_square_roi
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.uq_phase import auto_calibration, phase_uq
from ctuq.studies.calibration import heldout_rows, score_run
from ctuq.studies.common import StudyError


@pytest.fixture
def run(tiny_run_none):
    """conftest's tiny run with ``uq.calibration: none`` (the posterior's own map; the bias model scored beside it)."""
    return tiny_run_none


@pytest.fixture
def biased(tiny_run):
    """The same run with the default ``uq.calibration: auto``, which is ``bias`` on a scan with unused angles."""
    return tiny_run


def _metrics(folder):
    return json.loads((folder / rf.METRICS_NAME).read_text())


def test_calibration_bias_writes_sqrt_std2_plus_tau2_mask(biased):
    m = _metrics(biased)
    cal = m["uq"]["calibration"]
    assert cal["mode"] == "bias" and cal["k"] is None
    assert cal["tau"] == m["uq"]["heldout"]["bias"]["tau"] > 0  # the tiny run's DIP bias leaves room for τ
    assert cal["tau_se"] > 0 and cal["tau_interval_95"][0] < cal["tau"] < cal["tau_interval_95"][1]
    std, raw = tifffile.imread(biased / rf.STD_NAME), tifffile.imread(biased / rf.STD_UNCALIBRATED_NAME)
    mask = object_mask(tifffile.imread(biased / rf.RECONSTRUCTION_NAME))
    assert mask.mean() == pytest.approx(cal["mask_fraction"], abs=1e-12) and 0 < cal["mask_fraction"] < 1
    np.testing.assert_allclose(std, np.sqrt(raw.astype(np.float64) ** 2 + cal["tau"] ** 2 * mask), rtol=1e-6)
    assert np.array_equal(std[mask == 0], raw[mask == 0])  # outside the object the posterior's map as it is
    before, after = m["uq"]["summary_uncalibrated"], m["uq"]["summary"]
    assert set(before) == set(after) and m["coverage"] == after["coverage"]  # top level: std.tif's
    assert after["mean_std"] > before["mean_std"]


def test_none_records_what_bias_would_give_and_bias_scores_it(run, biased):
    """The ``none`` run records ``summary_bias`` without applying it; the bias run scores the same map (same
    posterior and seed: the same numbers), and its ``summary_uncalibrated`` is the ``none`` run's ``summary``."""
    m0, m1 = _metrics(run), _metrics(biased)
    assert m0["uq"]["calibration"] == {"mode": "none", "setting": "none", "k": None}
    would = m0["uq"]["summary_bias"]
    assert would["tau"] == pytest.approx(m1["uq"]["calibration"]["tau"], rel=1e-9)
    for key in ("marginal_ll", "mean_std", "spearman"):
        assert m1["uq"]["summary"][key] == pytest.approx(would[key], rel=1e-6), key
        assert m1["uq"]["summary_uncalibrated"][key] == pytest.approx(m0["uq"]["summary"][key], rel=1e-6), key
    assert m1["uq"]["summary"]["joint_ll"]["10"] == pytest.approx(would["joint_ll"]["10"], rel=1e-6)
    assert "summary_bias" not in m1["uq"] and "summary_recalibrated" in m1["uq"]


def test_the_study_scores_bias_as_the_map_the_option_writes(run, biased):
    """The calibration study's ``bias`` score of the ``none`` run is the score of the bias run's std.tif, and its
    joint LL the one the ``none`` run recorded for the same τ."""
    scores = score_run(run, "bias")
    assert scores["tau"] == pytest.approx(_metrics(biased)["uq"]["calibration"]["tau"], rel=1e-9)
    std = tifffile.imread(biased / rf.STD_NAME).astype(np.float64)
    roi = inner_square_roi(std.shape)
    err = tifffile.imread(run / rf.RECONSTRUCTION_NAME) - tifffile.imread(run / rf.GROUND_TRUTH_NAME)
    err, std = err.astype(np.float64)[roi], std[roi]
    assert scores["marginal_ll"] == pytest.approx(np.mean(-0.5 * np.log(2 * np.pi * std**2) - 0.5 * (err / std) ** 2))
    assert scores["joint_ll_10"] == _metrics(run)["uq"]["summary_bias"]["joint_ll"]["10"]
    assert scores["k"] is None and scores["bias"] is None  # the bias entry compares with the posterior's map


@pytest.mark.slow
def test_the_default_auto_applies_bias_where_the_scan_has_unused_angles(run, biased, tmp_path):
    """``uq.calibration: auto`` (the default) is ``bias`` when the held-out check runs: the same std.tif as an
    explicit ``bias``, bit for bit, and metrics.json records the setting beside the mode it resolved to."""
    copy = shutil.copytree(run, tmp_path / "bias")
    state = restored_state(copy, "uq.calibration=bias")
    phase_uq(state)
    cal, auto = state.metrics["uq"]["calibration"], _metrics(biased)["uq"]["calibration"]
    assert cal["mode"] == auto["mode"] == "bias" and (cal["setting"], auto["setting"]) == ("bias", "auto")
    assert cal["tau"] == auto["tau"]
    assert np.array_equal(tifffile.imread(copy / rf.STD_NAME), tifffile.imread(biased / rf.STD_NAME))


@pytest.mark.slow
def test_the_default_auto_is_none_without_unused_angles(biased, tmp_path):
    """Every angle used: no held-out check, so ``auto`` leaves the posterior's map (the bias run's
    std_uncalibrated.tif goes), with no warning. (Every 6th detector column keeps the run's 512 measurements.)"""
    out = shutil.copytree(biased, tmp_path / "all")
    state = restored_state(out, "data.angular_subsampling=1", "data.detector_subsampling=6")
    phase_uq(state)
    assert state.metrics["uq"]["calibration"] == {"mode": "none", "setting": "auto", "k": None}
    assert "heldout_skipped" in state.metrics["uq"] and not (out / rf.STD_UNCALIBRATED_NAME).exists()
    assert state.warnings == []


def test_auto_resolves_by_the_check_and_the_prior():
    """``auto``: nothing without a held-out check; the bias model for the g-prior (and the isotropic prior); the
    global ``k`` for TV-PredCP, whose posterior is too narrow everywhere (docs/calibration.md): each prior class says
    which (``auto_calibration``); an explicit value is kept as it is."""
    for prior, want in (("gprior", "bias"), ("isotropic", "bias"), ("tv_predcp", "heldout")):
        preferred = auto_calibration(prior)
        assert preferred == want
        assert resolve_calibration("auto", checked=False, preferred=preferred) == "none"
        assert resolve_calibration("auto", checked=True, preferred=preferred) == want
        for value in ("none", "heldout", "bias"):
            assert resolve_calibration(value, checked=True, preferred=preferred) == value


@pytest.mark.slow
def test_tau_zero_leaves_the_posterior_std_bit_for_bit(run, tmp_path, monkeypatch):
    """τ = 0 (the fit found no room for a bias): ``std.tif`` is the posterior's, bit for bit, and so are its scores."""
    fit = BiasModel.fit

    def no_room(rows, reconstruction=None):  # the bias fit at the lower end of its range: τ = 0, no s.e.
        return BiasModel(0.0, fit(rows, reconstruction).mask)

    monkeypatch.setattr(BiasModel, "fit", staticmethod(no_room))
    copy = shutil.copytree(run, tmp_path / "zero")
    state = restored_state(copy, "uq.calibration=bias")
    phase_uq(state)
    m = state.metrics
    assert m["uq"]["calibration"]["tau"] == 0.0 and m["uq"]["calibration"]["tau_se"] is None
    std, raw = tifffile.imread(copy / rf.STD_NAME), tifffile.imread(copy / rf.STD_UNCALIBRATED_NAME)
    assert np.array_equal(std, raw) and np.array_equal(raw, tifffile.imread(run / rf.STD_NAME))
    assert m["uq"]["summary"] == m["uq"]["summary_uncalibrated"]


def test_bad_calibration_value_names_the_key_and_bias(capsys):
    assert main(["reconstruct", "--no-uq", "--set", "uq.calibration=biased"]) == 2
    err = capsys.readouterr().err.strip()
    assert "uq.calibration" in err and "bias" in err and "\n" not in err


def _strip_bias_weight(folder):
    path = folder / rf.HELDOUT_ROWS_NAME
    with np.load(path) as z:
        kept = {k: z[k] for k in z.files}
    weight = kept.pop("bias_weight")
    with open(path, "wb") as fh:
        np.savez(fh, **kept)
    return weight


def test_rows_without_bias_weights_are_rescored_without_the_bias_model(run, tmp_path, capsys):
    """Rows without ``bias_weight`` (a file from before the bias model: regenerated, not upgraded): ``ctuq uq RUN
    --check`` rescores them without the bias model (no ``bias`` in heldout.json, the file left as it is), and the
    study refuses ``uq.calibration = bias`` on them in one line naming the run."""
    copy = tmp_path / "old"
    shutil.copytree(run, copy)
    _strip_bias_weight(copy)
    before = (copy / rf.HELDOUT_ROWS_NAME).read_bytes()
    assert main(["uq", str(copy), "--check", "--no-progress"]) == 0
    assert "held-out check on" in capsys.readouterr().out
    rep = json.loads((copy / rf.HELDOUT_NAME).read_text())
    assert "bias" not in rep and rep["scale"]["k"] == _metrics(run)["uq"]["heldout"]["scale"]["k"]
    assert (copy / rf.HELDOUT_ROWS_NAME).read_bytes() == before
    assert "bias" not in heldout_rows(copy).report
    with pytest.raises(StudyError, match="uq.calibration = bias cannot be fitted") as err:
        score_run(copy, "bias")
    assert str(copy) in str(err.value) and "\n" not in str(err.value)


def test_biased_moments_add_the_variance_on_every_diagonal_only():
    """The added sums equal those of one sample per pixel (``sqrt(k v_j)`` at pixel ``j``): exact, seed 0."""
    gen = torch.Generator().manual_seed(0)
    shape, sizes = (23, 29), [1, 2, 3, 7]
    moments = SampleMoments(shape, patch_sizes=sizes).update(torch.randn(40, *shape, generator=gen))
    var = torch.rand(shape, generator=gen, dtype=torch.float64) * (torch.rand(shape, generator=gen) > 0.3)
    out = biased_moments(moments, var)
    ref = SampleMoments(shape, patch_sizes=sizes)
    ref.update(torch.diag((40 * var).sqrt().reshape(-1)).reshape(-1, *shape))
    a, b, r = moments.state_dict(), out.state_dict(), ref.state_dict()
    assert out.n_samples == moments.n_samples == 40
    torch.testing.assert_close(out.variance(), moments.variance() + var, rtol=0, atol=1e-12)
    for p in a["patch_sums"]:
        torch.testing.assert_close(b["patch_sums"][p], a["patch_sums"][p] + r["patch_sums"][p], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="variance must be"):
        biased_moments(moments, -var)
