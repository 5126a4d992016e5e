"""The fitted DIP is written and read only through ``ctuq.models.model_file``: ``dip_model.pt`` of the pipeline,
``ctuq uq``'s restore, and pretrained weights. Files of ctuq 0.1 (no version) still load; newer versions are
refused naming the version."""

from pathlib import Path

import pytest
import torch

from ctuq.config import load_config
from ctuq.models import (
    MODEL_FILE_FORMAT,
    MODEL_FILE_VERSION,
    ModelFileError,
    build_unet,
    make_net_input,
    read_model_file,
    write_model_file,
)
from ctuq.pipeline import RunState, phase_restore_dip
from ctuq.reconstruct.pretrain import load_pretrained, save_pretrained


def _tiny():
    torch.manual_seed(0)
    return build_unet("tiny")


def _restore(out_dir: Path, scale: float = 14.0) -> RunState:
    cfg = load_config("demo", [f"dip.scale={scale}"])
    state = RunState(cfg=cfg, out_dir=out_dir, device=torch.device("cpu"), command="uq")
    phase_restore_dip(state)
    return state


def test_pre_change_dip_model_file_is_read_and_restored(tmp_path):
    # dip_model.pt as ctuq 0.1's `ctuq reconstruct` wrote it: no format, no version.
    model, net_input = _tiny(), make_net_input((16, 16), seed=3)
    torch.save(
        {
            "model_config": model.config.to_dict(),
            "state_dict": model.state_dict(),
            "net_input": net_input,
            "scale": 14.0,
            "best_iteration": 7,
        },
        tmp_path / "dip_model.pt",
    )
    mf = read_model_file(tmp_path / "dip_model.pt", need_input=True)
    assert mf.version == 0 and mf.best_iteration == 7 and mf.input == "noise" and mf.scale == 14.0
    state = _restore(tmp_path)
    with torch.no_grad():
        expected = model.eval()(net_input)[0, 0] / 14.0
    torch.testing.assert_close(state.images["dip"], expected)
    assert torch.equal(state.net_input, net_input)


def test_written_model_file_round_trips_through_restore(tmp_path):
    model, net_input = _tiny(), make_net_input((16, 16), seed=1)
    write_model_file(
        tmp_path / "dip_model.pt",
        model,
        scale=14.0,
        net_input=net_input,
        best_iteration=3,
        meta={"dip": {"iterations": 4}},
    )
    blob = torch.load(tmp_path / "dip_model.pt", weights_only=True)
    assert blob["format"] == MODEL_FILE_FORMAT and blob["version"] == MODEL_FILE_VERSION
    state = _restore(tmp_path)
    assert state.images["dip"].shape == (16, 16)
    with pytest.raises(ValueError, match=r"dip.scale = 10: the DIP in .*dip_model.pt was fitted with scale 14"):
        _restore(tmp_path, scale=10.0)


def test_newer_version_is_refused_naming_the_version(tmp_path):
    model = _tiny()
    path = tmp_path / "dip_model.pt"
    torch.save(
        {
            "format": "ctuq.model",
            "version": 99,
            "model_config": model.config.to_dict(),
            "state_dict": model.state_dict(),
            "net_input": make_net_input((16, 16)),
            "scale": 14.0,
        },
        path,
    )
    with pytest.raises(ModelFileError, match=r"dip_model.pt: model file version 99 is newer than this ctuq reads"):
        read_model_file(path)
    with pytest.raises(ModelFileError, match="version 99"):
        _restore(tmp_path)
    with pytest.raises(ModelFileError, match=r"^model.pretrained: .*version 99"):
        load_pretrained(_tiny(), path)


def test_restore_without_model_file_uses_the_checkpoint_or_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="has neither dip_model.pt nor dip_checkpoint.pt"):
        _restore(tmp_path)
    model, net_input = _tiny(), make_net_input((16, 16), seed=2)
    torch.save(
        {
            "version": 1,
            "model_config": model.config.to_dict(),
            "best_state": model.state_dict(),
            "net_input": net_input,
            "meta": {"scale": 14.0},
        },
        tmp_path / "dip_checkpoint.pt",
    )
    state = _restore(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(state.images["dip"], model.eval()(net_input)[0, 0] / 14.0)


def test_pretrained_weights_are_model_files_and_old_formats_still_load(tmp_path):
    model = _tiny()
    path = save_pretrained(tmp_path / "pre.pt", model, scale=14.0, meta={"noise": 0.01})
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == MODEL_FILE_FORMAT and blob["input"] == "fbp" and blob["meta"] == {"noise": 0.01}
    fresh = build_unet("tiny")
    got = load_pretrained(fresh, path)
    assert got["input"] == "fbp" and got["scale"] == 14.0
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # a DIP checkpoint ({"model": ...}) still loads (ctuq 0.1's pretrain output: tests/test_config.py's bundled
    # demo weights)
    ckpt = tmp_path / "dip_checkpoint.pt"
    torch.save({"version": 1, "model": model.state_dict(), "model_config": model.config.to_dict()}, ckpt)
    fresh = build_unet("tiny")
    load_pretrained(fresh, ckpt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # the architecture is still checked, naming the setting
    with pytest.raises(ValueError, match=r"model.pretrained: .* was trained with channels = "):
        load_pretrained(build_unet("small"), path)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="model.pretrained: .*junk.pt could not be read as a torch file"):
        load_pretrained(_tiny(), tmp_path / "junk.pt")
