"""The held-out bias variance τ² (:func:`ctuq.calibration.bias.fit_bias_variance`, the bias model's fit and its entry
in the check's report): var_i = v_i + τ² w_i + σ²_i."""

import math

import numpy as np
import pytest

from ctuq.calibration import BiasModel, HeldoutRows, bias
from ctuq.calibration.bias import fit_bias_variance
from ctuq.metrics.heldout import heldout_check


def _rows(tau: float, seed: int, m: int = 80000):
    """Rows drawn from the model: v, w, σ² of the size of a CT check's (image share ~0.2, a bias that doubles the
    image part on the rows through the object, half the rows outside it: w = 0)."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 1.5, m) * 2e-4
    w = np.where(rng.random(m) < 0.5, rng.uniform(5.0, 15.0, m), 0.0)  # mm² per (mm⁻¹)²
    s2 = np.full(m, 6e-4)
    r = rng.normal(0.0, np.sqrt(v + tau * tau * w + s2))
    groups = np.repeat(np.arange(m // 50), 50)
    return r, v, s2, w, groups


@pytest.mark.slow
def test_a_known_bias_std_is_recovered():
    """Seed 3, τ = 4e-3 mm⁻¹, 80000 rows: τ² w is 0.08–0.26 of a row's variance on the object's rows (as on the
    300-angle CT run), and the fit's s.e. of τ is ~2 % (curvature and bootstrap); the tolerance, 10 %, is 5 s.e.,
    and the 95 % bootstrap interval must hold τ."""
    tau = 4e-3
    r, v, s2, w, g = _rows(tau, seed=3)
    fit = fit_bias_variance(r, v, s2, w, groups=g, n_bootstrap=50, seed=0)
    assert not fit["zero"] and not fit["at_upper_bound"]
    assert fit["tau"] == pytest.approx(tau, rel=0.10)
    assert fit["se_curvature"] < 0.03 * tau
    lo, hi = fit["interval_95"]
    assert lo < tau < hi
    assert 0.0 < fit["bias_variance_fraction"] < 0.3


def test_no_bias_in_the_rows_gives_a_small_or_zero_tau():
    """Seed 4, τ = 0: the estimate is 0 (no room) or below 1e-3 mm⁻¹ (τ² w then under 2 % of σ²), and a posterior
    that already explains the rows keeps its LL."""
    r, v, s2, w, g = _rows(0.0, seed=4)
    fit = fit_bias_variance(r, v, s2, w, groups=g, n_bootstrap=0)
    assert fit["zero"] or fit["tau"] < 1e-3
    base = heldout_check(r, np.zeros_like(r), variance=v, noise_variance=s2, groups=g, n_bootstrap=0)
    assert fit["log_likelihood"] >= base["log_likelihood"] - 1e-12  # τ = 0 is in the searched family


def test_residuals_smaller_than_predicted_give_zero():
    """Rows with half the predicted variance leave no room for a bias: τ = 0 exactly, no s.e."""
    r, v, s2, w, g = _rows(0.0, seed=5)
    fit = fit_bias_variance(r * math.sqrt(0.5), v, s2, w, groups=g, n_bootstrap=10)
    assert fit["zero"] and fit["tau"] == 0.0 and fit["se_bootstrap"] is None and fit["bias_variance_fraction"] == 0.0


def test_the_check_reports_the_bias_only_for_rows_with_weights(monkeypatch):
    """The bias model writes its entry (``bias``) into the scored rows' report and fits itself from the same rows,
    with the rows' bootstrap: the same τ and s.e., from one fit (the bootstrap runs once per rows; new weights or
    bootstrap settings fit again); rows without bias weights get neither."""
    r, v, s2, w, g = _rows(4e-3, seed=6, m=4000)
    rows = HeldoutRows(r, v, s2, g, bias_weight=w)
    calls = []
    monkeypatch.setattr(bias, "fit_bias_variance", lambda *a, **k: calls.append(k) or fit_bias_variance(*a, **k))
    rep = rows.score(n_bootstrap=20, seed=3)
    alone = fit_bias_variance(r, v, s2, w, groups=g, n_bootstrap=20, seed=3)
    assert rep["bias"] == alone and "bias" not in heldout_check(r, np.zeros_like(r), variance=v, noise_variance=s2)
    fitted = BiasModel.fit(rows, np.ones((4, 4)))
    assert fitted.tau == alone["tau"] and fitted.tau_se == alone["se_bootstrap"]
    assert fitted.tau_interval_95 == alone["interval_95"]
    assert len(calls) == 1
    rows.seed = 4
    assert BiasModel.fit(rows, np.ones((4, 4))).tau_se != fitted.tau_se and len(calls) == 2
    rows.bias_weight = 2.0 * w
    assert BiasModel.fit(rows, np.ones((4, 4))).tau == pytest.approx(alone["tau"] / math.sqrt(2.0), rel=1e-6)
    without = HeldoutRows(r, v, s2, g)
    assert "bias" not in without.score(n_bootstrap=0) and BiasModel.fit(without, np.ones((4, 4))) is None


def test_an_empty_object_mask_gives_no_bias_instead_of_an_error():
    r, v, s2, _w, g = _rows(4e-3, seed=8, m=400)
    out = fit_bias_variance(r, v, s2, np.zeros(400), groups=g, n_bootstrap=0)
    assert out["tau"] == 0.0 and out["zero"] and out["empty_mask"] and out["bias_variance_fraction"] == 0.0
    u = v + s2  # the posterior's own predictive, untouched
    assert out["log_likelihood"] == pytest.approx(float(np.mean(-0.5 * (np.log(2 * np.pi * u) + r * r / u))))


@pytest.mark.parametrize(
    "weights, fragment",
    [
        (np.ones(10), "bias_weight must be (100,)"),
        (-np.ones(100), "≥ 0"),
        (np.full(100, np.nan), "finite"),
    ],
)
def test_bad_bias_weights_name_the_argument(weights, fragment):
    r, v, s2, _w, _g = _rows(0.0, seed=7, m=100)
    with pytest.raises(ValueError, match="fit_bias_variance: bias_weight") as err:
        fit_bias_variance(r, v, s2, weights)
    assert fragment in str(err.value)
