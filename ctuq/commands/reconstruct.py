"""``ctuq reconstruct``: load a scan, reconstruct it with FBP, (TV,) and the deep image prior, write a run folder.

The work is done by :func:`ctuq.reconstruct` (:mod:`ctuq.run`; phases load → fbp → [tv] → dip → [uq] → write, see
:mod:`ctuq.pipeline`); this module only builds the argument parser and hands the options on.

Defaults: the bundled ``demo`` config (``ctuq/configs/demo.yaml``) on the bundled simulated scan, written to
``runs/<timestamp>/``. See :mod:`ctuq.pipeline.run_folder` for the files.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ctuq.commands import command_parser
from ctuq.config import describe, load_config
from ctuq.errors import CTUQError
from ctuq.log import run_log
from ctuq.pipeline import run_folder
from ctuq.registry import lazy_module

api = lazy_module("ctuq.run")  # the work: imported when a run starts, not for --help

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq reconstruct`` with ``subparsers``; returns its parser."""
    p = command_parser(
        subparsers,
        "reconstruct",
        __doc__,
        "  ctuq reconstruct --no-uq                   # bundled demo scan, CPU, ~45 s (with uncertainty ~85 s)\n"
        "  ctuq reconstruct --config walnut_2d_60 --data /data/Walnut1 --device cuda\n"
        "  ctuq reconstruct --set dip.iterations=300 --set tv.enabled=true --out runs/quick\n"
        "  ctuq reconstruct --resume --out runs/quick     # continue an interrupted run\n",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="scan: walnut-layout folder, scan.yaml or NXtomo .nxs/.h5 file (default: the bundled simulated scan)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML config file or bundled name (demo, demo_pretrained, walnut_2d_60, walnut_2d_120, "
        "walnut_3d, walnut_3d_published, tiny); default: demo, or the run folder's config.yaml with --resume",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config value, e.g. --set dip.lr=1e-3 (repeatable)",
    )
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<timestamp>)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the config's device")
    p.add_argument("--seed", type=int, help="overrides the config's seed")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run from its checkpoints in --out (which must be given): the DIP, then the "
        "inference; bit-identical to a run that was never interrupted",
    )
    p.add_argument("--no-uq", action="store_true", help="skip the uncertainty phase (reconstruction only)")
    p.add_argument(
        "--save-samples",
        action="store_true",
        help="also write every posterior image sample to OUT/samples/ (large; = --set uq.save_samples=true)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--config-keys",
        nargs="?",
        const="",
        metavar="SECTION",
        help="print every config key (or those of SECTION, e.g. uq) with its default and meaning, and exit",
    )
    p.set_defaults(func=run)
    return p


def config_keys(section: str = "") -> str:
    """Every key of the config (of ``section`` when given: ``"uq"``, ``"uq.cg"``) as ``key = default  # help``
    lines, the defaults of the bundled ``demo`` config (:func:`ctuq.config.describe`); :class:`~ctuq.errors.CTUQError`
    for an unknown section."""
    cfg = load_config(None)
    node = cfg
    for part in [p for p in section.split(".") if p]:
        child = getattr(node, part, None)
        if child is None or not dataclasses.is_dataclass(child):
            sections = [f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
            sections = ", ".join(sections)
            raise CTUQError(f"--config-keys {section}: not a config section (sections: {sections})")
        node = child
    prefix = section + "." if section else ""
    return "\n".join(
        f"{key} = {value!r}" + (f"  # {text}" if text else "") for key, value, text in describe(node, prefix)
    )


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq reconstruct`` for parsed ``args`` (:func:`ctuq.run.reconstruct`); user errors propagate to
    :func:`ctuq.cli.main`."""
    if args.config_keys is not None:
        print(config_keys(args.config_keys))
        return 0
    if args.resume and not args.out:
        raise CTUQError("--resume: needs --out DIR (the run folder to continue)")
    config = args.config
    if args.resume and config is None and (Path(args.out) / run_folder.CONFIG_NAME).is_file():
        config = Path(args.out) / run_folder.CONFIG_NAME
    out_dir = Path(args.out) if args.out else run_folder.new_run_folder("runs")
    with run_folder.discard_if_empty(out_dir), run_log(out_dir / run_folder.LOG_NAME):
        run = api.reconstruct(
            args.data,
            config=config,
            set=args.overrides,
            out=out_dir,
            resume=args.resume,
            uq=not args.no_uq,
            progress=not args.no_progress,
            device=args.device,
            seed=args.seed,
            save_samples=args.save_samples or None,
        )
        state = run._state
        state.log(f"wrote {out_dir} in {sum(state.timings.values()):.1f} s")
    return 0
