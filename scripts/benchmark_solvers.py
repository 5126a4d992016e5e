#!/usr/bin/env python
"""The solvers of the linearised posterior on one problem: exact, CG (rank 400 and adaptive rank), SDD and SGD.

What it reproduces: the solver comparison of docs/NOTES.md ("Solver comparison on a real CT problem": the solve
table, the real-network table) and, with ``--tune``, the SDD/SGD tuning and sampled-EM tables of
docs/notebook/engineering.md, on which the defaults of ``SDDSolver.Options`` / ``SGDSolver.Options`` and
``uq.solver: auto``'s choice rest::

    python scripts/benchmark_solvers.py --run RUN --cache small_eig.pt --fo-budget 20000 --adaptive-cap 3000 \\
        --rank-thresholds 1 4 16 --real-rhs 4 --threads 1 [--sdd-momentum 0.99] [--tune]

where RUN is ``ctuq reconstruct --set model.preset=small --out RUN`` on the bundled scan.

What it measures: Jacobian products, wall time, accuracy of the solves and of the sampled-EM fixed point against
the exact route, the whole-workload product count (``--em-steps`` × (``--samples`` + 1) + ``--workload-samples`` +
1 right-hand sides) and its ratio to rank-400 CG. ``--run RUN_DIR`` takes the problem from a finished
``ctuq reconstruct`` run (its scan, fitted DIP and σ², through ctuq's CT front end
``ctuq.pipeline.ct_model.ct_posterior``); without it the problem is the synthetic one of ``scripts/_bench_common.py``
(a ctuq U-Net with random weights and a sparse line map in place of the ray transform).

Method (stated with the tables): the exact eigendecomposition ``K̄ = QΛQᵀ`` is computed once (``c`` VJPs + ``c``
JVPs; cached with ``--cache``) and defines the exact reference and the EM fixed point. Iteration counts of the
full-batch solvers and of Nyström-preconditioned CG are invariant under the rotation ``Qᵀ`` (Gaussian test matrices
and probes are rotation invariant in distribution), so the tables run on the rotated problem (``Ψ' = Λ^½``,
products cost ``O(c)``), block SDD on ``Ψ' = QΛ^½`` (coordinates matter there), and the leading configurations are
re-run on the real network (``--real-rhs`` right-hand sides) to check that the counts carry over.

CPU timings are noisy when other processes share the cores: repeat a run before trusting a difference.

Examples::

    python scripts/benchmark_solvers.py --run runs/small --cache /tmp/small_eig.pt
    python scripts/benchmark_solvers.py --preset tiny --size 32 --c 256 --detectors 32 --fo-budget 50 \\
        --workload-samples 8 --adaptive-cap 100 --blocks                      # seconds: the synthetic problem
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
from _bench_common import add_problem_arguments, apply_threads, build_problem, make_targets, print_table

from ctuq.config import UQConfig, load_config
from ctuq.inference import (
    CGSolver,
    ConvergenceWarning,
    DenseFeatures,
    FeatureOperator,
    GaussianLikelihood,
    LinearizedFeatures,
    LinearizedPosterior,
    SampledEM,
    SDDSolver,
    SGDSolver,
)
from ctuq.linearize import LinearizedNetwork
from ctuq.models import read_model_file
from ctuq.pipeline import run_folder
from ctuq.pipeline.ct_model import ct_posterior
from ctuq.pipeline.noise import resolve_noise
from ctuq.pipeline.scan import load_scan
from ctuq.utils import resolve_device, tune_malloc


class RotatedFeatures:
    """``Ψ' = Λ^½`` (diagonal, ``c × c``) of a kernel ``K̄ = QΛQᵀ`` in its eigenbasis: products cost ``O(c)``."""

    def __new__(cls, lam: torch.Tensor, dtype=torch.float32):
        class _Rotated(FeatureOperator):
            def __init__(self, root):
                super().__init__()
                self.root = root
                self.n_features = self.n_outputs = int(root.numel())
                self.dtype, self.device = root.dtype, root.device

            def _matvec(self, W):
                return W * self.root

            def _rmatvec(self, R):
                return R * self.root

        return _Rotated(lam.clamp_min(0).sqrt().to(dtype))


