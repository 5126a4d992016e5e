"""Tuning on held-out angles (ctuq.reconstruct.heldout): the held-out error against a dense reference, the TV weight
path, the DIP's held-out selection and early stop (with resume), and the split of a scan's held-out rows."""

import json
import math
import shutil

import numpy as np
import pytest
import tifffile
import torch
from test_dip import Interrupt, parallel_problem

from ctuq.data.problem import HeldoutData
from ctuq.errors import CheckpointMismatch
from ctuq.models import build_unet, make_net_input
from ctuq.reconstruct.classical import tv_reconstruction
from ctuq.reconstruct.dip import fit_dip, load_checkpoint
from ctuq.reconstruct.heldout import HeldoutMonitor, _vertex, tv_weight_path, weight_grid


@pytest.fixture(scope="module")
def split_problem():
    """A 32² phantom seen from 24 angles: every 3rd (8) used, the other 16 held out; noisy (seed 0)."""
    op, x, y, fbp = parallel_problem(n_angles=24, noise=0.03)
    used = list(range(0, 24, 3))
    held = [i for i in range(24) if i % 3]
    y_used = y[used]
    held_rows = HeldoutData(op=op.subset(held), y=y[held], geometry_rows=np.array(held), n_used=len(used))
    return op.subset(used), y_used, x, held_rows


def test_heldout_error_matches_a_dense_weighted_mean(split_problem):
    _, _, x, held = split_problem
    var = torch.rand(held.y.shape, generator=torch.Generator().manual_seed(0)) + 0.5
    mon = HeldoutMonitor(held.op, held.y, var)
    img = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    A = held.op.matrix.double().numpy()
    r = A @ img.double().numpy().ravel() - held.y.double().numpy().ravel()
    w = 1.0 / var.double().numpy().ravel()
    assert mon.error(img) == pytest.approx(float(np.sum(w * r**2) / np.sum(w)), rel=1e-5)
    plain = HeldoutMonitor(held.op, held.y)
    assert plain.error(img) == pytest.approx(float(np.mean(r**2)), rel=1e-5)
    assert plain.n_angles == 16


def test_monitor_rejects_bad_input(split_problem):
    _, _, _, held = split_problem
    with pytest.raises(ValueError, match="y has shape"):
        HeldoutMonitor(held.op, held.y[:3])
    with pytest.raises(ValueError, match="finite and positive"):
        HeldoutMonitor(held.op, held.y, torch.zeros_like(held.y))
    with pytest.raises(ValueError, match="variances have shape"):
        HeldoutMonitor(held.op, held.y, torch.ones(3))
    with pytest.raises(ValueError, match="every"):
        HeldoutMonitor(held.op, held.y, every=0)
    with pytest.raises(ValueError, match="patience"):
        HeldoutMonitor(held.op, held.y, patience=0)


def test_weight_grid_and_vertex():
    g = weight_grid(1e-3, 1.0, 2)
    assert g[0] == 1.0 and g[-1] == pytest.approx(1e-3) and len(g) == 7
    assert all(a > b for a, b in zip(g, g[1:]))
    with pytest.raises(ValueError, match="low < high"):
        weight_grid(1.0, 0.1, 2)
    # an exact parabola in log λ: the vertex is found between grid points
    grid = weight_grid(1e-3, 1.0, 4)
    target = 0.02
    errors = [(math.log(w / target)) ** 2 + 1.0 for w in grid]
    best = int(np.argmin(errors))
    assert _vertex(grid, errors, best) == pytest.approx(target, rel=1e-9)
    # at an end of the path, or without curvature, the grid point itself
    assert _vertex(grid, errors, 0) == grid[0]
    assert _vertex([1.0, 0.5, 0.25], [1.0, 1.0, 1.0], 1) == 0.5


