"""``ctuq pretrain``: train the U-Net on simulated walnut slices to map FBP to image ("educated DIP").

The training pairs use the *same* ray transform and FBP as the reconstruction it prepares (the ``data`` section
of the config; default: the bundled scan's demo geometry): random synthetic walnuts (``walnut_phantom`` with seeds
from ``--seed`` on, never seed 0, which the bundled scan shows), sliced at random heights, projected, given
Gaussian noise and reconstructed by FBP. The saved weights start a DIP with ``--set model.pretrained=FILE --set
model.input=fbp`` (the network then sees the scan's own FBP as its fixed input).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

__all__ = ["add_parser", "run", "simulated_slices"]


def simulated_slices(volume, n_phantoms: int, slices_per_phantom: int, *, seed: int, z_range: float = 4.0,
                     progress: bool = True) -> torch.Tensor:
    """``(n_phantoms · slices_per_phantom, *volume.shape)`` float32 phantom slices (mm⁻¹) on the 2D grid
    ``volume``, from ``walnut_phantom(seed + i)`` at heights evenly spread over ``[−z_range, z_range]`` mm."""
    from ctuq.data.phantom import walnut_phantom
    from ctuq.utils import progress as bar

    if n_phantoms < 1 or slices_per_phantom < 1:
        raise ValueError(f"simulated_slices: need >= 1 phantom and slice, got {n_phantoms}, {slices_per_phantom}")
    heights = np.linspace(-z_range, z_range, slices_per_phantom) if slices_per_phantom > 1 else np.zeros(1)
    images = []
    for i in bar(range(n_phantoms), desc="phantoms", disable=None if progress else True):
        phantom = walnut_phantom(seed + i)
        for z in heights:
            images.append(torch.from_numpy(phantom.rasterize(volume, z=float(z), supersampling=2)).float())
    return torch.stack(images)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "pretrain",
        help="pretrain the U-Net on simulated walnuts (FBP → image) to start the DIP from",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  ctuq pretrain --out pretrained.pt                     # demo geometry and network\n"
            "  ctuq reconstruct --set model.pretrained=pretrained.pt --set model.input=fbp \\\n"
            "                   --set dip.iterations=500 --out runs/educated\n"
            "  ctuq pretrain --config walnut_2d_60 --data /data/Walnut1 --device cuda --out walnut60.pt\n"
        ),
    )
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the weights (.pt)")
    p.add_argument("--config", metavar="FILE", help="config whose data/model/dip sections to match (default demo)")
    p.add_argument("--data", metavar="DIR", help="scan whose geometry to train for (default: the bundled scan)")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config value (repeatable)")
    p.add_argument("--phantoms", type=int, default=48, help="synthetic walnuts (default 48)")
    p.add_argument("--slices-per-phantom", type=int, default=4, help="slices per walnut (default 4)")
    p.add_argument("--iterations", type=int, default=1500, help="Adam iterations (default 1500)")
    p.add_argument("--batch-size", type=int, default=8, help="images per iteration (default 8)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate, cosine-annealed (default 2e-3)")
    p.add_argument("--noise", type=float, default=0.01,
                   help="Gaussian noise std relative to the mean |sinogram| (default 0.01)")
    p.add_argument("--seed", type=int, default=1000, help="first phantom seed (default 1000; must be > 0)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the config's device")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ctuq import data as ctdata
    from ctuq.commands.reconstruct import build_model
    from ctuq.config import ConfigError, load_config
    from ctuq.operators import fbp
    from ctuq.reconstruct.pretrain import make_training_pairs, pretrain_unet, save_pretrained
    from ctuq.utils import resolve_device, seed_everything

    def log(msg: str) -> None:
        print(f"[ctuq pretrain] {msg}", file=sys.stderr, flush=True)

    if args.seed < 1:
        print("ctuq pretrain: --seed must be >= 1 (seed 0 is the bundled scan's walnut)", file=sys.stderr)
        return 2
    try:
        # Pretraining starts from random weights unless the user overrides model.pretrained explicitly.
        cfg = load_config(args.config, ["model.pretrained=null", *args.overrides],
                          **{"data.path": args.data, "device": args.device})
    except ConfigError as exc:
        print(f"ctuq pretrain: {exc}", file=sys.stderr)
        return 2
    if cfg.data.ndim != 2:
        print("ctuq pretrain: only 2D slices are supported (data.ndim = 2)", file=sys.stderr)
        return 2
    device = resolve_device(cfg.device)
    progress = not args.no_progress
    dc = cfg.data
    path = Path(dc.path) if dc.path is not None else ctdata.default_data_dir()
    d = ctdata.load_walnut_slice(path, slice_index=dc.slice_index, orbit=dc.orbit,
                                 angular_subsampling=dc.angular_subsampling,
                                 detector_subsampling=dc.detector_subsampling,
                                 image_shape=None if dc.image_shape is None else tuple(dc.image_shape),
                                 backend=dc.backend, device=device, progress=progress)
    t0 = time.perf_counter()
    seed_everything(args.seed)
    images = simulated_slices(d.op.volume, args.phantoms, args.slices_per_phantom, seed=args.seed,
                              progress=progress)
    stack = iter(images)
    inputs, targets = make_training_pairs(
        d.op, lambda y: fbp(d.op, y, filter_type=cfg.fbp.filter, frequency_scaling=cfg.fbp.frequency_scaling),
        lambda _gen: next(stack), len(images), noise=args.noise, scale=cfg.dip.scale, seed=args.seed,
        progress=progress)
    log(f"{len(images)} training pairs from {args.phantoms} synthetic walnuts in {time.perf_counter() - t0:.1f} s")
    model = build_model(cfg, d.op.ndim).to(device)
    result = pretrain_unet(model, inputs, targets, iterations=args.iterations, batch_size=args.batch_size,
                           lr=args.lr, seed=args.seed, progress=progress)
    log(f"trained {args.iterations} iterations in {result.time_s:.1f} s; final loss "
        f"{np.mean(result.loss_history[-50:]):.3e} (scaled units², mean of the last 50)")
    save_pretrained(args.out, model, scale=cfg.dip.scale, meta={
        "phantom_seeds": [args.seed, args.seed + args.phantoms - 1],
        "slices_per_phantom": args.slices_per_phantom,
        "noise": args.noise,
        "iterations": args.iterations,
        "data": str(path),
        "image_shape": list(d.op.image_shape),
        "measurement_shape": list(d.op.measurement_shape),
        "final_loss": float(np.mean(result.loss_history[-50:])),
    })
    log(f"wrote {args.out}; use it with --set model.pretrained={args.out} --set model.input=fbp")
    return 0
