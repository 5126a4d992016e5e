"""The calibration-method contract (:class:`ctuq.testing.CalibrationContract`) over every registered method, the
registry (:data:`ctuq.registry.CALIBRATIONS`) and what ``uq.calibration = auto`` resolves to."""

import math

import numpy as np
import pytest

from ctuq.calibration import (
    BiasModel,
    CalibrationMethod,
    HeldoutRows,
    HeldoutScale,
    NoCalibration,
    SpatialBias,
    fit_linear_variance,
    resolve_calibration,
)
from ctuq.config import ConfigError, load_config
from ctuq.config.engine import describe
from ctuq.registry import CALIBRATIONS
from ctuq.testing import CalibrationCase, CalibrationContract, synthetic_heldout_rows


def disk(n: int = 24) -> np.ndarray:
    """A reconstruction: a disk of 0.05 mm⁻¹ on an empty background (its object mask is the disk)."""
    yy, xx = np.mgrid[:n, :n]
    return 0.05 * (((yy - (n - 1) / 2) ** 2 + (xx - (n - 1) / 2) ** 2) < (n / 3) ** 2).astype(np.float64)


def spatial_rows(w_object: float = 1e-5, w_edges: float = 2e-5, m: int = 40000, seed: int = 4) -> HeldoutRows:
    """Rows drawn from the spatial model with a known answer: ``r_i ~ N(0, v_i + σ² + w_object W_oi + w_edges W_ei)``
    (the object's weights on half the rows, the edges' on a third; no widening of the posterior), with the maps of
    :func:`disk`'s reconstruction."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 1.5, m) * 2e-4
    w_obj = np.where(rng.random(m) < 0.5, rng.uniform(5.0, 15.0, m), 0.0)
    w_edge = np.where(rng.random(m) < 1 / 3, rng.uniform(0.0, 20.0, m), 0.0)
    r = rng.normal(0.0, np.sqrt(v + 6e-4 + w_object * w_obj + w_edges * w_edge))
    maps = SpatialBias.image_features(disk())
    weights = {"spatial_object": w_obj, "spatial_edges": w_edge}
    meta = {"n_samples": 256, "n_angles": 400, "n_used_angles": 400, "noise_model": "homoscedastic"}
    groups = np.repeat(np.arange(400), m // 400)
    return HeldoutRows(r, v, 6e-4, groups, meta=meta, features=maps, feature_weights=weights)


# One case per built-in method; 40000 synthetic rows (seed 0) with the answer known. The s.e. of k and of τ there is
# about 2-4 % (curvature; test_heldout.py, test_heldout_bias.py), so 10 % is at least 2.5 s.e.
CASES = {
    "none": lambda: CalibrationCase(NoCalibration, synthetic_heldout_rows(k=2.0), disk()),
    "heldout": lambda: CalibrationCase(HeldoutScale, synthetic_heldout_rows(k=2.0), disk(), {"k": 2.0}, 0.10),
    "bias": lambda: CalibrationCase(BiasModel, synthetic_heldout_rows(tau=4e-3), disk(), {"tau": 4e-3}, 0.10),
    # two weights fitted at once from 40000 rows: 20 % (their s.e. there is about 7 %, seed 4)
    "spatial": lambda: CalibrationCase(SpatialBias, spatial_rows(), disk(), {"w_object": 1e-5, "w_edges": 2e-5}, 0.2),
}


class TestNone(CalibrationContract):
    def make_case(self):
        return CASES["none"]()


class TestHeldoutScale(CalibrationContract):
    def make_case(self):
        return CASES["heldout"]()


class TestBiasModel(CalibrationContract):
    def make_case(self):
        return CASES["bias"]()


class TestSpatialBias(CalibrationContract):
    def make_case(self):
        return CASES["spatial"]()


def test_a_method_without_row_variances_is_abstract_and_refused_by_the_registry():
    """``row_variance`` is part of the model a method owns: a class without it cannot be made, nor registered (it
    would fail only when ``ctuq design`` scores a row with it)."""

    class NoRows(HeldoutScale):
        name = "no_rows"
        row_variance = CalibrationMethod.row_variance  # the abstract one: not implemented

    with pytest.raises(TypeError, match="abstract"):
        NoRows(1.0)
    with pytest.raises(TypeError, match="NoRows is abstract: it does not implement row_variance"):
        CALIBRATIONS.register(NoRows)
    assert "no_rows" not in CALIBRATIONS


def test_the_parametric_methods_share_one_maximum_likelihood_fit():
    """k, τ and the spatial weights are :func:`fit_linear_variance` with their own base and columns: the methods'
    numbers are the helper's, bit for bit."""
    rows = synthetic_heldout_rows(k=1.5, tau=3e-3, m=8000, n_groups=80)
    rows.n_bootstrap = 0
    r, v, s2, w = rows.residual, rows.variance, rows.noise_variance, rows.bias_weight
    theta, info = fit_linear_variance(r, s2, v[:, None])
    assert HeldoutScale.fit(rows, disk()).k == info["k"] and theta[0] == info["k"] ** 2
    unit = float(np.mean(v + s2)) / float(np.mean(w))
    _, info = fit_linear_variance(r, v + s2, (w * unit)[:, None])
    assert BiasModel.fit(rows, disk()).tau == info["k"] * math.sqrt(unit)
    srows = spatial_rows()
    cols = np.stack(
        [srows.variance, srows.feature_weights["spatial_object"], srows.feature_weights["spatial_edges"]], 1
    )
    theta, info = fit_linear_variance(srows.residual, srows.variance + srows.noise_variance, cols)
    fitted = SpatialBias.fit(srows, disk())
    assert [fitted.w_posterior, fitted.weights["object"], fitted.weights["edges"]] == theta.tolist()
    assert info["converged"] and np.isfinite(info["log_likelihood"])
    with pytest.raises(ValueError, match="no bootstrap for 3 columns"):
        fit_linear_variance(srows.residual, srows.noise_variance, cols, n_bootstrap=10)


