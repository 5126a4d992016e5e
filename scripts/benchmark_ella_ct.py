"""Benchmark: what ELLA's std map is worth for CT, against the exact linearised posterior of a finished run.

What it reproduces: the CT table of docs/classification.md's ELLA section (issue 46, item 4).

For a finished ``ctuq reconstruct`` run with a ground truth (e.g. ``ctuq reconstruct --out runs/demo``) it rebuilds
the run's fitted posterior (its DIP, prior scales ``s``, ``a`` and ``σ²`` from the run's checkpoints: the same
linearisation point, prior and likelihood) and, for each landmark count ``M`` and rank ``K``, ELLA's posterior in
``K`` dimensions (:func:`ctuq.inference.nystrom_basis` on ``M`` rows of the run's whitened, scaled features
``Ψ = D^(−1/2) T Φ diag(s)`` through Jacobian products, seed 0; one basis per ``M`` with every eigenpair above the
features' round-off, whose leading ``K`` are the basis of rank ``K``; ``K`` runs over ``--ranks`` up to the rank
found, and that rank itself):

    ζ = V u,  Cov(u) = Σ_u = (GᵀG / σ² + a I_K)⁻¹,  G = Ψ V  (c × K, K Jacobian-vector products),

whose pixel variance is ``diag(P Σ_u Pᵀ)`` with ``P = Φ diag(s) V / scale`` (``d_x × K``, mm⁻¹: ``K`` more products)
and whose held-out row variance is ``diag(T_h P Σ_u Pᵀ T_hᵀ)``. Printed per (K, M), against the run's exact
posterior (its ``std_uncalibrated.tif``, 1024 samples, so a ~2 % Monte Carlo error per pixel):

* the fraction of the exact posterior's pixel variance ELLA keeps (mean over the inner square) and the median
  relative error ``|std_ELLA / std_exact − 1|`` there;
* the held-out check of ELLA's predictive on the run's check angles: its coverage@0.9, the ML variance scale ``k`` of
  the image part (1: right), the bias model's ``τ`` and the log-likelihood per row, beside the exact posterior's;
* ENCE and coverage@0.9 per std decile inside the object, right scale and marginal LL in the inner square (as
  ``scripts/benchmark_peers.py`` scores), of ELLA's own map and of ELLA's map with the run's calibration method refitted
  on ELLA's held-out rows (``bias``: ``sqrt(std² + τ² M)``), beside the same for the exact posterior;
* the seconds ELLA takes (the basis of ``M`` rows, shared by the ``K`` of one ``M``; ``G`` and ``Σ_u``; ``P``) against
  the run's own inference phase (``metrics.json``), and once the seconds the run's prior takes to compute its scales
  through products (ELLA uses the run's scales).

``--dense`` adds ELLA on the run's assembled float64 ``Ψ`` (where its exact solver assembled it) with all ``c`` rows:
float32 products leave only the eigenpairs above ~1e-5 × the largest, float64 reaches ``K`` near ``d``.

    ctuq reconstruct --out runs/demo
    python scripts/benchmark_ella_ct.py runs/demo --dense

The rebuilt posterior is set up from a temporary copy of the run's checkpoint; the run folder is not written to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import tifffile
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_peers import scores  # noqa: E402

import ctuq  # noqa: E402
from ctuq.calibration import read_rows  # noqa: E402
from ctuq.inference import DenseFeatures, RowScaledFeatures, ScaledFeatures, ella_features, nystrom_basis  # noqa: E402
from ctuq.inference.priors import PriorProblem  # noqa: E402
from ctuq.metrics import inner_square_roi  # noqa: E402
from ctuq.pipeline import run_folder as rf  # noqa: E402
from ctuq.pipeline.phases import phase_load, phase_restore_dip  # noqa: E402
from ctuq.pipeline.runner import Phase, RunState, fitted_posterior, run_phases  # noqa: E402
from ctuq.registry import CALIBRATIONS  # noqa: E402
from ctuq.utils import atomic_path, resolve_device  # noqa: E402


def rebuild(run_dir: Path):
    """The run's state (scan with its check angles, restored DIP) and its fitted posterior, with the seconds taken."""
    cfg = ctuq.load_run(run_dir).config
    t0 = time.perf_counter()
    state = RunState(cfg=cfg, out_dir=run_dir, device=resolve_device(cfg.device), progress=False, command="uq")
    run_phases(state, [Phase("load", phase_load), Phase("restore_dip", phase_restore_dip)])
    uq = fitted_posterior(state)
    return state, uq.posterior, time.perf_counter() - t0


