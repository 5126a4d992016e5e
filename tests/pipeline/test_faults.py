"""Faults a run must survive with one clear line: a full disk during any write (the file is not written, every
earlier output is intact, no temporary file is left) and damaged or edited state files — DIP and inference
checkpoints, design checkpoints, study folders — refused like a damaged model file (a user error naming the file)."""

import errno
import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from tiny import NO_FIGURES, NO_TV, tiny_args

import ctuq.utils
from ctuq.cli import main
from ctuq.design.dip_prior import DIPPrior
from ctuq.design.engine import DesignEngine
from ctuq.design.factors import DenseFactor
from ctuq.design.greedy import _digest, greedy_design
from ctuq.design.model import DesignModel
from ctuq.errors import CheckpointMismatch, DiskFullError, format_user_error, is_user_error
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import SparseRayTransform
from ctuq.pipeline import checkpoints
from ctuq.reconstruct.dip import load_checkpoint
from ctuq.studies import Log, StudyError, check_study_folder
from ctuq.utils import atomic_path, atomic_torch_save, atomic_write_json, atomic_write_tiff

FAST = tiny_args(
    "data.angular_subsampling=1",
    "model.channels=[2, 2]",
    "model.skip_channels=[0, 1]",
    "dip.iterations=20",
    "dip.checkpoint_every=5",
    *NO_TV,
    "uq.samples=32",
    "uq.sample_chunk=16",
    "uq.em_steps=2",
    *NO_FIGURES,
)


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _one_user_error(exc) -> str:
    assert is_user_error(exc)
    text = format_user_error(exc)
    assert "\n" not in text
    return text


