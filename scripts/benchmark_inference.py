#!/usr/bin/env python
"""Cost of linearised inference, phase by phase: wall time and Jacobian products (JVPs / VJPs) spent.

Synthetic problem (no CT code is imported: the point is the inference cost): a U-Net from
``ctuq.models.build_unet`` (preset ``tiny``/``small``/``walnut``, random weights) at ``--size``², its fixed noise
input, and a sparse linear map ``T`` (``c × size²``) standing in for the ray transform. ``--map lines`` (default)
samples parallel-beam lines through the image at nearest pixels (``c = angles × detectors`` with
``--detectors`` bins; about ``1.2·size`` pixels per row, like a real ray transform); ``--map random`` puts the same
number of non-zeros at random positions. The targets ``ỹ`` are drawn from the linear model itself
(``--target prior``: ``ỹ = Ψ w + ε``, ``w ~ N(0, I/a_true)``, ``ε ~ N(0, noise_std²)``), so that EM settles near
``a_true`` and the CG iteration counts reflect that regime (they grow as ``a`` falls: ``C = K̄/a + σ²I`` then
has more eigenvalues above ``σ²`` than a rank-``r`` preconditioner captures); ``--target network`` uses
``T g(ṽ) + ε`` of the untrained network instead (EM then drives ``a`` far down: a hard, unrealistic regime).

Phases (``main``): tracing the linearisation, g-prior scales, the solver set-up (CG preconditioner, or assembling
and decomposing ``K̄`` for the exact solver), every EM step, and the prediction samples (posterior mean, weight
samples in seeded chunks, image-space samples ``Φ(s ⊙ ζ)`` and their pixelwise std). For each the table gives
the wall time, JVPs and VJPs spent (per sample), the kernel products spent inside CG, and the *floor*: the
products the phase needs whatever the solver does (e.g. a prediction sample needs one JVP for ``Ψw₀``, one VJP
for ``Ψᵀ(…)`` and one JVP for its image; an EM step needs ``k`` JVPs and no VJPs).

Other modes:

* ``--products``: per-sample JVP and VJP time of the presets at ``--size``², vmapped, for chunk sizes 1/8/16,
  with ``mode="linearize"`` (traced once) and ``mode="recompute"``.
* ``--compare-preconditioners``: CG iterations of single-pass Nyström, Halko alg. 5.6 and pivoted Cholesky on
  synthetic spectra and on the U-Net kernel of this problem.
* ``--compare-cg``: ctuq's deflated PCG against linear_operator's ``linear_cg`` on this problem.
* ``--compare-solvers``: exact, CG (rank 400 and adaptive rank), SDD and SGD on the same problem (the scale
  issue): Jacobian products, wall time, accuracy of the solves and of the sampled-EM fixed point against the exact
  route, the whole-workload product count (``--em-steps`` × (``--samples`` + 1) + ``--workload-samples`` + 1
  right-hand sides) and its ratio to rank-400 CG, plus the SDD/SGD tuning tables. ``--run RUN_DIR`` takes the
  problem from a finished ``ctuq reconstruct`` run (its scan, fitted DIP and σ²) instead of the synthetic one.
  Method (stated with the tables): the exact eigendecomposition ``K̄ = QΛQᵀ`` is computed once (``c`` VJPs +
  ``c`` JVPs; cached with ``--cache``) and defines the exact reference and the EM fixed point. Iteration counts of
  the full-batch solvers and of Nyström-preconditioned CG are invariant under the rotation ``Qᵀ`` (Gaussian test
  matrices and probes are rotation invariant in distribution), so the tables run on the rotated problem
  (``Ψ' = Λ^½``, products cost ``O(c)``), block SDD on ``Ψ' = QΛ^½`` (coordinates matter there), and the
  leading configurations are re-run on the real network (``--real-rhs`` right-hand sides) to check that the
  counts carry over.

CPU timings are noisy when other processes share the cores: repeat a run before trusting a difference.

Examples::

    python scripts/benchmark_inference.py --preset small --size 128 --c 7680 --pred-samples 64
    python scripts/benchmark_inference.py --products --presets tiny small --size 128
    python scripts/benchmark_inference.py --compare-preconditioners --preset tiny --size 64 --c 1024 --detectors 64
    python scripts/benchmark_inference.py --device cuda --preset walnut --size 501 --c 7680 --pred-samples 1024
    python scripts/benchmark_inference.py --compare-solvers --run runs/small --cache /tmp/small_eig.pt
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings

import numpy as np
import torch

from ctuq.config import UQConfig, load_config
from ctuq.inference import (
    CGSolver,
    ConvergenceWarning,
    DenseFeatures,
    ExactEigSolver,
    FeatureOperator,
    GaussianLikelihood,
    LinearizedFeatures,
    LinearizedPosterior,
    SampledEM,
    ScaledFeatures,
    SDDSolver,
    SGDSolver,
    Workload,
    choose_solver,
    posterior_mean,
    sample_chunks,
)
from ctuq.linearize import LinearizedNetwork
from ctuq.models import build_unet, count_parameters, make_net_input, read_model_file
from ctuq.pipeline import run_folder
from ctuq.pipeline.scan import load_scan
from ctuq.pipeline.uq import ct_posterior
from ctuq.priors import gprior_scales
from ctuq.utils import resolve_device, tune_malloc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------- synthetic T
def line_matrix(size: int, n_angles: int, n_det: int, kind: str = "lines", seed: int = 0) -> torch.Tensor:
    """Sparse ``(n_angles·n_det, size²)`` float32 COO matrix: parallel-beam lines or random positions.

    Lines: angle ``θ_a`` uniform in [0, π), detector offsets spanning 1.2× the image width, points every half
    pixel along each line, nearest-pixel weights of 0.5 (pixel units), duplicates summed. Rows are angle-major.
    """
    n = size
    thetas = np.linspace(0, np.pi, n_angles, endpoint=False)
    offsets = (np.arange(n_det) - (n_det - 1) / 2) * (1.2 * n / n_det)
    half = 0.75 * n
    steps = np.arange(-half, half, 0.5)
    rows, cols = [], []
    for a, th in enumerate(thetas):
        d, p = np.array([np.cos(th), np.sin(th)]), np.array([-np.sin(th), np.cos(th)])
        pts = offsets[:, None, None] * p + steps[None, :, None] * d  # (n_det, steps, 2), centre at 0
        ix = np.floor(pts[..., 0] + n / 2).astype(np.int64)
        iy = np.floor(pts[..., 1] + n / 2).astype(np.int64)
        inside = (ix >= 0) & (ix < n) & (iy >= 0) & (iy < n)
        det = np.broadcast_to(np.arange(n_det)[:, None], ix.shape)
        rows.append((a * n_det + det)[inside])
        cols.append((iy * n + ix)[inside])
    r = np.concatenate(rows)
    c = np.concatenate(cols)
    if kind == "random":
        rng = np.random.default_rng(seed)
        c = rng.integers(0, n * n, size=c.size)
    elif kind != "lines":
        raise ValueError(f"line_matrix: kind must be 'lines' or 'random', got {kind!r}")
    vals = np.full(r.size, 0.5, dtype=np.float32)
    T = torch.sparse_coo_tensor(
        torch.from_numpy(np.stack([r, c])), torch.from_numpy(vals), (n_angles * n_det, n * n), check_invariants=True
    )
    return T.coalesce()


class SparseMap:
    """``L(X) = X Tᵀ`` and ``Lᵀ(R) = R T`` on rows, with CSR copies of ``T`` and ``Tᵀ`` on ``device``."""

    def __init__(self, T_coo: torch.Tensor, device: torch.device):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            self.T = T_coo.to_sparse_csr().to(device)
            self.Tt = T_coo.t().coalesce().to_sparse_csr().to(device)
        self.c, self.d_x = T_coo.shape

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return (self.T @ X.T).T

    def adjoint(self, R: torch.Tensor) -> torch.Tensor:
        return (self.Tt @ R.T).T


# ----------------------------------------------------------------------------------------------- problem
def build_problem(args, device: torch.device):
    torch.manual_seed(args.seed)
    model = build_unet(args.preset).to(device)
    x = make_net_input((args.size, args.size), seed=args.seed).to(device)
    n_det = args.detectors
    if args.c % n_det:
        raise SystemExit(f"--c {args.c} must be a multiple of --detectors {n_det} (angles × detectors)")
    T = SparseMap(line_matrix(args.size, args.c // n_det, n_det, args.map, args.seed), device)
    return model, x, T


def make_targets(args, feats, net, T, device) -> torch.Tensor:
    """``ỹ``: a draw from the linear model's prior predictive at ``--a-true`` (1 JVP), or ``T g(ṽ)`` + noise."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    eps = args.noise_std * torch.randn(T.c, generator=gen).to(device)
    if args.target == "prior":
        w = torch.randn(1, feats.n_features, generator=gen).to(device) / math.sqrt(args.a_true)
        return feats.matvec(w)[0] + eps
    with torch.no_grad():
        return T.forward(net.output()[None])[0] + eps


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
        _sync(self.device)
        self.t0 = time.perf_counter()
        self.j0, self.v0 = self.net.n_jvp, self.net.n_vjp
        return self

    def __exit__(self, *exc):
        _sync(self.device)
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
        s = gprior_scales(
            lambda R: net.vjp(T.adjoint(R)),
            T.c,
            method=args.gprior,
            n_probes=args.gprior_probes,
            n_features=net.d,
            seed=args.seed,
            device=device,
            progress=args.progress,
        )
    floor = {"exact": T.c, "stochastic": args.gprior_probes, "isotropic": 0}[args.gprior]
    n_zero = int((s == 0).sum())
    table.add(f"g-prior scales ({args.gprior})", ph.wall, ph.jvp, ph.vjp, 0, 0, floor, None, f"{n_zero} zero columns")

    feats = ScaledFeatures(LinearizedFeatures(net, T.forward, T.adjoint, n_outputs=T.c), s)
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
                xs = feats.network_matvec(chunk.weights)
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


