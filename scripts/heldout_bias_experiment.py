#!/usr/bin/env python
"""Experiment (issue 26, item 1): can held-out measurements fit an image-error model whose pixel std is right?

The model: the reconstruction's error is the posterior's plus a bias the posterior does not contain, white inside
the object (the DIP's error inside the object is nearly uncorrelated between neighbouring pixels at these
sizes, lag-1 autocorrelation −0.2 … 0.15, see docs/calibration.md)::

    e = x̂ − x ~ N(0, k² Σ + τ² M),      M = diag(object mask: Gaussian-smoothed x̂ (σ 1 px) > 10 % of its max)

so on a held-out angle ``a`` (rows ``T_a``) the residual ``r_a = y_a − T_a x̂`` is predicted as
``N(0, k² T_a Σ T_aᵀ + τ² T_a M T_aᵀ + σ² I)``, and ``(k, τ)`` are fitted by maximum likelihood over the held-out
angles, with the full per-angle covariance (rows of one angle are correlated) and, for comparison, with its
diagonal only. The pixel std is then ``sqrt(k² std² + τ² M)``. ``T_a Σ T_aᵀ`` comes from 256 posterior samples
(the std map's first, same seed), ``T_a M T_aᵀ`` from the assembled held-out matrix (so: ``data.backend: sparse``).

For each finished run folder (read only: it is copied to a temporary folder, its DIP restored and its posterior
set up and fitted afresh with the run's own config, as ``ctuq uq RUN --check`` does without saved rows), the script
caches what it needs in ``--out/<name>.npz`` and writes ``--out/table.md`` and ``--out/results.json``:

* evidence: the held-out residual against its predicted variance, the ground truth's own held-out misfit against
  ``σ²`` and its correlation with the projected error, the line-integral oracle, the error's autocorrelation;
* image-space scores (inner square, against the ground truth): right scale, coverage @0.9/0.95, marginal LL against
  the constant-std oracle, for the posterior as is, the global ``k`` (today's ``uq.calibration: heldout``), the
  bias model fitted on the held-out rows (full per-angle covariance; diagonal), and the bias model's image-space
  oracle (``k``, ``τ`` fitted against the ground truth: what the family could give if the held-out fit found it).

Example (one thread; measured 1–5 min per 64² study run, most of it the posterior, on a loaded 2-core CPU)::

    nice -n 10 env OMP_NUM_THREADS=1 python scripts/heldout_bias_experiment.py --out runs/heldout_bias \\
        runs/cal_study/runs/*/angles_60/gprior-homoscedastic
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import tifffile
import torch
from scipy import ndimage, optimize
from scipy.stats import norm

from ctuq.config import load_config
from ctuq.metrics import inner_square_roi
from ctuq.options import NoiseModel
from ctuq.pipeline import calibration as calib
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.phases import Phase, RunState, phase_load, phase_restore_dip
from ctuq.pipeline.runner import run_phases

MASK_FRACTION = 0.1  # object = smoothed x̂ above this fraction of its maximum
MAX_ANGLES = 300  # held-out angles the fit uses at most (every n-th): bounds its time, ~30 s per run


def run_name(run_dir: Path) -> str:
    """``scan/angles_N/setting`` of a study run folder (its last three path parts)."""
    return "/".join(run_dir.resolve().parts[-3:])


def dump(run_dir: Path, cache: Path, n_samples: int = calib.HELDOUT_SAMPLES) -> None:
    """Rebuild the run's posterior on a temporary copy and save to ``cache`` (npz): ``samples`` (S, d) float32
    zero-mean image samples (mm⁻¹), ``T_*`` the held-out CSR matrix (rows, d; mm), ``resid`` (rows,) ``y_h − T_h x̂``
    (mm), ``sigma2`` (rows,) noise variance (mm²), ``n_cols``, ``groups`` (geometry rows), ``gt``, ``xhat``, ``std``
    (H, W) in mm⁻¹ (``std``: the posterior's, also of a run with ``uq.calibration: heldout``)."""
    with tempfile.TemporaryDirectory(prefix="heldout-bias-") as tmp:
        work = Path(tmp) / "run"
        shutil.copytree(run_dir, work)
        cfg = load_config(work / "config.yaml")
        device = torch.device("cpu")
        held, reason = calib.heldout_data(cfg, device)
        if held is None:
            raise SystemExit(f"{run_dir}: {reason}")
        state = RunState(cfg=cfg, out_dir=work, device=device, uq=True, progress=False, command="uq")
        run_phases(state, [Phase("load", phase_load), Phase("restore_dip", phase_restore_dip)])
        posterior = calib.fitted_posterior(state).posterior
        scale = cfg.dip.scale
        chunks = [
            (images / scale).double().cpu()
            for _i, images, _ps in posterior.sample_outputs(
                n_samples, chunk_size=cfg.uq.sample_chunk, seed=cfg.seed + 1
            )
        ]
        xhat = state.images["dip"].detach().cpu().double().numpy()
        sigma2 = float(posterior.sigma2) / scale**2
        if cfg.uq.noise == NoiseModel.PER_RAY:
            sigma2 = sigma2 * held.relative_variances
        csr = held.op.csr
        t_h = sp.csr_matrix(
            (csr.values().double().numpy(), csr.col_indices().numpy(), csr.crow_indices().numpy()),
            shape=tuple(csr.shape),
        )
        y = held.y.reshape(-1).double().numpy()
        # a run with uq.calibration = heldout keeps the posterior's own std apart (std.tif is k × std)
        std_name = rf.STD_UNCALIBRATED_NAME if (work / rf.STD_UNCALIBRATED_NAME).is_file() else rf.STD_NAME
        np.savez(
            cache,
            samples=torch.cat(chunks).numpy().astype(np.float32),
            T_data=t_h.data,
            T_indices=t_h.indices,
            T_indptr=t_h.indptr,
            T_shape=np.asarray(t_h.shape),
            resid=y - t_h @ xhat.ravel(),
            sigma2=np.broadcast_to(np.asarray(sigma2, np.float64), y.shape).copy(),
            n_cols=held.op.c // held.n_angles,
            groups=held.geometry_rows,
            gt=tifffile.imread(work / "ground_truth.tif").astype(np.float64),
            xhat=xhat,
            std=tifffile.imread(work / std_name).astype(np.float64),
        )


def _block_nll(resid: np.ndarray, cov: np.ndarray) -> float:
    """Mean Gaussian negative log-likelihood per row (without ½ log 2π) of ``resid`` (A, n) under per-angle
    covariances ``cov`` (A, n, n)."""
    chol = np.linalg.cholesky(cov)
    z = np.linalg.solve(chol, resid[:, :, None])[:, :, 0]
    return float((0.5 * np.sum(z**2) + np.sum(np.log(np.diagonal(chol, axis1=1, axis2=2)))) / resid.size)


def evaluate(cache: Path, name: str) -> dict:
    """Evidence and image-space scores of one cached run (module docstring)."""
    z = np.load(cache)
    t_h = sp.csr_matrix((z["T_data"], z["T_indices"], z["T_indptr"]), shape=tuple(z["T_shape"]))
    xhat, gt, std = z["xhat"], z["gt"], z["std"]
    n_cols = int(z["n_cols"])
    n_angles = len(z["resid"]) // n_cols
    sel = np.arange(0, n_angles, max(1, math.ceil(n_angles / MAX_ANGLES)))
    rows = (sel[:, None] * n_cols + np.arange(n_cols)[None]).ravel()
    resid = z["resid"][rows].reshape(len(sel), n_cols)
    s2 = z["sigma2"][rows].reshape(len(sel), n_cols)
    t_sel = t_h[rows]
    samples = z["samples"].astype(np.float64)
    proj = (t_sel @ samples.T).T.reshape(samples.shape[0], len(sel), n_cols)
    sig = np.einsum("sai,saj->aij", proj, proj) / samples.shape[0]
    smooth = ndimage.gaussian_filter(xhat, 1.0)
    mask = (smooth > MASK_FRACTION * smooth.max()).astype(np.float64)
    g = t_sel.multiply(mask.ravel()[None]).tocsr()
    bias = np.stack(
        [(g[i * n_cols : (i + 1) * n_cols] @ g[i * n_cols : (i + 1) * n_cols].T).toarray() for i in range(len(sel))]
    )
    noise = s2[:, :, None] * np.eye(n_cols)
    v, w = np.einsum("aii->ai", sig), np.einsum("aii->ai", bias)
    err = xhat - gt
    t_err = (t_sel @ err.ravel()).reshape(resid.shape)
    misfit = resid + t_err  # y_h − T_h x: noise plus projection-model error
    inner_obj = ndimage.binary_erosion(mask > 0, iterations=3)
    pairs = inner_obj[:, :-1] & inner_obj[:, 1:]
    evidence = {
        "residual_over_predicted": float(np.mean(resid**2) / np.mean(s2 + v)),
        "image_share": float(np.mean(v) / np.mean(s2 + v)),
        "truth_misfit_over_sigma2": float(np.mean(misfit**2) / np.mean(s2)),
        "residual_over_truth_misfit": float(np.mean(resid**2) / np.mean(misfit**2)),
        "corr_misfit_projected_error": float(np.corrcoef(misfit.ravel(), t_err.ravel())[0, 1]),
        "line_integral_oracle": float(np.sqrt(np.mean(t_err**2) / np.mean(v))),
        "error_lag1_autocorr_object": float((err[:, :-1] * err[:, 1:])[pairs].mean() / np.mean(err[inner_obj] ** 2)),
        "held_out_angles_fitted": len(sel),
    }

    def nll_diag(log_k: float, log_tau: float) -> float:
        u = math.exp(2 * log_k) * v + math.exp(2 * log_tau) * w + s2
        return float(0.5 * np.mean(np.log(u) + resid**2 / u))

    def nll_full(log_k: float, log_tau: float) -> float:
        return _block_nll(resid, math.exp(2 * log_k) * sig + math.exp(2 * log_tau) * bias + noise)

    roi = inner_square_roi(xhat.shape)
    e_in, s_in, m_in = err[roi].ravel(), std[roi].ravel(), mask[roi].ravel()
    ll_const = float(np.mean(norm.logpdf(e_in, 0, np.sqrt(np.mean(e_in**2)))))
    scores = []

    def score(method: str, k: float, tau: float) -> None:
        sd = np.sqrt(k**2 * s_in**2 + tau**2 * m_in)
        with np.errstate(divide="ignore", invalid="ignore"):
            entry = {
                "method": method,
                "k": k,
                "tau": tau,
                "right_scale": float(np.sqrt(np.mean((e_in / sd) ** 2))),
                "coverage_0.9": float(np.mean(np.abs(e_in) <= norm.ppf(0.95) * sd)),
                "coverage_0.95": float(np.mean(np.abs(e_in) <= norm.ppf(0.975) * sd)),
                "marginal_ll": float(np.mean(norm.logpdf(e_in, 0, sd))),
                "oracle_ll": ll_const,
            }
        scores.append(entry)

    score("posterior", 1.0, 0.0)
    fk = optimize.minimize_scalar(lambda q: nll_diag(q, -60.0), bounds=(-6.0, 6.0), method="bounded")
    score("global k (diagonal; uq.calibration=heldout)", math.exp(fk.x), 0.0)
    tau0 = math.log(2e-3)
    for method, fun in (("bias model, full per-angle covariance", nll_full), ("bias model, diagonal", nll_diag)):
        fit = optimize.minimize(
            lambda q, f=fun: f(*q), [0.0, tau0], method="Nelder-Mead", options={"xatol": 1e-5, "fatol": 1e-10}
        )
        score(method, *(float(x) for x in np.exp(fit.x)))
    fo = optimize.minimize(
        lambda q: -np.mean(norm.logpdf(e_in, 0, np.sqrt(math.exp(2 * q[0]) * s_in**2 + math.exp(2 * q[1]) * m_in))),
        [0.0, tau0],
        method="Nelder-Mead",
    )
    score("bias model, image-space oracle (knows the truth)", *(float(x) for x in np.exp(fo.x)))
    return {"run": name, "evidence": evidence, "scores": scores}


def markdown(results: list[dict]) -> str:
    """The evidence table, the per-run scores and the mean over runs per method."""
    lines = [
        "| run | mean r² / mean(σ² + v) | image share | truth misfit d²/σ² | r²/d² | corr(d, T_h e) "
        "| line-integral oracle | lag-1 autocorr of e (object) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = (
        "residual_over_predicted",
        "image_share",
        "truth_misfit_over_sigma2",
        "residual_over_truth_misfit",
        "corr_misfit_projected_error",
        "line_integral_oracle",
        "error_lag1_autocorr_object",
    )
    for r in results:
        lines.append(f"| {r['run']} | " + " | ".join(f"{r['evidence'][k]:.2f}" for k in keys) + " |")
    lines += [
        "",
        "| run | std map | k | τ (mm⁻¹) | right scale | cov@0.9 | cov@0.95 | marginal LL | constant-std oracle LL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for s in r["scores"]:
            lines.append(
                f"| {r['run']} | {s['method']} | {s['k']:.3f} | {s['tau']:.2e} | {s['right_scale']:.2f} | "
                f"{s['coverage_0.9']:.3f} | {s['coverage_0.95']:.3f} | {s['marginal_ll']:.3f} | {s['oracle_ll']:.3f} |"
            )
    lines += [
        "",
        "| std map | runs | median right scale | right scale in [0.85, 1.15] | mean cov@0.9 | mean cov@0.95 "
        "| LL above the oracle | LL ≥ posterior's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    methods = list(dict.fromkeys(s["method"] for r in results for s in r["scores"]))
    for m in methods:
        per = [(r["scores"][0], next(s for s in r["scores"] if s["method"] == m)) for r in results]
        n = len(per)
        lines.append(
            f"| {m} | {n} | {np.median([s['right_scale'] for _p, s in per]):.2f} | "
            f"{sum(0.85 <= s['right_scale'] <= 1.15 for _p, s in per)}/{n} | "
            f"{np.mean([s['coverage_0.9'] for _p, s in per]):.3f} | "
            f"{np.mean([s['coverage_0.95'] for _p, s in per]):.3f} | "
            f"{sum(s['marginal_ll'] > s['oracle_ll'] for _p, s in per)}/{n} | "
            f"{sum(s['marginal_ll'] >= p['marginal_ll'] - 1e-12 for p, s in per)}/{n} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: ``RUN_DIR ... --out DIR``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="finished run folders with a ground truth (sparse backend)")
    p.add_argument("--out", type=Path, required=True, help="folder for the caches, table.md and results.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for run_dir in args.runs:
        name = run_name(run_dir)
        cache = args.out / (name.replace("/", "__") + ".npz")
        if not cache.is_file():
            dump(run_dir, cache)
        results.append(evaluate(cache, name))
        print(f"{name}: done", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "table.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