def _exact_problem(args, device):
    """``(posterior with an exact_dual solver, network, description)`` for the synthetic problem or ``--run``; the
    posterior's state (scales + eigendecomposition) is cached in ``--cache``."""
    if args.run:
        cfg = load_config(run_folder.require_run_folder(args.run), [f"device={device.type}"])
        data, path, _ = load_scan(cfg, device, progress=False)
        mf = read_model_file(f"{args.run}/{run_folder.MODEL_NAME}", need_input=True)
        model = mf.build(device)
        settings = UQConfig(
            solver="exact_dual",
            prior="isotropic" if args.gprior == "isotropic" else "gprior",
            gprior={"method": args.gprior if args.gprior != "isotropic" else "exact", "probes": args.gprior_probes},
            prior_precision=args.a0,
        )
        # one noise variance, as the documented table was measured (the scan's per-ray variances are not used)
        noise = resolve_noise(settings, None, data.op.measurement_shape)
        post, net, info = ct_posterior(
            model,
            mf.net_input,
            data.op,
            data.y.to(device),
            scale=mf.scale,
            settings=settings,
            seed=args.seed,
            noise=noise,
        )
        desc = (
            f"run {args.run} (scan {path}): {cfg.model.preset} U-Net, image {tuple(data.op.image_shape)}, "
            f"c = {data.op.c}, d = {net.d}, σ² from the DIP residual {info['initial_sigma2']:.4g}"
        )
    else:
        model, x, T = build_problem(args, device)
        net = LinearizedNetwork(model, x, chunk_size=args.chunk_size, mode=args.mode)
        base = LinearizedFeatures(net, T.forward, T.adjoint, n_outputs=T.c)
        y = make_targets(args, base, net, T, device)
        post = LinearizedPosterior(
            base,
            y,
            prior="isotropic" if args.gprior == "isotropic" else "gprior",
            prior_options={}
            if args.gprior == "isotropic"
            else {"method": "exact" if args.gprior == "exact" else "stochastic", "probes": args.gprior_probes},
            likelihood=GaussianLikelihood(args.sigma2, True),
            a=args.a0,
            solver="exact_dual",
            seed=args.seed,
        )
        desc = (
            f"synthetic: {args.preset} U-Net (random weights) at {args.size}², {args.map} map, c = {T.c}, "
            f"d = {net.d}, targets from the prior at a = {args.a_true}"
        )
    if args.cache and os.path.isfile(args.cache):
        post.load_state_dict(torch.load(args.cache, weights_only=True))
        desc += f"; decomposition from {args.cache}"
    t0 = time.perf_counter()
    j0, v0 = net.n_jvp, net.n_vjp
    post.setup()
    setup = (time.perf_counter() - t0, net.n_jvp - j0, net.n_vjp - v0)
    if args.cache and not os.path.isfile(args.cache):
        torch.save(post.state_dict(), args.cache)
    return post, net, desc, setup


def _solve_counts(make, feats, R, a, s2, X_ref, kernel_diag=None):
    """Solve once with a fresh solver from ``make()``; ``(products incl. set-up, max rel. residual, rel. error,
    iterations max, wall s)``."""
    solver = make(feats)
    j0, v0 = feats.n_matvec, feats.n_rmatvec
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        X, st = solver.solve(R, a, s2)
    wall = time.perf_counter() - t0
    prods = ((feats.n_matvec - j0) + (feats.n_rmatvec - v0)) / 2
    setup = getattr(solver, "n_setup_products", None)
    low = getattr(solver, "_eig", None)
    setup = low.n_products if low is not None else (setup or 0)
    err = float((X.double() - X_ref).norm() / X_ref.norm())
    out = {
        "products": prods,
        "setup": setup,
        "solve": prods - setup,
        "residual": float(st.relative_residual.max()),
        "error": err,
        "iterations": st.max_iterations,
        "wall": wall,
        "converged": st.all_converged,
        "X": X,
    }
    if kernel_diag is not None:
        # error of Ψζ = K̄u/a (the sample at the measurement functionals): what a dual error costs a prediction
        out["meas_error"] = float(((X.double() - X_ref) * kernel_diag).norm() / (X_ref * kernel_diag).norm())
    return out


