"""Scale issue, part 2: the 3D path on the CPU — a 3D parallel-beam operator assembled slice by slice from
ASTRA's 2D projectors, a simulated volume, and the whole 3D pipeline (3D U-Net DIP, inference, streaming 3D
statistics, orthogonal-slice figures, converged EM, per-phase timings); the walnut_3d configs and their CPU error."""

import json

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import SlicewiseParallelRayTransform, make_ray_transform
from ctuq.operators.fbp import fbp, fdk


@pytest.fixture(scope="module")
def op():
    return SlicewiseParallelRayTransform(
        VolumeGeometry((6, 10, 12), 0.5), np.linspace(0, np.pi, 9, endpoint=False), 16, 0.5
    )


def test_slicewise_operator_is_the_2d_operator_per_slice_with_an_exact_adjoint(op):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *op.image_shape, generator=g, dtype=torch.float64).float()
    y = torch.randn(2, *op.measurement_shape, generator=g, dtype=torch.float64).float()
    assert op.measurement_shape == (9, 6, 16) and op.c == 9 * 6 * 16
    lhs, rhs = float((op(x).double() * y.double()).sum()), float((x.double() * op.adjoint(y).double()).sum())
    assert lhs == pytest.approx(rhs, rel=1e-5)
    for k in range(6):  # detector row k is slice k's 2D sinogram
        torch.testing.assert_close(op(x)[:, :, k], op.slice_operator(x[:, k]))
    # its parallel3d geometry has the 2D rays and detector axis per slice, rows along +z at the voxel pitch
    v3, v2 = op.geometry.to_vectors().vectors, op.slice_operator.geometry.to_vectors().vectors
    np.testing.assert_allclose(v3[:, [0, 1, 6, 7]], v2[:, [0, 1, 4, 5]], atol=1e-12)
    np.testing.assert_allclose(v3[:, 9:12], np.tile([0.0, 0.0, 0.5], (9, 1)), atol=1e-12)
    # hence FDK (parallel3d, pure torch) is the 2D FBP of every slice
    torch.testing.assert_close(
        fdk(op, op(x[0])), fbp(op.slice_operator, op(x[0]).permute(1, 0, 2)), rtol=1e-4, atol=1e-5
    )
    # angle subsets and the autograd wrapper work as for every backend
    sub = op.subset([0, 4])
    torch.testing.assert_close(sub(x), op(x)[:, [0, 4]])
    xr = x[:1].clone().requires_grad_(True)
    (op(xr) * y[:1]).sum().backward()
    torch.testing.assert_close(xr.grad, op.adjoint(y[:1]))


def test_make_ray_transform_builds_it_from_a_parallel3d_geometry():
    vol = VolumeGeometry((4, 8, 8), 1.0)
    geom = ProjectionGeometry(
        "parallel3d", (4, 12), angles=np.linspace(0, np.pi, 5, endpoint=False), det_spacing=(1.0, 1.0)
    )
    assert isinstance(make_ray_transform(vol, geom, backend="sparse"), SlicewiseParallelRayTransform)
    with pytest.raises(ValueError, match=r"detector rows \(3, pitch 1.0 mm\) must coincide with the volume's slices"):
        make_ray_transform(
            vol, ProjectionGeometry("parallel3d", (3, 12), angles=[0.0], det_spacing=(1.0, 1.0)), backend="sparse"
        )
    cone = ProjectionGeometry(
        "cone", (4, 12), angles=[0.0], det_spacing=(1.0, 1.0), source_origin=50.0, origin_det=50.0
    )
    with pytest.raises(ValueError, match="cone-beam volumes need 'astra_cuda'"):
        make_ray_transform(vol, cone, backend="sparse")


def test_simulated_volume_and_its_errors():
    from ctuq.data.volume import simulate_parallel_volume

    d = simulate_parallel_volume((8, 8, 8), n_angles=5, noise=0.0, seed=1)
    assert d.y.shape == (5, 8, 12) and d.ground_truth.shape == (8, 8, 8) and d.geometry.kind == "parallel3d"
    # exact line integrals of the phantom vs T of its voxel averages: equal up to the discretisation of a 5 mm
    # voxel grid (measured 0.31 at 8³, 0.12 at 24³: no inverse crime)
    rel = float((d.op(d.ground_truth) - d.y).norm() / d.y.norm())
    assert rel < 0.4
    with pytest.raises(ValueError, match=r"shape must be 3 ints >= 2 \(D, H, W\)"):
        simulate_parallel_volume((8, 8))
    with pytest.raises(ValueError, match="noise must be >= 0"):
        simulate_parallel_volume((4, 4, 4), noise=-1.0)


