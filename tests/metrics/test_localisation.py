"""error_localisation: whether a std map points at the errors, against hand-built maps whose answer is known."""

import numpy as np
import pytest

from ctuq.metrics.calibration import OBJECT_FRACTION, error_localisation


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
