"""scripts/benchmark_peers.py without deepinv (not a dependency): its scores of a posterior against known answers,
its table, and the one-line error when deepinv is missing. The chain itself is measured by running the script."""

import sys

import numpy as np
import pytest
from tiny import load_script


def _script():
    return load_script("benchmark_peers")


def _disc(seed=0, n=96):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:n, :n]
    gt = 0.04 * (np.hypot(yy - n / 2, xx - n / 2) < 0.45 * n)
    std = 1e-3 * np.exp(0.5 * rng.standard_normal((n, n)))
    return gt, std, gt + std * rng.standard_normal((n, n))


def test_scores_of_a_calibrated_posterior_and_of_one_too_narrow():
    """Errors drawn from the map itself (seed 0, ~2 300 inner-square pixels): coverage@0.9 0.90 ± 0.02, right scale
    1 ± 0.05, ENCE below 0.1, LL above the constant-std oracle's; the same map halved is seen as too narrow."""
    peers = _script()
    gt, std, mean = _disc()
    good, narrow = peers.scores(gt, mean, std), peers.scores(gt, mean, std / 2)
    assert good["coverage_0.9"] == pytest.approx(0.9, abs=0.02) and good["right_scale"] == pytest.approx(1, abs=0.05)
    assert good["ence"] < 0.1 and good["marginal_ll"] > good["oracle_ll"] and len(good["decile_coverage"]) == 10
    assert narrow["right_scale"] == pytest.approx(2 * good["right_scale"]) and narrow["ence"] > 0.8
    assert good["psnr"] == narrow["psnr"] > 30
    row = {**good, "seconds": 12.0}
    text = peers.table([{"run": "runs/x", "rows": {"ctuq (std.tif)": row}}])
    assert "| runs/x | ctuq (std.tif) |" in text and f"{good['coverage_0.9']:.3f}" in text


def test_without_deepinv_the_script_says_how_to_install_it(monkeypatch):
    peers = _script()
    monkeypatch.setitem(sys.modules, "deepinv", None)  # import deepinv → ImportError, whether installed or not
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the torchvision stand-in stays in this test
    with pytest.raises(SystemExit, match="deepinv is not installed"):
        peers.import_deepinv()


def test_a_folder_that_is_not_a_finished_run_is_named(tmp_path, monkeypatch, capsys):
    peers = _script()
    monkeypatch.setattr(peers, "import_deepinv", lambda: None)  # the check comes before any chain
    with pytest.raises(SystemExit, match=r"metrics\.json: cannot read the run's metrics"):
        peers.main([str(tmp_path)])
    with pytest.raises(SystemExit):
        peers.main([str(tmp_path), "--iterations", "3"])
    assert "--iterations must be at least 10, got 3" in capsys.readouterr().err