def test_the_spatial_model_gives_no_weight_to_a_term_the_rows_do_not_show():
    fitted = SpatialBias.fit(spatial_rows(w_object=1e-5, w_edges=0.0), disk())
    assert fitted.weights["edges"] < 0.1 * fitted.weights["object"]
    assert fitted.w_posterior < 0.05


def test_every_built_in_method_has_a_contract_case_in_registration_order():
    built_in = [name for name, cls in CALIBRATIONS.items() if cls.__module__.startswith("ctuq.")]
    assert built_in == list(CASES) == ["none", "heldout", "bias", "spatial"]
    assert CALIBRATIONS.choices()[:5] == ("auto", "none", "heldout", "bias", "spatial")
    # the keys metrics.json has always had for the scores of the methods not applied
    assert HeldoutScale.summary_name() == "summary_recalibrated" and BiasModel.summary_name() == "summary_bias"


def test_every_registered_method_is_a_value_of_both_options_and_in_the_help():
    """``uq.calibration`` and ``design.calibration`` take their values from the registry (``auto`` only the first),
    and the help of ``uq.calibration`` (``--config-keys``) lists every method with its summary."""
    helps = {key: text for key, _value, text in describe(load_config("demo"))}
    for name, method in CALIBRATIONS.items():
        assert f"{name}: {method.summary}" in helps["uq.calibration"]
        assert load_config("demo", [f"design.calibration={name}"]).design.calibration == name
    with pytest.raises(ConfigError, match=r"design.calibration must be one of \['none', 'heldout', 'bias', 'spatial'"):
        load_config("demo", ["design.calibration=auto"])


def test_auto_resolves_by_the_check_and_the_preferred_method():
    """``auto``: nothing without a held-out check; else the method the prior prefers; an explicit value is kept as
    it is; an unknown one is refused naming the valid values."""
    for preferred in ("bias", "heldout"):
        assert resolve_calibration("auto", checked=False, preferred=preferred) == "none"
        assert resolve_calibration("auto", checked=True, preferred=preferred) == preferred
        for value in ("none", "heldout", "bias"):
            assert resolve_calibration(value, checked=True, preferred=preferred) == value
    with pytest.raises(ValueError, match=r"uq.calibration must be one of \['auto', 'none', 'heldout', 'bias'"):
        resolve_calibration("biased", checked=True, preferred="bias")
    with pytest.raises(ValueError, match="'tv' is not registered"):
        resolve_calibration("auto", checked=True, preferred="tv")


def test_tau_zero_and_the_identity_leave_the_map_bit_for_bit():
    std = np.random.default_rng(0).uniform(1e-3, 2e-3, (24, 24)).astype(np.float32)
    assert BiasModel(0.0, disk() > 0).apply_std(std) is std
    assert NoCalibration().apply_std(std) is std
    # τ > 0 changes the object's pixels only, and the same way from torch and numpy (one formula)
    biased = BiasModel(1e-3, disk() > 0).apply_std(std)
    assert np.array_equal(biased[disk() == 0], std[disk() == 0]) and np.all(biased[disk() > 0] > std[disk() > 0])


@pytest.mark.parametrize(
    "args, fragment",
    [((-1e-3, np.ones((4, 4))), "tau must be finite and ≥ 0"), ((1e-3, np.full((4, 4), 0.5)), "mask must be")],
)
def test_bad_bias_model_arguments_are_named(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        BiasModel(*args)


def test_a_bad_scale_is_named():
    with pytest.raises(ValueError, match="HeldoutScale: k must be positive"):
        HeldoutScale(0.0)


def test_spatial_refuses_negative_weights_and_unknown_features():
    maps = SpatialBias.image_features(disk())
    unit = {k.removeprefix("spatial_"): v for k, v in maps.items()}
    with pytest.raises(ValueError, match="finite and ≥ 0"):
        SpatialBias(0.0, {"edges": -1e-6}, unit)
    with pytest.raises(ValueError, match="without a known feature or a map"):
        SpatialBias(0.0, {"corners": 1e-6}, unit)
    assert SpatialBias.fit(None, disk()) is None  # no held-out check: nothing to fit on
