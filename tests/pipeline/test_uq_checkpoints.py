"""The CT inference's checkpoint module (ctuq.pipeline.checkpoints): file names from the run-folder contract,
version and fingerprint checks, and the refusals of a sharded resume — without running an inference."""

import pytest
import torch

from ctuq.config import UQConfig, load_config
from ctuq.errors import CheckpointMismatch, is_user_error
from ctuq.inference import LocalShard
from ctuq.pipeline import checkpoints
from ctuq.pipeline import run_folder as rf


class _Ranks(LocalShard):
    """A shard of ``world_size`` ranks without a process group (only its rank arithmetic is used here)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def test_moments_file_names_come_from_the_run_folder_contract(tmp_path):
    assert checkpoints.moments_file_name(LocalShard()) == rf.UQ_MOMENTS_NAME
    name = checkpoints.moments_file_name(_Ranks(1, 2))
    assert name == rf.UQ_MOMENTS_SHARD_PATTERN.format(rank=1, world=2) == "uq_moments.rank1of2.pt"
    for r in range(2):
        (tmp_path / checkpoints.moments_file_name(_Ranks(r, 2))).write_bytes(b"")
    (tmp_path / rf.UQ_MOMENTS_NAME).write_bytes(b"")
    assert [p.name for p in checkpoints.shard_moments_files(tmp_path)] == [
        "uq_moments.rank0of2.pt",
        "uq_moments.rank1of2.pt",
    ]
    assert checkpoints.shard_world_sizes(tmp_path) == {2}


def test_sharded_resume_is_refused_with_another_rank_count_or_single_process_sums(tmp_path):
    (tmp_path / "uq_moments.rank0of2.pt").write_bytes(b"")
    with pytest.raises(CheckpointMismatch, match=r"written by 2 rank\(s\), this run has 3.*--nproc_per_node=2"):
        checkpoints.check_shard_checkpoints(tmp_path, _Ranks(0, 3))
    checkpoints.check_shard_checkpoints(tmp_path, _Ranks(1, 2))  # the same rank count resumes
    (tmp_path / rf.UQ_MOMENTS_NAME).write_bytes(b"")
    with pytest.raises(CheckpointMismatch, match="single-process run; resume without torchrun"):
        checkpoints.check_shard_checkpoints(tmp_path, _Ranks(1, 2))


def test_checkpoint_round_trip_version_and_fingerprint(tmp_path):
    path = tmp_path / rf.UQ_STATE_NAME
    fp = {"c": 10, "seed": 0, "samples": 8}
    checkpoints.save_uq_checkpoint(path, fp, stage="em", posterior={"a": torch.tensor(2.0)})
    state = checkpoints.load_uq_checkpoint(path, fp)
    assert list(state) == ["version", "fingerprint", "stage", "posterior"]
    assert state["version"] == checkpoints.UQ_STATE_VERSION and state["stage"] == "em"
    with pytest.raises(CheckpointMismatch, match="samples") as info:
        checkpoints.load_uq_checkpoint(path, dict(fp, samples=16))
    assert is_user_error(info.value)
    torch.save({"version": 1, "fingerprint": fp}, path)
    with pytest.raises(CheckpointMismatch, match=r"version 1.*reads version 2.*delete"):
        checkpoints.load_uq_checkpoint(path, fp)


def test_fingerprint_names_later_settings_only_when_changed():
    class Net:
        d = 3

        @staticmethod
        def params():
            return torch.arange(3.0)

    class Op:
        image_shape, c = (2, 2), 6

    y = torch.ones(2, 3)
    base = checkpoints.uq_fingerprint(Net, Op, y, 2.0, 0, UQConfig())
    assert "sdd_step" not in base and base["samples"] == UQConfig().samples and base["y_sum"] == 12.0
    changed = checkpoints.uq_fingerprint(Net, Op, y, 2.0, 0, UQConfig(sdd_step=UQConfig().sdd_step * 2))
    assert changed["sdd_step"] == UQConfig().sdd_step * 2
    # uq.noise joined the fingerprint when homoscedastic was its default: a run resolved to homoscedastic (the
    # default auto on a scan without counts) fingerprints as checkpoints written then did, per_ray as per_ray did
    plain = checkpoints.uq_fingerprint(Net, Op, y, 2.0, 0, UQConfig(noise="homoscedastic"))
    assert "noise" not in plain and plain == {k: v for k, v in base.items() if k != "noise"}
    assert checkpoints.uq_fingerprint(Net, Op, y, 2.0, 0, UQConfig(noise="per_ray"))["noise"] == "per_ray"


# What uq_fingerprint gave before the solvers' config sections (computed with the code of that time, for the Net, Op
# and y of the test above): checkpoints written then carry these dicts and must still resume.
FINGERPRINT_BEFORE = {
    "image_shape": [2, 2],
    "c": 6,
    "d": 3,
    "y_sum": 12.0,
    "weights_sum": 3.0,
    "weights_sq_sum": 5.0,
    "scale": 2.0,
    "seed": 0,
    "prior": "gprior",
    "gprior_method": "exact",
    "gprior_probes": 256,
    "solver": "auto",
    "preconditioner": "nystrom",
    "rank": 400,
    "oversampling": 10,
    "cg_tol": 0.001,
    "cg_max_iter": 150,
    "em_steps": 5,
    "em_samples": 16,
    "em_tol": 0.01,
    "prior_precision": 100.0,
    "noise_variance": None,
    "learn_noise": True,
    "samples": 1024,
    "sample_chunk": 64,
    "roi": "inner_square",
    "patch_sizes": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    "noise": "auto",
}
FLAT_OVERRIDES = [
    "uq.solver=cg",
    "uq.rank=20",
    "uq.cg_tol=1e-5",
    "uq.first_order_tol=1e-3",
    "uq.sdd_batch=7",
    "uq.adaptive_rank=true",
]
FLAT_BEFORE = dict(
    FINGERPRINT_BEFORE,
    solver="cg",
    rank=20,
    cg_tol=1e-5,
    em_steps=50,
    em_tol=1e-3,
    adaptive_rank=True,
    sdd_batch=7,
    first_order_tol=1e-3,
)
NESTED_OVERRIDES = [
    "uq.solver=cg",
    "uq.cg.rank=20",
    "uq.cg.rtol=1e-5",
    "uq.sdd.rtol=1e-3",
    "uq.sgd.rtol=1e-3",
    "uq.sdd.batch_size=7",
    "uq.cg.adaptive_rank=true",
]


def _fingerprint(settings):
    class Net:
        d = 3

        @staticmethod
        def params():
            return torch.arange(3.0)

    class Op:
        image_shape, c = (2, 2), 6

    return checkpoints.uq_fingerprint(Net, Op, torch.ones(2, 3), 2.0, 0, settings)


def test_the_fingerprint_of_the_same_settings_is_the_dict_of_before():
    assert _fingerprint(UQConfig()) == FINGERPRINT_BEFORE
    # old flat keys and the sections they stand for: the same dict as before
    for overrides in (FLAT_OVERRIDES, NESTED_OVERRIDES):
        fp = _fingerprint(load_config("demo", overrides).uq)
        assert fp == FLAT_BEFORE


def test_options_without_a_flat_key_join_the_fingerprint_when_changed():
    fp = _fingerprint(load_config("demo", ["uq.cg.initial_rank=50", "uq.sgd.rtol=0.05", "uq.sdd.lanczos_steps=9"]).uq)
    assert fp["cg.initial_rank"] == 50 and fp["sdd.lanczos_steps"] == 9
    # sgd.rtol differs from first_order_tol (which is sdd.rtol): both are recorded
    assert fp["sgd.rtol"] == 0.05 and "first_order_tol" not in fp
    assert "cg.initial_rank" not in _fingerprint(UQConfig())