def test_tv_path_picks_the_lowest_heldout_error(split_problem):
    op, y, x, held = split_problem
    mon = HeldoutMonitor(held.op, held.y)
    weights = weight_grid(1e-3, 3.0, 2)
    full = tv_weight_path(op, y, mon, weights=weights, iterations=40, ground_truth=x, stop_early=False, progress=False)
    assert full.weights == sorted(weights, reverse=True) and len(full.errors) == len(weights)
    assert full.path_weight == full.weights[int(np.argmin(full.errors))]
    # the held-out minimum is not at an end of this path, and its image is far better than the extremes'
    i = full.weights.index(full.path_weight)
    assert 0 < i < len(weights) - 1
    assert full.psnrs[i] > max(full.psnrs[0], full.psnrs[-1]) + 1.0
    # the chosen weight lies within half a grid step of the path's best
    assert full.path_weight / math.sqrt(math.sqrt(10)) <= full.weight <= full.path_weight * math.sqrt(math.sqrt(10))
    # stopping early once past the minimum does not change the choice, only the cost
    short = tv_weight_path(op, y, mon, weights=weights, iterations=40, progress=False)
    assert short.path_weight == full.path_weight and short.weight == full.weight
    assert len(short.weights) < len(full.weights) and short.psnrs is None
    # each point of the path continues the previous one: the first point is a plain TV solve
    first = tv_reconstruction(op, y, weight=max(weights), iterations=40, progress=False)
    assert mon.error(first["reconstruction"]) == pytest.approx(full.errors[0], rel=1e-5)
    with pytest.raises(ValueError, match="positive and finite"):
        tv_weight_path(op, y, mon, weights=[0.1, -1.0], iterations=2, progress=False)


def test_tv_path_discrepancy_principle(split_problem):
    """``criterion='discrepancy'``: the largest λ whose residual on the used rows is at most the lowest held-out
    error, between the two path points around the crossing."""
    op, y, x, held = split_problem
    mon = HeldoutMonitor(held.op, held.y)
    weights = weight_grid(1e-3, 3.0, 2)
    path = tv_weight_path(op, y, mon, weights=weights, iterations=40, stop_early=False, criterion="discrepancy",
                          progress=False)  # fmt: skip
    level = min(path.errors)
    # the residual falls with λ; the crossing lies between the last weight above the level and the first below
    assert all(a >= b - 1e-12 for a, b in zip(path.residuals, path.residuals[1:]))
    i = next(k for k, r in enumerate(path.residuals) if r <= level)
    assert 0 < i and path.path_weight == path.weights[i]
    assert path.weights[i] <= path.weight <= path.weights[i - 1]
    # it regularises at least as much as the held-out minimum
    assert path.weight >= path.weights[int(np.argmin(path.errors))]
    assert path.summary()["criterion"] == "discrepancy" and len(path.summary()["residual"]) == len(weights)
    var = torch.ones_like(held.y)
    with pytest.raises(ValueError, match="without variances"):
        tv_weight_path(op, y, HeldoutMonitor(held.op, held.y, var), weights=weights, iterations=2,
                       criterion="discrepancy", progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="criterion must be one of"):
        tv_weight_path(op, y, mon, weights=weights, iterations=2, criterion="oracle", progress=False)


def _fit(op, y, x, monitor, iterations, ckpt=None, resume=False, stop_at=None):
    torch.manual_seed(1)

    def cb(it, info):
        if stop_at is not None and it == stop_at:
            raise Interrupt

    return fit_dip(
        op,
        y,
        model=build_unet("tiny"),
        net_input=make_net_input(op.image_shape, seed=1),
        iterations=iterations,
        lr=5e-3,
        scale=2.0,
        ground_truth=x,
        checkpoint_path=ckpt,
        checkpoint_every=5 if ckpt else 0,
        resume=resume,
        seed=4,
        progress=False,
        callback=cb,
        monitor=monitor,
    )


