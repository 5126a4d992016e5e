"""The linearised-DIP design prior and the angle-selection study's pieces, on tiny sizes.

A 16² image, 10 parallel-beam candidate angles × 23 detector pixels; the DIP prior tests use a two-layer conv net
(d = 72: the prior is network-agnostic, and every vmapped product of the U-Net costs ~10 ms of overhead on a CPU
whatever the image size); the study test uses the study's own U-Net.
"""

import dataclasses
import math
import types

import numpy as np
import pytest
import torch

from ctuq.config import DesignConfig
from ctuq.design import DesignEngine, greedy_design
from ctuq.design.dip_prior import DIPPrior
from ctuq.design.factors import DenseFactor

S = 16


@pytest.fixture(scope="module")
def problem():
    from ctuq.data.rectangles import parallel_geometry, rectangles_image
    from ctuq.models import make_net_input
    from ctuq.operators import SparseRayTransform

    img, _ = rectangles_image(np.random.default_rng(0), S, supersampling=2)
    vol, geo = parallel_geometry(S, np.arange(10) * math.pi / 10)
    op = SparseRayTransform(vol, geo)
    x = torch.from_numpy(img)
    y = op(x) + 0.02 * torch.randn(op.measurement_shape, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.LeakyReLU(0.2), torch.nn.Conv2d(4, 1, 3, padding=1)
    )
    return types.SimpleNamespace(op=op, y=y, x=x, net=net, ni=make_net_input((S, S), seed=0))


def test_dip_prior_scales_precision_and_refresh(problem):
    from ctuq.inference import LinearizedFeatures
    from ctuq.inference.priors import gprior_scales
    from ctuq.linearize import LinearizedNetwork

    p = problem
    ds = DesignConfig(refresh_every=2, dense="always", samples=32)
    prior = DIPPrior(p.net, p.ni, p.op, p.y, 14.0, settings=ds, sigma2=0.05)
    pilot = [0, 5]
    model = prior.build(pilot)
    assert isinstance(model.factor, DenseFactor) and model.image_prior == "dip"
    # the exact g-prior on the pilot rows, as the core computes it with VJPs
    op_p = p.op.subset(pilot)
    net = LinearizedNetwork(p.net, p.ni, mode="recompute")
    feats = LinearizedFeatures(net, op_p.forward_flat, op_p.adjoint_flat)
    s_ref = gprior_scales(feats.rmatvec, feats.n_outputs, method="exact", n_features=net.d)
    assert torch.allclose(model.scales, s_ref, rtol=1e-4)
    # energy rule: a = #non-zero scales / (‖ỹ‖² − c σ²) with ỹ = scale·y + T(Φṽ − g(ṽ))
    with torch.no_grad():
        delta = net.jvp(net.params()[None])[0] - net.output()
        yt = 14.0 * p.y[pilot].reshape(-1) + op_p.forward_flat(delta[None])[0]
    a_ref = float((s_ref > 0).sum()) / float(yt.double().pow(2).sum() - yt.numel() * 0.05)
    assert model.a == pytest.approx(a_ref, rel=1e-4)
    # refresh after every 2 acquired angles: new scales from the chosen rows
    eng = DesignEngine(model, route="sampled", n_samples=32)
    eng.reset(pilot)
    assert prior.updater(eng, 1, pilot + [2], False) is None
    new = prior.updater(eng, 2, pilot + [2, 7], False)
    assert new is not None and new.info["n_chosen"] == 4 and not torch.allclose(new.scales, model.scales)


def test_assembled_and_jvp_dip_priors_give_the_same_design(problem):
    p = problem
    pilot = [0, 5]
    models = [
        DIPPrior(
            p.net, p.ni, p.op, p.y, 14.0, settings=DesignConfig(refresh_every=0, dense=d, samples=32), sigma2=0.05
        ).build(pilot)
        for d in ("always", "never")
    ]
    assert isinstance(models[0].factor, DenseFactor) and hasattr(models[1].factor, "params")
    vals = []
    for m in models:
        eng = DesignEngine(m, route="exact")
        eng.reset(pilot)
        vals.append(eng.criteria("eig", 0.0)[0])
    f = torch.isfinite(vals[0])
    assert torch.allclose(vals[0][f], vals[1][f], rtol=1e-3)


