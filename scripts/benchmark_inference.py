#!/usr/bin/env python
"""Cost of linearised inference, phase by phase: wall time and Jacobian products (JVPs / VJPs) spent.

What it reproduces: ``--products`` gives the per-sample JVP/VJP table in the module docstring of
``ctuq/linearize.py`` (``--products --presets small --size 128``) and the chunk-size figures of docs/NOTES.md
("Jacobian products run in vmap chunks": ``--products --presets tiny small --chunks 8 16 32``); the phase table
measures DESIGN.md §5's cost floor (Jacobian products × the cost of one) phase by phase, as the guide's "Test"
section (docs/guide.md) lists it.

The problem is the synthetic one of ``scripts/_bench_common.py``: a U-Net of ctuq (``--preset``, random weights) and
a sparse line map in place of the ray transform, so the cost is the inference's and no scan is needed; the
inference itself is ctuq's (``ctuq.linearize``, ``ctuq.inference``: the g-prior, the CG or exact
solver, the sampled EM and the Matheron sampler).

Phases: tracing the linearisation, g-prior scales, the solver set-up (CG preconditioner, or assembling and
decomposing ``K̄`` for the exact solver), every EM step, and the prediction samples (posterior mean, weight samples
in seeded chunks, image-space samples ``Φ(s ⊙ ζ)`` and their pixelwise std). For each the table gives the wall
time, JVPs and VJPs spent (per sample), the kernel products spent inside CG, and the *floor*: the products the
phase needs whatever the solver does (e.g. a prediction sample needs one JVP for ``Ψw₀``, one VJP for ``Ψᵀ(…)`` and
one JVP for its image; an EM step needs ``k`` JVPs and no VJPs).

``--products``: per-sample JVP and VJP time of the presets at ``--size``², vmapped, for chunk sizes 1/8/16, with
``mode="linearize"`` (traced once) and ``mode="recompute"``.

The solver comparisons live in their own scripts: ``scripts/benchmark_solvers.py`` (exact, CG, adaptive-rank CG,
SDD, SGD) and ``scripts/benchmark_cg.py`` (CG preconditioners; ctuq's PCG against linear_operator's ``linear_cg``).

CPU timings are noisy when other processes share the cores: repeat a run before trusting a difference.

Examples::

    python scripts/benchmark_inference.py --preset small --size 128 --c 7680 --pred-samples 64
    python scripts/benchmark_inference.py --products --presets tiny small --size 128
    python scripts/benchmark_inference.py --device cuda --preset walnut --size 501 --c 7680 --pred-samples 1024
    python scripts/benchmark_inference.py --preset tiny --size 32 --c 256 --detectors 32 --rank 20 --pred-samples 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _bench_common import (
    add_problem_arguments,
    apply_threads,
    build_problem,
    gprior_features,
    make_targets,
    print_table,
    sync,
)

from ctuq.inference import CGSolver, ExactEigSolver, SampledEM, Workload, choose_solver, posterior_mean, sample_chunks
from ctuq.linearize import LinearizedNetwork
from ctuq.models import build_unet, count_parameters, make_net_input
from ctuq.utils import resolve_device, tune_malloc

#: Options of the former all-in-one script that moved to the solver benchmarks: their new home.
MOVED = {
    "--compare-solvers": "scripts/benchmark_solvers.py",
    "--compare-preconditioners": "scripts/benchmark_cg.py",
    "--compare-cg": "scripts/benchmark_cg.py --backends",
}


class Table:
    """Collects rows and prints them aligned."""

    HEAD = ("phase", "wall s", "JVPs", "VJPs", "CG prods", "floor JVP", "floor VJP", "CG it max", "notes")

    def __init__(self):
        self.rows: list[tuple] = []

    def add(self, *row):
        self.rows.append(tuple(row))
        print("  " + " | ".join(str(v) for v in row), file=sys.stderr, flush=True)

    def print(self):
        cells = [self.HEAD] + [tuple(_fmt(v) for v in r) for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.HEAD))]
        for j, r in enumerate(cells):
            print("  ".join(v.rjust(w) if i in range(1, 8) else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))))
            if j == 0:
                print("  ".join("-" * w for w in widths))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


class Phase:
    """Context manager measuring wall time and network JVP/VJP counts of a phase."""

    def __init__(self, net: LinearizedNetwork, device: torch.device):
        self.net, self.device = net, device

    def __enter__(self):
        sync(self.device)
        self.t0 = time.perf_counter()
        self.j0, self.v0 = self.net.n_jvp, self.net.n_vjp
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.wall = time.perf_counter() - self.t0
        self.jvp = self.net.n_jvp - self.j0
        self.vjp = self.net.n_vjp - self.v0
        return False


def run_main(args) -> None:
    device = resolve_device(args.device)
    model, x, T = build_problem(args, device)
    net = LinearizedNetwork(model, x, chunk_size=args.chunk_size, mode=args.mode)
    print(
        f"# preset {args.preset} at {args.size}², d = {net.d} linearised weights "
        f"({count_parameters(model)} parameters), c = {T.c} ({args.map} map, {T.T.values().numel()} non-zeros), "
        f"device {device}, torch threads {torch.get_num_threads()}, mode {args.mode}"
    )
    table = Table()
    with Phase(net, device) as ph:
        net.jvp(torch.zeros(1, net.d, device=device))
        net.vjp(torch.zeros(1, net.d_out, device=device))
    table.add(
        "linearise (trace + 1 warm-up each)",
        ph.wall,
        ph.jvp,
        ph.vjp,
        0,
        0,
        0,
        None,
        f"chunks jvp {net.chunk_size_for('jvp')}, vjp {net.chunk_size_for('vjp')}, jvp_impl {net.jvp_impl}",
    )

    with Phase(net, device) as ph:
        feats, s = gprior_features(args, net, T, device, progress=args.progress)
    floor = {"exact": T.c, "stochastic": args.gprior_probes, "isotropic": 0}[args.gprior]
    n_zero = int((s == 0).sum())
    table.add(f"g-prior scales ({args.gprior})", ph.wall, ph.jvp, ph.vjp, 0, 0, floor, None, f"{n_zero} zero columns")

    y = make_targets(args, feats, net, T, device)

    if args.solver == "auto":
        wl = Workload(
            em_steps=args.em_steps,
            em_samples=args.samples,
            prediction_samples=args.pred_samples,
            rank=args.rank,
            oversampling=args.oversampling,
        )
        with Phase(net, device) as ph:
            kind, est = choose_solver(feats, wl)
        for e in est.values():
            print(
                f"# cost model {e.solver:5s}: {e.jvp:.0f} JVPs, {e.vjp:.0f} VJPs, {e.dense_flops:.2e} flops, "
                f"{e.memory_bytes / 1e6:.0f} MB, {e.seconds:.0f} s{'' if e.feasible else ' (does not fit)'}"
            )
        table.add(f"solver choice → {kind}", ph.wall, ph.jvp, ph.vjp, 0, 0, 0, None, "measures product times")
        args.solver = kind
    if args.solver == "exact":
        solver = ExactEigSolver(feats, memory_budget=args.memory_budget, progress=args.progress)
        with Phase(net, device) as ph:
            solver.decompose()
        table.add(
            "assemble K̄ + eigh (exact)", ph.wall, ph.jvp, ph.vjp, 0, 0, T.c, None, f"{solver.n_setup_products} rows"
        )
    else:
        solver = CGSolver(
            feats,
            preconditioner=args.preconditioner,
            rank=args.rank,
            oversampling=args.oversampling,
            rtol=args.rtol,
            max_iter=args.max_iter,
            seed=args.seed,
        )
        with Phase(net, device) as ph:
            eig = solver.build_preconditioner()
        rp = 0 if eig is None else eig.n_products
        table.add(
            f"preconditioner ({args.preconditioner}, r={args.rank}, p={args.oversampling})",
            ph.wall,
            ph.jvp,
            ph.vjp,
            0,
            rp,
            rp + (0 if eig is None else eig.n_diag_products),
            None,
            "" if eig is None else f"λ_max {float(eig.eigenvalues[0]):.3g}, λ_r {float(eig.eigenvalues[-1]):.3g}",
        )

    em = SampledEM(
        feats,
        solver,
        y,
        a=args.a0,
        sigma2=args.sigma2,
        learn_noise=args.learn_noise,
        n_samples=args.samples,
        max_steps=args.em_steps,
        tol=args.em_tol,
        seed=args.seed,
    )
    while not em.done:
        with Phase(net, device) as ph:
            rec = em.step()
        st = rec["solver"]
        cg_prods = 0 if st is None else st["n_products"]
        exact = rec["gamma_method"] == "exact"
        table.add(
            f"EM step {rec['step']}",
            ph.wall,
            ph.jvp,
            ph.vjp,
            cg_prods,
            0 if exact else args.samples,
            0,
            None if st is None else st["max_iterations"],
            f"a {rec['a']:.3g}→{rec['a_new']:.3g}, γ {rec['gamma']:.1f}",
        )

    k = args.pred_samples
    if k > 0:
        with Phase(net, device) as ph:
            w_star, _, st_mean = posterior_mean(feats, solver, y, em.a, em.sigma2)
            sq = torch.zeros(net.d_out, dtype=torch.float64, device=device)
            max_it, cg_prods = st_mean.max_iterations, st_mean.n_products
            for _, chunk in sample_chunks(
                feats, solver, em.a, em.sigma2, k, chunk_size=args.pred_chunk, seed=args.seed
            ):
                xs = feats.base.network_matvec(chunk.weights * feats.scales)  # Φ(s ⊙ ζ)
                sq += xs.double().pow(2).sum(0)
                max_it = max(max_it, chunk.stats.max_iterations)
                cg_prods += chunk.stats.n_products
            std = (sq / k).sqrt()
        table.add(
            f"prediction ({k} samples + mean)",
            ph.wall,
            ph.jvp,
            ph.vjp,
            cg_prods,
            2 * k,
            k + 1,
            max_it,
            f"mean std {float(std.mean()):.3g}, {ph.wall / k * 1e3:.0f} ms/sample",
        )

    table.print()
    tot_wall = sum(r[1] for r in table.rows)
    tot_j = sum(r[2] for r in table.rows)
    tot_v = sum(r[3] for r in table.rows)
    print(f"total: {tot_wall:.1f} s, {tot_j} JVPs, {tot_v} VJPs; final a = {em.a:.4g}, σ² = {em.sigma2:.4g}")


def run_products(args) -> None:
    device = resolve_device(args.device)
    print(
        f"# per-sample Jacobian products at {args.size}², device {device}, torch threads {torch.get_num_threads()}; "
        f"min and median of {args.repeats} calls after a warm-up call (the min is robust to other load)"
    )
    head = ("preset", "d", "mode", "chunk", "JVP ms/sample min", "median", "VJP ms/sample min", "median")
    rows = []
    for preset in args.presets:
        torch.manual_seed(args.seed)
        model = build_unet(preset).to(device)
        x = make_net_input((args.size, args.size), seed=args.seed).to(device)
        for mode in args.modes:
            net = LinearizedNetwork(model, x, mode=mode)
            for chunk in args.chunks:
                net.chunk_size = chunk
                res = []
                for kind, width in (("jvp", net.d), ("vjp", net.d_out)):
                    X = torch.randn(chunk, width, device=device)
                    fn = net.jvp if kind == "jvp" else net.vjp
                    fn(X)
                    times = []
                    for _ in range(args.repeats):
                        sync(device)
                        t0 = time.perf_counter()
                        fn(X)
                        sync(device)
                        times.append(time.perf_counter() - t0)
                    res += [min(times) / chunk * 1e3, statistics.median(times) / chunk * 1e3]
                rows.append((preset, net.d, f"{mode} ({net.jvp_impl})", chunk, *(f"{v:.1f}" for v in res)))
                print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    for flag, home in MOVED.items():
        if flag in argv:
            raise SystemExit(f"benchmark_inference.py: {flag} moved to {home} (same options)")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--products", action="store_true", help="per-sample JVP/VJP timing table instead of the phases")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"], help="--products: presets to time")
    ap.add_argument("--modes", nargs="+", default=["linearize", "recompute"], help="--products: modes to time")
    ap.add_argument("--chunks", nargs="+", type=int, default=[1, 8, 16], help="--products: chunk sizes")
    ap.add_argument("--repeats", type=int, default=3, help="--products: timed calls per setting")
    ap.add_argument("--solver", default="cg", choices=("cg", "exact", "auto"))
    ap.add_argument("--preconditioner", default="nystrom", choices=("nystrom", "halko", "pivoted_cholesky", "none"))
    ap.add_argument("--rank", type=int, default=400)
    ap.add_argument("--oversampling", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--max-iter", type=int, default=150)
    ap.add_argument("--samples", type=int, default=16, help="EM samples per step")
    ap.add_argument("--em-steps", type=int, default=5)
    ap.add_argument("--em-tol", type=float, default=0.0, help="EM stopping tolerance (0: run all steps)")
    ap.add_argument("--learn-noise", action="store_true")
    ap.add_argument("--pred-samples", type=int, default=64, help="prediction samples (0: skip)")
    ap.add_argument("--pred-chunk", type=int, default=16, help="prediction samples per seeded chunk")
    ap.add_argument("--memory-budget", type=int, default=None, help="bytes for Ψᵀ when assembling K̄ (exact)")
    ap.add_argument("--progress", action="store_true")
    add_problem_arguments(ap)
    args = ap.parse_args(argv)
    apply_threads(args)
    if args.products:
        run_products(args)
    else:
        run_main(args)


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
