"""Classification metrics (ctuq.metrics.classification) on hand-computable examples."""

import math

import numpy as np
import pytest
import torch

from ctuq.metrics import (
    accuracy,
    brier_score,
    classification_summary,
    expected_calibration_error,
    joint_log_likelihood,
    joint_log_likelihoods,
    nll,
    paired_bootstrap,
    reliability_diagram,
)


def test_nll_accuracy_brier_by_hand():
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.5, 0.5, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1])
    assert nll(p, y) == pytest.approx(-(math.log(0.7) + math.log(0.3) + math.log(0.5)) / 3)
    assert accuracy(p, y) == pytest.approx(1 / 3)  # ties go to the first class (argmax)
    brier = ((0.3**2 + 0.2**2 + 0.1**2) + (0.1**2 + 0.7**2 + 0.6**2) + (0.5**2 + 0.5**2)) / 3
    assert brier_score(p, y) == pytest.approx(brier)
    assert brier_score(np.eye(3), [0, 1, 2]) == 0.0 and nll(np.eye(3), [0, 1, 2]) == 0.0
    with pytest.raises(ValueError, match="labels must lie in 0..2"):
        nll(p, torch.tensor([0, 1, 3]))


def test_ece_uses_15_equal_width_bins():
    # confidences 0.95 (right) and 0.65 (wrong) and 0.65 (right): bins (14/15, 1] and (9/15, 10/15]
    p = torch.tensor([[0.95, 0.05], [0.65, 0.35], [0.35, 0.65]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1])
    d = reliability_diagram(p, y)
    assert d["count"].sum() == 3 and d["count"][14] == 1 and d["count"][9] == 2
    assert d["accuracy"][9] == pytest.approx(0.5) and d["confidence"][9] == pytest.approx(0.65)
    expected = (1 / 3) * abs(1 - 0.95) + (2 / 3) * abs(0.5 - 0.65)
    assert expected_calibration_error(p, y) == pytest.approx(expected)
    assert expected_calibration_error(p, y, n_bins=1) == pytest.approx(abs(2 / 3 - (0.95 + 0.65 + 0.65) / 3))


def test_joint_log_likelihood_of_tuples():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (50,), generator=g)
    one = torch.log_softmax(torch.randn(1, 50, 4, generator=g, dtype=torch.float64), -1)
    # a point estimate: κ = 1 is the mean log-likelihood (up to the sampling of tuples), for every κ the mean of
    # the tuple members' log-likelihoods
    marginal = float(one[0, torch.arange(50), y].mean())
    assert joint_log_likelihood(one, y, 1, n_tuples=200000) == pytest.approx(marginal, abs=0.01)
    assert joint_log_likelihood(one, y, 7, n_tuples=200000) == pytest.approx(marginal, abs=0.01)
    # two samples that disagree on which points are right: joint of a repeated point > product of marginals
    lp = torch.log(torch.tensor([[[0.9, 0.1]], [[0.1, 0.9]]], dtype=torch.float64))  # S=2, N=1
    label = torch.tensor([0])
    assert joint_log_likelihood(lp, label, 1) == pytest.approx(math.log(0.5))
    assert joint_log_likelihood(lp, label, 2) == pytest.approx(math.log((0.81 + 0.01) / 2) / 2)
    out = joint_log_likelihoods(one, y, kappas=[1, 2], n_tuples=100, seed=3)
    assert set(out) == {1, 2} and out == joint_log_likelihoods(one, y, kappas=[1, 2], n_tuples=100, seed=3)
    with pytest.raises(ValueError, match="sampling must be one of"):
        joint_log_likelihood(one, y, 2, sampling="triadic")


def test_classification_summary_keys():
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(8, 30, 3, generator=g, dtype=torch.float64), -1)
    y = torch.randint(0, 3, (30,), generator=g)
    s = classification_summary(lp.exp().mean(0), y, lp, kappas=range(1, 4))
    assert set(s) == {"nll", "accuracy", "ece", "brier", "joint_ll"} and set(s["joint_ll"]) == {1, 2, 3}


def _two_predictives(n=120, seed=3):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.distributions.Categorical(logits=logits).sample()  # labels drawn from p: p is calibrated
    p = torch.softmax(logits, 1)
    q = torch.softmax(2.5 * logits, 1)  # over-confident
    return p, q, y


@pytest.mark.parametrize("block", [2**22, 7 * 120])  # one block, and blocks of 7 resamples (the last one short)
def test_paired_bootstrap_matches_a_loop_over_resampled_test_sets(block, monkeypatch):
    # reference: the same resamples (one default_rng(seed).integers call), each scored by nll() and
    # expected_calibration_error() on its own resampled test set
    import ctuq.metrics.classification as cm

    monkeypatch.setattr(cm, "_BOOTSTRAP_BLOCK", block)
    p, q, y = _two_predictives()
    out = paired_bootstrap(p, q, y, n_resamples=300, seed=7)
    idx = np.random.default_rng(7).integers(0, len(y), size=(300, len(y)))
    for metric, f in (("nll", nll), ("ece", expected_calibration_error)):
        diffs = np.array([f(p[i], y[i]) - f(q[i], y[i]) for i in idx])
        assert out[metric]["difference"] == pytest.approx(f(p, y) - f(q, y), abs=1e-12)
        assert out[metric]["interval_95"] == pytest.approx(tuple(np.percentile(diffs, [2.5, 97.5])), abs=1e-12)
        assert out[metric]["p_better"] == pytest.approx(float((diffs < 0).mean()))
    # the calibrated predictive beats the over-confident one on NLL in (nearly) every resample
    assert out["nll"]["difference"] < 0 and out["nll"]["p_better"] > 0.95 and out["nll"]["interval_95"][1] < 0


def test_paired_bootstrap_of_a_predictive_with_itself_is_zero_and_errors_name_the_shape():
    p, _, y = _two_predictives()
    out = paired_bootstrap(p, p, y, n_resamples=50)
    assert out["n"] == len(y) and out["n_resamples"] == 50
    for metric in ("nll", "ece"):
        assert out[metric]["difference"] == 0.0 and out[metric]["interval_95"] == (0.0, 0.0)
        assert out[metric]["p_better"] == 0.0
    with pytest.raises(ValueError, match=r"one shape, got \(120, 4\) and \(120, 3\)"):
        paired_bootstrap(p, p[:, :3] / p[:, :3].sum(1, keepdim=True), y.clamp_max(2))
    with pytest.raises(ValueError, match="n_resamples must be a positive int, got 0"):
        paired_bootstrap(p, p, y, n_resamples=0)
    with pytest.raises(ValueError, match="paired_bootstrap: n_bins must be a positive int, got 0"):
        paired_bootstrap(p, p, y, n_bins=0)
