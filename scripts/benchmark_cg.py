#!/usr/bin/env python
"""CG for ``C = K̄/a + σ²I``: which preconditioner (default), and ctuq's PCG against linear_operator's ``linear_cg``
(``--backends``).

What it reproduces:

* the preconditioner table in the module docstring of ``ctuq/inference/solvers/preconditioners.py`` ("Which one is
  default, and why"), the reason single-pass Nyström is the default (docs/NOTES.md, "Inference"):
  ``python scripts/benchmark_cg.py --preset tiny --size 64 --c 1024 --detectors 64``. CG iterations to rtol 1e-3
  (max over the right-hand sides) of single-pass Nyström, Halko alg. 5.6 and pivoted Cholesky, on synthetic spectra
  (``c = 400``, ``aσ² = 1``) and on the U-Net kernel of the synthetic problem (``--synthetic-only`` skips it);
* the ``linear_cg`` comparison in the module docstring of ``ctuq/inference/solvers/cg.py`` (docs/NOTES.md:
  "CG: our own batched PCG"): ``python scripts/benchmark_cg.py --backends --preset small`` (kernel products, wall
  time, iterations and the largest relative residual of both on ``--samples`` + 1 right-hand sides).

The problem is the synthetic one of ``scripts/_bench_common.py`` (a ctuq U-Net with random weights and a sparse line
map in place of the ray transform); the solvers are ctuq's (``ctuq.inference.CGSolver``).

Examples::

    python scripts/benchmark_cg.py --preset tiny --size 64 --c 1024 --detectors 64
    python scripts/benchmark_cg.py --synthetic-only
    python scripts/benchmark_cg.py --backends --preset small --size 128 --c 7680
"""

from __future__ import annotations

import argparse
import time

import torch
from _bench_common import (
    add_problem_arguments,
    apply_threads,
    build_problem,
    gprior_features,
    print_table,
    sync,
)

from ctuq.inference import CGSolver, DenseFeatures
from ctuq.linearize import LinearizedNetwork
from ctuq.utils import resolve_device, tune_malloc


def _spectrum_features(eigs: torch.Tensor, d: int, seed: int = 0) -> DenseFeatures:
    c = eigs.numel()
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(c, c, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, c, generator=gen, dtype=torch.float64))
    return DenseFeatures(U @ torch.diag(eigs.sqrt()) @ V.T)


def _precond_rows(name, feats, ranks, p, a, s2, n_rhs, seed):
    gen = torch.Generator().manual_seed(seed)
    rhs = torch.randn(n_rhs, feats.n_outputs, generator=gen).to(feats.device, feats.dtype)
    none = CGSolver(feats, preconditioner="none", rtol=1e-3, max_iter=2000).solve(rhs, a, s2)[1].max_iterations
    out = []
    for r in ranks:
        cells = []
        for method, rank in (("nystrom", r), ("halko", r), ("nystrom", 2 * r + p), ("pivoted_cholesky", r)):
            if rank > feats.n_outputs:
                cells.append("-")
                continue
            solver = CGSolver(
                feats, preconditioner=method, rank=rank, oversampling=p, rtol=1e-3, max_iter=2000, seed=seed
            )
            t0 = time.perf_counter()
            eig = solver.build_preconditioner()
            t_build = time.perf_counter() - t0
            it = solver.solve(rhs, a, s2)[1].max_iterations
            extra = f"+{eig.n_diag_products}d" if eig.n_diag_products else ""
            cells.append(f"{it} ({eig.n_products}{extra}, {t_build:.1f}s)")
        out.append((name, none, r, *cells))
    return out


def run_preconditioners(args) -> None:
    head = ("kernel", "no precond.", "rank r", "single-pass r", "Halko 5.6 r", "single-pass 2r+p", "piv. Cholesky r")
    rows = []
    c = 400
    i = torch.arange(1, c + 1, dtype=torch.float64)
    spectra = {
        "synthetic 1e4/i": 1e4 / i,
        "synthetic 1e5/i²": 1e5 * i**-2.0,
        "synthetic log 1e5..1e-5": torch.logspace(5, -5, c, dtype=torch.float64),
    }
    for name, eigs in spectra.items():
        rows += _precond_rows(name, _spectrum_features(eigs, 2 * c), (25, 50, 100, 200), 10, 1.0, 1.0, 8, 1)
    if not args.synthetic_only:
        device = resolve_device(args.device)
        model, x, T = build_problem(args, device)
        net = LinearizedNetwork(model, x, chunk_size=args.chunk_size, mode=args.mode)
        feats, _ = gprior_features(args, net, T, device)
        rows += _precond_rows(
            f"U-Net {args.preset} {args.size}², c={T.c}, a={args.a0}",
            feats,
            args.ranks,
            args.oversampling,
            args.a0,
            args.sigma2,
            args.samples + 1,
            args.seed,
        )
    print(
        "# CG iterations to rtol 1e-3 (max over right-hand sides); in brackets: kernel products of the "
        "preconditioner (+d: diagonal products) and its build time"
    )
    print_table(head, rows)


def run_backends(args) -> None:
    device = resolve_device(args.device)
    model, x, T = build_problem(args, device)
    net = LinearizedNetwork(model, x, chunk_size=args.chunk_size, mode=args.mode)
    feats, _ = gprior_features(args, net, T, device)
    base = CGSolver(
        feats, preconditioner=args.preconditioner, rank=args.rank, oversampling=args.oversampling, seed=args.seed
    )
    eig = base.build_preconditioner()
    rhs = torch.randn(args.samples + 1, T.c, generator=torch.Generator().manual_seed(args.seed)).to(device)
    print(
        f"# {args.samples + 1} right-hand sides, preconditioner {args.preconditioner} rank {args.rank}, "
        f"a = {args.a0}, σ² = {args.sigma2}, rtol {args.rtol}"
    )
    print("backend     wall s  kernel products  max it  max rel. residual")
    for backend in ("pcg", "linear_cg"):
        solver = CGSolver(feats, preconditioner=eig, rtol=args.rtol, max_iter=args.max_iter, backend=backend)
        sync(device)
        t0 = time.perf_counter()
        _, st = solver.solve(rhs, args.a0, args.sigma2)
        sync(device)
        print(
            f"{backend:10s}  {time.perf_counter() - t0:6.1f}  {st.n_products:15d}  {st.max_iterations:6d}  "
            f"{float(st.relative_residual.max()):.2e}"
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", action="store_true", help="ctuq's deflated PCG vs linear_operator.linear_cg")
    ap.add_argument("--synthetic-only", action="store_true", help="preconditioners: skip the U-Net kernel")
    ap.add_argument("--ranks", nargs="+", type=int, default=[50, 100, 200], help="preconditioners: U-Net ranks")
    ap.add_argument(
        "--preconditioner",
        default="nystrom",
        choices=("nystrom", "halko", "pivoted_cholesky", "none"),
        help="--backends: the preconditioner both backends use",
    )
    ap.add_argument("--rank", type=int, default=400, help="--backends: its rank")
    ap.add_argument("--oversampling", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-3, help="--backends: relative tolerance")
    ap.add_argument("--max-iter", type=int, default=150, help="--backends: iteration cap")
    ap.add_argument("--samples", type=int, default=16, help="right-hand sides = samples + 1 (an EM step's)")
    add_problem_arguments(ap)
    args = ap.parse_args(argv)
    apply_threads(args)
    if args.backends:
        run_backends(args)
    else:
        run_preconditioners(args)


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
