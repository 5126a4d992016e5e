#!/usr/bin/env python
"""Calibration study (issue 26): coverage, right-scale factor, log-likelihood against the best constant std and
Spearman(std, |error|) over simulated walnut and textured scans, per angle count and per combination of
uq.prior × uq.noise × uq.calibration (mean ± s.e. over scans), with margins against the targets you pass.

The study is :mod:`ctuq.studies.calibration`; this script is its command line. Every scan is simulated with 1200
angles (``ctuq simulate --phantom walnut|textured --projections 1201``), so each angle count is a subset and the
remaining angles are held out. The DIP is fitted once per scan × angle count; each prior × noise setting reruns
only the inference on a copy of that run (``ctuq uq RUN --set uq.noise=...``), once: ``uq.calibration`` values (any
registered calibration method) are scored from that same posterior (each method fitted on its held-out rows and
applied to its std map). A setting the config does not know yet is reported as unavailable before any work starts.
``--target METRIC=LOW:HIGH`` (repeatable; a bound may be empty) reports each combination's worst margin against the
range over the angle counts; without targets the results hold the measured numbers only.

Outputs in ``--out``::

    results.md, results.json          the table, the targets' margins (pass/fail), every per-scan score
    calibration.png                    coverage against nominal level (0.05…0.99), one curve per combination
    scans/<kind>_<seed>/               the simulated scans
    runs/<scan>/angles_<N>/dip/        the DIP run (``ctuq.reconstruct(..., uq=False)``: ``ctuq reconstruct --no-uq``)
    runs/<scan>/angles_<N>/<prior>-<noise>/   the inference run of one setting (``ctuq.uncertainty`` on a copy of
                                       the DIP run: ``ctuq uq``), and its score.json (every calibration's scores)
    study.json                         the options (a rerun must use the same ones)

Rerunning the same command (or with ``--resume``, which says so) calls the API on the same run folders: finished
runs are loaded, an interrupted one continues from its checkpoints.

Examples::

    python scripts/calibration_study.py --out runs/calibration                     # 5 + 5 scans, 60 and 300 angles
    python scripts/calibration_study.py --tiny --out /tmp/cal                      # seconds: the test's size
    python scripts/calibration_study.py --walnut-seeds 0 1 --textured-seeds 0 1 --settings 60 \\
        --noises homoscedastic --calibrations none heldout --out runs/cal_small
    python scripts/calibration_study.py --tiny --out /tmp/cal --target right_scale=0.85:1.15 \\
        --target coverage_0.9=0.86:0.94 --target coverage_0.95=0.92: --target min_ll_margin=0:   # issue 26's
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from ctuq.registry import CALIBRATIONS
from ctuq.studies import StudyError
from ctuq.studies.calibration import (
    AXES,
    DEFAULTS,
    TARGET_METRICS,
    TINY,
    CalibrationOptions,
    parse_target,
    run_study,
)
from ctuq.studies.common import Log
from ctuq.studies.study_options import option_help
from ctuq.utils import tune_malloc

_LISTS = ("walnut_seeds", "textured_seeds", "settings", "priors", "noises", "calibrations")


def _help(name: str, extra: str = "") -> str:
    """A flag's help: the option's own (:class:`CalibrationOptions`), its default and its ``--tiny`` value."""
    text, tiny = option_help(CalibrationOptions, name), getattr(TINY, name)
    if tiny != getattr(DEFAULTS, name):
        text += f"; --tiny: {list(tiny) if isinstance(tiny, tuple) else tiny}"
    return text + extra


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; study options default to ``None`` (then :data:`DEFAULTS`, or :data:`TINY`: the
    fields of :class:`CalibrationOptions`)."""
    p = argparse.ArgumentParser(
        prog="calibration_study.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Outputs in") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", metavar="DIR", required=True, help="study folder (created; reruns resume in it)")
    p.add_argument("--walnut-seeds", type=int, nargs="*", metavar="S", help=_help("walnut_seeds"))
    p.add_argument("--textured-seeds", type=int, nargs="*", metavar="S", help=_help("textured_seeds"))
    p.add_argument("--settings", type=int, nargs="+", metavar="ANGLES", help=_help("settings"))
    p.add_argument("--priors", nargs="+", metavar="P", help=_help("priors", f"; one of {', '.join(AXES['uq.prior'])}"))
    p.add_argument("--noises", nargs="+", metavar="N", help=_help("noises", f"; one of {', '.join(AXES['uq.noise'])}"))
    p.add_argument(
        "--calibrations",
        nargs="+",
        metavar="C",
        help=_help("calibrations", f"; registered: {', '.join(CALIBRATIONS.names())}"),
    )
    p.add_argument(
        "--target",
        action="append",
        metavar="METRIC=LOW:HIGH",
        help="report each combination's worst margin against this range (repeatable; a bound may be empty, e.g. "
        f"coverage_0.95=0.92:); METRIC one of {', '.join(TARGET_METRICS)}. Default: none",
    )
    p.add_argument("--config", help=_help("config"))
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="config override for every run, as `ctuq reconstruct --set` (repeatable)",
    )
    p.add_argument("--tiny", action="store_true", help="test size: 1 + 1 tiny scans, 8 angles, a short DIP")
    p.add_argument("--resume", action="store_true", help="continue the study in --out (what a rerun does anyway)")
    p.add_argument(
        "--rescore",
        action="store_true",
        help="recompute every score from the finished runs (e.g. after a change of the held-out statistic); no "
        "inference is repeated",
    )
    p.add_argument("--progress", action="store_true", help="progress bars of the runs")
    p.add_argument("--debug", action="store_true", help="show the traceback behind an error")
    return p


def resolve_options(args: argparse.Namespace) -> CalibrationOptions:
    """:data:`DEFAULTS` (:data:`TINY` for ``--tiny``) with the given flags: a list flag replaces the list, ``--set``
    adds to it."""
    base = TINY if args.tiny else DEFAULTS
    given = {key: tuple(getattr(args, key)) for key in _LISTS if getattr(args, key) is not None}
    if args.config is not None:
        given["config"] = args.config
    if args.target:
        given["targets"] = dict(parse_target(text) for text in args.target)
    return dataclasses.replace(
        base,
        **given,
        set=(*base.set, *(args.set or [])),
        progress=bool(args.progress),
        rescore=bool(args.rescore),
        tiny=bool(args.tiny),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the study; user errors are one line ``calibration_study.py: ...`` with exit status 2."""
    args = build_parser().parse_args(argv)
    tune_malloc()
    log = Log("calibration_study")
    try:
        options = resolve_options(args)
    except StudyError as exc:
        print(f"calibration_study.py: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.resume and not (out / "study.json").is_file():
        print(f"calibration_study.py: --resume: {out} holds no study (no study.json)", file=sys.stderr)
        return 2
    command = "python scripts/calibration_study.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    try:
        results = run_study(options, out, command, log)
    except (StudyError, ValueError) as exc:  # CTUQError is a ValueError: every user error of the pipeline
        if args.debug:
            raise
        print(f"calibration_study.py: {exc}", file=sys.stderr)
        return 2
    print((out / "results.md").read_text())
    for g in results["gates"]:  # margins against the targets given (none: nothing printed)
        marks = ", ".join(f"{k} {'pass' if v['pass'] else 'FAIL'} ({v['margin']:+.3f})" for k, v in g["gates"].items())
        print(f"{g['combination']}: {'PASS' if g['pass'] else 'FAIL'} — {marks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
