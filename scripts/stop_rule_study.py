"""How many angles: the predicted error against the actual one, and the stop rule against the oracle count.

The study is :mod:`ctuq.studies.stop_rule`; this script is its command line. Per simulated scan (1200 angles; walnut
and textured phantoms): ``ctuq design --plan`` from a pilot, the design on the scan's measurements with each new
angle scored before use, and DIP reconstructions from the first n designed angles and from n equidistant ones, each
a design or run folder made through the public API (``ctuq.design_angles``, ``ctuq.reconstruct``). Writes
``OUT/results.md`` (and per scan ``OUT/<scan>/result.json``); ``OUT/study.json`` records the options. A rerun of the
same command resumes: finished designs and runs are loaded, an interrupted one continues from its checkpoints.

    python scripts/stop_rule_study.py --out runs/stop_rule            # 4 walnut + 4 textured scans, 64², 10 → 30 angles
    python scripts/stop_rule_study.py --out runs/stop_tiny --tiny     # seconds: the machinery only
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from ctuq.studies.common import Log, StudyError
from ctuq.studies.stop_rule import DEFAULTS, TINY, StopRuleOptions, run_study
from ctuq.studies.study_options import option_help


def _help(name: str) -> str:
    """A flag's help: the option's own (:class:`StopRuleOptions`), its default and its ``--tiny`` value."""
    text, tiny = option_help(StopRuleOptions, name), getattr(TINY, name)
    return text + (
        f"; --tiny: {list(tiny) if isinstance(tiny, tuple) else tiny}" if tiny != getattr(DEFAULTS, name) else ""
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; study options default to ``None`` (then :data:`DEFAULTS`, or :data:`TINY`: the
    fields of :class:`StopRuleOptions`)."""
    p = argparse.ArgumentParser(
        prog="stop_rule_study.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="study folder (created; reruns resume in it)")
    p.add_argument("--walnut-seeds", type=int, nargs="*", metavar="S", help=_help("walnut_seeds"))
    p.add_argument("--textured-seeds", type=int, nargs="*", metavar="S", help=_help("textured_seeds"))
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=_help("set") + "; each --set adds to it"
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long run of the machinery (tests)")
    p.add_argument("--progress", action="store_true", help="progress bars of the designs and runs")
    p.add_argument("--threads", type=int, metavar="N", help="torch threads")
    p.add_argument("--debug", action="store_true", help="show the traceback behind an error")
    return p


def resolve_options(args: argparse.Namespace) -> StopRuleOptions:
    """:data:`DEFAULTS` (:data:`TINY` for ``--tiny``) with the given flags: a seed list replaces the list, ``--set``
    adds to it."""
    base = TINY if args.tiny else DEFAULTS
    given = {
        key: tuple(getattr(args, key)) for key in ("walnut_seeds", "textured_seeds") if getattr(args, key) is not None
    }
    return dataclasses.replace(
        base, **given, set=(*base.set, *args.set), progress=bool(args.progress), tiny=bool(args.tiny)
    )


def main(argv=None) -> int:
    """Run the study; user errors are one line ``stop_rule_study.py: ...`` with exit status 2."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text = run_study(resolve_options(args), Path(args.out), Log("stop_rule_study"))
    except (StudyError, ValueError) as exc:  # CTUQError is a ValueError: every user error of the pipeline
        if args.debug:
            raise
        print(f"stop_rule_study.py: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
