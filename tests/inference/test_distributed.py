"""Scale issue, part 3: sample sharding with torch.distributed (gloo, 2 CPU processes spawned from the test)
against one process — the linearised inference directly (with an interruption and a per-rank resume) and the
`torchrun -m ctuq uq` command line."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny import sets

from ctuq.cli import main
from ctuq.errors import CheckpointMismatch
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.inference import LocalShard, TorchShard, shutdown
from ctuq.metrics import SampleMoments
from ctuq.models import UNet, make_net_input
from ctuq.operators import SparseRayTransform
from ctuq.pipeline.checkpoints import check_shard_checkpoints
from ctuq.pipeline.uq import UQRun, UQSettings

TIMEOUT_S = 120
SOLVERS = ("cg", "sdd")  # sharded in one spawn of the two ranks (starting them costs more than both runs)


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
        cg={"rank": 40},
        em_steps=2,
        em_samples=5,
        samples=20,
        sample_chunk=5,
        patch_sizes=[1, 2],
        roi="full",
        gprior={"method": "stochastic", "probes": 32},
        sdd={"max_iter": 40, "rtol": 1e-3},
        sgd={"rtol": 1e-3},
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


def _sharded_run(rank, world, model, net_input, op, y, shard, solver: str, work_dir: str) -> None:
    """The interrupted and resumed sharded run of one rank (see :func:`_worker`)."""
    settings = _settings(solver)
    original = SampleMoments.update
    calls = [0]

    def failing(self, chunk):  # every rank stops after its first chunk, before any collective
        calls[0] += 1
        if calls[0] > 1:
            raise _Interrupt
        return original(self, chunk)

    def run(**kwargs):
        return UQRun(
            model, net_input, op, y, scale=3.0, settings=settings, seed=0, work_dir=work_dir, progress=False,
            shard=shard, moments_checkpoint_seconds=0.0, **kwargs
        ).run()  # fmt: skip

    SampleMoments.update = failing
    try:
        run()
    except _Interrupt:
        pass
    finally:
        SampleMoments.update = original
    assert os.path.isfile(os.path.join(work_dir, f"uq_moments.rank{rank}of{world}.pt"))
    res = run(resume=True)
    if rank == 0:
        torch.save(_summary(res), work_dir + ".pt")
    else:
        assert res.std is None and res.moments is None


class _Interrupt(Exception):
    pass


def _worker(rank: int, world: int, port: int, work: str) -> None:
    """One rank: for each solver of :data:`SOLVERS`, a sharded run interrupted after one of its two chunks, then
    resumed from the per-rank checkpoints in ``work/<solver>``; rank 0 saves the result to ``work/<solver>.pt``."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    clean = False
    try:
        op, model, net_input, y = _problem()
        shard = TorchShard()
        for solver in SOLVERS:
            _sharded_run(rank, world, model, net_input, op, y, shard, solver, os.path.join(work, solver))
        clean = True
    finally:
        shutdown(clean=clean)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::ctuq.inference.ConvergenceWarning")
def test_two_gloo_ranks_equal_one_process_and_resume_per_rank(tmp_path):
    op, model, net_input, y = _problem()
    ctx = mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    # the single-process references while the ranks start
    single = {
        solver: _summary(
            UQRun(model, net_input, op, y, scale=3.0, settings=_settings(solver), seed=0, progress=False).run()
        )
        for solver in SOLVERS
    }
    deadline = time.time() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the 2-rank run did not finish within {TIMEOUT_S} s")
    for solver in SOLVERS:
        sharded = torch.load(tmp_path / f"{solver}.pt", weights_only=False)
        assert sharded["n"] == single[solver]["n"] == 20
        # The same EM probes and sample chunks, solved on other ranks in other batches: equal up to float32 product
        # round-off and float64 summation order (patch covariances to 1e-3 relative or 1e-7 absolute against a
        # diagonal of ~1e-3: a small off-diagonal entry carries the round-off of the whole patch).
        np.testing.assert_allclose(sharded["em"], single[solver]["em"], rtol=1e-4, err_msg=solver)
        np.testing.assert_allclose(sharded["std"], single[solver]["std"], rtol=1e-3, atol=1e-7, err_msg=solver)
        np.testing.assert_allclose(sharded["patch2"], single[solver]["patch2"], rtol=1e-3, atol=1e-7, err_msg=solver)
    # resuming with another number of ranks is refused, naming the count that wrote the checkpoints
    with pytest.raises(CheckpointMismatch, match="written by 2 rank\\(s\\), this run has 3"):

        class Three(LocalShard):
            rank, world_size = 0, 3

        check_shard_checkpoints(tmp_path / SOLVERS[0], Three())


def test_distributed_flag_without_torchrun_is_a_clear_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.yaml").write_text("device: cpu\n")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main(["uq", str(tmp_path), "--distributed", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--distributed: the environment lacks RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in err
    assert "torchrun --nproc_per_node=N -m ctuq uq RUN_DIR" in err


@pytest.mark.slow
def test_torchrun_uq_command_matches_one_process(tiny_run_none, tmp_path):
    """`torchrun --nproc_per_node=2 -m ctuq uq RUN` (gloo) writes the metrics a single `ctuq uq RUN` writes."""
    one, two = (shutil.copytree(tiny_run_none, tmp_path / name) for name in ("one", "two"))
    cg = ("uq.solver=cg", "uq.cg.rank=50", "uq.samples=24", "uq.sample_chunk=6", "uq.em_steps=2", "uq.em_samples=4")
    # a sharded run has no held-out check, so uq.calibration = auto would differ from one process by design
    uq = [*sets(*cg, "uq.patch_sizes=[1, 2]", "uq.calibration=none"), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CTUQ_NO_PROGRESS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port())]
    # the two ranks start in their processes while this one runs the same inference
    proc = subprocess.Popen(
        [*torchrun, "-m", "ctuq", "uq", str(two), *uq],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert main(["uq", str(one), *uq]) == 0
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    assert m2["uq"]["stats"]["world_size"] == 2 and m2["uq"]["n_samples"] == m1["uq"]["n_samples"] == 24
    for key in ("a", "sigma2", "mean_std"):
        assert m2["uq"][key] == pytest.approx(m1["uq"][key], rel=1e-3), key
    assert m2["marginal_ll"] == pytest.approx(m1["marginal_ll"], rel=1e-3)
    assert not list(two.glob("uq_moments*"))  # per-rank running sums removed after a finished run