@pytest.mark.parametrize("weight_space", [True, False])
def test_refreshed_design_through_vjps_keeps_the_chosen_rows(problem, monkeypatch, weight_space):
    """A design through the network's VJPs with g-prior refreshes keeps the chosen angles' rows once projected
    (BlockRowStore): each chosen block is projected once over the whole design, and the angles and final scales
    are those of the design that projects them anew at every refresh (to float32 rounding). An acquisition takes
    ``K T^βᵀ`` from the kept rows of ``β``: on the image-space route (the ``small`` U-Net's) its kernel products
    are only the conditioning on the chosen angles'; the weight-space route takes no kernel products."""
    from ctuq.design.factors import BlockRowStore
    from ctuq.design.model import DesignModel

    p = problem
    ds = DesignConfig(refresh_every=2, dense="never", samples=32)
    runs = []
    kernel_rows = []
    plain_kernel = DesignModel.kernel

    def counted_kernel(self, X):
        kernel_rows[-1] += X.shape[0]
        return plain_kernel(self, X)

    monkeypatch.setattr(DesignModel, "kernel", counted_kernel)
    monkeypatch.setattr(DesignModel, "weight_space", lambda self, max_bytes=1 << 30: weight_space)
    for keep in (True, False):
        kernel_rows.append(0)
        monkeypatch.setattr(BlockRowStore, "fits", staticmethod(lambda *a, **k: keep))
        prior = DIPPrior(p.net, p.ni, p.op, p.y, 14.0, settings=ds, sigma2=0.05)
        model = prior.build([0, 5], n_steps=4)
        assert (model.row_store is not None) == keep
        eng = DesignEngine(model, "sampled", n_samples=32)
        res = greedy_design(
            eng,
            [0, 5],
            4,
            criterion="ese",
            angles_deg=np.arange(10) * 18.0,
            jitter=0.0,
            updater=prior.updater,
            progress=False,
        )
        runs.append((res.acquired, eng.model.scales, model.row_store))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 4
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-5, atol=0.0)
    store = runs[0][2]
    assert store.n_projected == 6 and sorted(store.slots) == sorted([0, 5] + runs[0][0])
    k = p.op.c // p.op.n_angles
    # per acquisition on the image-space route: k rows (the conditioning) with the store, 2k without
    assert kernel_rows == ([0, 0] if weight_space else [4 * k, 8 * k])


def test_retraining_updater_refits_and_restores(problem, tmp_path):
    p = problem
    ds = DesignConfig(refresh_every=0, retrain_every=1, retrain_iterations=3, dense="never", samples=16)
    prior = DIPPrior(p.net, p.ni, p.op, p.y, 14.0, settings=ds, sigma2=0.05, work_dir=tmp_path)
    model = prior.build([0, 5])
    res = greedy_design(
        DesignEngine(model, "sampled", n_samples=16),
        [0, 5],
        1,
        criterion="ese",
        angles_deg=np.arange(10) * 18.0,
        jitter=0.0,
        updater=prior.updater,
        progress=False,
        update_last=True,
    )
    saved = tmp_path / "retrain_001.pt"
    assert saved.is_file() and prior.n_retrains == 1 and len(res.acquired) == 1
    again = DIPPrior(p.net, p.ni, p.op, p.y, 14.0, settings=ds, sigma2=0.05, work_dir=tmp_path)
    again.build([0, 5])
    again._retrain([0, 5] + res.acquired, 1, replay=True)  # restored from the file, not refitted
    for k, v in again.net_model.state_dict().items():
        assert torch.equal(v, prior.net_model.state_dict()[k])


