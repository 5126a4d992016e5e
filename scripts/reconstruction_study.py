"""Which reconstruction wins where: FBP, TV and the DIP with fixed settings and tuned on held-out angles, against the
oracle (the setting the ground truth would choose).

The study is :mod:`ctuq.studies.reconstruction`; this script is its command line. Per simulated scan (1200 angles;
walnut and textured phantoms), image size (64², 128²) and angle count (60, 300), and on the bundled scan (the demo),
two runs through the public API (``ctuq.reconstruct``): the settings before tuning (``--no-uq``), and the defaults
with the uncertainty, scored against the ground truth at the new linearisation point. Writes ``OUT/results.md`` and
``OUT/results.json``; ``OUT/study.json`` records the options. A rerun of the same command resumes.

    python scripts/reconstruction_study.py --out runs/reconstruction            # 2 scans × 2 sizes × 2 counts + demo
    python scripts/reconstruction_study.py --out runs/reconstruction_tiny --tiny    # seconds: the machinery only
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from ctuq.studies.common import Log, StudyError
from ctuq.studies.reconstruction import DEFAULTS, TINY, ReconstructionOptions, run_study
from ctuq.studies.study_options import option_help


def _help(name: str) -> str:
    """A flag's help: the option's own (:class:`ReconstructionOptions`), its default and its ``--tiny`` value."""
    text, tiny = option_help(ReconstructionOptions, name), getattr(TINY, name)
    return text + (
        f"; --tiny: {list(tiny) if isinstance(tiny, tuple) else tiny}" if tiny != getattr(DEFAULTS, name) else ""
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; study options default to ``None`` (then :data:`DEFAULTS`, or :data:`TINY`)."""
    p = argparse.ArgumentParser(
        prog="reconstruction_study.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="study folder (created; reruns resume in it)")
    for key in ("walnut_seeds", "textured_seeds", "sizes", "settings"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, nargs="*", metavar="N", help=_help(key))
    p.add_argument("--no-bundled", action="store_true", help="leave out the bundled scan (the demo)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=_help("set") + "; each --set adds to it"
    )
    p.add_argument("--tiny", action="store_true", help="a seconds-long run of the machinery (tests)")
    p.add_argument("--progress", action="store_true", help="progress bars of the runs")
    p.add_argument("--threads", type=int, metavar="N", help="torch threads")
    p.add_argument("--debug", action="store_true", help="show the traceback behind an error")
    return p


def resolve_options(args: argparse.Namespace) -> ReconstructionOptions:
    """:data:`DEFAULTS` (:data:`TINY` for ``--tiny``) with the given flags: a list replaces the list, ``--set`` adds."""
    base = TINY if args.tiny else DEFAULTS
    given = {
        key: tuple(getattr(args, key))
        for key in ("walnut_seeds", "textured_seeds", "sizes", "settings")
        if getattr(args, key) is not None
    }
    return dataclasses.replace(
        base,
        **given,
        bundled=base.bundled and not args.no_bundled,
        set=(*base.set, *args.set),
        progress=bool(args.progress),
        tiny=bool(args.tiny),
    )


def main(argv=None) -> int:
    """Run the study; user errors are one line ``reconstruction_study.py: ...`` with exit status 2."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        text = run_study(resolve_options(args), Path(args.out), Log("reconstruction_study"))
    except (StudyError, ValueError) as exc:  # CTUQError is a ValueError: every user error of the pipeline
        if args.debug:
            raise
        print(f"reconstruction_study.py: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
