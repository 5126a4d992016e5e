"""Optional pretraining ("educated DIP"): teach the U-Net to map FBP reconstructions of simulated phantoms to
the phantoms, then start the DIP from those weights with the scan's own FBP as the fixed input.

Training pairs are ``(s · FBP(T x + ε), s · x)`` for random phantoms ``x`` (``ctuq.data.phantom``), the same
operator ``T`` and FBP as the reconstruction, relative Gaussian noise ``ε``, and the DIP's scale ``s``; the loss is
the mean squared error. :func:`save_pretrained` writes a model file (:mod:`ctuq.models.model_file`, ``input:
"fbp"``); :func:`load_pretrained` loads one of any version this ctuq reads (or a DIP checkpoint) into a model of the
same architecture and refuses a mismatching one by naming the differing setting.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ctuq.models.model_file import MODEL_FILE_FORMAT, ModelFileError, read_model_file, write_model_file
from ctuq.utils import progress as _progress_bar

__all__ = [
    "make_training_pairs",
    "pretrain_unet",
    "save_pretrained",
    "load_pretrained",
    "resolve_pretrained_path",
    "PretrainResult",
    "BUNDLED_DATA",
]

# The repository's data/ folder: relative `model.pretrained` paths that do not exist in the working directory are
# looked up here, so the bundled configs can name the bundled weights (data/pretrained/...) from anywhere.
BUNDLED_DATA = Path(__file__).resolve().parents[2] / "data"


@dataclasses.dataclass
class PretrainResult:
    """``loss_history`` per iteration (scaled units), ``time_s`` wall time, ``iterations``."""

    loss_history: list[float]
    time_s: float
    iterations: int


def make_training_pairs(
    op,
    fbp: Callable[[torch.Tensor], torch.Tensor],
    phantom: Callable[[torch.Generator], torch.Tensor],
    n: int,
    *,
    noise: float = 0.01,
    scale: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` training pairs ``(inputs, targets)``, each ``(n, 1, *image_shape)`` float32 on ``op.device``.

    ``fbp(y)`` maps a ``measurement_shape`` sinogram to an ``image_shape`` image; ``phantom(generator)`` draws
    one ``image_shape`` phantom (original units). ``noise`` is the std of the Gaussian noise relative to the
    mean absolute sinogram value. Both returned tensors are multiplied by ``scale``.
    """
    if n < 1:
        raise ValueError(f"make_training_pairs: n must be >= 1, got {n}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    inputs, targets = [], []
    for _ in _progress_bar(range(n), desc="phantoms", disable=None if progress else True):
        x = phantom(gen).to(op.device, torch.float32)
        if tuple(x.shape) != tuple(op.image_shape):
            raise ValueError(
                f"make_training_pairs: phantom has shape {tuple(x.shape)}; operator expects {op.image_shape}"
            )
        with torch.no_grad():
            y = op(x)
            y = y + noise * y.abs().mean() * torch.randn(y.shape, generator=gen).to(y.device)
        inputs.append(fbp(y).to(op.device, torch.float32) * scale)
        targets.append(x * scale)
    return torch.stack(inputs)[:, None], torch.stack(targets)[:, None]


def pretrain_unet(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    iterations: int,
    batch_size: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> PretrainResult:
    """Supervised training of ``model`` on ``(inputs, targets)`` (``(N, C, *spatial)``) with Adam and MSE,
    mini-batches drawn with a seeded generator; the model is trained in place on the tensors' device."""
    if inputs.shape[0] != targets.shape[0] or inputs.shape[2:] != targets.shape[2:]:
        raise ValueError(f"pretrain_unet: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} do not match")
    if iterations < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(
            f"pretrain_unet: need iterations >= 1, batch_size >= 1, lr > 0; got {iterations}, {batch_size}, {lr}"
        )
    model = model.to(inputs.device).train()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, iterations)
    hist: list[float] = []
    t0 = time.perf_counter()
    bar = _progress_bar(range(iterations), desc="pretrain", disable=None if progress else True)
    for it in bar:
        idx = torch.randint(0, inputs.shape[0], (min(batch_size, inputs.shape[0]),), generator=gen)
        idx = idx.to(inputs.device)
        opt.zero_grad(set_to_none=True)
        loss = (model(inputs[idx]) - targets[idx]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        hist.append(float(loss.detach()))
        if it % 10 == 0:
            bar.set_postfix(loss=f"{hist[-1]:.3e}", refresh=False)
    return PretrainResult(loss_history=hist, time_s=time.perf_counter() - t0, iterations=iterations)


def save_pretrained(path: str | os.PathLike, model: nn.Module, *, scale: float, meta: dict | None = None) -> Path:
    """Write pretrained weights (CPU), the architecture and the scale they were trained with, atomically, as a
    model file (:func:`ctuq.models.write_model_file`, ``input="fbp"``, no fixed input)."""
    if not hasattr(model, "config"):
        raise TypeError("save_pretrained: the model must be a ctuq.models.UNet (it needs .config)")
    return write_model_file(path, model, scale=scale, input="fbp", meta=meta)


def resolve_pretrained_path(path: str | os.PathLike) -> Path:
    """``path`` if it exists; else, for a relative path, the same path inside the repository's ``data/`` folder
    (e.g. ``pretrained/tiny_demo.pt``). Raises ``FileNotFoundError`` naming both places."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.is_absolute() and (BUNDLED_DATA / p).is_file():
        return BUNDLED_DATA / p
    where = f" or {BUNDLED_DATA / p}" if not p.is_absolute() else ""
    raise FileNotFoundError(f"model.pretrained: {p} does not exist{where}")


def load_pretrained(model: nn.Module, path: str | os.PathLike) -> dict:
    """Load weights from ``path`` into ``model`` (in place) and return the file's contents.

    Accepts model files (:func:`ctuq.models.read_model_file`: ``ctuq pretrain`` output, ``dip_model.pt``) and DIP
    checkpoints (``dip_checkpoint.pt``: its latest weights, ``"model"``). The stored architecture must equal
    ``model.config`` (except the dropout rate). Relative paths are resolved by :func:`resolve_pretrained_path`.

    Returns
    -------
    dict
        For a model file its fields (``model_config``, ``state_dict``, ``scale``, ``net_input``, ``input``,
        ``best_iteration``, ``meta``, ``version``); for a DIP checkpoint the checkpoint itself.

    Raises
    ------
    ModelFileError
        (a ``ValueError``) unreadable file, a model file of another version, neither a model file nor a DIP
        checkpoint, another architecture; the message begins with ``model.pretrained:``.
    """
    path = resolve_pretrained_path(path)
    try:
        mf = read_model_file(path)
    except ModelFileError as exc:
        blob = _read_weights_blob(path)
        if blob.get("format") == MODEL_FILE_FORMAT:
            raise ModelFileError(f"model.pretrained: {exc}") from None  # a real model file read_model_file refused
        if "model" not in blob:
            raise ModelFileError(
                f"model.pretrained: {path} is neither a ctuq model file nor a DIP checkpoint (no 'model' entry; "
                f"keys: {sorted(blob)})"
            ) from None
        state = blob["model"]
    else:
        blob = {f.name: getattr(mf, f.name) for f in dataclasses.fields(mf)}  # asdict would copy the weights
        state = mf.state_dict
    saved_cfg = blob.get("model_config")
    if saved_cfg is not None and hasattr(model, "config"):
        mine = model.config.to_dict()
        for key in sorted(set(saved_cfg) | set(mine)):
            if key == "dropout":
                continue
            if saved_cfg.get(key) != mine.get(key):
                raise ModelFileError(
                    f"model.pretrained: {path} was trained with {key} = {saved_cfg.get(key)!r} but the configured "
                    f"U-Net has {key} = {mine.get(key)!r}; configure the same architecture (model.* keys)"
                )
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ModelFileError(f"model.pretrained: {path} does not fit the configured U-Net: {exc}") from None
    return blob


def _read_weights_blob(path: Path) -> dict:
    # A file that is not a model file: a DIP checkpoint (reconstruct.dip), read as a plain dict of tensors.
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ModelFileError(f"model.pretrained: {path} could not be read as a torch file: {exc}") from exc
    if not isinstance(blob, dict):
        raise ModelFileError(f"model.pretrained: {path} does not hold a dict of weights")
    return blob