def _no_temporary_files(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


# ------------------------------------------------------------------------------------------------ full disk
def test_every_atomic_writer_turns_a_full_disk_into_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "out.json"
    atomic_write_json(path, {"old": 1})

    def half_written_then_full(tmp):
        tmp.write_text('{"new": ')
        raise _enospc(tmp)

    with pytest.raises(DiskFullError) as info, atomic_path(path) as tmp:
        half_written_then_full(tmp)
    assert _one_user_error(info.value).startswith(f"{path}: no space left on device")
    assert json.loads(path.read_text()) == {"old": 1}
    _no_temporary_files(tmp_path)

    # torch.save reports a failed write as an unspecific RuntimeError: the writer's OSError is what is raised
    def full_after_100_bytes(self, data):
        self.fh.write(bytes(data)[:100])
        self.error = _enospc(self.fh.name)
        raise self.error

    ckpt = tmp_path / "state.pt"
    atomic_torch_save(ckpt, {"step": 1})
    monkeypatch.setattr(ctuq.utils._RecordingWriter, "write", full_after_100_bytes)
    with pytest.raises(DiskFullError, match=f"^{ckpt}: no space left on device"):
        atomic_torch_save(ckpt, {"step": 2, "weights": torch.zeros(1000)})
    monkeypatch.undo()
    assert torch.load(ckpt, weights_only=True) == {"step": 1}

    tif = tmp_path / "image.tif"
    atomic_write_tiff(tif, np.ones((4, 4), np.float32))

    def imwrite_full(file, data, **kw):
        Path(file).write_bytes(b"II*\x00partial")
        raise _enospc(file)

    monkeypatch.setattr(ctuq.utils.tifffile, "imwrite", imwrite_full)
    with pytest.raises(DiskFullError, match=f"^{tif}: no space left on device"):
        atomic_write_tiff(tif, np.zeros((4, 4), np.float32))
    monkeypatch.undo()
    np.testing.assert_array_equal(tifffile.imread(tif), np.ones((4, 4), np.float32))

    def no_inode_left(*args, **kwargs):
        raise _enospc(tmp_path)

    monkeypatch.setattr(ctuq.utils.tempfile, "mkstemp", no_inode_left)
    with pytest.raises(DiskFullError, match=f"^{tmp_path / 'new.json'}: no space left"):
        atomic_write_json(tmp_path / "new.json", {})
    monkeypatch.undo()
    _no_temporary_files(tmp_path)
    assert not (tmp_path / "new.json").exists()


class _FullDiskAt:
    """``ctuq.utils``'s view of ``os`` in which the ``occurrence``-th atomic write onto a file named ``name`` (the
    ``os.replace`` of its temporary file) fails with a full disk after half of its data reached the disk; records
    what every successful write committed."""

    def __init__(self, name: str, occurrence: int = 1):
        self.name, self.occurrence, self.seen = name, occurrence, 0
        self.committed: dict[Path, str] = {}
        self.failed: Path | None = None

    def __getattr__(self, attr):
        return getattr(os, attr)

    def replace(self, src, dst):
        dst = Path(dst)
        if dst.name == self.name:
            self.seen += 1
            if self.seen == self.occurrence:
                data = Path(src).read_bytes()
                Path(src).write_bytes(data[: len(data) // 2])
                self.failed = dst
                raise _enospc(src)
        os.replace(src, dst)
        self.committed[dst] = hashlib.sha256(dst.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("name, occurrence", [("fbp.tif", 1), ("dip_checkpoint.pt", 2), ("std.tif", 1)])
def test_a_full_disk_during_a_run_gives_one_line_and_leaves_earlier_outputs_intact(
    name, occurrence, tiny_scan, tmp_path, monkeypatch, capsys
):
    """The disk fills while fbp.tif is written (an early write), while the DIP checkpoint's second version replaces
    its first, or while the std map is written (after every checkpoint of the inference)."""
    out = tmp_path / "run"
    disk = _FullDiskAt(name, occurrence)
    monkeypatch.setattr(ctuq.utils, "os", disk)
    rc = main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *FAST])
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and disk.failed == out / name
    assert err[-1].startswith(f"ctuq reconstruct: {out / name}: no space left on device"), err
    assert [ln for ln in err if ln.startswith("ctuq reconstruct: ")] == [err[-1]]  # the one error line
    assert len(disk.committed) >= 2  # the lock's record and config.yaml at least
    for path, digest in disk.committed.items():  # every earlier output as it was last written, whole
        if path.name != ".ctuq.lock.json":  # the lock's record goes with the lock
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path
    assert disk.failed.exists() == (disk.failed in disk.committed)
    _no_temporary_files(out)
    assert not (out / "metrics.json").exists()
    if name == "dip_checkpoint.pt":
        assert load_checkpoint(out / name)["iteration"] == 5  # the first version, intact: --resume continues


# ------------------------------------------------------------------------------------------------ damaged state
def test_damaged_dip_and_inference_checkpoints_are_refused_naming_the_file(tmp_path, tiny_scan, capsys):
    ckpt = tmp_path / "dip_checkpoint.pt"
    ckpt.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointMismatch) as info:
        load_checkpoint(ckpt)
    assert _one_user_error(info.value).startswith(f"{ckpt}: not a readable DIP checkpoint")
    torch.save({"version": 1, "iteration": 3}, ckpt)
    with pytest.raises(CheckpointMismatch, match=r"damaged DIP checkpoint \(lacks \['model'"):
        load_checkpoint(ckpt)
    state = tmp_path / "uq_state.pt"
    state.write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointMismatch) as info:
        checkpoints.load_uq_checkpoint(state, {"seed": 0})
    assert _one_user_error(info.value).startswith(f"{state}: not a readable ctuq UQ checkpoint")
    # through the command line: one line, exit 2, before any iteration
    run = tmp_path / "run"
    run.mkdir()
    (run / "dip_checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(run), "--resume", "--no-uq", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ctuq reconstruct: {run / 'dip_checkpoint.pt'}: not a readable DIP checkpoint")


def _design(tmp_path, n_acquire, checkpoint):
    H, K, n_angles = 6, 8, 12
    op = SparseRayTransform(
        VolumeGeometry((H, H), 1.0),
        ProjectionGeometry("parallel", (K,), angles=np.arange(n_angles) * math.pi / n_angles, det_spacing=1.0),
        dtype=torch.float64,
    )
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(H * H, 20, generator=g, dtype=torch.float64)
    model = DesignModel(op, DenseFactor(phi, (H, H)), torch.rand(20, generator=g, dtype=torch.float64) + 0.5, 2.0, 0.3)
    return greedy_design(
        DesignEngine(model, "sampled", n_samples=32, seed=2),
        [0, 6],
        n_acquire,
        criterion="eig",
        angles_deg=np.arange(n_angles) * 15.0,
        jitter=0.01,
        progress=False,
        fingerprint={"problem": "test"},
        checkpoint=checkpoint,
    )


