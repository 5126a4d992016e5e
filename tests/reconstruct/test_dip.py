"""DIP fit, TV baseline and their numerics on tiny parallel-beam problems (32² image, ASTRA CPU matrix)."""

import math

import astra
import numpy as np
import pytest
import torch

from ctuq.errors import CheckpointMismatch
from ctuq.metrics import psnr
from ctuq.models import build_unet, make_net_input
from ctuq.operators.base import RayTransform
from ctuq.reconstruct.dip import fit_dip, load_checkpoint, tv_anisotropic


class MatrixRayTransform(RayTransform):
    """A dense-matrix ray transform for tests: exact adjoint by construction."""

    def __init__(self, matrix: np.ndarray, image_shape, measurement_shape, angles):
        self.matrix = torch.as_tensor(matrix, dtype=torch.float32)
        self.image_shape, self.measurement_shape = tuple(image_shape), tuple(measurement_shape)
        self.angles = np.asarray(angles)
        self.device = torch.device("cpu")

    def _forward_raw(self, x):
        return (x.reshape(x.shape[0], -1) @ self.matrix.T).reshape(x.shape[0], *self.measurement_shape)

    def _adjoint_raw(self, y):
        return (y.reshape(y.shape[0], -1) @ self.matrix).reshape(y.shape[0], *self.image_shape)

    def subset(self, idx):
        rows = self.matrix.reshape(*self.measurement_shape, -1)[list(idx)].reshape(-1, self.matrix.shape[1])
        return MatrixRayTransform(
            rows.numpy(), self.image_shape, (len(idx), self.measurement_shape[1]), self.angles[list(idx)]
        )

    def to(self, device):
        if torch.device(device).type != "cpu":
            raise ValueError("MatrixRayTransform is CPU-only")
        return self


def parallel_problem(n=32, n_angles=8, n_det=48, noise=0.01, seed=0):
    """Two-ellipse phantom (values in [0, 1]), its noisy sinogram, the operator and ASTRA's FBP of it."""
    vol = astra.create_vol_geom(n, n)
    angles = np.linspace(0, np.pi, n_angles, endpoint=False)
    proj = astra.create_proj_geom("parallel", n / n_det, n_det, angles)
    pid = astra.create_projector("linear", proj, vol)
    mid = astra.projector.matrix(pid)
    op = MatrixRayTransform(astra.matrix.get(mid).toarray(), (n, n), (n_angles, n_det), angles)
    astra.matrix.delete(mid)
    yy, xx = np.mgrid[:n, :n] / n - 0.5
    x = 0.5 * ((xx**2 / 0.16 + yy**2 / 0.09) < 1) + 0.5 * (((xx - 0.1) ** 2 + (yy + 0.05) ** 2) < 0.01)
    x = torch.as_tensor(x, dtype=torch.float32)
    y0 = op(x)
    gen = torch.Generator().manual_seed(seed)
    y = y0 + noise * float(y0.abs().mean()) * torch.randn(y0.shape, generator=gen)

    sid = astra.data2d.create("-sino", proj, y.numpy())
    rid = astra.data2d.create("-vol", vol)
    cfg = astra.astra_dict("FBP")
    cfg.update(ProjectorId=pid, ProjectionDataId=sid, ReconstructionDataId=rid, FilterType="hann")
    aid = astra.algorithm.create(cfg)
    astra.algorithm.run(aid)
    fbp = torch.as_tensor(astra.data2d.get(rid), dtype=torch.float32)
    astra.algorithm.delete(aid)
    astra.data2d.delete([sid, rid])
    astra.projector.delete(pid)
    return op, x, y, fbp


@pytest.fixture(scope="module")
def problem():
    return parallel_problem()


