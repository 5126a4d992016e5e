"""How many angles: the predicted error against the actual one, and the stop rule against the oracle count.

The study is :mod:`ctuq.studies.stop_rule`; this script is its command line. Per simulated scan (1200 angles; walnut
and textured phantoms): ``ctuq design --plan`` from a pilot, the design on the scan's measurements with each new
angle scored before use, and DIP reconstructions from the first n designed angles and from n equidistant ones.
Writes ``OUT/results.md``; a rerun of the same command resumes.

    python scripts/stop_rule_study.py --out runs/stop_rule            # 4 walnut + 4 textured scans, 64², 10 → 30 angles
    python scripts/stop_rule_study.py --out runs/stop_tiny --tiny     # seconds: the machinery only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ctuq.studies.common import Log
from ctuq.studies.stop_rule import DEFAULTS, TINY, run_study


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, metavar="DIR", help="study folder (created; reruns resume in it)")
    p.add_argument("--walnut-seeds", type=int, nargs="*", metavar="S", help=f"default {DEFAULTS['walnut_seeds']}")
    p.add_argument("--textured-seeds", type=int, nargs="*", metavar="S", help=f"default {DEFAULTS['textured_seeds']}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run of the machinery (tests)")
    p.add_argument("--threads", type=int, metavar="N", help="torch threads")
    args = p.parse_args(argv)
    opts = dict(TINY if args.tiny else DEFAULTS)
    if args.walnut_seeds is not None:
        opts["walnut_seeds"] = args.walnut_seeds
    if args.textured_seeds is not None:
        opts["textured_seeds"] = args.textured_seeds
    opts["set"] = [*opts["set"], *args.set]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(run_study(opts, Path(args.out), Log("stop_rule_study")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
