"""How many angles (``ctuq.design.forecast``, ``ctuq.design.plan``): the conditional moments of unseen rows against
dense Gaussian conditioning, the prequential check's coverage on data drawn from the model, targets with units, the
stop rule in the greedy loop (and its resume), and ``ctuq design --plan`` / ``--target-rmse`` end to end on a tiny
scan.

Sizes: 8×8 images, 12 parallel-beam candidates × 11 detector pixels, float64 (the references of test_design.py).
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from ctuq.calibration.rows import HeldoutRows
from ctuq.design.candidates import DesignError
from ctuq.design.engine import DesignEngine
from ctuq.design.forecast import (
    ErrorForecaster,
    OnlineCalibration,
    RowPredictor,
    StopRule,
    forecast_counts,
    parse_target,
)
from ctuq.design.greedy import greedy_design
from ctuq.registry import CALIBRATIONS
from tests.design.test_design import MODELS, N_ANG, K, dense_K, dense_model, op  # noqa: F401 - op is a fixture

H = 8


def _dense_conditioning(model, chosen, prior_mean, y):
    """Mean and covariance of all candidate rows given the chosen ones (dense, float64 numpy)."""
    T = model.op.matrix.toarray()
    Kx = dense_K(model).numpy()
    C_all = T @ Kx @ T.T
    rows = model.rows(chosen).numpy()
    Ctt = C_all[np.ix_(rows, rows)] + model.sigma2 * np.eye(rows.size)
    gain = C_all[:, rows] @ np.linalg.inv(Ctt)
    mean = prior_mean.reshape(-1) + gain @ (y.reshape(-1)[rows] - prior_mean.reshape(-1)[rows])
    cov = C_all - gain @ C_all[rows, :]
    return mean, cov


@pytest.mark.parametrize("kind", ["isotropic", "dense", "dense_image_space", "network"])
@pytest.mark.parametrize("route", ["exact", "sampled"])
def test_conditional_mean_and_predictive_variance_equal_dense_conditioning(op, kind, route):  # noqa: F811
    """μ = m + T K Tτᵀ Cτ⁻¹ (y_τ − m_τ) to 1e-9 on every route and factor; the predictive variance to 1e-9 on the
    exact route and, from m = 4000 samples (seed 0), to 15 % per row (its Monte-Carlo s.e. is √(2/m) ≈ 2 %)."""
    model = MODELS[kind](op)
    g = torch.Generator().manual_seed(3)
    prior_mean = torch.randn(N_ANG, K, generator=g, dtype=torch.float64)
    y = torch.randn(N_ANG, K, generator=g, dtype=torch.float64) * 2.0
    eng = DesignEngine(model, route=route, n_samples=4000, seed=0)
    eng.reset([0, 6])
    eng.acquire(3, 1)
    mean_ref, cov_ref = _dense_conditioning(model, [0, 6, 3], prior_mean.numpy(), y.numpy())
    got = eng.conditional_mean(prior_mean, y[eng.chosen])
    np.testing.assert_allclose(got.reshape(-1).numpy(), mean_ref, rtol=1e-9, atol=1e-9 * np.abs(mean_ref).max())
    part = eng.conditional_mean(prior_mean, y[eng.chosen], blocks=[5, 1])
    np.testing.assert_allclose(part.numpy(), got[[5, 1]].numpy(), rtol=1e-12, atol=1e-12)
    var = eng.predictive_variance([5, 1, 9]).numpy().reshape(-1)
    ref = np.concatenate([np.diag(cov_ref)[b * K : (b + 1) * K] for b in (5, 1, 9)])
    if route == "exact":
        np.testing.assert_allclose(var, ref, rtol=1e-9, atol=1e-12 * ref.max())
    else:
        big = ref > 0.05 * ref.max()
        np.testing.assert_allclose(var[big], ref[big], rtol=0.15)


def test_online_coverage_is_nominal_when_the_data_follow_the_model(op):  # noqa: F811
    """Data drawn from the design model itself (image from the prior, noise σ²): every acquired angle's rows,
    scored before they are used, fall in their 90 % interval at the nominal rate (all 10 acquisitions pooled over
    8 seeds, 880 rows: 0.9 ± 0.03, about 3 binomial s.e.), and the refitted scale stays near 1 (within 0.8-1.25)."""
    model = dense_model(op)
    T = torch.as_tensor(op.matrix.toarray())
    Lk = torch.linalg.cholesky(dense_K(model) + 1e-10 * torch.eye(H * H, dtype=torch.float64))
    inside, ks = [], []
    for seed in range(8):
        g = torch.Generator().manual_seed(100 + seed)
        x = Lk @ torch.randn(H * H, generator=g, dtype=torch.float64)
        y = (T @ x + model.sigma2**0.5 * torch.randn(T.shape[0], generator=g, dtype=torch.float64)).reshape(N_ANG, K)
        center = torch.zeros(H * H, dtype=torch.float64)
        recon = np.ones((H, H))  # the mask: every pixel
        fc = ErrorForecaster("heldout", recon, n_bootstrap=0)
        predictor = RowPredictor(center, y, model, fc.mask)
        eng = DesignEngine(model, route="exact")
        eng.reset([0])
        pilot = predictor.rows(eng, list(range(1, N_ANG)))
        fc.fit(pilot)
        online = OnlineCalibration(fc, pilot)
        for step, beta in enumerate([6, 3, 9, 2, 8, 4, 10, 1, 7, 5], start=1):
            rec = online.score(predictor.rows(eng, [beta]), step, 15.0 * beta)
            eng.acquire(beta, step)
        inside.append(rec["cumulative_coverage_90"])
        ks.append(fc.method.k)
    assert abs(np.mean(inside) - 0.9) <= 0.03, inside
    assert 0.8 <= np.median(ks) <= 1.25, ks


def test_forecaster_applies_the_registered_method_and_bands_it(monkeypatch):
    """The predicted RMS error is the calibrated std map's RMS inside the object mask: for the scale k,
    k × sqrt(mean_M v); the band brackets it; the bias model adds τ² inside the mask. Every registered method is a
    valid design.calibration, and the bootstrap refits are the method's own fits on the resampled rows: nothing is
    scored."""
    rng = np.random.default_rng(0)
    m = 40 * 5
    groups = np.repeat(np.arange(40), 5)
    rows = HeldoutRows(
        residual=rng.normal(size=m) * np.sqrt(2.0 * 1.0 + 0.5),
        variance=np.full(m, 1.0),
        noise_variance=0.5,
        groups=groups,
        bias_weight=np.full(m, 1.0),
    )
    recon = np.zeros((6, 6))
    recon[1:5, 1:5] = 1.0

    def no_scoring(self, **kwargs):
        raise AssertionError("the forecaster scored held-out rows")

    monkeypatch.setattr(HeldoutRows, "score", no_scoring)
    fc = ErrorForecaster("heldout", recon, n_bootstrap=30, seed=1).fit(rows)
    assert len(fc.replicates) == 30
    var = np.full((6, 6), 4e-4)
    out = fc.predict(var, 12)
    assert out["rmse"] == pytest.approx(fc.method.k * 0.02, rel=1e-12)
    assert out["rmse_band"][0] <= out["rmse"] <= out["rmse_band"][1]
    assert out["rmse_band"][1] > out["rmse_band"][0]
    bias = ErrorForecaster("bias", recon, n_bootstrap=0).fit(rows)
    tau = bias.method.tau
    assert bias.predict(var, 12)["rmse"] == pytest.approx(math.sqrt(4e-4 + tau**2), rel=1e-9)
    # every registered method is offered, fits on rows with its image features' weights (as RowPredictor gives
    # them) and gives a row variance (the prequential check needs it)
    for name in CALIBRATIONS:
        each = ErrorForecaster(name, recon, n_bootstrap=3, seed=2)
        weights = {k: rng.uniform(0.5, 1.5, m) for k in each.features}
        fitted = each.fit(dataclasses.replace(rows, features=each.features, feature_weights=weights)).method
        assert fitted is not None and all(r is not None for r in each.replicates), name
        v = fitted.row_variance(dataclasses.replace(rows, feature_weights=weights))
        assert v.shape == (m,) and np.all(v >= 0.5), name  # at least the noise σ²
        assert np.isfinite(each.predict(var, 12)["rmse"]), name
    with pytest.raises(DesignError, match=r"design.calibration must be one of \['none', 'heldout', 'bias'"):
        ErrorForecaster("biased", recon)
    with pytest.raises(DesignError, match="no object"):
        ErrorForecaster("heldout", np.zeros((6, 6)))


def test_rows_concat_and_take_keep_every_array():
    a = HeldoutRows(np.arange(3.0), np.ones(3), 0.5, np.array([0, 0, 1]), bias_weight=np.full(3, 2.0))
    b = HeldoutRows(np.arange(2.0), np.ones(2), np.array([0.1, 0.2]), np.array([4, 4]), bias_weight=np.ones(2))
    c = HeldoutRows.concat([a, b])
    np.testing.assert_array_equal(c.noise_variance, [0.5, 0.5, 0.5, 0.1, 0.2])
    np.testing.assert_array_equal(c.bias_weight, [2, 2, 2, 1, 1])
    t = c.take([4, 0])
    np.testing.assert_array_equal(t.residual, [1.0, 0.0])
    np.testing.assert_array_equal(t.groups, [4, 0])
    assert HeldoutRows.concat([a, HeldoutRows(np.ones(1), np.ones(1), 1.0, np.zeros(1))]).bias_weight is None


@pytest.mark.parametrize(
    ("kind", "text", "value", "relative"),
    [
        ("rmse", "0.002/mm", 0.002, False),
        ("rmse", "2e-3 mm^-1", 0.002, False),
        ("rmse", "0.002 mm⁻¹", 0.002, False),
        ("psnr", "30dB", 30.0, False),
        ("psnr", "31.5 db", 31.5, False),
        ("min_gain", "1%", 0.01, True),
        ("min_gain", "1e-4/mm", 1e-4, False),
    ],
)
def test_targets_are_read_with_their_units(kind, text, value, relative):
    t = parse_target(kind, text)
    assert t.value == pytest.approx(value) and t.relative is relative


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("rmse", "0.002", "--target-rmse: '0.002' has no unit; give it in mm⁻¹"),
        ("rmse", "-0.002/mm", "--target-rmse: '-0.002/mm' must be positive"),
        ("rmse", "0/mm", "--target-rmse: '0/mm' must be positive"),
        ("rmse", "0.002 HU", "is not a number with a unit"),
        ("psnr", "30", "--target-psnr: '30' has no unit; give it in dB"),
        ("min_gain", "-1%", "--min-gain: '-1%' must be positive"),
    ],
)
def test_bad_targets_get_one_line_naming_the_option(kind, text, message):
    with pytest.raises(DesignError) as err:
        parse_target(kind, text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_plan_recommends_the_protocol_that_meets_the_target_with_fewer_angles():
    from ctuq.design.plan import recommend

    def curve(errors):
        return [{"rmse": e, "psnr": 20 - 20 * math.log10(e / 0.01)} for e in errors]

    planned = {
        "counts": [10, 20, 40],
        "designed": curve([4e-3, 2e-3, 1e-3]),
        "equidistant": curve([4e-3, 2.5e-3, 0.9e-3]),
    }
    # 2e-3/mm: designed at 20 angles; equidistant between 20 and 40 (log-linear: 20 + 20·ln(1.25)/ln(2.5/0.9) = 24.4)
    r = recommend(planned, parse_target("rmse", "2e-3/mm"))
    assert r["recommended"] == "designed" and r["counts"]["designed"] == pytest.approx(20.0)
    assert r["counts"]["equidistant"] == pytest.approx(20 + 20 * math.log(1.25) / math.log(2.5 / 0.9))
    assert r["reason"] == "2e-3/mm: designed 20 angles, equidistant 25 angles"
    # 0.95e-3/mm: only equidistant meets it within 40 angles
    r = recommend(planned, parse_target("rmse", "0.95e-3/mm"))
    assert r["recommended"] == "equidistant" and r["counts"]["designed"] is None
    # the same on the PSNR scale (34 dB = 2e-3 here), a tie in whole angles goes to the equidistant scan
    r = recommend(planned, parse_target("psnr", "33.98dB"))
    assert r["recommended"] == "designed" and r["counts"]["designed"] == pytest.approx(20.0, abs=0.1)
    tie = dict(planned, equidistant=curve([4e-3, 2e-3, 1e-3]))
    assert recommend(tie, parse_target("rmse", "2e-3/mm"))["recommended"] == "equidistant"
    assert recommend(planned, parse_target("rmse", "1e-5/mm"))["reason"].startswith("neither is predicted")
    # without a target: the lower predicted error at the last count, and where each is ahead
    r = recommend(planned)
    assert r["recommended"] == "equidistant" and r["ahead"] == {"designed": [20], "equidistant": [40]}
    assert r["reason"] == "predicted RMS error after 40 angles: designed 1.111 × equidistant (margin 2%)"
    # a design predicted 1 % better meets the target first but inside the margin: the equidistant scan
    close = dict(planned, equidistant=curve([4e-3, 2.02e-3, 1.01e-3]))
    r = recommend(close, parse_target("rmse", "2e-3/mm"))
    assert r["recommended"] == "equidistant" and r["counts"]["designed"] == pytest.approx(20.0)
    assert r["reason"].endswith("(the design's predicted gain is below the 2% margin)")
    assert recommend(close, parse_target("rmse", "2e-3/mm"), margin=0.005)["recommended"] == "designed"


def test_the_plan_recommends_designed_angles_only_up_to_the_trusted_count():
    """Above :func:`trusted_count` (a third of the image side) the equidistant scan is recommended however far
    ahead the plan predicts the design; at or below it the margin rule alone decides."""
    from ctuq.design.plan import recommend, recommends_designed, trusted_count

    def curve(errors):
        return [{"rmse": e, "psnr": 20 - 20 * math.log10(e / 0.01)} for e in errors]

    assert [trusted_count(s) for s in [(64, 64), (128, 128), (1, 96, 128), (32, 20), (2, 2)]] == [21, 42, 42, 10, 1]
    planned = {
        "counts": [10, 20, 40],
        "designed": curve([4e-3, 2e-3, 1e-3]),
        "equidistant": curve([4e-3, 2.5e-3, 1.2e-3]),
    }
    # 2e-3/mm: the design meets it at 20 angles (equidistant at ~25): within 21, above 19
    assert recommend(planned, parse_target("rmse", "2e-3/mm"), max_designed=21)["recommended"] == "designed"
    r = recommend(planned, parse_target("rmse", "2e-3/mm"), max_designed=19)
    assert (
        r["recommended"] == "equidistant" and r["max_designed"] == 19 and r["counts"]["designed"] == pytest.approx(20)
    )
    assert r["reason"].endswith("(designed angles are recommended up to 19 angles at this image size)")
    # without a target: the last count, 40 angles, with the design predicted 17 % ahead
    assert recommend(planned)["recommended"] == "designed" and recommend(planned)["max_designed"] is None
    r = recommend(planned, max_designed=21)
    assert r["recommended"] == "equidistant"
    assert r["reason"] == (
        "predicted RMS error after 40 angles: designed 0.833 × equidistant (margin 2%); designed angles are "
        "recommended up to 21 angles at this image size"
    )
    # a count is rounded up to whole angles before the comparison; the margin still applies below the limit
    assert recommends_designed(0.9, 1.0, 21.0, max_designed=21) and not recommends_designed(
        0.9, 1.0, 21.2, max_designed=21
    )
    assert not recommends_designed(0.99, 1.0, 10, max_designed=21)


def test_stop_rule_decisions():
    hist = [{"rmse": 0.01, "psnr": 20.0}, {"rmse": 0.006, "psnr": 24.0}, {"rmse": 0.0058, "psnr": 24.2}]
    assert not StopRule.from_settings(target_rmse="0.005/mm").met(hist)
    assert StopRule.from_settings(target_rmse="0.006/mm").met(hist)
    assert StopRule.from_settings(target_psnr="24dB").met(hist)
    assert StopRule.from_settings(min_gain="5%").met(hist)  # 0.0002 < 5 % of 0.0058
    assert not StopRule.from_settings(min_gain="1%").met(hist)
    assert not StopRule.from_settings(min_gain="1%").met(hist[:1])  # no gain after one forecast
    with pytest.raises(DesignError, match="one stop target"):
        StopRule.from_settings(target_rmse="0.005/mm", target_psnr="30dB")
    best = {"count": 30, "rmse": 0.004, "rmse_band": [0.0035, 0.0045], "psnr": 28.0, "psnr_band": [27.0, 29.0]}
    why = StopRule.from_settings(target_rmse="0.001/mm").reachable(best)
    assert why.startswith("--target-rmse: 0.001/mm is below the predicted RMS error after 30 angles")
    assert StopRule.from_settings(target_rmse="0.0036/mm").reachable(best) is None  # inside the band: try
    assert "above the predicted PSNR" in StopRule.from_settings(target_psnr="35dB").reachable(best)
    assert forecast_counts(10, 30, 5) == [10, 15, 20, 25, 30]
    assert forecast_counts(10, 10, 5) == [10]


def test_stop_rule_stops_the_greedy_loop_and_a_resume_stops_at_the_same_step(op, tmp_path):  # noqa: F811
    """``after_step`` returning True ends the design there; the checkpoint holds the steps so far, and a resumed
    design replays them, hears the same stop and acquires nothing more."""
    model = dense_model(op)
    kw = dict(criterion="eig", angles_deg=np.arange(N_ANG) * 15.0, jitter=0.01, progress=False)
    calls = []

    def stop_after_3(engine, step, replay):
        calls.append((step, replay))
        return step == 3

    ck = tmp_path / "state.pt"
    res = greedy_design(DesignEngine(model, "exact"), [0, 6], 8, checkpoint=ck, after_step=stop_after_3, **kw)
    assert res.stopped_at == 3 and len(res.acquired) == 3
    calls.clear()
    again = greedy_design(DesignEngine(model, "exact"), [0, 6], 8, checkpoint=ck, after_step=stop_after_3, **kw)
    assert again.stopped_at == 3 and again.acquired == res.acquired and again.resumed_steps == 3
    assert calls == [(1, True), (2, True), (3, True)]
    full = greedy_design(DesignEngine(model, "exact"), [0, 6], 5, **kw)
    assert full.stopped_at is None and full.acquired[:3] == res.acquired


# ------------------------------------------------------------------------------------------------ end to end
TINY_SCAN = ["data.image_shape=[32,32]", "data.detector_subsampling=8", "dip.iterations=150", "tv.enabled=false"]


@pytest.fixture(scope="module")
def tiny_scan(tmp_path_factory):
    from ctuq.pipeline.simulate import simulate

    path = tmp_path_factory.mktemp("scan") / "walnut"
    simulate(path, "tiny", overrides={"n_projections": 49, "det_rows": 4, "gt_shape": (1, 128, 128)}, progress=False)
    return path


def _cli(args):
    from ctuq.cli import main

    return main(["design", "--no-progress", *args])


@pytest.mark.slow
def test_plan_writes_the_forecast_without_acquiring(tiny_scan, tmp_path):
    out = tmp_path / "plan"
    sets = [x for s in TINY_SCAN for x in ("--set", s)]
    args = ["--data", str(tiny_scan), "--candidates", "24", "--pilot", "4", "--acquire", "6", *sets]
    assert _cli([*args, "--plan", "--out", str(out)]) == 0
    rec = json.loads((out / "design.json").read_text())
    plan = rec["forecast"]["plan"]
    assert rec["plan_only"] and plan["counts"][0] == 4 and plan["counts"][-1] == 10
    for name in ("designed", "equidistant"):
        rmse = [r["rmse"] for r in plan[name]]
        assert all(r["rmse_band"][0] <= r["rmse"] <= r["rmse_band"][1] for r in plan[name])
        assert rmse[-1] < rmse[0]  # more angles, smaller predicted error
    assert len(plan["designed_order"]) == 6
    advice = plan["recommendation"]  # no target: the strategy with the lower predicted error after 10 angles
    lower = min(("designed", "equidistant"), key=lambda k: plan[k][-1]["rmse"])
    assert advice["recommended"] == lower and advice["target"] is None
    assert advice["max_designed"] == 10  # trusted_count of the 32² grid: the 10 angles are within it
    assert (out / "forecast.png").stat().st_size > 0
    assert not (out / "designed").exists() and not (out / "std_design.tif").exists()
    # a target the plan says cannot be reached is refused before acquiring anything
    out2 = tmp_path / "unreachable"
    assert _cli([*args, "--target-rmse", "1e-6/mm", "--out", str(out2)]) == 2
    assert not (out2 / "design.json").exists() and not (out2 / "work" / "design_state.pt").exists()
    # the stop rule: a target the pilot's forecast already nearly meets stops within the budget
    target = plan["designed"][1]["rmse"] * 1.0001
    out3 = tmp_path / "stop"
    extra = ["--set", "design.reconstruct=false"]
    assert _cli([*args, *extra, "--target-rmse", f"{target}/mm", "--out", str(out3)]) == 0
    got = json.loads((out3 / "design.json").read_text())
    stop = got["forecast"]["stop"]
    assert stop["met"] and stop["predicted_rmse"] <= target and stop["n_angles"] < 10
    assert len(got["forecast"]["online"]) == len(got["acquired"]) == stop["n_angles"] - 4
    assert (out3 / "online_calibration.png").stat().st_size > 0
    assert got["forecast"]["predicted_from"].startswith("the tracked DIP (300 ")  # a stop target tracks the DIP
    advice = got["forecast"]["plan"]["recommendation"]  # for the target: the predicted count of each protocol
    assert advice["target"] == f"{target}/mm" and advice["counts"]["designed"] is not None
    # resumed: the same stop, nothing more acquired
    assert _cli([*args, *extra, "--target-rmse", f"{target}/mm", "--out", str(out3), "--resume"]) == 0
    again = json.loads((out3 / "design.json").read_text())
    assert again["angles_deg"] == got["angles_deg"]
    assert again["forecast"]["after_step"] == got["forecast"]["after_step"]  # replayed: bitwise the same
    assert again["forecast"]["online"] == got["forecast"]["online"]


def test_bad_stop_inputs_are_one_line_before_any_work(tmp_path, capsys):
    assert _cli(["--target-rmse", "0.002", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ctuq design: --target-rmse: '0.002' has no unit; give it in mm⁻¹, e.g. 0.002/mm"]
    assert _cli(["--target-psnr", "30dB", "--criterion", "equidistant", "--out", str(tmp_path / "b")]) == 2
    assert "needs a greedy criterion" in capsys.readouterr().err
    # design.forecast = false (the plain greedy loop) has no forecast to plan or stop with
    for args in (["--plan"], ["--target-psnr", "30dB"]):
        assert _cli([*args, "--set", "design.forecast=false", "--out", str(tmp_path / "c")]) == 2
        assert "needs the error forecast, but design.forecast = false" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_recommendation_of_designed_angles_says_they_are_not_for_fbp(caplog):
    """The log line after a recommendation: designed angles come with the FBP caveat (FBP from them was up to 6
    dB below equidistant angles in the protocol study); the equidistant recommendation gives the command instead."""
    import logging

    from ctuq.pipeline.design import _say_advice

    with caplog.at_level(logging.INFO, logger="ctuq.pipeline.design"):
        _say_advice({"recommended": "designed", "reason": "r", "counts": {"designed": 20.0}}, 10, acquiring=True)
    assert any("FBP from them is worse" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ctuq.pipeline.design"):
        _say_advice({"recommended": "equidistant", "reason": "r", "counts": {"equidistant": 31.2}}, 10, acquiring=False)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "FBP" not in text and "--criterion equidistant --acquire 22" in text
