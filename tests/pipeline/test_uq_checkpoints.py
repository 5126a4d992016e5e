"""The CT inference's checkpoint module (ctuq.pipeline.checkpoints): file names from the run-folder contract,
version and fingerprint checks, and the refusals of a sharded resume — without running an inference."""

import pytest
import torch

from ctuq.config import UQConfig, load_config
from ctuq.config.engine import to_dict
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


def _fingerprint(settings):
    class Net:
        d = 3

        @staticmethod
        def params():
            return torch.arange(3.0)

    class Op:
        image_shape, c = (2, 2), 6

    return checkpoints.uq_fingerprint(Net, Op, torch.ones(2, 3), 2.0, 0, settings)


def test_the_fingerprint_holds_the_settings_as_config_yaml_does():
    base = _fingerprint(UQConfig())
    sizes = {"image_shape": [2, 2], "c": 6, "d": 3, "y_sum": 12.0, "weights_sum": 3.0, "weights_sq_sum": 5.0}
    assert {k: base[k] for k in sizes} == sizes and (base["scale"], base["seed"]) == (2.0, 0)
    written = {
        k: v for k, v in checkpoints._dotted(to_dict(UQConfig())).items() if k not in checkpoints._NOT_FINGERPRINTED
    }
    assert {k: base[k] for k in written} == written and written["samples"] == UQConfig().samples
    # solver auto: no solver section until the run resolves it (its defaults are the same numbers)
    assert not any(k.startswith(("cg.", "sdd.", "sgd.")) for k in base)
    cg = _fingerprint(load_config("demo", ["uq.solver=cg", "uq.cg.rank=20"]).uq)
    assert cg["solver"] == "cg" and cg["cg.rank"] == 20 and cg["cg.rtol"] == UQConfig().cg.rtol
    # another solver's section set away from its defaults is recorded too (whole); the prior's section with its prior
    other = _fingerprint(load_config("demo", ["uq.sdd.step_size=0.5", "uq.prior=tv_predcp"]).uq)
    assert other["sdd.step_size"] == 0.5 and other["sdd.max_iter"] == UQConfig().sdd.max_iter
    assert not any(k.startswith(("cg.", "sgd.")) for k in other) and other["tv_predcp.steps"] == 100


def test_settings_that_leave_the_numbers_alone_are_not_fingerprinted():
    base = _fingerprint(UQConfig())
    same = ["uq.calibration=none", "uq.save_samples=true", "uq.memory_budget_gb=2", "uq.chunk_size=7"]
    assert _fingerprint(load_config("demo", same).uq) == _fingerprint(load_config("demo").uq)
    assert not set(base) & checkpoints._NOT_FINGERPRINTED


def test_a_changed_section_option_is_named_in_the_mismatch(tmp_path):
    path = tmp_path / rf.UQ_STATE_NAME
    checkpoints.save_uq_checkpoint(path, _fingerprint(load_config("demo", ["uq.solver=cg"]).uq), stage="em")
    now = _fingerprint(load_config("demo", ["uq.solver=cg", "uq.cg.rank=20"]).uq)
    with pytest.raises(CheckpointMismatch, match=r"its cg.rank is 400 but this run has 20"):
        checkpoints.load_uq_checkpoint(path, now)
