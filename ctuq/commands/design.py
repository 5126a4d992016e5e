"""``ctuq design``: choose the next scan angles for a sparse pilot scan (Bayesian experimental design).

The work is done by :func:`ctuq.pipeline.design.run_design` (pilot DIP → prior → greedy EIG/ESE design → std maps and
reconstructions from pilot + designed against as many equidistant angles); this module only parses arguments.
The design sees every angle of the scan (``data.angular_subsampling`` defaults to 1 here); ``--candidates N``
thins them to N evenly spaced ones. See ``docs/experimental_design.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ctuq.commands import command_parser
from ctuq.log import run_log
from ctuq.options import Baseline, Criterion, DesignPriorKind, values
from ctuq.pipeline import run_folder
from ctuq.registry import lazy_module

candidates = lazy_module("ctuq.design.candidates")
design = lazy_module("ctuq.pipeline.design")
api = lazy_module("ctuq.run")  # the work (ctuq.design_angles): imported when a design starts, not for --help

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq design`` with ``subparsers``; returns its parser."""
    p = command_parser(
        subparsers,
        "design",
        __doc__,
        "  ctuq design --out runs/design                        # bundled scan: 20-angle pilot, 40 acquired\n"
        "  ctuq design --pilot 10 --acquire 20 --criterion ese --out runs/ese\n"
        "  ctuq design --prior matern --candidates 120 --out runs/matern\n"
        "  ctuq design --pilot-angles pilot.txt --acquire 10 --data /data/Walnut1 --out runs/w1\n"
        "  ctuq design --resume --out runs/design               # continue a killed design\n"
        "  ctuq design --plan --out runs/plan                   # predicted error vs number of angles\n"
        "  ctuq design --target-rmse 0.002/mm --acquire 60 --out runs/stop   # acquire until good enough\n",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="scan: walnut-layout folder, scan.yaml or NXtomo .nxs/.h5 file (default: the bundled simulated scan)",
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML config or bundled name for scan, DIP, FBP, TV (default: demo)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override a config value, e.g. --set design.samples=500 (repeatable)",
    )
    p.add_argument("--out", metavar="DIR", help="output folder (default: runs/<timestamp>)")
    p.add_argument(
        "--pilot",
        type=int,
        metavar="N",
        help="pilot angles, equidistant among the candidates (design.pilot, default 20)",
    )
    p.add_argument(
        "--pilot-angles",
        metavar="FILE",
        help="pilot angles in degrees (text, one per line, or .npy); each must be a candidate angle",
    )
    p.add_argument(
        "--candidates",
        type=int,
        metavar="N",
        help="N candidate angles evenly spaced among the scan's (default: all of the scan's angles)",
    )
    p.add_argument(
        "--acquire",
        type=int,
        metavar="N",
        help="angles to acquire (design.acquire, default 40); the cap of a stop rule",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="only predict the error after pilot … pilot + acquire angles, designed and equidistant "
        "(design.json, forecast.png); nothing is acquired",
    )
    p.add_argument(
        "--target-rmse",
        metavar="R",
        help="acquire until the predicted RMS error inside the object is at most R, with its unit (e.g. 0.002/mm)",
    )
    p.add_argument("--target-psnr", metavar="DB", help="acquire until the predicted PSNR is at least DB (e.g. 30dB)")
    p.add_argument(
        "--min-gain",
        metavar="D",
        help="acquire until an angle improves the predicted RMS error by less than D (e.g. 1%% or 1e-4/mm)",
    )
    p.add_argument(
        "--criterion",
        choices=(*values(Criterion), *values(Baseline)),
        help="eig (default), ese, diag_eig, or a baseline",
    )
    p.add_argument("--prior", choices=values(DesignPriorKind), help="dip (default), isotropic or matern")
    p.add_argument("--samples", type=int, metavar="M", help="pseudo-measurement samples per step (sampled route)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the config's device")
    p.add_argument("--seed", type=int, help="overrides the config's seed")
    p.add_argument("--resume", action="store_true", help="continue a killed design in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq design`` for parsed ``args``; user errors propagate to :func:`ctuq.cli.main`."""
    if args.resume and not args.out:
        raise candidates.DesignError("--resume: needs --out DIR (the design folder to continue)")
    if args.pilot is not None and args.pilot_angles is not None:
        raise candidates.DesignError("--pilot-angles: give either --pilot N or --pilot-angles FILE, not both")
    pilot_angles = design.read_angles_file(args.pilot_angles) if args.pilot_angles else None
    out = Path(args.out or run_folder.new_run_folder("runs"))
    with run_folder.discard_if_empty(out), run_log(out / run_folder.LOG_NAME):
        api.design_angles(
            args.data,
            config=args.config,
            set=args.overrides,
            pilot=args.pilot,
            acquire=args.acquire,
            candidates=args.candidates,
            pilot_angles=pilot_angles,
            plan=args.plan,
            target_rmse=args.target_rmse,
            target_psnr=args.target_psnr,
            criterion=args.criterion,
            prior=args.prior,
            samples=args.samples,
            device=args.device,
            seed=args.seed,
            out=out,
            resume=args.resume,
            progress=not args.no_progress,
        )
    return 0