def test_rectangles_phantoms():
    from ctuq.data.rectangles import rectangles_image, rectangles_stack

    stack, phi = rectangles_stack(3, 32, seed=4)
    assert stack.shape == (3, 32, 32) and stack.dtype == np.float32 and phi.shape == (3,)
    assert stack.min() >= 0 and 0.5 <= stack.max() <= 3.0  # sums of ≤ 3 rectangles of intensity U(0.5, 1)
    assert np.array_equal(rectangles_stack(2, 32, seed=4)[0], stack[:2])  # image i depends on (seed, i) only
    # a fixed orientation without spread gives edges along φ and φ + 90°: the image's gradient directions
    img, _ = rectangles_image(np.random.default_rng(1), 64, orientation_mean=30.0, orientation_std=0.0)
    gy, gx = np.gradient(img.astype(np.float64))
    z = (np.hypot(gx, gy) * np.exp(4j * np.arctan2(gy, gx))).sum()  # 4θ: edges at φ and φ + 90° agree
    est = np.degrees(np.angle(z)) / 4.0 % 90.0
    assert abs((est - 30.0 + 45.0) % 90.0 - 45.0) < 3.0 and abs(z) > 0.3 * np.hypot(gx, gy).sum()


@pytest.mark.slow
def test_study_image_runs_and_resumes(tmp_path):
    from ctuq.studies.angle_selection import DEFAULTS, run_image
    from ctuq.studies.common import Log

    opts = dataclasses.replace(
        DEFAULTS,
        size=16,
        candidates=10,
        pilot=2,
        acquire=2,
        every=2,
        samples=16,
        iterations=5,
        warm_iterations=3,
        tv_iterations=5,
        recon=("tv", "dip"),
        progress=False,
        strategies=("equidistant", "equidistant_grid", "random", "matern", "dip_ese"),
    )
    from ctuq.data.rectangles import rectangles_stack

    gt = rectangles_stack(1, 16, seed=0)[0][0]
    res = run_image(0, gt, opts, tmp_path, torch.device("cpu"), Log("test"))
    assert set(res) == set(opts.strategies)
    assert set(res["random"]["recon"]) == {"2", "4"} and set(res["equidistant_grid"]["recon"]) == {"2"}
    for rec in res.values():
        for m in rec["recon"].values():
            assert set(m) == {"tv", "dip"} and m["tv"]["best_psnr"] >= m["tv"]["psnr"] - 1e-9
    assert res["dip_ese"]["timings"]["route"] == "sampled" and len(res["dip_ese"]["angles_deg"]["4"]) == 4
    again = run_image(0, gt, opts, tmp_path, torch.device("cpu"), Log("test"))  # finished pairs are read back
    assert again["dip_ese"]["angles_deg"] == res["dip_ese"]["angles_deg"]


@pytest.mark.slow
def test_study_adds_a_reconstruction_method_at_the_recorded_angles(tmp_path):
    """A TV-only study rerun with --recon tv dip adds the DIP reconstructions to the finished results from the
    recorded angles and the same data — the numbers of a study run with both from the start — and leaves TV's
    and the designs alone: their run folders are loaded, not redone."""
    import json

    from ctuq.studies.angle_selection import TINY
    from ctuq.studies.angle_selection_report import run_study

    opts = dataclasses.replace(TINY, images=1, strategies=("equidistant", "random"), progress=False, device="cpu")
    run_study(dataclasses.replace(opts, recon=("tv",)), tmp_path / "grown")
    first = json.loads((tmp_path / "grown/img_000/random/result.json").read_text())
    assert all(set(r) == {"tv"} for r in first["recon"].values())
    tv_run = tmp_path / "grown/img_000/random/004/tv/metrics.json"
    stamp = tv_run.stat().st_mtime_ns
    run_study(dataclasses.replace(opts, recon=("tv", "dip")), tmp_path / "grown")
    assert tv_run.stat().st_mtime_ns == stamp  # the TV run was loaded (reuse), not redone
    run_study(dataclasses.replace(opts, recon=("tv", "dip")), tmp_path / "both")
    for s in opts.strategies:
        grown = json.loads((tmp_path / f"grown/img_000/{s}/result.json").read_text())
        both = json.loads((tmp_path / f"both/img_000/{s}/result.json").read_text())
        assert grown["angles_deg"] == both["angles_deg"] and set(grown["recon"]) == set(both["recon"])
        for key, r in grown["recon"].items():
            assert r["dip"]["psnr"] == pytest.approx(both["recon"][key]["dip"]["psnr"], abs=1e-9)
            assert r["tv"] == both["recon"][key]["tv"]
    assert json.loads((tmp_path / "grown/study.json").read_text())["options"]["recon"] == ["dip", "tv"]


