"""error_localisation and the contrast scores (ENCE, reliability, the calibrated reference Spearman, the power fit):
whether a std map points at the errors by the right amount, against maps whose answer is known."""

import numpy as np
import pytest

from ctuq.metrics.calibration import (
    OBJECT_FRACTION,
    calibrated_spearman,
    error_localisation,
    power_fit,
    reliability,
)


def _scene(seed=0, n=40):
    """A disc object (ground truth 1 inside, 0 outside) and errors that grow from its centre."""
    yy, xx = np.mgrid[:n, :n]
    r = np.hypot(yy - n / 2, xx - n / 2)
    gt = (r < n / 3).astype(np.float64)
    err = 0.01 + 0.1 * r / r.max() + 1e-4 * np.random.default_rng(seed).random((n, n))
    return gt, err


def test_a_map_that_ranks_like_the_errors_scores_one_and_a_flat_one_chance():
    gt, err = _scene()
    perfect = error_localisation(err, err, gt)
    assert perfect["spearman_inside"] == pytest.approx(1.0) and perfect["auc_top10"] == pytest.approx(1.0)
    # brighter on the object, flat inside it: perfect-looking over the image, nothing inside the object
    plateau = error_localisation(0.05 + 0.05 * gt, err, gt)
    assert plateau["spearman_inside"] is None and plateau["auc_top10"] == pytest.approx(0.5)
    assert plateau["object_fraction"] == pytest.approx(float((gt > OBJECT_FRACTION).mean()))


def test_conditional_coverage_sees_a_map_too_narrow_in_its_brightest_pixels():
    gt, err = _scene(1)
    std = err / 1.645 * 1.2  # every interval 20 % wider than the error: covers everywhere
    inside = gt > OBJECT_FRACTION
    top = inside & (std >= np.quantile(std[inside], 0.9))
    err_bad = np.where(top, 3.0 * err, err)  # the brightest tenth's errors 3 × what its std allows
    good = error_localisation(std, err, gt)["conditional_coverage_0.9"]
    bad = error_localisation(std, err_bad, gt)["conditional_coverage_0.9"]
    assert len(good) == 10 and min(good) == 1.0
    # right on average over the object, wrong where brightest (one pixel of the tenth spills into decile 9)
    assert bad[:8] == [1.0] * 8 and bad[8] > 0.95 and bad[-1] == 0.0


def test_shapes_are_checked():
    gt, err = _scene()
    with pytest.raises(ValueError, match="abs_error"):
        error_localisation(err, err[:-1], gt)


def _calibrated(seed=0, n=150, spread=0.5):
    """A disc object and a std map with ``sd(ln std) = spread`` whose errors are exactly as large as it says
    (``|e| = std·|z|``, ``z ~ N(0, 1)``)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:n, :n]
    gt = (np.hypot(yy - n / 2, xx - n / 2) < 0.45 * n).astype(np.float64)
    std = 1e-3 * np.exp(spread * rng.standard_normal((n, n)))
    return gt, std, std * np.abs(rng.standard_normal((n, n)))


def test_a_calibrated_map_has_small_ence_and_a_spearman_ratio_of_one():
    # seed 0, ~14 000 object pixels: each decile's RMSE has a relative s.e. of about 2 %, so ENCE ≈ 0.02
    gt, std, err = _calibrated()
    out = error_localisation(std, err, gt)
    assert out["ence"] < 0.05
    assert out["spearman_ratio"] == pytest.approx(1.0, abs=0.08)
    # the ceiling of DESIGN.md §8: sd(ln std) = 0.5 caps a perfect map's Spearman at about 0.45
    assert out["spearman_reference"] == pytest.approx(0.45, abs=0.03)
    rmv, rmse = np.array(out["reliability"]["rmv"]), np.array(out["reliability"]["rmse"])
    assert rmv.shape == (10,) and np.all(np.diff(rmv) > 0) and np.allclose(rmse / rmv, 1.0, atol=0.1)


def test_a_too_flat_map_is_seen_by_ence_and_the_ratio_not_by_spearman():
    gt, std, err = _calibrated(1)
    # the same ranking with a third of the contrast, rescaled to the same mean variance: Spearman cannot tell
    flat = std**0.33
    flat *= np.sqrt(np.mean(std[gt > 0] ** 2) / np.mean(flat[gt > 0] ** 2))
    good, bad = error_localisation(std, err, gt), error_localisation(flat, err, gt)
    assert bad["spearman_inside"] == pytest.approx(good["spearman_inside"])
    assert bad["ence"] > 0.25 > 0.05 > good["ence"]
    assert bad["spearman_ratio"] > 2.0  # too flat
    # the reliability line is steeper than the diagonal: the dark bins over-cover, the bright ones under-cover
    rmv, rmse = np.array(bad["reliability"]["rmv"]), np.array(bad["reliability"]["rmse"])
    assert rmse[0] < rmv[0] and rmse[-1] > rmv[-1]


def test_reliability_matches_a_hand_computation_and_names_bad_input():
    std = np.repeat([1.0, 2.0], 4).reshape(2, 4)
    err = np.array([[1, 1, 1, 1], [4, 4, 0, 0]], dtype=np.float64)
    rel = reliability(std, err, bins=2)
    # bin 1: RMV 1, RMSE 1; bin 2: RMV 2, RMSE sqrt(8) → ENCE (0 + (√8 − 2)/2) / 2
    assert np.allclose(rel.rmv, [1, 2]) and np.allclose(rel.rmse, [1, np.sqrt(8)])
    assert rel.ence == pytest.approx((np.sqrt(8) - 2) / 4)
    with pytest.raises(ValueError, match="fewer than bins=10"):
        reliability(std, err)
    with pytest.raises(ValueError, match="std"):
        reliability(std[:, :3], err, bins=2)
    with pytest.raises(ValueError, match="bins must be a positive int"):
        reliability(std, err, bins=0)


def test_the_calibrated_reference_is_seeded_and_none_for_a_constant_map():
    _, std, _ = _calibrated(2, n=60)
    assert calibrated_spearman(std, seed=3) == calibrated_spearman(std, seed=3)
    assert calibrated_spearman(np.full((8, 8), 0.1)) is None
    with pytest.raises(ValueError, match="draws must be a positive int"):
        calibrated_spearman(std, draws=0)


def test_power_fit_recovers_the_power_of_a_map_whose_errors_follow_its_square():
    gt, std, err = _calibrated(3)
    shown = 3.0 * np.sqrt(std)  # the errors follow shown² / 9: γ = 2, c = 1/9
    fit = power_fit(shown, err, gt > 0)
    assert fit["gamma"] == pytest.approx(2.0, abs=0.1)
    assert fit["c"] * np.mean(shown[gt > 0] ** fit["gamma"]) == pytest.approx(np.mean(std[gt > 0]), rel=0.05)
    assert fit["ence"] < 0.05
    with pytest.raises(ValueError, match="std must be finite and > 0"):
        power_fit(np.zeros((8, 8)), np.ones((8, 8)))
