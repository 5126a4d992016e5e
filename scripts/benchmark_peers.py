#!/usr/bin/env python
"""ctuq's std map beside a peer's posterior on the same scan: deepinv's Langevin samplers with a TV prior.

For each finished ctuq run folder (``ctuq reconstruct`` with a ground truth: ``reconstruction.tif``, ``std.tif``,
``tv.tif``, ``ground_truth.tif``, ``config.yaml``, ``metrics.json``), the script loads the run's own scan, angles and
ray transform (:func:`ctuq.pipeline.scan.load_scan` on the run's config), and samples the posterior

    p(x | y) ∝ exp(−‖T x − y‖² / (2σ²) − (λ/σ²) · TV_σd(x))

with deepinv's unadjusted Langevin algorithm (``--sampler ula``, Laumont et al. 2022) or SKRock (``--sampler
skrock``, Pereyra et al. 2020), the prior's score from deepinv's TV denoiser (no downloaded weights; ``TV_σd`` is the
Moreau–Yosida envelope of isotropic TV that a denoiser of strength ``σd`` defines). The prior is given every advantage
ctuq's own TV has: its weight is ctuq's held-out-tuned TV weight ``λ`` (``metrics.json["tv"]["weight"]``, so the
posterior's mode is the run's ``tv.tif`` as ``σd → 0``), ``σ²`` the noise variance ctuq's own inference fitted
(``metrics.json["uq"]["sigma2"]`` over the DIP scale², the mean row variance of its likelihood; ``--noise photon``: the
mean of the scan's per-ray measurement variances, which the coarse grid's misfit exceeds several-fold), and the chain
starts at ``tv.tif``. ``σd`` is set so the prior's gradient is 10× smoother than the likelihood's
(``σd = 10 (λ/σ²) / L``, ``L = ‖T‖²/σ²``) and the step is ``0.9 / (L + (λ/σ²)/σd)``, the stability bound.

Both posteriors are scored the same way, in the run's inner square (and inside the object: the ground truth above
20 % of its maximum), against the ground truth: PSNR of the posterior mean (whole image, as ``metrics.json``),
coverage@0.9, the right scale ``sqrt(mean((e/std)²))``, the marginal Gaussian LL against the constant-std oracle's,
ENCE and coverage@0.9 per std decile inside the object (:func:`ctuq.metrics.calibration.error_localisation`), and wall
time (ctuq: its TV, DIP and inference phases from ``metrics.json``; the peer: the chain, plus the TV run it starts
from). ctuq's row is the shipped ``std.tif`` beside its reconstruction. By default the chain runs as many steps as fit
in the seconds ctuq's DIP and inference took (timed by two pilot chains of 300 and 600 steps): the two are compared at
equal time.

deepinv (0.5) is not a dependency of ctuq. It imports torchvision, whose PyPI wheels are CUDA builds that do not load
beside a CPU torch; the samplers and the TV denoiser never use it, so on such a machine the script stands in an empty
module for torchvision (and says so). Install::

    pip install --no-deps --target PEERS deepinv==0.5.0 torchmetrics einops natsort lightning-utilities
    PYTHONPATH=PEERS python scripts/benchmark_peers.py runs/demo

Examples::

    python scripts/benchmark_peers.py RUN [RUN ...] [--sampler ula|skrock] [--iterations N] [--seed S] [--json FILE]
    [--noise ctuq|photon] [--no-progress]
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import math
import sys
import time
import types
from pathlib import Path

import numpy as np
import tifffile
import torch

from ctuq.config import load_config
from ctuq.errors import OutDirError
from ctuq.metrics import inner_square_roi, marginal_log_likelihood, psnr
from ctuq.metrics.calibration import error_localisation, headline_coverage
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.scan import load_scan
from ctuq.utils import atomic_write_json

#: The prior's gradient is this many times smoother than the likelihood's (σd from it).
PRIOR_SMOOTHNESS = 10.0
#: The share of the chain discarded as burn-in, and the thinning of what is kept.
BURNIN, THINNING = 0.2, 5
#: Steps of the shorter of the two pilot chains that time a step when the chain is matched to ctuq's time.
PILOT = 300


class _EmptyModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``torchvision`` and its submodules as empty modules (deepinv imports it at start-up, the samplers and
    the TV denoiser never call it)."""

    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Empty(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class _Empty(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Empty(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args, **kwargs):
        return self


def import_deepinv():
    """deepinv, with an empty torchvision when the installed one cannot load (module docstring); a one-line
    ``SystemExit`` when deepinv is not installed."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a CUDA build of torchvision beside a CPU torch fails with RuntimeError or ImportError
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.meta_path.insert(0, _EmptyModules())
        print(f"[peers] torchvision does not load ({type(exc).__name__}): an empty module stands in", file=sys.stderr)
    try:
        import deepinv
    except ImportError as exc:
        raise SystemExit(f"benchmark_peers: deepinv is not installed ({exc}); see the module docstring") from None
    return deepinv


def _read(run: Path, name: str) -> np.ndarray:
    path = run / name
    if not path.is_file():
        raise SystemExit(f"benchmark_peers: {path} is missing (a finished `ctuq reconstruct` run with a ground truth)")
    return tifffile.imread(path).astype(np.float64)


def scores(gt: np.ndarray, mean: np.ndarray, std: np.ndarray) -> dict:
    """The row of one posterior (module docstring): ``psnr`` (dB), ``coverage_0.9``, ``right_scale``,
    ``marginal_ll`` and ``oracle_ll`` (nats/pixel) in the inner square; ``ence`` and ``decile_coverage`` inside the
    object. Images ``(H, W)`` in mm⁻¹."""
    roi = inner_square_roi(gt.shape)
    err = (mean - gt)[roi]
    z = err / std[roi]
    rms = float(np.sqrt(np.mean(err**2)))
    where = error_localisation(std, np.abs(mean - gt), gt, roi)
    return {
        "psnr": psnr(torch.from_numpy(mean), torch.from_numpy(gt)),
        "coverage_0.9": headline_coverage(gt, mean, std, roi)["0.9"],
        "right_scale": float(np.sqrt(np.mean(z**2))),
        "marginal_ll": marginal_log_likelihood(gt, mean, std**2, roi),
        "oracle_ll": marginal_log_likelihood(gt, mean, rms**2, roi),
        "ence": where["ence"],
        "decile_coverage": where["conditional_coverage_0.9"],
    }


def _ctuq_row(run: Path, metrics: dict, gt: np.ndarray) -> dict:
    timings = metrics.get("timings", {})
    seconds = sum(float(timings.get(k) or 0.0) for k in ("tv", "dip", "uq"))
    return {**scores(gt, _read(run, rf.RECONSTRUCTION_NAME), _read(run, rf.STD_NAME)), "seconds": seconds}


def _physics(deepinv, op, image_shape, meas_shape):
    """``T`` as a deepinv linear physics on ``(1, 1, H, W)`` images and ``(1, 1, angles, columns)`` sinograms."""

    def forward(x):
        return op.forward_flat(x.reshape(1, -1)).reshape(1, 1, *meas_shape)

    def adjoint(y):
        return op.adjoint_flat(y.reshape(1, -1)).reshape(1, 1, *image_shape)

    return deepinv.physics.LinearPhysics(A=forward, A_adjoint=adjoint)


def peer_row(
    deepinv,
    run: Path,
    metrics: dict,
    gt: np.ndarray,
    *,
    sampler: str,
    iterations: int | None,
    seed: int,
    noise: str = "ctuq",
    progress: bool = True,
) -> dict:
    """Sample the TV posterior of the run's scan with deepinv (module docstring) and score its mean and std.

    ``iterations``: the chain's steps; ``None`` matches ctuq's time: the chain gets the seconds ctuq's DIP and
    inference took (``metrics.json["timings"]``; both start from the same TV run), at the per-step time of a
    :data:`PILOT`-step pilot chain. ``noise``: ``σ²`` from ctuq's fitted noise (``ctuq``) or the scan's photon
    statistics (``photon``; module docstring). ``progress``: deepinv's bar over the chain's steps (not the pilots')."""
    cfg = load_config(run / rf.CONFIG_NAME)
    data, _, _ = load_scan(cfg, torch.device("cpu"), progress=False, run_dir=run)
    op = data.op
    if noise == "photon" and data.variances is None:
        raise SystemExit(f"benchmark_peers: {run}: the scan has no per-ray variances (photon counts): --noise photon")
    tv = metrics.get("tv") or {}
    if tv.get("weight") is None or tv.get("op_norm") is None:
        raise SystemExit(f"benchmark_peers: {run / rf.METRICS_NAME}: no TV weight (the run had tv.enabled false)")
    if noise == "ctuq":  # the mean row variance of ctuq's own likelihood: its σ² (scaled units) over the DIP scale²
        sigma2 = float(metrics["uq"]["sigma2"]) / float(metrics["dip"]["scale"]) ** 2
    else:
        sigma2 = float(data.variances.double().mean())
    weight = float(tv["weight"]) / sigma2  # λ/σ²: TV's objective divided by σ², a log density
    op_norm = float(tv["op_norm"])
    lipschitz = op_norm**2 / sigma2
    sigma_d = PRIOR_SMOOTHNESS * weight / lipschitz
    step = 0.9 / (lipschitz + weight / sigma_d)
    image_shape, meas_shape = tuple(op.image_shape), tuple(data.y.shape)
    physics = _physics(deepinv, op, image_shape, meas_shape)
    y = data.y.reshape(1, 1, *meas_shape).to(op.dtype)
    x0 = torch.from_numpy(_read(run, rf.TV_NAME)).to(op.dtype).reshape(1, 1, *image_shape)
    # 20 inner iterations every step (crit 0: no early exit), so a step costs the same all along the chain and the
    # pilots time it
    prior = deepinv.optim.ScorePrior(denoiser=deepinv.models.TVDenoiser(n_it_max=20, crit=0.0))
    fidelity = deepinv.optim.data_fidelity.L2(sigma=math.sqrt(sigma2))
    # α·(x − D_σd(x))/σd² is the gradient of α/σd · TV_σd: α = (λ/σ²)·σd gives the weight λ/σ²
    common = dict(alpha=weight * sigma_d, sigma=sigma_d, thinning=THINNING)
    common.update(burnin_ratio=BURNIN, clip=None)

    def build(steps: int, verbose: bool = False):
        options = {**common, "max_iter": steps, "verbose": verbose}
        if sampler == "ula":
            return deepinv.sampling.ULA(prior, fidelity, step_size=step, **options)
        return deepinv.sampling.SKRock(prior, fidelity, step_size=step, inner_iter=10, eta=0.05, **options)

    if iterations is None:  # ctuq's DIP + inference seconds, at the pilots' time per step
        budget = sum(float((metrics.get("timings") or {}).get(k) or 0.0) for k in ("dip", "uq"))
        seconds = []
        for steps in (PILOT, 2 * PILOT):  # the difference of two pilots: a step's time without the set-up's
            t0 = time.perf_counter()
            with torch.no_grad():
                build(steps).sample(y, physics, x_init=x0, seed=seed)
            seconds.append(time.perf_counter() - t0)
        per_step = max(seconds[1] - seconds[0], 1e-3 * seconds[0]) / PILOT
        iterations = max(PILOT, int((budget - seconds[0] + (seconds[1] - seconds[0])) / per_step))
    chain = build(iterations, verbose=progress)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        mean, var = chain.sample(y, physics, x_init=x0, seed=seed)
    seconds = time.perf_counter() - t0
    mean = mean.reshape(image_shape).double().numpy()
    std = var.reshape(image_shape).double().clamp_min(0).sqrt().numpy()
    if not (np.all(np.isfinite(mean)) and np.all(std > 0)):
        raise SystemExit(f"benchmark_peers: {run}: the {sampler} chain diverged (step {step:.3g})")
    row = scores(gt, mean, std)
    row["seconds"] = seconds + float(tv.get("time_s") or 0.0) + float((tv.get("tuning") or {}).get("time_s") or 0.0)
    row["chain_seconds"] = seconds
    row["settings"] = {"sigma2": sigma2, "tv_weight": float(tv["weight"]), "sigma_d": sigma_d, "step": step}
    row["iterations"] = iterations
    return row


def _fmt(v, digits=3):
    return "—" if v is None else f"{v:.{digits}f}"


def table(results: list[dict]) -> str:
    lines = [
        "| run | method | PSNR (dB) | cov@0.9 | right scale | marginal LL (oracle) | ENCE | cov@0.9 per decile | s "
        "| chain steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for method, row in r["rows"].items():
            dec = row["decile_coverage"] or []
            lines.append(
                f"| {r['run']} | {method} | {row['psnr']:.2f} | {row['coverage_0.9']:.3f} | {row['right_scale']:.2f} "
                f"| {row['marginal_ll']:.2f} ({row['oracle_ll']:.2f}) | {_fmt(row['ence'], 2)} "
                f"| {min(dec, default=float('nan')):.2f}–{max(dec, default=float('nan')):.2f} | {row['seconds']:.0f} "
                f"| {row.get('iterations', '—')} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished ctuq run folders with a ground truth")
    parser.add_argument("--sampler", choices=("ula", "skrock"), default="ula")
    parser.add_argument(
        "--iterations", type=int, help="Markov chain steps (default: as many as fit in ctuq's DIP + inference time)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--noise",
        choices=("ctuq", "photon"),
        default="ctuq",
        help="σ²: the noise variance ctuq's inference fitted (default), or the mean of the scan's per-ray variances",
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no bar over the chain's steps")
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < 10:
        parser.error(f"--iterations must be at least 10, got {args.iterations}")
    deepinv = import_deepinv()
    results = []
    for run in args.runs:
        try:
            metrics = rf.read_metrics(run)
        except OutDirError as exc:  # one line naming the file: not a finished run
            raise SystemExit(f"benchmark_peers: {exc}") from None
        gt = _read(run, rf.GROUND_TRUTH_NAME)
        rows = {"ctuq (std.tif)": _ctuq_row(run, metrics, gt)}
        label = f"deepinv {args.sampler.upper()} + TV"
        rows[label] = peer_row(
            deepinv,
            run,
            metrics,
            gt,
            sampler=args.sampler,
            iterations=args.iterations,
            seed=args.seed,
            noise=args.noise,
            progress=args.progress,
        )
        results.append({"run": str(run), "rows": rows})
        peer = rows[label]
        print(f"[peers] {run}: {peer['iterations']} steps, {peer['chain_seconds']:.0f} s", file=sys.stderr)
    print(table(results))
    if args.json:
        atomic_write_json(args.json, {"command": " ".join(sys.argv), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