def run_solvers(args) -> None:
    device = resolve_device(args.device)
    post, net, desc, (t_setup, j_setup, v_setup) = _exact_problem(args, device)
    lam, Q = post.solver.decompose()
    c = post.n_outputs
    feats = post.features
    print(f"# {desc}")
    print(
        f"# exact reference: K̄ assembled and eigendecomposed in {t_setup:.0f} s ({j_setup} JVPs, {v_setup} VJPs "
        f"incl. the g-prior); {lam.numel()} non-zero eigenvalues, λ_max {float(lam[-1]):.4g}; torch threads "
        f"{torch.get_num_threads()}"
    )

    # The operating point: the exact EM fixed point (exact γ, no products).
    em = SampledEM(
        feats,
        post.solver,
        post.targets,
        likelihood=GaussianLikelihood(post.sigma2, True),
        a=post.a,
        max_steps=500,
        tol=1e-10,
        seed=args.seed,
    )
    res = em.run()
    a_star, s2_star = res.a, res.sigma2
    gamma = float(post.solver.gamma(a_star, s2_star))
    above = int((lam / a_star > s2_star).sum())
    print(
        f"# exact EM fixed point: a = {a_star:.6g}, σ² = {s2_star:.6g} ({res.steps} steps); effective dimension "
        f"γ = {gamma:.1f}; eigenvalues with λ/a > σ²: {above}; κ(C) = {1 + float(lam[-1]) / (a_star * s2_star):.3g}"
    )

    # Right-hand sides at the fixed point: the mean's ỹ and k Matheron rows ε − Ψw₀, rotated into the eigenbasis.
    k = args.samples
    gen = torch.Generator().manual_seed(args.seed + 7)
    lam32 = lam.to(torch.float64)
    eps = torch.randn(k, c, generator=gen, dtype=torch.float64) * s2_star**0.5
    psi_w0 = torch.randn(k, lam.numel(), generator=gen, dtype=torch.float64) * (lam32 / a_star).sqrt()
    y_rot = Q.T @ post.targets.double()
    R_rot = torch.cat([y_rot[None], eps[:, : lam.numel()] - psi_w0], dim=0)
    X_rot = R_rot / (lam32 / a_star + s2_star)
    rot = RotatedFeatures(lam, dtype=feats.dtype)

    def cg(rank, adaptive=False, rtol=1e-3, pre="nystrom", threshold=1.0):
        return lambda f: CGSolver(
            f,
            preconditioner=pre,
            rank=rank,
            oversampling=args.oversampling,
            rtol=rtol,
            max_iter=args.max_iter,
            seed=args.seed,
            adaptive_rank=adaptive,
            rank_threshold=threshold,
        )

    def sdd(rtol, budget, **kw):
        return lambda f: SDDSolver(f, rtol=rtol, max_iter=budget, seed=args.seed, **kw)

    def sgd(rtol, budget, **kw):
        return lambda f: SGDSolver(f, rtol=rtol, max_iter=budget, seed=args.seed, **kw)

    n_wl = args.em_steps * (k + 1) + args.workload_samples + 1
    print(
        f"\n## Solve accuracy and products on the rotated problem ({k + 1} right-hand sides at the fixed point; "
        f"workload = {args.em_steps} EM steps × {k + 1} + {args.workload_samples + 1} prediction right-hand "
        f"sides = {n_wl} solves)"
    )
    head = (
        "solver",
        "rtol",
        "set-up prods",
        "solve prods/rhs",
        "max it",
        "max rel. res.",
        "rel. error u",
        "rel. error Ψζ",
        "workload prods",
        "ratio vs CG-400",
    )
    rows = []
    base_total = {}
    configs = []
    kdiag = (lam32 / a_star).to(torch.float64)
    for tol in args.tols:
        configs += [(f"cg rank {args.rank}", tol, cg(args.rank, rtol=tol))]
        configs += [
            (
                f"cg adaptive (cap {args.adaptive_cap}, thr {thr:g}σ²)",
                tol,
                cg(args.adaptive_cap, True, rtol=tol, threshold=thr),
            )
            for thr in args.rank_thresholds
        ]
        configs += [
            (
                f"sdd full batch η={args.sdd_step:g} ρ={args.sdd_momentum:g} (budget {args.fo_budget})",
                tol,
                sdd(tol, args.fo_budget, step_size=args.sdd_step, momentum=args.sdd_momentum),
            ),
            (
                f"sgd η={args.sdd_step:g} ρ={args.sdd_momentum:g} (budget {args.fo_budget})",
                tol,
                sgd(tol, args.fo_budget, lr=args.sdd_step, momentum=args.sdd_momentum),
            ),
        ]
    for name, tol, make in configs if not args.skip_main else []:
        r = _solve_counts(make, rot, R_rot.to(rot.dtype), a_star, s2_star, X_rot, kdiag)
        per = r["solve"] / (k + 1)
        total = r["setup"] + per * n_wl
        if name.startswith("cg rank"):
            base_total[tol] = total
        ratio = base_total.get(tol, float("nan")) / total
        rows.append(
            (
                name,
                f"{tol:g}",
                r["setup"],
                f"{per:.1f}",
                r["iterations"],
                f"{r['residual']:.2e}",
                f"{r['error']:.2e}",
                f"{r['meas_error']:.2e}",
                f"{total:.0f}",
                f"{ratio:.2f}" if r["converged"] else f"({ratio:.2f}, not converged)",
            )
        )
        print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)

    if args.tune:
        _tuning_tables(args, rot, R_rot, X_rot, a_star, s2_star, lam, Q, k)
    elif args.blocks and args.blocks_only:
        _block_table(args, lam, Q, R_rot, a_star, s2_star)
    if args.skip_main or args.blocks_only:
        return

    # EM fixed point with each solver (sampled γ̂, 16 probes per step unless --samples), against the exact one.
    print(
        f"\n## Sampled EM with each solver (rotated problem, {args.em_steps} steps from a = {post.a:.4g}, σ² = "
        f"{post.likelihood.sigma2:.4g}; {k} probes per step) vs the exact fixed point"
    )
    head = ("solver", "a", "rel. err a", "σ²", "rel. err σ²", "solve prods (all steps)", "max rel. res. (last)")
    rows = []
    for name, make, fixed in (
        (f"cg rank {args.rank}", cg(args.rank), False),
        ("cg adaptive", cg(args.adaptive_cap, True, threshold=args.rank_thresholds[0]), False),
        (
            "sdd (fixed probes, warm)",
            sdd(args.em_tol_solver, args.fo_budget, step_size=args.sdd_step, momentum=args.sdd_momentum),
            True,
        ),
        (
            "sgd (fixed probes, warm)",
            sgd(args.em_tol_solver, args.fo_budget, lr=args.sdd_step, momentum=args.sdd_momentum),
            True,
        ),
    ):
        solver = make(rot)
        em = SampledEM(
            rot,
            solver,
            y_rot.to(rot.dtype),
            likelihood=GaussianLikelihood(post.likelihood.sigma2, True),
            a=post.a,
            n_samples=k,
            max_steps=args.em_steps,
            tol=0.0,
            seed=args.seed,
            fixed_probes=fixed,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out = em.run()
            except FloatingPointError as exc:  # an unconverged solve can leave ‖w*‖² ≤ 0
                rows.append((name, "failed", "-", "-", "-", "-", str(exc)[:60]))
                continue
        prods = sum(rec["solver"]["n_products"] for rec in out.trace)
        rows.append(
            (
                name,
                f"{out.a:.5g}",
                f"{abs(out.a / a_star - 1):.2e}",
                f"{out.sigma2:.5g}",
                f"{abs(out.sigma2 / s2_star - 1):.2e}",
                prods,
                f"{out.trace[-1]['solver']['max_relative_residual']:.2e}",
            )
        )
        print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)

    if args.real_rhs > 0:
        _real_check(args, post, net, feats, a_star, s2_star, lam, Q, cg, sdd, sgd)


