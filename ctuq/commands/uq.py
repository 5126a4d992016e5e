"""``ctuq uq RUN_DIR``: rerun only the uncertainty phase on a finished ``ctuq reconstruct`` run.

Reads the run's ``config.yaml`` (``--set uq.KEY=VALUE`` changes the inference settings), reloads the scan, restores
the fitted DIP from ``dip_model.pt`` (no refitting), runs the linearised inference and rewrites ``std.tif``, the
uncertainty figures and ``metrics.json`` (the DIP/FBP/TV numbers of the original run are kept). ``--resume``
continues an interrupted inference from the checkpoints in the run folder. The work is done by
:func:`ctuq.pipeline.rerun_uq`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq uq`` with ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "uq",
        help="rerun only the uncertainty phase on a finished reconstruction folder",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  ctuq uq runs/demo                                   # same settings as the run\n"
            "  ctuq uq runs/demo --set uq.samples=256 --set uq.em_steps=10\n"
            "  ctuq uq runs/demo --resume                          # continue an interrupted inference\n"
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="folder written by `ctuq reconstruct`")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config value, e.g. --set uq.samples=256 (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the run's device")
    p.add_argument("--resume", action="store_true", help="continue from the inference checkpoints in RUN_DIR")
    p.add_argument("--save-samples", action="store_true",
                   help="also write every posterior image sample to RUN_DIR/samples/ (large)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq uq`` for parsed ``args``; user errors propagate to :func:`ctuq.cli.main`."""
    from ctuq.config import load_config
    from ctuq.pipeline import rerun_uq, run_folder

    out_dir = Path(args.run_dir)
    cfg = load_config(run_folder.require_run_folder(out_dir), args.overrides,
                      **{"device": args.device, "uq.save_samples": args.save_samples or None})
    state = rerun_uq(cfg, out_dir, resume=args.resume, progress=not args.no_progress)
    state.log(f"updated {out_dir} in {sum(state.timings.values()):.1f} s")
    return 0