@pytest.mark.slow
def test_dip_beats_fbp_on_tiny_phantom(problem):
    op, x, y, fbp = problem
    torch.manual_seed(0)
    model = build_unet("tiny")
    res = fit_dip(
        op,
        y,
        model=model,
        net_input=make_net_input(op.image_shape, seed=0),
        iterations=300,
        lr=3e-3,
        tv_weight=1e-3,
        ground_truth=x,
        seed=0,
        progress=False,
    )
    p_fbp, p_dip = psnr(fbp, x), psnr(res.reconstruction, x)
    # Seed 0: FBP 21.8 dB, DIP 24.9 dB (seeds 1, 2: 24.9, 25.4); require a 1.5 dB margin.
    assert p_dip > p_fbp + 1.5, (p_fbp, p_dip)
    assert res.reconstruction.shape == op.image_shape and res.reconstruction.dtype == torch.float32
    assert len(res.loss_history) == 300 and len(res.psnr_history) == 300
    assert res.best_loss == min(res.loss_history) == res.loss_history[res.best_iteration]
    # the returned model holds the best weights, and the reconstruction is g(best weights)
    with torch.no_grad():
        again = model(res.net_input)[0, 0] / res.scale
    assert torch.equal(again, res.reconstruction)


def test_loss_is_mean_squared_residual_plus_summed_tv(problem):
    op, x, y, _ = problem

    class Fixed(torch.nn.Module):
        def __init__(self, image):
            super().__init__()
            self.image = torch.nn.Parameter(image.clone()[None, None])

        def forward(self, _):
            return self.image

    scale, gamma = 3.0, 0.01
    image = 0.7 * x * scale
    res = fit_dip(
        op,
        y,
        model=Fixed(image),
        net_input=torch.zeros(1, 1, *op.image_shape),
        iterations=1,
        lr=1e-3,
        tv_weight=gamma,
        scale=scale,
        progress=False,
    )
    data = float((op(image) - scale * y).pow(2).mean())
    tv = float((image[1:] - image[:-1]).abs().sum() + (image[:, 1:] - image[:, :-1]).abs().sum())
    assert math.isclose(res.data_loss_history[0], data, rel_tol=1e-5)
    assert math.isclose(res.tv_history[0], tv, rel_tol=1e-5)
    assert math.isclose(res.loss_history[0], data + gamma * tv, rel_tol=1e-5)
    # best weights are those *before* the step, so the reconstruction is the input image / scale
    assert torch.allclose(res.reconstruction, image / scale)


class Interrupt(Exception):
    pass


def _fit(op, y, x, ckpt, iterations, *, resume=False, stop_at=None, **kw):
    torch.manual_seed(1)
    model = build_unet("tiny", dropout=0.1)  # dropout makes the RNG state part of what must be restored

    def cb(it, info):
        if stop_at is not None and it == stop_at:
            raise Interrupt

    return fit_dip(
        op,
        y,
        model=model,
        net_input=make_net_input(op.image_shape, seed=1),
        iterations=iterations,
        lr=2e-3,
        tv_weight=1e-3,
        scale=2.0,
        ground_truth=x,
        checkpoint_path=ckpt,
        checkpoint_every=3,
        resume=resume,
        seed=4,
        progress=False,
        callback=cb,
        **kw,
    )


def test_interrupted_and_resumed_run_is_bit_identical(problem, tmp_path):
    op, x, y, _ = problem
    full = _fit(op, y, x, tmp_path / "full.pt", 12)
    ckpt = tmp_path / "run.pt"
    with pytest.raises(Interrupt):
        _fit(op, y, x, ckpt, 12, stop_at=7)  # killed during iteration 7; last checkpoint after 6
    assert load_checkpoint(ckpt)["iteration"] == 6
    resumed = _fit(op, y, x, ckpt, 12, resume=True)
    assert resumed.resumed_from == 6
    assert resumed.loss_history == full.loss_history
    assert resumed.psnr_history == full.psnr_history
    assert resumed.best_iteration == full.best_iteration
    for key in full.final_state_dict:
        assert torch.equal(resumed.final_state_dict[key], full.final_state_dict[key]), key
        assert torch.equal(resumed.best_state_dict[key], full.best_state_dict[key]), key
    assert torch.equal(resumed.reconstruction, full.reconstruction)
    # the finished checkpoint records the whole run and its fixed input
    done = load_checkpoint(ckpt)
    assert done["iteration"] == 12 and len(done["history"]["loss"]) == 12
    assert torch.equal(done["net_input"], make_net_input(op.image_shape, seed=1))
    assert done["model_config"]["dropout"] == 0.1


