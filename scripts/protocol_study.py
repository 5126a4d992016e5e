"""Designed angles against equidistant and golden-angle ones, at every count, and the plan's ranking of them.

The study is :mod:`ctuq.studies.protocols`; this script is its command line. Per simulated scan (1200 angles; walnut,
textured and laminate phantoms): ``ctuq design --plan`` and the design itself from a pilot, for each
``design.spread``, and FBP, TV and the DIP from the first n angles of every protocol (each design, equidistant,
golden angle), each a design or run folder made through the public API (``ctuq.design_angles``,
``ctuq.reconstruct``). Writes ``OUT/results.md`` and ``OUT/results.json`` (per scan ``OUT/<scan>/result.json``);
``OUT/study.json`` records the options. A rerun of the same command resumes.

    python scripts/protocol_study.py --out runs/protocols            # one scan per kind, 64², 10 → 80 angles
    python scripts/protocol_study.py --out runs/protocols_tiny --tiny   # seconds: the machinery only
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from ctuq.studies.common import Log, StudyError
from ctuq.studies.protocols import DEFAULTS, TINY, ProtocolOptions, run_study
from ctuq.studies.study_options import option_help


def _help(name: str) -> str:
    """A flag's help: the option's own (:class:`ProtocolOptions`), its default and its ``--tiny`` value."""
    text, tiny = option_help(ProtocolOptions, name), getattr(TINY, name)
    return text + (
        f"; --tiny: {list(tiny) if isinstance(tiny, tuple) else tiny}" if tiny != getattr(DEFAULTS, name) else ""
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; study options default to ``None`` (then :data:`DEFAULTS`, or :data:`TINY`)."""
    p = argparse.ArgumentParser(
        prog="protocol_study.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="study folder (created; reruns resume in it)")
    for key in ("walnut_seeds", "textured_seeds", "laminate_seeds", "counts"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, nargs="*", metavar="N", help=_help(key))
    p.add_argument("--spreads", type=float, nargs="+", metavar="S", help=_help("spreads"))
    p.add_argument("--pilot", type=int, metavar="N", help=_help("pilot"))
    p.add_argument("--candidates", type=int, metavar="N", help=_help("candidates"))
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=_help("set") + "; each --set adds to it"
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long run of the machinery (tests)")
    p.add_argument("--progress", action="store_true", help="progress bars of the designs and runs")
    p.add_argument("--threads", type=int, metavar="N", help="torch threads")
    p.add_argument("--debug", action="store_true", help="show the traceback behind an error")
    return p


def resolve_options(args: argparse.Namespace) -> ProtocolOptions:
    """:data:`DEFAULTS` (:data:`TINY` for ``--tiny``) with the given flags: a list replaces the list, ``--set``
    adds to it."""
    base = TINY if args.tiny else DEFAULTS
    keys = ("walnut_seeds", "textured_seeds", "laminate_seeds", "counts", "spreads")
    given = {key: tuple(getattr(args, key)) for key in keys if getattr(args, key) is not None}
    given.update({key: getattr(args, key) for key in ("pilot", "candidates") if getattr(args, key) is not None})
    return dataclasses.replace(
        base, **given, set=(*base.set, *args.set), progress=bool(args.progress), tiny=bool(args.tiny)
    )


def main(argv=None) -> int:
    """Run the study; user errors are one line ``protocol_study.py: ...`` with exit status 2."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text = run_study(resolve_options(args), Path(args.out), Log("protocol_study"))
    except (StudyError, ValueError) as exc:  # CTUQError is a ValueError: every user error of the pipeline
        if args.debug:
            raise
        print(f"protocol_study.py: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
