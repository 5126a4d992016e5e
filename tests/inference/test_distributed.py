"""Scale issue, part 3: sample sharding with torch.distributed (gloo, 2 CPU processes spawned from the test)
against one process — the linearised inference directly (with an interruption and a per-rank resume) and the
`torchrun -m ctuq uq` command line."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from ctuq.errors import CheckpointMismatch
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.inference import LocalShard
from ctuq.models import UNet, make_net_input
from ctuq.operators import SparseRayTransform
from ctuq.pipeline.checkpoints import check_shard_checkpoints
from ctuq.pipeline.uq import UQSettings, run_linearized_uq

TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem():
    """16² image, 30 angles × 32 detector pixels (c = 960), a small U-Net (d = 676)."""
    torch.manual_seed(0)
    op = SparseRayTransform(
        VolumeGeometry((16, 16), 1.0),
        ProjectionGeometry("parallel", (32,), angles=np.linspace(0, np.pi, 30, endpoint=False), det_spacing=0.6),
    )
    model = UNet(channels=(4, 4), skip_channels=(0, 2), norm_groups=2)
    net_input = make_net_input((16, 16), seed=1, std=1.0)
    yy, xx = np.mgrid[:16, :16] / 16 - 0.5
    x_true = torch.as_tensor(0.3 * ((xx**2 + yy**2) < 0.12), dtype=torch.float32)
    y = op(x_true) + 0.02 * torch.randn(op.measurement_shape, generator=torch.Generator().manual_seed(2))
    return op, model, net_input, y


def _settings(solver: str) -> UQSettings:
    # sdd: a short budget (the solves stop short and warn; sharding must not change what they return)
    return UQSettings(
        solver=solver,
        rank=40,
        em_steps=2,
        em_samples=5,
        samples=20,
        sample_chunk=5,
        patch_sizes=[1, 2],
        roi="full",
        gprior_method="stochastic",
        gprior_probes=32,
        sdd_iterations=40,
        first_order_tol=1e-3,
    )


def _summary(res) -> dict:
    return {
        "std": res.std.double().numpy(),
        "a": res.a,
        "sigma2": res.sigma2,
        "n": res.n_samples,
        "patch2": res.moments.state_dict()["patch_sums"]["2"].numpy(),
        "em": [r["a_new"] for r in res.em_trace],
    }


class _Interrupt(Exception):
    pass


def _worker(rank: int, world: int, port: int, solver: str, work: str, out: str) -> None:
    """One rank: a sharded run interrupted after one of its two chunks, then resumed from the per-rank checkpoints."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore")

    from ctuq.inference import TorchShard, shutdown
    from ctuq.metrics import SampleMoments

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    clean = False
    try:
        op, model, net_input, y = _problem()
        shard = TorchShard()
        settings = _settings(solver)
        original = SampleMoments.update
        calls = [0]

        def failing(self, chunk):  # every rank stops after its first chunk, before any collective
            calls[0] += 1
            if calls[0] > 1:
                raise _Interrupt
            return original(self, chunk)

        SampleMoments.update = failing
        try:
            run_linearized_uq(
                model,
                net_input,
                op,
                y,
                scale=3.0,
                settings=settings,
                seed=0,
                work_dir=work,
                progress=False,
                shard=shard,
                moments_checkpoint_seconds=0.0,
            )
        except _Interrupt:
            pass
        finally:
            SampleMoments.update = original
        assert os.path.isfile(os.path.join(work, f"uq_moments.rank{rank}of{world}.pt"))
        res = run_linearized_uq(
            model,
            net_input,
            op,
            y,
            scale=3.0,
            settings=settings,
            seed=0,
            work_dir=work,
            resume=True,
            progress=False,
            shard=shard,
            moments_checkpoint_seconds=0.0,
        )
        if rank == 0:
            torch.save(_summary(res), out)
        else:
            assert res.std is None and res.moments is None
        clean = True
    finally:
        shutdown(clean=clean)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.filterwarnings("ignore::ctuq.inference.ConvergenceWarning")