# ----------------------------------------------------------------------------------------------- products
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
                        _sync(device)
                        t0 = time.perf_counter()
                        fn(X)
                        _sync(device)
                        times.append(time.perf_counter() - t0)
                    res += [min(times) / chunk * 1e3, statistics.median(times) / chunk * 1e3]
                rows.append((preset, net.d, f"{mode} ({net.jvp_impl})", chunk, *(f"{v:.1f}" for v in res)))
                print("  " + " | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


# ----------------------------------------------------------------------------------------------- comparisons
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


def run_compare_preconditioners(args) -> None:
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
        s = gprior_scales(
            lambda R: net.vjp(T.adjoint(R)),
            T.c,
            method=args.gprior,
            n_probes=args.gprior_probes,
            n_features=net.d,
            seed=args.seed,
            device=device,
        )
        feats = ScaledFeatures(LinearizedFeatures(net, T.forward, T.adjoint, n_outputs=T.c), s)
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
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


def run_compare_cg(args) -> None:
    device = resolve_device(args.device)
    model, x, T = build_problem(args, device)
    net = LinearizedNetwork(model, x, chunk_size=args.chunk_size, mode=args.mode)
    s = gprior_scales(
        lambda R: net.vjp(T.adjoint(R)),
        T.c,
        method=args.gprior,
        n_probes=args.gprior_probes,
        n_features=net.d,
        seed=args.seed,
        device=device,
    )
    feats = ScaledFeatures(LinearizedFeatures(net, T.forward, T.adjoint, n_outputs=T.c), s)
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
        _sync(device)
        t0 = time.perf_counter()
        _, st = solver.solve(rhs, args.a0, args.sigma2)
        _sync(device)
        print(
            f"{backend:10s}  {time.perf_counter() - t0:6.1f}  {st.n_products:15d}  {st.max_iterations:6d}  "
            f"{float(st.relative_residual.max()):.2e}"
        )


# ----------------------------------------------------------------------------------------------- solvers
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
            gprior_method=args.gprior if args.gprior != "isotropic" else "exact",
            prior="isotropic" if args.gprior == "isotropic" else "gprior",
            gprior_probes=args.gprior_probes,
            prior_precision=args.a0,
        )
        post, net, info = ct_posterior(
            model, mf.net_input, data.op, data.y.to(device), scale=mf.scale, settings=settings, seed=args.seed
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
            gprior_method="exact" if args.gprior == "exact" else "stochastic",
            gprior_probes=args.gprior_probes,
            likelihood=GaussianLikelihood(args.sigma2, True),
            a=args.a0,
            solver="exact_dual",
            seed=args.seed,
        )
        desc = (
            f"synthetic: {args.preset} U-Net (random weights) at {args.size}², {args.map} map, c = {T.c}, "
            f"d = {net.d}, targets from the prior at a = {args.a_true}"
        )
    if args.cache and __import__("os").path.isfile(args.cache):
        post.load_state_dict(torch.load(args.cache, weights_only=True))
        desc += f"; decomposition from {args.cache}"
    t0 = time.perf_counter()
    j0, v0 = net.n_jvp, net.n_vjp
    post.setup()
    setup = (time.perf_counter() - t0, net.n_jvp - j0, net.n_vjp - v0)
    if args.cache and not __import__("os").path.isfile(args.cache):
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


