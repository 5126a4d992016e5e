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
angles), psnr_<tv|dip>[_oracle].png, study.json, and per image img_<i>/ (pilot DIP, per strategy result.json and
design checkpoints). A rerun skips finished (image, strategy) pairs; more images or strategies may be added to an
existing study, and several processes may share the folder with different ``--strategies``: the tables hold
every finished result in the folder, and ``--report`` rebuilds them without running anything.

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
import math
import shlex
import sys
from pathlib import Path

from ctuq.studies import StudyError
from ctuq.studies.angle_selection import DEFAULTS, STUDY_STRATEGIES, TINY
from ctuq.studies.angle_selection_report import markdown_tables, run_study
from ctuq.utils import tune_malloc

_HELP = {
    "images": "number of images (default 30)",
    "images_file": ".npy or TIFF stack (N, H, W), H = W: own phantoms",
    "size": "image side of the generated phantoms (default 128)",
    "orientation_mean": "fix every image's preferential angle (degrees; default: U(0, 180) per image)",
    "orientation_std": "rectangles' spread around it (degrees, default 2.86)",
    "noise": "noise std as a fraction of mean |Tx| (default 0.05)",
    "candidates": "candidate angles in [0°, 180°) (default 200)",
    "pilot": "pilot angles (default 5)",
    "acquire": "acquisitions (default 35)",
    "every": "reconstruct every this many angles (default 5)",
    "samples": "m, samples per step of the DIP designs (default 3000)",
    "strategies": "subset of strategies",
    "recon": "reconstructions: tv dip (default both)",
    "jitter": "criteria jitter (default 0.01)",
    "refresh_every": "DIP g-prior refresh (default 5)",
    "retrain_every": "retraining period of *_retrain (default 5)",
    "retrain_iterations": "iterations of one retraining (default 300)",
    "preset": "U-Net preset (default tiny)",
    "iterations": "pilot DIP iterations (default 2000)",
    "lr": "pilot DIP learning rate (default 3e-3)",
    "tv_weight": "DIP TV weight (default 1e-6)",
    "clip_grad_norm": "DIP gradient clip (default 1)",
    "scale": "DIP data/image scale (default 1)",
    "input_std": "DIP input std (default 0.1)",
    "warm_iterations": "iterations of each warm-started DIP reconstruction (default 500)",
    "warm_lr": "their learning rate (default 1e-3)",
    "tv_lambda": "TV reconstruction weight λ (default 0.003)",
    "tv_iterations": "PDHG iterations (default 300)",
    "seed": "seed of phantoms, noise, networks, samples (default 0)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="angle_selection.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, metavar="DIR", help="study folder (created; reruns resume in it)")
    for key, default in DEFAULTS.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(default, list):
            choices = STUDY_STRATEGIES if key == "strategies" else ("tv", "dip") if key == "recon" else None
            p.add_argument(flag, nargs="+", choices=choices, help=_HELP[key])
        elif key == "images_file":
            p.add_argument(flag, metavar="FILE", help=_HELP[key])
        else:
            typ = (
                int
                if isinstance(default, int) and key not in ("noise",)
                else float
                if isinstance(default, float) or key == "orientation_mean"
                else str
            )
            p.add_argument(flag, type=typ, help=_HELP[key])
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


def resolve_options(args) -> dict:
    opts = dict(DEFAULTS)
    if args.tiny:
        opts.update(TINY)
    for key in DEFAULTS:
        v = getattr(args, key)
        if v is not None:
            opts[key] = list(v) if isinstance(v, (list, tuple)) else v
    opts.update(device=args.device, threads=args.threads, tiny=bool(args.tiny), progress=not args.no_progress)

    def need(ok, what):
        if not ok:
            raise StudyError(what)

    for key in (
        "images",
        "size",
        "candidates",
        "pilot",
        "acquire",
        "every",
        "samples",
        "iterations",
        "warm_iterations",
        "tv_iterations",
        "retrain_iterations",
    ):
        need(opts[key] >= 1, f"--{key.replace('_', '-')} must be >= 1, got {opts[key]}")
    need(
        opts["pilot"] + opts["acquire"] <= opts["candidates"],
        f"--acquire: pilot {opts['pilot']} + {opts['acquire']} exceed the {opts['candidates']} candidates",
    )
    need(opts["noise"] > 0 and math.isfinite(opts["noise"]), f"--noise must be positive, got {opts['noise']}")
    need(opts["orientation_std"] >= 0, f"--orientation-std must be >= 0, got {opts['orientation_std']}")
    need(len(opts["strategies"]) == len(set(opts["strategies"])), "--strategies: repeated strategy")
    return opts


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = resolve_options(args)
        command = shlex.join(["python", "scripts/angle_selection.py", *(sys.argv[1:] if argv is None else argv)])
        agg = run_study(opts, Path(args.out), command=command, report_only=args.report)
    except StudyError as exc:
        print(f"angle_selection: {exc}", file=sys.stderr)
        return 2
    print(markdown_tables(agg, opts["strategies"]), end="")
    return 0


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    sys.exit(main())
