"""The fitted DIP is written and read only through ``ctuq.models.model_file``: ``dip_model.pt`` of the pipeline,
``ctuq uq``'s restore, and pretrained weights. Files without the format tag or of another version are refused naming
the file and the version."""

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


def test_a_file_without_the_format_tag_or_of_an_older_version_is_refused(tmp_path):
    # dip_model.pt as an unreleased ctuq wrote it: no format tag; runs are regenerated, not upgraded
    model, net_input = _tiny(), make_net_input((16, 16), seed=3)
    blob = {"model_config": model.config.to_dict(), "state_dict": model.state_dict(), "net_input": net_input}
    torch.save(dict(blob, scale=14.0), tmp_path / "dip_model.pt")
    with pytest.raises(ModelFileError, match=r"dip_model.pt: not a ctuq model file \(no format tag 'ctuq.model'"):
        read_model_file(tmp_path / "dip_model.pt")
    with pytest.raises(ModelFileError, match="no format tag"):
        _restore(tmp_path)
    torch.save(dict(blob, scale=14.0, format=MODEL_FILE_FORMAT, version=1, input="noise"), tmp_path / "dip_model.pt")
    with pytest.raises(ModelFileError, match=f"model file version 1, this ctuq reads version {MODEL_FILE_VERSION}"):
        read_model_file(tmp_path / "dip_model.pt")


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


def test_pretrained_weights_are_model_files_or_dip_checkpoints(tmp_path):
    model = _tiny()
    path = save_pretrained(tmp_path / "pre.pt", model, scale=14.0, meta={"noise": 0.01})
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == MODEL_FILE_FORMAT and blob["input"] == "fbp" and blob["meta"] == {"noise": 0.01}
    fresh = build_unet("tiny")
    got = load_pretrained(fresh, path)
    assert got["input"] == "fbp" and got["scale"] == 14.0
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # a DIP checkpoint ({"model": ...}: the latest weights of a fit) loads too
    ckpt = tmp_path / "dip_checkpoint.pt"
    torch.save({"version": 1, "model": model.state_dict(), "model_config": model.config.to_dict()}, ckpt)
    fresh = build_unet("tiny")
    load_pretrained(fresh, ckpt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    # the architecture is still checked, naming the setting
    with pytest.raises(ValueError, match=r"model.pretrained: .* was trained with channels = "):
        load_pretrained(build_unet("small"), path)
    # a dict of weights that is neither (a pretrain file of an unreleased ctuq) is refused naming its keys
    torch.save({"version": 1, "state_dict": model.state_dict(), "model_config": model.config.to_dict()}, ckpt)
    with pytest.raises(ModelFileError, match=r"^model.pretrained: .* neither a ctuq model file nor a DIP checkpoint"):
        load_pretrained(_tiny(), ckpt)
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="model.pretrained: .*junk.pt could not be read as a torch file"):
        load_pretrained(_tiny(), tmp_path / "junk.pt")
