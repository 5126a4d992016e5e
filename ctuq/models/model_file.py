"""One versioned file format for a fitted or pretrained U-Net: ``dip_model.pt`` and ``ctuq pretrain`` output.

Every writer of network weights in ctuq (``ctuq reconstruct``'s ``dip_model.pt``, ``ctuq pretrain``, the walnut
study) goes through :func:`write_model_file`, and every reader through :func:`read_model_file`, so one format
version and one set of error messages serve them all. The file is a plain dict (``torch.load(...,
weights_only=True)`` reads it):

====================  =================================================================================
key                   meaning
====================  =================================================================================
``format``            ``"ctuq.model"``
``version``           :data:`MODEL_FILE_VERSION`
``model_config``      :meth:`ctuq.models.UNetConfig.to_dict` (the architecture)
``state_dict``        weights on the CPU
``scale``             the data/image scale the network was fitted with (network output = scale × mm⁻¹)
``net_input``         the fixed DIP input ``(1, C, *image_shape)``, or ``None`` (pretrained weights)
``input``             ``"noise"`` or ``"fbp"``: what the network expects as its input
``best_iteration``    DIP iteration of the stored weights (``None`` if not a DIP fit)
``meta``              free-form JSON-like dict (summary numbers, training settings)
====================  =================================================================================

A file without the ``format`` tag, or of another version, is refused with a message naming the file and both
versions.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ctuq.errors import CTUQError
from ctuq.models.unet import UNet
from ctuq.utils import atomic_torch_save

__all__ = [
    "MODEL_FILE_FORMAT",
    "MODEL_FILE_VERSION",
    "ModelFile",
    "ModelFileError",
    "write_model_file",
    "read_model_file",
]

MODEL_FILE_FORMAT = "ctuq.model"
MODEL_FILE_VERSION = 2


class ModelFileError(CTUQError):
    """A model file is unreadable, incomplete or of an unknown version; the message names the file (a user error:
    :mod:`ctuq.errors`)."""


@dataclasses.dataclass
class ModelFile:
    """Contents of a model file (see the module docstring for each field); ``version`` is the file's own."""

    model_config: dict
    state_dict: dict
    scale: float
    net_input: torch.Tensor | None = None
    input: str = "noise"
    best_iteration: int | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    version: int = MODEL_FILE_VERSION

    def build(self, device: torch.device | str = "cpu") -> torch.nn.Module:
        """The U-Net with these weights, on ``device``, in eval mode."""
        model = UNet.from_config(self.model_config)
        model.load_state_dict(self.state_dict)
        return model.to(device).eval()


def write_model_file(
    path: str | os.PathLike,
    model: torch.nn.Module,
    *,
    scale: float,
    state_dict: dict | None = None,
    net_input: torch.Tensor | None = None,
    input: str = "noise",
    best_iteration: int | None = None,
    meta: dict | None = None,
) -> Path:
    """Write ``model``'s architecture and weights (``state_dict`` if given, e.g. a DIP's best weights) atomically.

    Parameters
    ----------
    path : path
        Destination (``.pt``); written through a temporary file, so a crash leaves no half-written file.
    model : UNet
        Gives the architecture (``model.config``) and, without ``state_dict``, the weights.
    scale : float
        Data/image scale (> 0) the weights were fitted with.
    net_input : torch.Tensor, optional
        ``(1, C, *image_shape)`` fixed DIP input.
    input : {"noise", "fbp"}
        The kind of input the network expects.
    best_iteration : int, optional
        DIP iteration of the weights.
    meta : dict, optional
        Extra plain values (numbers, strings, lists, dicts, tensors).
    """
    if not hasattr(model, "config"):
        raise TypeError("write_model_file: the model must be a ctuq.models.UNet (it needs .config)")
    if not float(scale) > 0:
        raise ValueError(f"write_model_file: scale must be positive, got {scale}")
    weights = state_dict if state_dict is not None else model.state_dict()
    path = Path(path)
    atomic_torch_save(
        path,
        {
            "format": MODEL_FILE_FORMAT,
            "version": MODEL_FILE_VERSION,
            "model_config": model.config.to_dict(),
            "state_dict": {k: v.detach().cpu() for k, v in weights.items()},
            "scale": float(scale),
            "net_input": None if net_input is None else net_input.detach().cpu(),
            "input": str(input),
            "best_iteration": None if best_iteration is None else int(best_iteration),
            "meta": dict(meta or {}),
        },
    )
    return path


def read_model_file(path: str | os.PathLike, *, need_input: bool = False) -> ModelFile:
    """Read a model file written by :func:`write_model_file`.

    Parameters
    ----------
    path : path
        The file.
    need_input : bool
        Refuse files without a fixed DIP input (``net_input``), e.g. pretrained weights where a fitted DIP is
        needed.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    ModelFileError
        Unreadable, not a ctuq model file, another version, or missing fields (the message names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ModelFileError(f"{path}: not a readable torch file ({type(exc).__name__}: {exc})") from exc
    if not isinstance(blob, dict):
        raise ModelFileError(f"{path}: not a ctuq model file (holds a {type(blob).__name__}, not a dict)")
    if blob.get("format") != MODEL_FILE_FORMAT:
        raise ModelFileError(
            f"{path}: not a ctuq model file (no format tag {MODEL_FILE_FORMAT!r}; keys {sorted(blob)[:8]})"
        )
    version = blob.get("version")
    if isinstance(version, int) and version > MODEL_FILE_VERSION:
        raise ModelFileError(
            f"{path}: model file version {version!r} is newer than this ctuq reads (version {MODEL_FILE_VERSION}); "
            f"upgrade ctuq"
        )
    if version != MODEL_FILE_VERSION:
        raise ModelFileError(
            f"{path}: model file version {version!r}, this ctuq reads version {MODEL_FILE_VERSION}; write it again "
            f"(refit the DIP, or rerun ctuq pretrain)"
        )
    missing = {"model_config", "state_dict", "scale", "input"} - set(blob)
    if missing:
        raise ModelFileError(f"{path}: not a ctuq model file (lacks {sorted(missing)}; keys {sorted(blob)[:8]})")
    net_input = blob.get("net_input")
    if need_input and net_input is None:
        raise ModelFileError(f"{path}: holds no fixed network input (net_input); it is not a fitted DIP")
    return ModelFile(
        model_config=dict(blob["model_config"]),
        state_dict=dict(blob["state_dict"]),
        scale=float(blob["scale"]),
        net_input=net_input,
        input=str(blob["input"]),
        best_iteration=blob.get("best_iteration"),
        meta=dict(blob.get("meta") or {}),
        version=version,
    )