def test_study_script_options_and_images_file(tmp_path, capsys):
    from tiny import load_script

    from ctuq.studies.angle_selection import DEFAULTS, load_images

    script = load_script("angle_selection")
    assert script.main(["--out", str(tmp_path / "s"), "--tiny", "--acquire", "30"]) == 2
    assert "--acquire: pilot 4 + 30 exceed the 20 candidates" in capsys.readouterr().err
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 8, 9), dtype=np.float32))
    assert script.main(["--out", str(tmp_path / "s"), "--tiny", "--images-file", str(bad)]) == 2
    assert "need a finite stack (N, H, W) with H = W, got (2, 8, 9)" in capsys.readouterr().err
    good = tmp_path / "good.tif"
    import tifffile

    tifffile.imwrite(good, np.random.default_rng(0).random((3, 12, 12)).astype(np.float32), photometric="minisblack")
    stack = load_images(dataclasses.replace(DEFAULTS, images=2, images_file=str(good)))
    assert stack.shape == (2, 12, 12) and stack.dtype == np.float32


def test_study_tables_hold_every_finished_result_with_paired_differences(tmp_path):
    """Two processes sharing a study folder with different strategies: each writes the tables of everything
    finished in it; ``--report`` rebuilds them without running; the paired difference to equidistant is the mean
    over images of the per-image PSNR differences."""
    import json

    from ctuq.studies.angle_selection import TINY
    from ctuq.studies.angle_selection_report import run_study

    opts = dataclasses.replace(TINY, recon=("tv",), progress=False, device="cpu")
    out = tmp_path / "study"
    run_study(dataclasses.replace(opts, strategies=("equidistant",)), out)
    agg = run_study(dataclasses.replace(opts, strategies=("random",)), out)
    text = (out / "results.md").read_text()
    assert "| equidistant (n=2)" in text and "| random (n=2)" in text and "minus equidistant" in text
    recs = [
        {s: json.loads((out / f"img_{i:03d}" / s / "result.json").read_text()) for s in ("equidistant", "random")}
        for i in range(2)
    ]
    for count in ("4", "6", "8"):
        d = [r["random"]["recon"][count]["tv"]["psnr"] - r["equidistant"]["recon"][count]["tv"]["psnr"] for r in recs]
        cell = agg["paired"]["tv"]["psnr"]["random"][int(count)]
        assert cell["n"] == 2 and cell["mean"] == pytest.approx(np.mean(d), abs=1e-12)
        assert cell["se"] == pytest.approx(np.std(d, ddof=1) / np.sqrt(2), abs=1e-12)
    # generated phantoms: the random design's distance to each phantom's orientation (equidistant left out)
    assert "against the phantoms' orientation" in text and set(agg["orientation"]) == {"random"}
    cells = agg["orientation"]["random"]
    assert cells["all"]["n"] == 2 and all(0.0 <= c["mean"] <= 45.0 for c in cells.values())
    (out / "results.md").unlink()
    again = run_study(dataclasses.replace(opts, strategies=("random",)), out, report_only=True)
    assert (out / "results.md").read_text() == text and again["paired"] == agg["paired"]
    from ctuq.studies import StudyError

    with pytest.raises(StudyError, match="holds no study"):
        run_study(opts, tmp_path / "empty", report_only=True)


def test_orientation_distances_modulo_90_degrees():
    """Distances of the acquired angles (pilot left out) to φ modulo 90°: 30° and 120° are on φ = 30°'s sharp
    projections (0°), 75° and 165° halfway between them (45°); prefixes longer than the acquisitions are left out."""
    from ctuq.studies.angle_selection_report import orientation_distances

    rec = {"angles_deg": {"2": [0.0, 90.0], "6": [0.0, 90.0, 30.0, 120.0, 75.0, 165.0]}}
    eq = {"angles_deg": {"6": [0.0, 30.0, 60.0, 90.0, 120.0, 150.0]}}
    got = orientation_distances([{"dip_ese": rec, "equidistant": eq}, {"dip_ese": rec}], [30.0, 210.0], pilot=2)
    assert set(got) == {"dip_ese"} and set(got["dip_ese"]) == {"first 1", "all"}
    assert got["dip_ese"]["first 1"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert got["dip_ese"]["all"]["mean"] == pytest.approx(22.5) and got["dip_ese"]["all"]["n"] == 2
