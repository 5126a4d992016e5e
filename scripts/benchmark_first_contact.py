#!/usr/bin/env python
"""A newcomer's first contact, timed: ``ctuq --help`` and every command's ``--help``, the default demo (``ctuq
reconstruct``, with its phases and the solver's own estimate of the inference), and ``make test-fast``; medians of
several runs, as a table (the guide's "Quick start", docs/guide.md, quotes it; docs/NOTES.md has the profile).

Run it on an idle machine (the numbers are wall times; a second busy process on 2 cores slows torch ~10×)::

    python scripts/benchmark_first_contact.py                    # help only: seconds
    python scripts/benchmark_first_contact.py --demo 3           # + 3 default demos (minutes each)
    python scripts/benchmark_first_contact.py --demo 1 --tests   # + one demo and `make test-fast`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("", "simulate", "reconstruct", "uq", "pretrain", "design", "view", "fetch")


def _time(cmd: list[str], **kw) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}")
    return took


def _row(name: str, values: list[float]) -> str:
    return f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} | {len(values)} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each --help (default 5)")
    ap.add_argument("--demo", type=int, default=0, metavar="N", help="also run the default demo N times")
    ap.add_argument("--tests", action="store_true", help="also time `make test-fast` once")
    args = ap.parse_args()
    exe = [sys.executable, "-m", "ctuq"]
    print("| what | median s | min s | max s | runs |\n|---|---|---|---|---|")
    for command in COMMANDS:
        argv = [*exe, command, "--help"] if command else [*exe, "--help"]
        print(_row(f"ctuq {command} --help".replace("  ", " "), [_time(argv) for _ in range(args.repeats)]))
    if args.demo:
        walls, phases, estimates = [], {}, []
        for i in range(args.demo):
            with tempfile.TemporaryDirectory(prefix="ctuq-demo-") as tmp:
                out = Path(tmp) / "demo"
                walls.append(_time([*exe, "reconstruct", "--out", str(out), "--no-progress", "-q"]))
                metrics = json.loads((out / "metrics.json").read_text())
                for name, seconds in metrics["timings"].items():
                    phases.setdefault(name, []).append(seconds)
                est = (metrics["uq"].get("stats") or {}).get("estimate") or {}
                if est.get("seconds") is not None:
                    estimates.append(est["seconds"])
                if i == 0:
                    summary = {
                        "DIP PSNR": metrics["psnr"]["dip"],
                        "marginal LL": metrics["marginal_ll"],
                        "joint LL 10×10": metrics["joint_ll"]["10"],
                        "coverage@0.9": metrics["coverage"]["0.9"],
                    }
        print(_row("ctuq reconstruct (the demo), wall", walls))
        for name, values in phases.items():
            print(_row(f"  phase {name}", values))
        if estimates:
            print(_row("  the solver's estimate of the inference", estimates))
        print("\n" + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.tests:
        env = {**os.environ, "CTUQ_SKIP_INSTALL": "1"}
        print(_row("make test-fast", [_time(["make", "test-fast"], cwd=ROOT, env=env)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