def run_compare_solvers(args) -> None:
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
    _print_table(head, rows)

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
    _print_table(head, rows)

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
    _print_table(head, rows)
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
    _print_table(head, rows)


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
    _print_table(head, rows)


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
    _print_table(head, rows)


def _print_table(head, rows) -> None:
    cells = [tuple(map(str, head))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for j, r in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--products", action="store_true", help="per-sample JVP/VJP timing table instead of the phases")
    ap.add_argument("--compare-preconditioners", action="store_true", help="CG iterations per preconditioner")
    ap.add_argument(
        "--synthetic-only", action="store_true", help="with --compare-preconditioners: skip the U-Net kernel"
    )
    ap.add_argument("--compare-cg", action="store_true", help="deflated PCG vs linear_operator.linear_cg")
    ap.add_argument(
        "--compare-solvers",
        action="store_true",
        help="exact, cg (rank --rank and adaptive), sdd, sgd on one problem (module docstring)",
    )
    ap.add_argument("--run", default=None, help="--compare-solvers: a finished ctuq reconstruct run folder")
    ap.add_argument("--cache", default=None, help="--compare-solvers: file caching the exact decomposition")
    ap.add_argument("--tols", nargs="+", type=float, default=[1e-2, 1e-3], help="--compare-solvers tolerances")
    ap.add_argument("--workload-samples", type=int, default=1024, help="prediction samples of the workload")
    ap.add_argument("--adaptive-cap", type=int, default=3000, help="rank cap of the adaptive preconditioner")
    ap.add_argument(
        "--rank-thresholds",
        nargs="+",
        type=float,
        default=[1.0],
        help="adaptive rank: stop when λ_r/a < this·σ² (one row each)",
    )
    ap.add_argument("--sdd-step", type=float, default=1.0, help="SDD/SGD step (× 1/λ_max)")
    ap.add_argument("--sdd-momentum", type=float, default=0.9)
    ap.add_argument("--fo-budget", type=int, default=5000, help="SDD/SGD iteration budget on the rotated problem")
    ap.add_argument("--em-tol-solver", type=float, default=1e-2, help="SDD/SGD rtol inside the EM comparison")
    ap.add_argument("--tune", action="store_true", help="--compare-solvers: also the SDD/SGD tuning tables")
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
    ap.add_argument("--preset", default="small", choices=("tiny", "small", "walnut"))
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"], help="--products: presets to time")
    ap.add_argument("--modes", nargs="+", default=["linearize", "recompute"], help="--products: modes to time")
    ap.add_argument("--chunks", nargs="+", type=int, default=[1, 8, 16], help="--products: chunk sizes")
    ap.add_argument("--repeats", type=int, default=3, help="--products: timed calls per setting")
    ap.add_argument("--size", type=int, default=128, help="image size (pixels per side)")
    ap.add_argument("--c", type=int, default=7680, help="number of measurements (angles × detectors)")
    ap.add_argument("--detectors", type=int, default=128, help="detector bins per angle")
    ap.add_argument("--map", default="lines", choices=("lines", "random"), help="structure of the sparse map T")
    ap.add_argument("--gprior", default="stochastic", choices=("exact", "stochastic", "isotropic"))
    ap.add_argument("--gprior-probes", type=int, default=256)
    ap.add_argument("--solver", default="cg", choices=("cg", "exact", "auto"))
    ap.add_argument("--preconditioner", default="nystrom", choices=("nystrom", "halko", "pivoted_cholesky", "none"))
    ap.add_argument("--rank", type=int, default=400)
    ap.add_argument("--ranks", nargs="+", type=int, default=[50, 100, 200], help="--compare-preconditioners ranks")
    ap.add_argument("--oversampling", type=int, default=10)
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--max-iter", type=int, default=150)
    ap.add_argument("--samples", type=int, default=16, help="EM samples per step")
    ap.add_argument("--em-steps", type=int, default=5)
    ap.add_argument("--em-tol", type=float, default=0.0, help="EM stopping tolerance (0: run all steps)")
    ap.add_argument("--a0", type=float, default=1.0, help="initial prior precision")
    ap.add_argument("--sigma2", type=float, default=1.0, help="noise variance")
    ap.add_argument("--noise-std", type=float, default=1.0, help="std of the synthetic measurement noise")
    ap.add_argument(
        "--target",
        default="prior",
        choices=("prior", "network"),
        help="ỹ = Ψw + ε with w ~ N(0, I/a_true) (prior), or T g(ṽ) + ε for the untrained network",
    )
    ap.add_argument(
        "--a-true", type=float, default=1.0, help="prior precision of the synthetic weights (--target prior)"
    )
    ap.add_argument("--learn-noise", action="store_true")
    ap.add_argument("--pred-samples", type=int, default=64, help="prediction samples (0: skip)")
    ap.add_argument("--pred-chunk", type=int, default=16, help="prediction samples per seeded chunk")
    ap.add_argument("--chunk-size", type=int, default=None, help="vmap chunk size (default: automatic)")
    ap.add_argument("--mode", default="linearize", choices=("linearize", "recompute"))
    ap.add_argument("--memory-budget", type=int, default=None, help="bytes for Ψᵀ when assembling K̄ (exact)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.products:
        run_products(args)
    elif args.compare_preconditioners:
        run_compare_preconditioners(args)
    elif args.compare_cg:
        run_compare_cg(args)
    elif args.compare_solvers:
        run_compare_solvers(args)
    else:
        run_main(args)


if __name__ == "__main__":
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    main()