@pytest.mark.slow
def test_the_3d_pipeline_runs_end_to_end_on_the_cpu(tmp_path):
    """3D U-Net DIP → linearised inference over the volume (adaptive-rank CG, EM until a and σ² both settle) → 3D
    streaming statistics → std volume, 2D patch likelihoods per slice, orthogonal-slice figure, per-phase timings."""
    import tifffile

    from ctuq.config import load_config
    from ctuq.data.volume import simulate_parallel_volume
    from ctuq.pipeline import reconstruct_problem

    data = simulate_parallel_volume((8, 8, 8), n_angles=8, noise=0.01, seed=0)  # 8³ shows every 3D step
    cfg = load_config(
        "demo",
        [
            "model.preset=tiny",
            "dip.iterations=20",
            "tv.enabled=true",
            "uq.solver=cg",
            "uq.cg.rank=400",
            "uq.cg.adaptive_rank=true",
            "uq.prior_precision=0.3",
            "uq.gprior.method=stochastic",
            "uq.gprior.probes=16",
            "uq.em_steps=25",
            "uq.em_samples=2",
            "uq.em_tol=0.05",
            "uq.em_stop_on=a_and_sigma2",
            "uq.samples=8",
            "uq.sample_chunk=4",
            "uq.patch_sizes=[1, 2]",
        ],
    )
    state = reconstruct_problem(cfg, tmp_path / "run", data, progress=False)
    out = tmp_path / "run"
    for name in (
        "reconstruction.tif",
        "std.tif",
        "fbp.tif",
        "ground_truth.tif",
        "uncertainty_slices.png",
        "uncertainty.png",
        "calibration.png",
        "metrics.json",
        "dip_model.pt",
    ):
        assert (out / name).is_file(), name
    m = json.loads((out / "metrics.json").read_text())
    assert m["data"]["ndim"] == 3 and m["data"]["operator"] == "SlicewiseParallelRayTransform"
    assert m["uq"]["stats"]["d_x"] == 8**3 and m["uq"]["n_samples"] == 8
    assert m["uq"]["stats"]["preconditioner"]["adaptive"] == {"cap": 400, "threshold": 1.0}
    assert m["uq"]["stats"]["em_converged"] and 2 <= len(m["em_trace"]) < 25
    last = m["em_trace"][-1]
    assert last["rel_change_a"] < 0.05 and last["rel_change_sigma2"] < 0.05
    assert set(m["joint_ll"]) == {"1", "2"} and m["marginal_ll"] is not None
    assert {"fbp", "dip", "uq"} <= set(m["timings"])
    assert {"offset", "gprior", "solver_setup", "em", "prediction"} <= set(m["uq"]["timings"])
    assert "tv.enabled: the TV baseline is 2D only" in " ".join(m["warnings"])
    std = tifffile.imread(out / "std.tif")
    assert std.shape == (8, 8, 8) and (std > 0).all()
    assert state.uq_result.std.shape == (8, 8, 8)


def test_moments_memory_error_names_the_patch_sizes(monkeypatch):
    import ctuq.memory
    from ctuq.pipeline.moments import check_moments_memory, moments_bytes
    from ctuq.pipeline.uq import UQSettings

    s = UQSettings(patch_sizes=[1, 2, 4, 8], roi="inner_square")
    need = moments_bytes((167, 167, 167), s)
    assert need == 8 * (167**3 + sum(117 * (117 // p) ** 2 * p**4 for p in (1, 2, 4, 8)))
    monkeypatch.setattr(ctuq.memory, "free_memory_bytes", lambda device: need)  # 80 % of it is all one may use
    with pytest.raises(
        ValueError,
        match=r"uq.patch_sizes \[1, 2, 4, 8\]: the streaming statistics of a "
        r"167×167×167 image .* need 1.\d GiB",
    ):
        check_moments_memory(s, (167, 167, 167))


@pytest.mark.parametrize("name", ["walnut_3d", "walnut_3d_published"])
def test_walnut_3d_configs_need_cuda_and_say_so(name, capsys):
    from ctuq.cli import main
    from ctuq.config import load_config

    cfg = load_config(name)
    assert cfg.data.ndim == 3 and cfg.uq.solver == "sgd" and cfg.uq.gprior.method == "stochastic"
    if name == "walnut_3d_published":  # exactly the published setting
        assert (cfg.data.orbit, cfg.data.angular_subsampling, cfg.data.detector_subsampling) == (2, 60, 3)
        assert cfg.data.image_shape == [167, 167, 167] and (cfg.data.expect_angles, cfg.data.expect_columns) == (
            20,
            256,
        )
        assert (cfg.uq.em_steps, cfg.uq.em_tol, cfg.uq.noise_variance, cfg.uq.learn_noise) == (4, 0.0, 1.0, False)
    else:  # the default: EM to convergence of a and σ²
        assert cfg.uq.em_stop_on == "a_and_sigma2" and cfg.uq.em_tol > 0 and cfg.uq.learn_noise
    assert main(["reconstruct", "--config", name, "--device", "cpu", "--no-progress"]) == 2
    assert "data.ndim = 3 (volumes) needs device 'cuda'" in capsys.readouterr().err