def test_resume_continues_to_more_iterations_and_rejects_other_settings(problem, tmp_path):
    op, x, y, _ = problem
    ckpt = tmp_path / "run.pt"
    _fit(op, y, x, ckpt, 4)
    longer = _fit(op, y, x, ckpt, 6, resume=True)
    assert longer.resumed_from == 4 and len(longer.loss_history) == 6
    with pytest.raises(CheckpointMismatch, match="its lr is 0.002 but this run has 0.01"):
        torch.manual_seed(1)
        fit_dip(
            op,
            y,
            model=build_unet("tiny", dropout=0.1),
            net_input=make_net_input(op.image_shape, seed=1),
            iterations=8,
            lr=1e-2,
            tv_weight=1e-3,
            scale=2.0,
            checkpoint_path=ckpt,
            resume=True,
            progress=False,
        )
    with pytest.raises(CheckpointMismatch, match="y_sum"):
        _fit(op, y * 1.1, x, ckpt, 8, resume=True)
    with pytest.raises(CheckpointMismatch, match="already done 6 iterations"):
        _fit(op, y, x, ckpt, 5, resume=True)


def test_same_seed_same_result(problem):
    op, x, y, _ = problem
    a = _fit(op, y, x, None, 5)
    b = _fit(op, y, x, None, 5)
    assert a.loss_history == b.loss_history


def test_checkpoint_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"hello": 1}, bad)
    with pytest.raises(ValueError, match="not a ctuq DIP checkpoint"):
        load_checkpoint(bad)


def test_bad_arguments_are_clear(problem):
    op, x, y, _ = problem
    model = build_unet("tiny")
    inp = make_net_input(op.image_shape)
    with pytest.raises(ValueError, match="y has shape"):
        fit_dip(op, y[:3], model=model, net_input=inp, iterations=1)
    with pytest.raises(ValueError, match="net_input has shape"):
        fit_dip(op, y, model=model, net_input=inp[0], iterations=1)
    with pytest.raises(ValueError, match="lr must be positive"):
        fit_dip(op, y, model=model, net_input=inp, iterations=1, lr=-1.0)
    with pytest.raises(ValueError, match="ground_truth has shape"):
        fit_dip(op, y, model=model, net_input=inp, iterations=1, ground_truth=x[:5])
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_path"):
        fit_dip(op, y, model=model, net_input=inp, iterations=1, resume=True)


def test_tv_anisotropic_2d_and_3d():
    x = torch.tensor([[0.0, 1.0], [3.0, 1.0]])
    assert float(tv_anisotropic(x)) == 3.0 + 0.0 + 1.0 + 2.0  # vertical |3-0|, |1-1|; horizontal |1-0|, |1-3|
    v = torch.zeros(3, 4, 5)
    v[1] = 2.0
    assert float(tv_anisotropic(v)) == 2 * 2.0 * 4 * 5  # two jumps of 2 along depth, 20 pixels each
    assert float(tv_anisotropic(v, ndim=2)) == 0.0


def test_tv_baseline_with_odl_pdhg(problem):
    from ctuq.reconstruct.classical import TorchRayTransformOperator, tv_reconstruction

    op, x, y, fbp = problem
    # The ODL wrapper has the exact adjoint of the torch operator.
    T = TorchRayTransformOperator(op)
    u, v = (
        T.domain.element(np.random.default_rng(0).standard_normal(op.image_shape).astype(np.float32)),
        T.range.element(np.random.default_rng(1).standard_normal(op.measurement_shape).astype(np.float32)),
    )
    assert math.isclose(T(u).inner(v), u.inner(T.adjoint(v)), rel_tol=1e-4)
    res = tv_reconstruction(op, y, weight=0.05, iterations=300, progress=False)
    rec = res["reconstruction"]
    assert rec.shape == op.image_shape and float(rec.min()) >= 0.0  # non-negativity constraint
    # Piecewise-constant phantom: TV clearly beats FBP (measured: FBP 21.8 dB, TV ~30 dB).
    assert psnr(rec, x) > psnr(fbp, x) + 3.0
    with pytest.raises(ValueError, match="weight must be positive"):
        tv_reconstruction(op, y, weight=0.0)
