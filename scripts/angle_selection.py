#!/usr/bin/env python
"""Angle-selection study: greedy Bayesian experimental design of CT angles against equidistant and random angles.

The published synthetic study (Barbano et al. 2022; Antorán's thesis §7.6): 128² images of 3 superimposed
rectangles with two perpendicular preferential directions that differ from image to image, 2D parallel beam
with 183 detector pixels, 200 candidate angles in [0°, 180°), a 5-angle pilot (candidates 0, 40, 80, 120, 160),
35 acquisitions, m = 3000 samples per step, noise std 5 % of the mean |Tx|. Strategies: equidistant (any count,
and the candidate-grid version), random, isotropic and Matérn-½ EIG, and the linearised DIP with EIG and ESE, with
and without retraining every 5 angles. Every 5 angles: TV and DIP (warm-started from the pilot DIP)
reconstructions, PSNR after a fixed iteration budget and the oracle best over iterations. Mean ± standard error
over images. The study is :mod:`ctuq.studies.angle_selection`; this script is its command line.

Outputs in ``--out``: results.md / results.json (tables, with each strategy's paired difference to equidistant
angles), psnr_<tv|dip>[_oracle].png, study.json, and per image img_<i>/ (the pilot DIP, the designs and the
reconstructions as run folders of ctuq's API, per strategy result.json). A rerun loads every finished run folder
and continues an interrupted one (killed or not); more images or strategies may be added to an existing study,
and several processes may share the folder with different ``--strategies``: the tables hold every finished
result in the folder, and ``--report`` rebuilds them without running anything.

Examples::

    python scripts/angle_selection.py --out runs/angles                     # the published setting (hours on CPU)
    python scripts/angle_selection.py --tiny --out /tmp/angles               # seconds: CI size
    python scripts/angle_selection.py --images 10 --recon tv --samples 1000 --out runs/angles10
    python scripts/angle_selection.py --images 10 --recon tv --samples 1000 --out runs/angles10 --report
    python scripts/angle_selection.py --images 10 --recon tv dip --samples 1000 --out runs/angles10  # adds DIP recons
    python scripts/angle_selection.py --images-file phantoms.npy --orientation-std 5 --out runs/mine
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import typing
from pathlib import Path

from ctuq.studies import StudyError
from ctuq.studies.angle_selection import DEFAULTS, STUDY_STRATEGIES, TINY, AngleSelectionOptions
from ctuq.studies.angle_selection_report import markdown_tables, run_study
from ctuq.studies.study_options import option_help
from ctuq.utils import tune_malloc

# flags of the run, not of the study's numbers: set below with their own defaults
_RUN_FLAGS = ("device", "threads", "tiny", "progress")
_CHOICES = {"strategies": STUDY_STRATEGIES, "recon": ("tv", "dip")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="angle_selection.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="study folder (created; reruns resume in it)")
    types = typing.get_type_hints(AngleSelectionOptions)
    for field in dataclasses.fields(AngleSelectionOptions):
        key = field.name
        if key in _RUN_FLAGS:
            continue
        flag, hint = "--" + key.replace("_", "-"), option_help(AngleSelectionOptions, key)
        if key in _CHOICES:
            p.add_argument(flag, nargs="+", choices=_CHOICES[key], help=hint)
        elif key == "images_file":
            p.add_argument(flag, metavar="FILE", help=hint)
        else:  # int, float, str, or one of them or None
            typ = next(t for t in typing.get_args(types[key]) or (types[key],) if t is not type(None))
            p.add_argument(flag, type=typ, help=hint)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (1 is kinder on a shared machine)")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="CI size: 2 images of 24², 20 candidates, pilot 4, 4 acquired, 64 samples, a few iterations",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--report",
        action="store_true",
        help="run nothing: rebuild results.md/json and the figures "
        "from the finished results in --out (e.g. after several processes shared the folder)",
    )
    return p


def resolve_options(args) -> AngleSelectionOptions:
    """The study's options: explicit command-line values > ``--tiny`` > the defaults; validated (``StudyError``)."""
    base = TINY if args.tiny else DEFAULTS
    given = {}
    for field in dataclasses.fields(AngleSelectionOptions):
        value = None if field.name in _RUN_FLAGS else getattr(args, field.name)
        if value is not None:
            given[field.name] = tuple(value) if isinstance(value, (list, tuple)) else value
    options = dataclasses.replace(
        base, **given, device=args.device, threads=args.threads, tiny=bool(args.tiny), progress=not args.no_progress
    )
    options.validate()
    return options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = resolve_options(args)
        command = shlex.join(["python", "scripts/angle_selection.py", *(sys.argv[1:] if argv is None else argv)])
        agg = run_study(options, Path(args.out), command=command, report_only=args.report)
    except StudyError as exc:
        print(f"angle_selection: {exc}", file=sys.stderr)
        return 2
    print(markdown_tables(agg, options.strategies), end="")
    return 0


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    sys.exit(main())
