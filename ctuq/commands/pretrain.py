"""``ctuq pretrain``: train the U-Net on simulated walnut slices to map FBP to image ("educated DIP").

The training pairs use the *same* ray transform and FBP as the reconstruction it prepares (the ``data`` section
of the config; default: the bundled scan's demo geometry): random synthetic walnuts (``walnut_phantom`` with seeds
from ``--seed`` on, never seed 0, which the bundled scan shows), sliced at random heights, projected, given
Gaussian noise and reconstructed by FBP. The saved weights start a DIP with ``--set model.pretrained=FILE --set
model.input=fbp`` (the network then sees the scan's own FBP as its fixed input). The work is done by
:func:`ctuq.pipeline.pretrain.pretrain`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ctuq.commands import command_parser
from ctuq.config import load_config
from ctuq.log import run_log
from ctuq.registry import lazy_module

pipeline_pretrain = lazy_module("ctuq.pipeline.pretrain")  # the work: imported when a run starts, not for --help

__all__ = ["add_parser", "run"]

_log = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq pretrain`` with ``subparsers``; returns its parser."""
    p = command_parser(
        subparsers,
        "pretrain",
        __doc__,
        "  ctuq pretrain --out pretrained.pt                     # demo geometry and network\n"
        "  ctuq reconstruct --set model.pretrained=pretrained.pt --set model.input=fbp \\\n"
        "                   --set dip.iterations=500 --out runs/educated\n"
        "  ctuq pretrain --config walnut_2d_60 --data /data/Walnut1 --device cuda --out walnut60.pt\n",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the weights (.pt)")
    p.add_argument("--config", metavar="FILE", help="config whose data/model/dip sections to match (default demo)")
    p.add_argument("--data", metavar="PATH", help="scan (folder, scan.yaml or NXtomo file) whose geometry to train for")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config value (repeatable)",
    )
    p.add_argument("--phantoms", type=int, default=48, help="synthetic walnuts (default 48)")
    p.add_argument("--slices-per-phantom", type=int, default=4, help="slices per walnut (default 4)")
    p.add_argument("--iterations", type=int, default=1500, help="Adam iterations (default 1500)")
    p.add_argument("--batch-size", type=int, default=8, help="images per iteration (default 8)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate, cosine-annealed (default 2e-3)")
    p.add_argument(
        "--noise", type=float, default=0.01, help="Gaussian noise std relative to the mean |sinogram| (default 0.01)"
    )
    p.add_argument("--seed", type=int, default=1000, help="first phantom seed (default 1000; must be > 0)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the config's device")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq pretrain`` for parsed ``args``; user errors propagate to :func:`ctuq.cli.main`."""
    # Pretraining starts from random weights unless the user overrides model.pretrained explicitly.
    cfg = load_config(
        args.config, ["model.pretrained=null", *args.overrides], **{"data.path": args.data, "device": args.device}
    )
    # no run folder: the log goes beside the weights, OUT.log
    with run_log(Path(f"{args.out}.log")):
        pipeline_pretrain.pretrain(
            cfg,
            args.out,
            phantoms=args.phantoms,
            slices_per_phantom=args.slices_per_phantom,
            iterations=args.iterations,
            batch_size=args.batch_size,
            lr=args.lr,
            noise=args.noise,
            seed=args.seed,
            progress=not args.no_progress,
        )
        _log.info(f"wrote {args.out}; use it with --set model.pretrained={args.out} --set model.input=fbp")
    return 0