def _tuning_tables(args, rot, R_rot, X_rot, a, s2, lam, Q, k):
    print(
        f"\n## SDD tuning (rotated problem, {k + 1} right-hand sides, budget {args.fo_budget}); products per "
        f"right-hand side to reach the relative residual (— : not within the budget)"
    )
    head = ("variant", "step η", "ρ", "batch", "start", *[f"rtol {t:g}" for t in args.tune_tols], "res. at budget")
    rows = []
    variants = []
    for rho in (0.9, 0.99, 0.999):
        for eta in (0.5, 1.0, 1.3):
            variants.append(("full batch", eta, rho, None, "b/σ²", 1.0))
    variants += [
        ("full batch, published averaging χ=100/T", 1.0, 0.9, None, "b/σ²", None),
        ("full batch, published averaging χ=100/T", 1.3, 0.99, None, "b/σ²", None),
        ("full batch, from u₀ = 0", 1.0, 0.9, None, "0", 1.0),
        ("full batch, from u₀ = 0", 1.3, 0.99, None, "0", 1.0),
    ]
    for name, eta, rho, batch, start, chi in variants:
        cells = []
        for tol in args.tune_tols:
            S = SDDSolver(
                rot,
                step_size=eta,
                momentum=rho,
                batch_size=batch,
                rtol=tol,
                max_iter=args.fo_budget,
                averaging=chi,
                seed=args.seed,
            )
            x0 = torch.zeros_like(R_rot).to(rot.dtype) if start == "0" else None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, st = S.solve(R_rot.to(rot.dtype), a, s2, x0=x0)
            cells.append(f"{st.n_products / (k + 1):.0f}" if st.all_converged else "—")
        rows.append((name, eta, rho, "full", start, *cells, f"{float(st.relative_residual.max()):.2e}"))
        print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)
    if args.blocks:
        _block_table(args, lam, Q, R_rot, a, s2)

    print("\n## SGD (primal) tuning, same right-hand sides and budget")
    head = ("step η", "ρ", "lr decay", "clip", *[f"rtol {t:g}" for t in args.tune_tols], "res. at budget")
    rows = []
    for eta, rho, decay, clip in (
        (1.0, 0.9, "none", None),
        (1.0, 0.99, "none", None),
        (1.0, 0.999, "none", None),
        (1.0, 0.9, "linear", None),
        (1.0, 0.99, "linear", None),
        (1.0, 0.99, "none", 1.0),
        (1.0, 0.99, "none", 0.1),
    ):
        cells = []
        for tol in args.tune_tols:
            S = SGDSolver(
                rot, lr=eta, momentum=rho, lr_decay=decay, clip=clip, rtol=tol, max_iter=args.fo_budget, seed=args.seed
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, st = S.solve(R_rot.to(rot.dtype), a, s2)
            cells.append(f"{st.n_products / (k + 1):.0f}" if st.all_converged else "—")
        rows.append((eta, rho, decay, clip, *cells, f"{float(st.relative_residual.max()):.2e}"))
        print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)


