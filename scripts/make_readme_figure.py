"""Regenerate README's figure, ``docs/uncertainty.png``: the demo's ``uncertainty.png`` (ground truth | DIP
reconstruction | |error| | std map, in mm⁻¹).

    python scripts/make_readme_figure.py                    # run the demo, copy its figure
    python scripts/make_readme_figure.py --run runs/demo    # reuse a finished demo run folder instead

The demo is ``ctuq reconstruct --config demo`` (what ``make demo`` runs). Without ``--run`` it runs into a temporary
folder that is removed afterwards (``--keep PATH`` writes it to ``PATH`` instead and keeps it); it takes 1.5–3
minutes on 2 CPU cores. Runs are bitwise reproducible on one machine, so the figure comes back byte for byte there
(the checked-in one is the demo's on a 2-core CPU: DIP 32.5 dB); DIP training amplifies rounding differences between
CPU types, so on another CPU its numbers differ slightly (README says so).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = "uncertainty.png"
DEFAULT_DEST = ROOT / "docs" / FIGURE


def run_demo(out: Path) -> None:
    """``ctuq reconstruct --config demo --out OUT`` (what ``make demo`` runs) in a fresh process."""
    cmd = [sys.executable, "-m", "ctuq", "reconstruct", "--config", "demo", "--out", str(out)]
    print("make_readme_figure: running " + " ".join(cmd[1:]), file=sys.stderr)
    subprocess.run(cmd, cwd=ROOT, check=True)


def copy_figure(run: Path, dest: Path) -> Path:
    """Copy ``RUN/uncertainty.png`` to ``dest``; one-line ``SystemExit`` naming the folder when it has none."""
    src = run / FIGURE
    if not src.is_file():
        raise SystemExit(f"make_readme_figure: --run {run}: no {FIGURE} there (a finished run with uncertainty?)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help="a finished demo run folder to take the figure from (no new run)")
    ap.add_argument("--keep", type=Path, help="run the demo into this folder and keep it (default: a temporary one)")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"where the figure goes (default {DEFAULT_DEST})")
    args = ap.parse_args(argv)
    if args.run is not None and args.keep is not None:
        ap.error("--run reuses a run and --keep makes one: give one of them")
    if args.run is not None:
        dest = copy_figure(args.run, args.dest)
    elif args.keep is not None:
        run_demo(args.keep)
        dest = copy_figure(args.keep, args.dest)
    else:
        with tempfile.TemporaryDirectory(prefix="ctuq-readme-figure-") as tmp:
            run_demo(Path(tmp) / "demo")
            dest = copy_figure(Path(tmp) / "demo", args.dest)
    print(f"make_readme_figure: wrote {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