@pytest.mark.parametrize("solver", ["cg", "sdd"])
def test_two_gloo_ranks_equal_one_process_and_resume_per_rank(solver, tmp_path):
    op, model, net_input, y = _problem()
    single = _summary(
        run_linearized_uq(model, net_input, op, y, scale=3.0, settings=_settings(solver), seed=0, progress=False)
    )
    out = str(tmp_path / "rank0.pt")
    ctx = mp.start_processes(
        _worker, args=(2, _free_port(), solver, str(tmp_path / "run"), out), nprocs=2, join=False, start_method="spawn"
    )
    import time

    deadline = time.time() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 2-rank run did not finish within {TIMEOUT_S} s")
    sharded = torch.load(out, weights_only=False)
    assert sharded["n"] == single["n"] == 20
    # The same EM probes and sample chunks, solved on other ranks in other batches: equal up to float32 product
    # round-off and float64 summation order (patch covariances to 1e-3 relative or 1e-7 absolute against a
    # diagonal of ~1e-3: a small off-diagonal entry carries the round-off of the whole patch).
    np.testing.assert_allclose(sharded["em"], single["em"], rtol=1e-4)
    np.testing.assert_allclose(sharded["std"], single["std"], rtol=1e-3, atol=1e-7)
    np.testing.assert_allclose(sharded["patch2"], single["patch2"], rtol=1e-3, atol=1e-7)
    # resuming with another number of ranks is refused, naming the count that wrote the checkpoints
    with pytest.raises(CheckpointMismatch, match="written by 2 rank\\(s\\), this run has 3"):

        class Three(LocalShard):
            rank, world_size = 0, 3

        check_shard_checkpoints(tmp_path / "run", Three())


def test_distributed_flag_without_torchrun_is_a_clear_error(tmp_path, monkeypatch, capsys):
    from ctuq.cli import main

    (tmp_path / "config.yaml").write_text("device: cpu\n")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["uq", str(tmp_path), "--distributed", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--distributed: the environment lacks RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in err
    assert "torchrun --nproc_per_node=N -m ctuq uq RUN_DIR" in err


def test_torchrun_uq_command_matches_one_process(tmp_path):
    """`torchrun --nproc_per_node=2 -m ctuq uq RUN` (gloo) writes the metrics a single `ctuq uq RUN` writes."""
    from ctuq.cli import main
    from ctuq.data.simulate import simulate_scan

    scan = tmp_path / "scan" / "Walnut1"
    simulate_scan(scan, preset="tiny", progress=False)
    base = [
        "--data",
        str(scan),
        "--set",
        "data.image_shape=[32, 32]",
        "--set",
        "data.angular_subsampling=2",
        "--set",
        "data.detector_subsampling=3",
        "--set",
        "dip.iterations=30",
        "--set",
        "model.preset=tiny",
        "--set",
        "tv.enabled=false",
        "--no-progress",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["reconstruct", *base, "--no-uq", "--out", str(one)]) == 0
    import shutil

    shutil.copytree(one, two)
    uq = [
        "--set",
        "uq.solver=cg",
        "--set",
        "uq.rank=50",
        "--set",
        "uq.samples=24",
        "--set",
        "uq.sample_chunk=6",
        "--set",
        "uq.em_steps=2",
        "--set",
        "uq.em_samples=4",
        "--set",
        "uq.patch_sizes=[1, 2]",
        # a sharded run has no held-out check, so uq.calibration = auto would differ from one process by design
        "--set",
        "uq.calibration=none",
        "--no-progress",
    ]
    assert main(["uq", str(one), *uq]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CTUQ_NO_PROGRESS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_port",
        str(_free_port()),
        "-m",
        "ctuq",
        "uq",
        str(two),
        *uq,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    assert m2["uq"]["stats"]["world_size"] == 2 and m2["uq"]["n_samples"] == m1["uq"]["n_samples"] == 24
    for key in ("a", "sigma2", "mean_std"):
        assert m2["uq"][key] == pytest.approx(m1["uq"][key], rel=1e-3), key
    assert m2["marginal_ll"] == pytest.approx(m1["marginal_ll"], rel=1e-3)
    assert not list(two.glob("uq_moments*"))  # per-rank running sums removed after a finished run