def _block_table(args, lam, Q, R_rot, a, s2):
    """Coordinate blocks against the full batch at the same budget (original basis Ψ' = QΛ^½: blocks are not
    rotation invariant). The published step βn for unit-diagonal kernels is η = βn·λ_max(C)/tr(C) here."""
    c = Q.shape[0]
    QL = DenseFeatures((Q * lam.clamp_min(0).sqrt()).to(torch.float32))
    R_q = (R_rot[: args.block_rhs] @ Q.T).to(torch.float32)
    lam_C = float(lam.max()) / a + s2
    tr_C = float(lam.sum()) / a + c * s2
    eta_pub = 50.0 * lam_C / tr_C
    print(
        f"\n## SDD: coordinate blocks vs the full batch ({R_q.shape[0]} right-hand sides, {args.block_budget} "
        f"iterations each = {args.block_budget} kernel products per right-hand side whatever the block; ρ = 0.9, "
        f"χ = 100/T; λ_max(C)/tr(C) = {lam_C / tr_C:.3g}, so the published βn = 50 is η = {eta_pub:.3g})"
    )
    head = ("batch r", "step η", "η·c/r", "rel. residual at budget", "rel. residual after 1/4 budget")
    rows = []
    for batch in [None, *args.blocks]:
        r = c if batch is None else batch
        etas = (1.0, 1.3) if batch is None else (r / c, 4 * r / c, eta_pub)
        for eta in etas:
            res = []
            for budget in (args.block_budget // 4, args.block_budget):
                S = SDDSolver(
                    QL,
                    step_size=eta,
                    momentum=0.9,
                    batch_size=batch,
                    rtol=1e-12,
                    max_iter=budget,
                    averaging=None,
                    seed=args.seed,
                )
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    _, st = S.solve(R_q, a, s2)
                res.append(float(st.relative_residual.max()))
            rows.append(
                (
                    "full" if batch is None else batch,
                    f"{eta:.3g}",
                    f"{eta * c / r:.3g}",
                    f"{res[1]:.2e}",
                    f"{res[0]:.2e}",
                )
            )
            print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)


