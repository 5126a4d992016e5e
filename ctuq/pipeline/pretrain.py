"""``ctuq pretrain`` as a library call: train the U-Net of a config on simulated walnut slices (FBP → image) and
write the weights as a model file (:mod:`ctuq.models.model_file`) to start an "educated DIP" from.

The training pairs use the *same* ray transform and FBP as the reconstruction they prepare (the config's ``data``
section; default: the bundled scan's demo geometry): random synthetic walnuts (``walnut_phantom`` with seeds from
``seed`` on, never seed 0, which the bundled scan shows), sliced at random heights, projected, given Gaussian noise
and reconstructed by FBP.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ctuq.config import Config, ConfigError
from ctuq.data.phantom import walnut_phantom
from ctuq.errors import CTUQError, OutDirError
from ctuq.operators import fbp
from ctuq.pipeline.phases import build_model
from ctuq.pipeline.run_folder import check_writable_folder
from ctuq.pipeline.scan import load_scan
from ctuq.reconstruct.pretrain import make_training_pairs, pretrain_unet, save_pretrained
from ctuq.utils import progress as _progress_bar
from ctuq.utils import resolve_device, seed_everything

__all__ = ["simulated_slices", "pretrain", "PretrainRun"]

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class PretrainRun:
    """Outcome of :func:`pretrain`: the written file, the trained model, its loss history (scaled units², per
    iteration), the training time (s) and the number of training pairs."""

    path: Path
    model: torch.nn.Module
    loss_history: list[float]
    time_s: float
    n_pairs: int


def simulated_slices(
    volume, n_phantoms: int, slices_per_phantom: int, *, seed: int, z_range: float = 4.0, progress: bool = True
) -> torch.Tensor:
    """``(n_phantoms · slices_per_phantom, *volume.shape)`` float32 phantom slices (mm⁻¹) on the 2D grid
    ``volume``, from ``walnut_phantom(seed + i)`` at heights evenly spread over ``[−z_range, z_range]`` mm."""
    if n_phantoms < 1 or slices_per_phantom < 1:
        raise ValueError(f"simulated_slices: need >= 1 phantom and slice, got {n_phantoms}, {slices_per_phantom}")
    heights = np.linspace(-z_range, z_range, slices_per_phantom) if slices_per_phantom > 1 else np.zeros(1)
    images = []
    for i in _progress_bar(range(n_phantoms), desc="phantoms", disable=None if progress else True):
        phantom = walnut_phantom(seed + i)
        for z in heights:
            images.append(torch.from_numpy(phantom.rasterize(volume, z=float(z), supersampling=2)).float())
    return torch.stack(images)


def _check_out_file(out: Path) -> None:
    if out.is_dir():
        raise OutDirError(f"--out {out}: is a folder; give the weights file to write, e.g. {out / 'pretrained.pt'}")
    if out.parent.exists() and not out.parent.is_dir():
        raise OutDirError(f"--out {out}: {out.parent} is a file, so no file can be written under it")
    check_writable_folder(out.parent, option="--out")


def pretrain(
    cfg: Config,
    out: str | Path,
    *,
    phantoms: int = 48,
    slices_per_phantom: int = 4,
    iterations: int = 1500,
    batch_size: int = 8,
    lr: float = 2e-3,
    noise: float = 0.01,
    seed: int = 1000,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> PretrainRun:
    """Pretrain ``cfg``'s U-Net for ``cfg``'s scan geometry and write it to ``out`` (``.pt`` model file).

    Parameters
    ----------
    cfg : Config
        Its ``data`` section gives the geometry (2D only), ``model`` the network, ``fbp`` the input
        reconstruction, ``dip.scale`` the scale; ``model.pretrained`` starts from weights if set.
    out : path
        The weights file; its folder is checked for writing before any work starts.
    phantoms, slices_per_phantom : int
        Synthetic walnuts and slices per walnut (training pairs = their product).
    iterations, batch_size, lr : int, int, float
        Adam iterations, images per iteration, learning rate (cosine-annealed).
    noise : float
        Gaussian noise std relative to the mean |sinogram|.
    seed : int
        First phantom seed (≥ 1: seed 0 is the bundled scan's walnut).
    progress : bool
        Progress bars on stderr.
    log : callable, optional
        Receives progress lines (default: logged, ``[ctuq pretrain] ...`` on the terminal).

    Raises
    ------
    CTUQError
        ``seed`` < 1, ``data.ndim`` ≠ 2, an unwritable ``out``, or the scan/device errors of
        :func:`ctuq.pipeline.scan.load_scan`.
    """
    if log is None:
        log = _log.info
    out = _check_arguments(cfg, out, seed)
    device = resolve_device(cfg.device)
    d, path, warnings = load_scan(cfg, device, progress=progress, heldout=False)
    for msg in warnings:
        _log.warning(msg)
    n_pairs, inputs, targets = _training_pairs(
        cfg,
        d.op,
        phantoms=phantoms,
        slices_per_phantom=slices_per_phantom,
        noise=noise,
        seed=seed,
        progress=progress,
        log=log,
    )
    model = build_model(cfg, d.op.ndim).to(device)
    result = pretrain_unet(
        model, inputs, targets, iterations=iterations, batch_size=batch_size, lr=lr, seed=seed, progress=progress
    )
    final = float(np.mean(result.loss_history[-50:]))
    log(
        f"trained {iterations} iterations in {result.time_s:.1f} s; final loss {final:.3e} (scaled units², mean "
        f"of the last 50)"
    )
    save_pretrained(
        out,
        model,
        scale=cfg.dip.scale,
        meta={
            "phantom_seeds": [seed, seed + phantoms - 1],
            "slices_per_phantom": slices_per_phantom,
            "noise": noise,
            "iterations": iterations,
            "data": str(path),
            "image_shape": list(d.op.image_shape),
            "measurement_shape": list(d.op.measurement_shape),
            "final_loss": final,
        },
    )
    return PretrainRun(path=out, model=model, loss_history=result.loss_history, time_s=result.time_s, n_pairs=n_pairs)


def _check_arguments(cfg: Config, out: str | Path, seed: int) -> Path:
    """The weights file ``out`` as a path, after the checks made before any work: ``seed`` ≥ 1, a 2D ``data``
    section and a writable ``out`` (one-line user errors naming the option)."""
    if seed < 1:
        raise CTUQError(f"--seed {seed}: must be >= 1 (seed 0 is the bundled scan's walnut)")
    if cfg.data.ndim != 2:
        raise ConfigError(f"data.ndim = {cfg.data.ndim}: ctuq pretrain supports only 2D slices (data.ndim = 2)")
    out = Path(out)
    _check_out_file(out)
    return out


def _training_pairs(
    cfg: Config, op, *, phantoms: int, slices_per_phantom: int, noise: float, seed: int, progress: bool, log: Callable
):
    """``(n_pairs, inputs, targets)``: the FBPs (``cfg.fbp``) of noisy projections by ``op`` of
    ``phantoms × slices_per_phantom`` simulated walnut slices and the slices themselves, both scaled by
    ``dip.scale`` (:func:`ctuq.reconstruct.pretrain.make_training_pairs`); the global seeds are set from ``seed``
    first."""
    t0 = time.perf_counter()
    seed_everything(seed)
    images = simulated_slices(op.volume, phantoms, slices_per_phantom, seed=seed, progress=progress)
    stack = iter(images)
    inputs, targets = make_training_pairs(
        op,
        lambda y: fbp(op, y, filter_type=cfg.fbp.filter, frequency_scaling=cfg.fbp.frequency_scaling),
        lambda _gen: next(stack),
        len(images),
        noise=noise,
        scale=cfg.dip.scale,
        seed=seed,
        progress=progress,
    )
    log(f"{len(images)} training pairs from {phantoms} synthetic walnuts in {time.perf_counter() - t0:.1f} s")
    return len(images), inputs, targets