def matrix_free(posterior):
    """``(Ψ₀ whitened, Ψ)`` of the fitted posterior through Jacobian products: the run's exact solver assembled
    ``Ψ₀``, which ELLA must not lean on (its rows and columns would be free, its timing meaningless)."""
    rows = posterior.likelihood.row_scales()
    white = posterior.base if rows is None else RowScaledFeatures(posterior.base, rows)
    return white, ScaledFeatures(white, posterior.scales)


def gprior_seconds(posterior, white) -> float:
    """The seconds the run's prior takes to compute its scales through products (what ELLA needs before its basis
    where no route assembles ``Ψ₀``)."""
    t0 = time.perf_counter()
    posterior.weight_prior.compute_scales(PriorProblem(white, None, posterior.a, posterior.sigma2, seed=0))
    return time.perf_counter() - t0


def ella_variances(posterior, features, basis, held_op, scale: float):
    """ELLA's pixel variances ``(d_x,)`` (mm⁻²) and held-out row variances ``(c_h,)`` (data units², as the run's
    rows) in the subspace of ``basis``, and the seconds of its two stages (module docstring); ``features`` is ``Ψ``."""
    times = {}
    t0 = time.perf_counter()
    G = ella_features(features, basis).matrix.double()
    precision = G.T @ G / posterior.sigma2 + posterior.a * torch.eye(basis.rank, dtype=torch.float64)
    cov = torch.linalg.inv(precision)
    cov = (cov + cov.T) / 2
    times["features"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        V = basis.V.T.to(posterior.base.dtype)
        P = posterior.output_samples(V).double() / scale  # (K, d_x): the image of each direction, mm⁻¹
        Q = held_op.forward_flat(P.to(held_op.dtype)).double().cpu()  # (K, c_h)
    pixel = ((cov @ P) * P).sum(0)
    rows = ((cov @ Q) * Q).sum(0)
    times["images"] = time.perf_counter() - t0
    return pixel.cpu().numpy(), rows.numpy(), times


def heldout_scores(rows) -> dict:
    """Of scored rows: ``k`` (the ``heldout`` method's ML scale of the image variance, the noise fixed), ``tau``
    (the ``bias`` method's, mm⁻¹), the posterior's own coverage@0.9 and log-likelihood per row."""
    report = rows.score()
    scale, bias = report.get("scale") or {}, report.get("bias") or {}
    return {
        "k": scale.get("k"),
        "tau": bias.get("tau"),
        "coverage_0.9": report["coverage_headline"]["0.9"],
        "ll": report["log_likelihood"],
    }


def calibrated(rows, reconstruction: np.ndarray, std: np.ndarray, method: str) -> np.ndarray:
    """``std`` with ``method`` refitted on ``rows`` (the map itself when the method does not fit on them)."""
    fitted = CALIBRATIONS[method].fit(rows, reconstruction)
    return std if fitted is None else np.asarray(fitted.apply_std(std), dtype=np.float64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a finished `ctuq reconstruct` run folder with a ground truth")
    ap.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[20, 100, 300, 1000, 3000],
        help="K (default 20 100 300 1000 3000; and always the rank found)",
    )
    ap.add_argument("--landmarks", type=int, nargs="+", default=[1000, 4000], help="M (default 1000 4000)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the landmark draw")
    ap.add_argument(
        "--dense",
        action="store_true",
        help="also ELLA on the run's assembled float64 Ψ with all rows (where its solver assembled it): K up to d",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    run_dir = args.run
    metrics = rf.read_metrics(run_dir)
    for name in (rf.GROUND_TRUTH_NAME, rf.STD_UNCALIBRATED_NAME, rf.HELDOUT_ROWS_NAME):
        if not (run_dir / name).is_file():
            raise SystemExit(f"benchmark_ella_ct: {run_dir / name} is missing (a finished run with a ground truth)")
    gt = tifffile.imread(run_dir / rf.GROUND_TRUTH_NAME).astype(np.float64)
    mean = tifffile.imread(run_dir / rf.RECONSTRUCTION_NAME).astype(np.float64)
    std_exact = tifffile.imread(run_dir / rf.STD_UNCALIBRATED_NAME).astype(np.float64)
    method = (metrics.get("uq", {}).get("calibration") or {}).get("mode") or "bias"
    saved = read_rows(run_dir / rf.HELDOUT_ROWS_NAME)

    state, posterior, rebuild_s = rebuild(run_dir)
    held = state.data.heldout
    scale = float(state.cfg.dip.scale)
    uq_s = float(metrics.get("timings", {}).get("uq") or 0.0)
    print(
        f"{run_dir}: c = {posterior.n_outputs} rows, d = {posterior.n_features} weights, a = {posterior.a:.4g}, "
        f"σ² = {posterior.sigma2:.4g}; posterior rebuilt in {rebuild_s:.1f} s; the run's inference phase {uq_s:.1f} s; "
        f"calibration {method!r}"
    )
    white, features = matrix_free(posterior)
    scales_s = gprior_seconds(posterior, white)
    print(f"the prior's scales through products: {scales_s:.1f} s (with the run's scales below)")
    roi = inner_square_roi(gt.shape)  # as the run's statistics and benchmark_peers.scores
    exact_row = {
        "heldout": heldout_scores(saved),
        "raw": scores(gt, mean, std_exact),
        "calibrated": scores(gt, mean, calibrated(saved, mean, std_exact, method)),
    }
    results = {"run": str(run_dir), "method": method, "exact": exact_row, "ella": [], "scales_seconds": scales_s}
    routes = [("products", features, m) for m in args.landmarks]
    if args.dense and isinstance(posterior.features, DenseFeatures):
        # the run's assembled float64 Ψ with every row: ELLA's subspace as the float64 round-off allows, K up to d
        routes.append(("float64", posterior.features, posterior.n_outputs))
    elif args.dense:
        print(f"--dense: this run's solver ({posterior.solver_name}) did not assemble Ψ; the float64 rows are skipped")
    for route, feats, m in routes:
        m = min(m, posterior.n_outputs)
        t0 = time.perf_counter()
        full = nystrom_basis(feats, m, None, seed=args.seed)
        basis_s = time.perf_counter() - t0
        print(f"  {route} M {m}: {full.rank_found} eigenpairs found, {basis_s:.1f} s", flush=True)
        for k in sorted({*(k for k in args.ranks if k <= full.rank_found), full.rank_found}):
            pixel, row_var, times = ella_variances(posterior, feats, full.leading(k), held.op, scale)
            times["basis"] = basis_s
            std = np.sqrt(np.maximum(pixel, 0.0)).reshape(gt.shape)
            kept = float((std[roi] ** 2).mean() / (std_exact[roi] ** 2).mean())
            rel = float(np.median(np.abs(std[roi] / std_exact[roi] - 1.0)))
            rows = dataclasses.replace(saved, variance=row_var)  # the run's rows, ELLA's image variance
            entry = {
                "route": route,
                "M": m,
                "K": k,
                "rank_found": full.rank_found,
                "variance_kept": kept,
                "median_relative_error": rel,
                "heldout": heldout_scores(rows),
                "raw": scores(gt, mean, std),
                "calibrated": scores(gt, mean, calibrated(rows, mean, std, method)),
                "seconds": times,
            }
            results["ella"].append(entry)
            print(f"    K {k}: {sum(times.values()):.1f} s, variance kept {kept:.3f}", flush=True)

    def line(name, e, seconds):
        h, r, c = e["heldout"], e["raw"], e["calibrated"]
        k = "–" if h["k"] is None else f"{h['k']:.1f}"
        tau = "–" if h["tau"] is None else f"{h['tau'] * 1e3:.2f}"
        dec = c["decile_coverage"] or [float("nan")]
        return (
            f"| {name} | {e.get('variance_kept', 1.0):.3f} | {e.get('median_relative_error', 0.0):.2f} | "
            f"{h['coverage_0.9']:.3f} / {k} / {tau} | {h['ll']:.3f} | {r['ence']:.2f} / {c['ence']:.2f} | "
            f"{min(dec):.2f}–{max(dec):.2f} | "
            f"{r['right_scale']:.2f} / {c['right_scale']:.2f} | {r['marginal_ll']:.3f} / {c['marginal_ll']:.3f} "
            f"({c['oracle_ll']:.3f}) | {seconds} |"
        )

    print()
    print(
        "| posterior | variance kept | median rel. error of std | held-out cov@0.9 / k / τ (1e-3 mm⁻¹) | held-out LL | "
        f"ENCE own / {method} | cov@0.9 per decile ({method}) | right scale own / {method} | marginal LL own / "
        f"{method} (oracle) | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(line("exact (the run's)", exact_row, f"{uq_s:.1f}"))
    for e in results["ella"]:
        name = f"ELLA M {e['M']} K {e['K']}" + (" (float64 Ψ)" if e["route"] == "float64" else "")
        print(line(name, e, f"{sum(e['seconds'].values()):.1f}"))
    if args.json is not None:
        with atomic_path(args.json) as tmp:
            Path(tmp).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
