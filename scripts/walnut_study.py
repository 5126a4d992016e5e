#!/usr/bin/env python
"""Walnut uncertainty study: linearised DIP inference against MC dropout, for several angle counts of one scan.

For one scan (default: a simulated walnut written by ``ctuq simulate``'s ``bundled`` preset into ``OUT/scan``;
the real walnut when ``--data`` names its ``Walnut{id}`` folder) and every angle count in ``--settings``, the
study loads the 2D slice problem and

1. fits the DIP once (U-Net without dropout): its reconstruction ``x̃`` is the mean of both linearised methods;
2. **linearised (sampled)**: g-prior, sampled EM with preconditioned CG, ``--samples`` dual Matheron samples
   (:func:`ctuq.uncertainty` on the DIP's run with ``uq.solver = cg``);
3. **linearised (exact)**: the exact reference (``solver="exact"``: the dense route ``TΦ`` for ``d < c``, the
   ``c × c`` eigendecomposition otherwise; exact EM to convergence, exact samples) when ``--exact`` permits:
   ``auto`` runs it when its memory estimate (:func:`ctuq.inference.estimate_solver_costs` from ``c``, ``d`` and
   the sample count) fits half the free memory of the device;
4. **MC dropout**: a second DIP, the same U-Net with channel dropout (``--dropout``, 0.05) after every conv block,
   fitted with dropout active, then ``--mc-passes`` stochastic passes
   (:mod:`ctuq.reconstruct.mc_dropout`).

Every method is scored by :func:`ctuq.metrics.uq_summary` in the inner-square region of interest (pixels 72:424 of
501, scaled to the grid): marginal test log-likelihood, joint log-likelihood of p×p patches (p = 1…10),
calibration, coverage. "hyperparameters" time is the g-prior, solver set-up (preconditioner or exact
decomposition) and EM; "prediction" time is the prediction samples (or the MC-dropout passes). MC dropout learns
no hyperparameters (its rate is fixed); its extra DIP fit is in the "fit" column.

The study itself is :mod:`ctuq.studies.walnut` (on the shared machinery of :mod:`ctuq.studies.common`); this
script is its command line.

Outputs in ``--out``::

    results.md, results.json          the table (rows: setting × method) and every number behind it
    uq_<N>.png                         reconstruction | |error| | std, one row per method (N = angle count)
    joint_ll_<N>.png                   joint log-likelihood against patch size
    calibration_<N>.png                calibration curves
    error_vs_std_<N>.png               |error| against std histograms
    angles_<N>/                        per setting: ground_truth.tif, reconstruction.tif (the DIP's), and run
        dip/                           folders (ctuq.load_run): the DIP fit (ctuq.reconstruct, uq=False),
        <method>/                      per method its run (std.tif, metrics.json, checkpoints; MC dropout's
                                       own DIP and mean.tif)
    study.json                         the options of the study (a rerun must use the same ones)
    scan/                              the simulated scan (only without --data)

Resuming: every run is made by the public API with ``resume=True, reuse=True``, so rerunning the same command
(also after a kill) loads the finished runs and continues the interrupted one from its checkpoints (the DIP fit's
``dip_checkpoint.pt``, the inference's ``uq_state.pt`` and sample chunks); the log says which.

Examples::

    python scripts/walnut_study.py --out runs/study                      # simulated walnut, CPU demo settings
    python scripts/walnut_study.py --tiny --out /tmp/study              # seconds: the test's size
    python scripts/walnut_study.py --data /data/Walnut1 --device cuda --preset walnut --iterations 2000 \\
        --lr 1e-4 --tv-weight 6.5e-6 --samples 1024 --out runs/walnut1  # the real walnut on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from ctuq.studies import StudyError
from ctuq.studies.walnut import DEFAULTS, TINY, WalnutOptions, markdown_table, run_study, table_rows
from ctuq.utils import tune_malloc


# ================================================================================================ options
def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every study option defaults to ``None`` (resolved by :func:`resolve_options`)."""
    p = argparse.ArgumentParser(
        prog="walnut_study.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Outputs in") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DEFAULTS
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="DIR",
        help="Walnut{id} folder (real or simulated); default: simulate one into OUT/scan (reused when it is there)",
    )
    g.add_argument(
        "--scan-preset",
        choices=("bundled", "tiny", "walnut"),
        help=f"simulation preset when --data is not given (default {d.scan_preset})",
    )
    g.add_argument("--out", metavar="DIR", required=True, help="study folder (created; reruns resume in it)")
    g.add_argument(
        "--settings",
        type=int,
        nargs="+",
        metavar="ANGLES",
        help=f"angle counts, each dividing the scan's number of distinct angles (default "
        f"{' '.join(map(str, d.settings))})",
    )
    g.add_argument("--orbit", type=int, choices=(1, 2, 3), help="source orbit (default 2)")
    g.add_argument("--slice-index", type=int, help="ground-truth slice (default: the central one)")
    g.add_argument(
        "--image-shape",
        type=int,
        nargs=2,
        metavar=("H", "W"),
        help="reconstruction grid (default: the ground-truth grid)",
    )
    g.add_argument(
        "--detector-subsampling",
        type=int,
        metavar="K",
        help="keep every K-th detector column (default: about 128 columns remain)",
    )
    g.add_argument("--backend", choices=("auto", "sparse", "astra_cuda"), help="ray transform (default auto)")
    g = p.add_argument_group("DIP")
    g.add_argument("--preset", choices=("tiny", "small", "walnut"), help=f"U-Net preset (default {d.preset})")
    g.add_argument("--iterations", type=int, help=f"DIP iterations (default {d.iterations})")
    g.add_argument("--lr", type=float, help=f"Adam learning rate (default {d.lr})")
    g.add_argument("--tv-weight", type=float, help=f"TV weight (default {d.tv_weight})")
    g.add_argument("--clip-grad-norm", type=float, help=f"gradient-norm clip, 0 disables (default {d.clip_grad_norm})")
    g.add_argument("--scale", type=float, help=f"data/image scale of the DIP (default {d.scale})")
    g.add_argument("--input-std", type=float, help=f"std of the fixed noise input (default {d.input_std})")
    g = p.add_argument_group("linearised inference")
    g.add_argument("--samples", type=int, help=f"prediction samples of the linearised methods (default {d.samples})")
    g.add_argument("--exact-samples", type=int, help="prediction samples of the exact reference (default: --samples)")
    g.add_argument("--em-steps", type=int, help=f"sampled-EM steps (default {d.em_steps})")
    g.add_argument("--em-samples", type=int, help=f"samples per sampled-EM step (default {d.em_samples})")
    g.add_argument(
        "--exact-em-steps",
        type=int,
        help=f"EM steps of the exact reference (free there; default {d.exact_em_steps}, tol 1e-3)",
    )
    g.add_argument("--rank", type=int, help=f"CG preconditioner rank (default {d.rank})")
    g.add_argument(
        "--gprior", choices=("exact", "stochastic"), help="g-prior scales: exact (c VJPs) or stochastic (default exact)"
    )
    g.add_argument("--prior-precision", type=float, help=f"initial prior precision a (default {d.prior_precision})")
    g.add_argument(
        "--exact",
        choices=("auto", "always", "never"),
        help="run the exact reference: auto = when its memory estimate fits the device (default)",
    )
    g = p.add_argument_group("MC dropout")
    g.add_argument("--mc-passes", type=int, help=f"stochastic forward passes (default {d.mc_passes})")
    g.add_argument("--mc-batch", type=int, help=f"passes per forward call (default {d.mc_batch})")
    g.add_argument("--dropout", type=float, help=f"dropout rate after every conv block (default {d.dropout})")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: CUDA if available")
    g.add_argument("--seed", type=int, help="seed of inputs, weights, dropout and samples (default 0)")
    g.add_argument(
        "--tiny",
        action="store_true",
        help="tiny preset for tests: tiny simulated scan, 4 and 8 angles, 32² grid, 24 detector columns, "
        f"{TINY.iterations} DIP iterations, a few samples (explicit options still win)",
    )
    g.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: torch's choice; on a machine shared with other jobs 1 can be "
        "several times faster)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    return p


def resolve_options(args: argparse.Namespace) -> WalnutOptions:
    """The study's options: explicit command-line values > ``--tiny`` (:data:`~ctuq.studies.walnut.TINY`) >
    :data:`~ctuq.studies.walnut.DEFAULTS`; ``exact_samples`` resolved and validated (``StudyError``)."""
    base = TINY if args.tiny else DEFAULTS
    given = {}
    for field in dataclasses.fields(WalnutOptions):
        value = getattr(args, field.name, None)
        if value is not None and field.name not in ("device", "threads", "tiny", "progress"):
            given[field.name] = tuple(value) if isinstance(value, (list, tuple)) else value
    options = dataclasses.replace(
        base, **given, device=args.device, threads=args.threads, tiny=bool(args.tiny), progress=not args.no_progress
    ).resolved()
    options.validate()
    return options


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input, with the reason on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = resolve_options(args)
        out = Path(args.out)
        command = shlex.join(["python", "scripts/walnut_study.py", *(sys.argv[1:] if argv is None else argv)])
        results = run_study(options, args.data, out, command=command)
    except StudyError as exc:
        print(f"walnut_study: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(table_rows(results)), end="")
    return 0


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    sys.exit(main())
