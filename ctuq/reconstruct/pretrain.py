"""Optional pretraining ("educated DIP"): teach the U-Net to map FBP reconstructions of simulated phantoms to
the phantoms, then start the DIP from those weights with the scan's own FBP as the fixed input.

Training pairs are ``(s · FBP(T x + ε), s · x)`` for random phantoms ``x`` (``ctuq.data.phantom``), the same
operator ``T`` and FBP as the reconstruction, relative Gaussian noise ``ε``, and the DIP's scale ``s``; the loss is
the mean squared error. :func:`save_pretrained` writes ``{"model_config", "state_dict", "scale", "input": "fbp",
"meta"}``; :func:`load_pretrained` loads it (or a DIP checkpoint / ``dip_model.pt``) into a model of the same
architecture and refuses a mismatching one by naming the differing setting.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ctuq.utils import atomic_torch_save
from ctuq.utils import progress as _progress_bar

__all__ = ["make_training_pairs", "pretrain_unet", "save_pretrained", "load_pretrained", "resolve_pretrained_path",
           "PretrainResult", "BUNDLED_DATA"]

# The repository's data/ folder: relative `model.pretrained` paths that do not exist in the working directory are
# looked up here, so the bundled configs can name the bundled weights (data/pretrained/...) from anywhere.
BUNDLED_DATA = Path(__file__).resolve().parents[2] / "data"

PRETRAINED_VERSION = 1


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
            raise ValueError(f"make_training_pairs: phantom has shape {tuple(x.shape)}; operator expects {op.image_shape}")
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
        raise ValueError(f"pretrain_unet: need iterations >= 1, batch_size >= 1, lr > 0; got "
                         f"{iterations}, {batch_size}, {lr}")
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
    """Write pretrained weights (CPU), the architecture and the scale they were trained with, atomically."""
    if not hasattr(model, "config"):
        raise TypeError("save_pretrained: the model must be a ctuq.models.UNet (it needs .config)")
    path = Path(path)
    atomic_torch_save(path, {
        "version": PRETRAINED_VERSION,
        "model_config": model.config.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "scale": float(scale),
        "input": "fbp",
        "meta": dict(meta or {}),
    })
    return path


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

    Accepts files from :func:`save_pretrained`, ``dip_model.pt`` (``state_dict``) and DIP checkpoints
    (``model``). The stored architecture must equal ``model.config`` (except the dropout rate). Relative paths
    are resolved by :func:`resolve_pretrained_path`.
    """
    path = resolve_pretrained_path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise ValueError(f"model.pretrained: {path} could not be read as a torch file: {exc}") from exc
    if not isinstance(blob, dict):
        raise ValueError(f"model.pretrained: {path} does not hold a dict of weights")
    state = blob.get("state_dict", blob.get("model"))
    if state is None:
        raise ValueError(f"model.pretrained: {path} has no 'state_dict' or 'model' entry (keys: {sorted(blob)})")
    saved_cfg = blob.get("model_config")
    if saved_cfg is not None and hasattr(model, "config"):
        mine = model.config.to_dict()
        for key in sorted(set(saved_cfg) | set(mine)):
            if key == "dropout":
                continue
            if saved_cfg.get(key) != mine.get(key):
                raise ValueError(
                    f"model.pretrained: {path} was trained with {key} = {saved_cfg.get(key)!r} but the configured "
                    f"U-Net has {key} = {mine.get(key)!r}; configure the same architecture (model.* keys)"
                )
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise ValueError(f"model.pretrained: {path} does not fit the configured U-Net: {exc}") from None
    return blob