def _real_check(args, post, net, feats, a, s2, lam, Q, cg, sdd, sgd):
    """The leading configurations on the real network: products, wall time, accuracy vs the exact solution."""
    m = args.real_rhs
    gen = torch.Generator().manual_seed(args.seed + 11)
    w0 = torch.randn(m - 1, feats.n_features, generator=gen) * a**-0.5
    eps = torch.randn(m - 1, feats.n_outputs, generator=gen) * s2**0.5
    dev = feats.device
    R = torch.cat([post.targets[None], eps.to(dev) - feats.matvec(w0.to(dev))], dim=0)
    X_ref = post.solver.solve(R, a, s2)[0].double()
    print(
        f"\n## On the real network ({m} right-hand sides: the mean and {m - 1} Matheron rows at the fixed point); "
        f"one kernel product = one JVP + one VJP"
    )
    head = (
        "solver",
        "rtol",
        "set-up prods",
        "solve prods/rhs",
        "max it",
        "max rel. res.",
        "rel. error",
        "wall s",
        "s per kernel product",
    )
    rows = []
    for tol in args.real_tols:
        for name, make in (
            (f"cg rank {args.rank}", cg(args.rank, rtol=tol)),
            ("cg adaptive", cg(args.adaptive_cap, True, rtol=tol, threshold=args.rank_thresholds[0])),
            ("sdd", sdd(tol, args.real_budget, step_size=args.sdd_step, momentum=args.sdd_momentum)),
            ("sgd", sgd(tol, args.real_budget, lr=args.sdd_step, momentum=args.sdd_momentum)),
        ):
            if name.startswith(("sdd", "sgd")) and args.real_budget <= 0:
                continue
            r = _solve_counts(make, feats, R, a, s2, X_ref)
            rows.append(
                (
                    name,
                    f"{tol:g}",
                    r["setup"],
                    f"{r['solve'] / m:.1f}",
                    r["iterations"],
                    f"{r['residual']:.2e}",
                    f"{r['error']:.2e}",
                    f"{r['wall']:.0f}",
                    f"{r['wall'] / max(r['products'], 1):.3f}",
                )
            )
            print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    print_table(head, rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=None, help="a finished ctuq reconstruct run folder (default: synthetic problem)")
    ap.add_argument("--cache", default=None, help="file caching the exact decomposition")
    ap.add_argument("--tols", nargs="+", type=float, default=[1e-2, 1e-3], help="tolerances of the solve table")
    ap.add_argument("--workload-samples", type=int, default=1024, help="prediction samples of the workload")
    ap.add_argument("--rank", type=int, default=400, help="rank of the fixed-rank CG preconditioner")
    ap.add_argument("--oversampling", type=int, default=10)
    ap.add_argument("--max-iter", type=int, default=150, help="CG iteration cap")
    ap.add_argument("--adaptive-cap", type=int, default=3000, help="rank cap of the adaptive preconditioner")
    ap.add_argument(
        "--rank-thresholds",
        nargs="+",
        type=float,
        default=[1.0],
        help="adaptive rank: stop when λ_r/a < this·σ² (one row each)",
    )
    ap.add_argument("--samples", type=int, default=16, help="EM samples per step")
    ap.add_argument("--em-steps", type=int, default=5)
    ap.add_argument("--sdd-step", type=float, default=1.0, help="SDD/SGD step (× 1/λ_max)")
    ap.add_argument("--sdd-momentum", type=float, default=0.9)
    ap.add_argument("--fo-budget", type=int, default=5000, help="SDD/SGD iteration budget on the rotated problem")
    ap.add_argument("--em-tol-solver", type=float, default=1e-2, help="SDD/SGD rtol inside the EM comparison")
    ap.add_argument("--tune", action="store_true", help="also the SDD/SGD tuning tables")
    ap.add_argument("--tune-tols", nargs="+", type=float, default=[1e-1, 1e-2], help="tolerances of the tuning")
    ap.add_argument(
        "--blocks",
        nargs="*",
        type=int,
        default=[128, 512, 2048],
        help="SDD block sizes of the block table (none: skip it)",
    )
    ap.add_argument("--block-rhs", type=int, default=4, help="right-hand sides of the block-SDD runs")
    ap.add_argument("--blocks-only", action="store_true", help="only the block table (after the main table)")
    ap.add_argument("--skip-main", action="store_true", help="skip the main table (tuning / blocks only)")
    ap.add_argument("--block-budget", type=int, default=3000, help="iteration budget of the block-SDD runs")
    ap.add_argument("--real-rhs", type=int, default=0, help="right-hand sides of the real-network check (0: skip)")
    ap.add_argument("--real-tols", nargs="+", type=float, default=[1e-3], help="tolerances of the real check")
    ap.add_argument("--real-budget", type=int, default=1000, help="SDD/SGD budget on the real network (0: skip)")
    add_problem_arguments(ap)
    args = ap.parse_args(argv)
    apply_threads(args)
    run_solvers(args)


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