def test_damaged_or_edited_design_checkpoints_are_refused(tmp_path):
    ckpt = tmp_path / "design_state.pt"
    first = _design(tmp_path, 2, ckpt)
    state = torch.load(ckpt, weights_only=True)
    assert [s["candidate"] for s in state["steps"]] == first.acquired and "digest" in state

    def refused(match):
        with pytest.raises(CheckpointMismatch, match=match) as info:
            _design(tmp_path, 3, ckpt)
        assert _one_user_error(info.value).startswith(f"{ckpt}: ")
        assert info.value.args[0].endswith("delete it to start the design afresh")

    edited = dict(state, steps=[dict(s) for s in state["steps"]])
    edited["steps"][1]["candidate"] = next(c for c in range(12) if c not in (0, 6, *first.acquired))
    torch.save(edited, ckpt)  # another angle, digest kept: the replay would silently design something else
    refused("content does not match its digest")
    torch.save({k: v for k, v in state.items() if k != "digest"}, ckpt)  # no digest: not a checkpoint ctuq wrote
    refused("content does not match its digest")
    edited = dict(state, steps=[dict(s) for s in state["steps"]])
    edited["steps"][1]["candidate"] = 99
    edited["digest"] = _digest(edited["fingerprint"], edited["steps"])  # a consistent file of nonsense
    torch.save(edited, ckpt)
    refused(r"step record 2 is damaged .* in \[0, 12\)")
    ckpt.write_bytes(ckpt.read_bytes()[:200])  # truncated
    refused("not a readable design checkpoint")
    torch.save(state, ckpt)  # the untouched file resumes
    assert _design(tmp_path, 3, ckpt).resumed_steps == 2


def test_damaged_retrained_weights_of_a_design_are_refused(tmp_path):
    # only what _retrain reads before it would fit: the stored weights of the DIP retrained after 4 angles
    prior = DIPPrior.__new__(DIPPrior)
    prior.work_dir, prior.net_model, prior.say = tmp_path, torch.nn.Linear(2, 2), print
    stored = tmp_path / "retrain_004.pt"
    stored.write_bytes(b"damaged")
    with pytest.raises(CheckpointMismatch, match=f"^{stored}: not the weights of this design's retrained DIP"):
        prior._retrain([0, 1, 2, 3], 4, True)
    torch.save({"weight": torch.zeros(3, 3)}, stored)  # another network's weights
    with pytest.raises(CheckpointMismatch, match=r"delete it to retrain$"):
        prior._retrain([0, 1, 2, 3], 4, True)


def test_edited_study_folders_are_refused(tmp_path):
    log = Log("test")
    check_study_folder(tmp_path, {"seed": 0, "settings": [4]}, log)
    record = json.loads((tmp_path / "study.json").read_text())
    assert record["options"] == {"seed": 0, "settings": [4]} and len(record["sha256"]) == 64
    check_study_folder(tmp_path, {"seed": 0, "settings": [4, 8]}, log)  # same study, more settings: resumes
    edited = json.loads((tmp_path / "study.json").read_text())
    edited["options"]["seed"] = 1  # edited by hand to pass for another study
    (tmp_path / "study.json").write_text(json.dumps(edited))
    with pytest.raises(StudyError) as info:
        check_study_folder(tmp_path, {"seed": 1, "settings": [4, 8]}, log)
    assert _one_user_error(info.value).startswith(f"{tmp_path / 'study.json'}: its options do not match their digest")
    (tmp_path / "study.json").write_text('{"options": ')
    with pytest.raises(StudyError, match="could not be read as JSON"):
        check_study_folder(tmp_path, {"seed": 1}, log)