def test_dip_keeps_the_iterate_with_the_lowest_heldout_error(split_problem):
    op, y, x, held = split_problem
    mon = HeldoutMonitor(held.op, held.y, every=4, patience=None)
    res = _fit(op, y, x, mon, 30)
    its = [i for i, _ in res.heldout_history]
    assert its == [*range(0, 30, 4), 29]  # every 4th iteration and the last
    errors = dict(res.heldout_history)
    assert res.best_iteration == min(errors, key=errors.get)
    assert res.best_loss == res.loss_history[res.best_iteration]
    # the kept weights are the ones that produced that iterate: their image has exactly that held-out error
    assert mon.error(res.reconstruction) == pytest.approx(errors[res.best_iteration], rel=1e-4)
    s = res.summary()
    assert s["selection"] == "heldout" and s["heldout_error"] == errors[res.best_iteration]
    assert _fit(op, y, x, None, 3).summary()["selection"] == "loss"


def test_dip_stops_once_past_the_minimum_and_resumes_bit_identically(split_problem, tmp_path):
    op, y, x, held = split_problem
    # a patience short enough for this fit to pass its held-out minimum (a 32² phantom overfits fast at lr 5e-3)
    mon = HeldoutMonitor(held.op, held.y, every=2, patience=6)
    full = _fit(op, y, x, mon, 400, ckpt=tmp_path / "full.pt")
    assert full.stopped_early and full.iterations < 400
    assert full.iterations - 1 - full.best_iteration >= 6
    assert len(full.loss_history) == full.iterations
    assert load_checkpoint(tmp_path / "full.pt")["stopped"] == full.iterations
    # killed part-way, then resumed: the same stop, the same weights
    ckpt = tmp_path / "run.pt"
    with pytest.raises(Interrupt):
        _fit(op, y, x, mon, 400, ckpt=ckpt, stop_at=full.iterations // 2)
    resumed = _fit(op, y, x, mon, 400, ckpt=ckpt, resume=True)
    assert resumed.resumed_from > 0
    assert resumed.iterations == full.iterations and resumed.best_iteration == full.best_iteration
    assert resumed.heldout_history == full.heldout_history
    assert torch.equal(resumed.reconstruction, full.reconstruction)
    # resuming a stopped fit runs nothing more
    again = _fit(op, y, x, mon, 400, ckpt=tmp_path / "full.pt", resume=True)
    assert again.iterations == full.iterations and torch.equal(again.reconstruction, full.reconstruction)
    # a checkpoint tuned on other rows is not resumed
    other = HeldoutMonitor(held.op, held.y * 1.01, every=2, patience=6)
    with pytest.raises(CheckpointMismatch, match="heldout_y_sum"):
        _fit(op, y, x, other, 400, ckpt=ckpt, resume=True)


def test_monitor_must_match_the_fit(split_problem):
    op, y, x, held = split_problem
    small, _, _, _ = parallel_problem(n=16, n_angles=4)
    with pytest.raises(ValueError, match="image shape"):
        _fit(op, y, x, HeldoutMonitor(small, small(torch.zeros(16, 16))), 2)


def test_heldout_split_is_interleaved_and_disjoint(split_problem):
    _, _, _, held = split_problem
    var = torch.arange(held.y.numel(), dtype=torch.float32).reshape(held.y.shape) + 1.0
    held = HeldoutData(op=held.op, y=held.y, geometry_rows=held.geometry_rows, n_used=8, variances=var)
    tune, check = held.split()
    assert list(tune.geometry_rows) == list(held.geometry_rows[0::2])
    assert list(check.geometry_rows) == list(held.geometry_rows[1::2])
    assert tune.n_used == check.n_used == 8
    for part, pos in ((tune, slice(0, None, 2)), (check, slice(1, None, 2))):
        assert torch.equal(part.y, held.y[pos]) and torch.equal(part.variances, var[pos])
        img = torch.rand(held.op.image_shape, generator=torch.Generator().manual_seed(2))
        assert torch.allclose(part.op(img), held.op(img)[pos])
    with pytest.raises(ValueError, match="positions"):
        held.subset([99])
    one = held.subset([0])
    with pytest.raises(ValueError, match="at least 2"):
        one.split()


def test_dip_tv_weight_chosen_on_heldout_angles_and_resumed(tiny_scan, tmp_path):
    """``dip.tv_weights``: one fit per candidate γ from the same initial weights; the lowest held-out error at the
    kept iterate wins and its checkpoint becomes ``dip_checkpoint.pt``; a run resumed from the first candidate's
    finished checkpoint alone (as after a kill during the second) ends with the same choice and image."""
    from tiny import NO_FIGURES, tiny_args

    from ctuq.cli import main
    from ctuq.pipeline import run_folder as rf

    cand = ("dip.tv_weights=[0.0, 0.3]", "dip.iterations=30", "dip.heldout_every=5", "tv.enabled=false")
    out = tmp_path / "run"
    assert (
        main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *tiny_args(*cand, *NO_FIGURES, uq=False)])
        == 0
    )
    m = json.loads((out / rf.METRICS_NAME).read_text())
    search = m["dip"]["tv_weight_search"]
    assert [s["tv_weight"] for s in search] == [0.0, 0.3]
    winner = min(search, key=lambda s: s["heldout_error"])
    assert m["dip"]["tv_weight"] == winner["tv_weight"] and m["dip"]["heldout_error"] == winner["heldout_error"]
    i = search.index(winner)
    assert (out / rf.CHECKPOINT_NAME).read_bytes() == (out / rf.CANDIDATE_CHECKPOINT.format(i)).read_bytes()
    # the two candidates differ (the TV term matters at γ = 0.3): a real choice was made
    assert search[0]["heldout_error"] != search[1]["heldout_error"]
    # resumed from the first candidate's finished checkpoint alone: the same numbers
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(out / rf.CONFIG_NAME, again / rf.CONFIG_NAME)
    shutil.copy(out / rf.CANDIDATE_CHECKPOINT.format(0), again / rf.CANDIDATE_CHECKPOINT.format(0))
    argv = ["reconstruct", "--data", str(tiny_scan), "--out", str(again), "--resume"]
    assert main([*argv, *tiny_args(*cand, *NO_FIGURES, uq=False)]) == 0
    m2 = json.loads((again / rf.METRICS_NAME).read_text())
    assert m2["dip"]["tv_weight_search"] == search and m2["dip"]["tv_weight"] == m["dip"]["tv_weight"]
    assert np.array_equal(
        tifffile.imread(again / rf.RECONSTRUCTION_NAME), tifffile.imread(out / rf.RECONSTRUCTION_NAME)
    )


def test_discrepancy_guard_keeps_the_heldout_error_near_its_minimum():
    """Where even the largest weight fits the used rows below the held-out floor (sparse angles: the held-out error
    is interpolation error, not noise), the weight is the largest whose held-out error is within the guard."""
    from ctuq.reconstruct.heldout import DISCREPANCY_GUARD, _discrepancy

    weights = [1.0, 0.1, 0.01, 0.001]
    errors = [2.0, 1.2, 1.0, 1.1]  # lowest at 0.01
    assert _discrepancy(weights, [0.5, 0.4, 0.3, 0.2], errors) == (0.1, 1)  # 1.2 ≤ 1.25 × 1.0
    assert DISCREPANCY_GUARD == 0.25
    # within the guard: the crossing, interpolated in log λ between 1.0 (residual 1.5) and 0.1 (residual 0.5)
    w, i = _discrepancy(weights, [1.5, 0.5, 0.3, 0.2], [1.1, 1.05, 1.0, 1.1])
    assert i == 1 and w == pytest.approx(0.1 * 10**0.5)
    # no residual reaches the level: the smallest weight
    assert _discrepancy(weights, [5.0, 4.0, 3.0, 2.0], errors) == (0.001, 3)
