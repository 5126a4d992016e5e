"""``ctuq uq RUN_DIR``: rerun only the uncertainty phase on a finished ``ctuq reconstruct`` run.

Reads the run's ``config.yaml`` (``--set uq.KEY=VALUE`` changes the inference settings), reloads the scan, restores
the fitted DIP from ``dip_model.pt`` (no refitting), runs the linearised inference and rewrites ``std.tif``, the
uncertainty figures and ``metrics.json`` (the DIP/FBP/TV numbers of the original run are kept). ``--resume``
continues an interrupted inference from the checkpoints in the run folder. The work is done by
:func:`ctuq.uncertainty` (:mod:`ctuq.run`).

Sharded over processes (one per GPU, or CPU processes with gloo): ``torchrun --nproc_per_node=N -m ctuq uq RUN_DIR``
(``--distributed`` is implied when ``torchrun`` sets ``WORLD_SIZE`` > 1; give it explicitly to insist on it). The EM
probes and the prediction chunks are split round robin over the ranks with the single-process seeds, so the result
equals the one-process run up to float64 summation order; rank 0 writes the results, each rank checkpoints its own
running sums (resume with the same N). GPUs: NCCL, rank r on ``cuda:LOCAL_RANK``.

``--check`` runs only the held-out calibration check (:func:`ctuq.pipeline.runner.check_run`): the run's posterior
against the scan's angles the run did not use; it prints a table and a verdict and writes ``heldout.json`` and
``heldout_calibration.png``, leaving every other file untouched. It rescores the rows the run saved
(``heldout_rows.npz``) in seconds; a run without them has its posterior rebuilt (and the rows are then saved).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ctuq.commands import command_parser
from ctuq.log import run_log
from ctuq.pipeline import run_folder
from ctuq.registry import lazy_module

# the work: imported when a run starts, not for --help
api = lazy_module("ctuq.run")
shards = lazy_module("ctuq.inference.distributed")
utils = lazy_module("ctuq.utils")

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq uq`` with ``subparsers``; returns its parser."""
    p = command_parser(
        subparsers,
        "uq",
        __doc__,
        "  ctuq uq runs/demo                                   # same settings as the run\n"
        "  ctuq uq runs/demo --set uq.samples=256 --set uq.em_steps=10\n"
        "  ctuq uq runs/demo --resume                          # continue an interrupted inference\n"
        "  ctuq uq runs/demo --check                           # held-out calibration check only\n"
        "  torchrun --nproc_per_node=4 -m ctuq uq runs/walnut --device cuda   # 4 GPUs (NCCL)\n",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="folder written by `ctuq reconstruct`")
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config value, e.g. --set uq.samples=256 (repeatable)",
    )
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the run's device")
    p.add_argument("--resume", action="store_true", help="continue from the inference checkpoints in RUN_DIR")
    p.add_argument(
        "--save-samples",
        action="store_true",
        help="also write every posterior image sample to RUN_DIR/samples/ (large)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only the held-out calibration check on the scan's unused angles: prints a verdict, writes "
        f"{run_folder.HELDOUT_NAME} and {run_folder.HELDOUT_FIGURE}, changes nothing else (seconds: it rescores "
        f"the run's {run_folder.HELDOUT_ROWS_NAME}; a run without them has its posterior rebuilt and gets them)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="shard the EM probes and prediction samples over the ranks of a torchrun launch "
        "(implied when WORLD_SIZE > 1)",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq uq`` for parsed ``args`` (:func:`ctuq.uncertainty`, :meth:`ctuq.Run.check`); user errors propagate
    to :func:`ctuq.cli.main`."""
    out_dir = Path(args.run_dir)
    run_folder.require_run_folder(out_dir)
    if args.check:  # changes no file but its own two, so not ctuq.log either
        check = api.Run(out_dir).check(progress=not args.no_progress)
        print(check.table())
        print(check.verdict)
        return 0
    with run_log(out_dir / run_folder.LOG_NAME):
        return _rerun(args, out_dir)


def _rerun(args: argparse.Namespace, out_dir: Path) -> int:
    options = dict(
        set=args.overrides,
        out=out_dir,
        resume=args.resume,
        progress=not args.no_progress,
        device=args.device,
        save_samples=args.save_samples or None,
    )
    distributed = args.distributed or int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not distributed:
        state = api.uncertainty(out_dir, **options)._state
        state.log(f"updated {out_dir} in {sum(state.timings.values()):.1f} s")
        return 0
    device = utils.resolve_device(args.device or api.Run(out_dir).config.device)
    shard, device = shards.init_from_env(device.type)
    clean = False
    try:
        state = api.uncertainty(out_dir, **options, shard=shard, rank_device=device)._state
        state.log(f"updated {out_dir} in {sum(state.timings.values()):.1f} s on {shard.world_size} rank(s)")
        clean = True
    finally:
        shards.shutdown(clean=clean)
    return 0
