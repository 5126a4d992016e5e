#!/usr/bin/env python
"""Walnut uncertainty study: linearised DIP inference against MC dropout, for several angle counts of one scan.

For one scan (default: a simulated walnut written by ``ctuq simulate``'s ``bundled`` preset into ``OUT/scan``;
the real walnut when ``--data`` names its ``Walnut{id}`` folder) and every angle count in ``--settings``, the
study loads the 2D slice problem and

1. fits the DIP once (U-Net without dropout): its reconstruction ``x̃`` is the mean of both linearised methods;
2. **linearised (sampled)**: g-prior, sampled EM with preconditioned CG, ``--samples`` dual Matheron samples
   (:func:`ctuq.uq.run_linearized_uq` with ``solver="cg"``);
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

Outputs in ``--out``::

    results.md, results.json          the table (rows: setting × method) and every number behind it
    uq_<N>.png                         reconstruction | |error| | std, one row per method (N = angle count)
    joint_ll_<N>.png                   joint log-likelihood against patch size
    calibration_<N>.png                calibration curves
    error_vs_std_<N>.png               |error| against std histograms
    angles_<N>/                        per setting: ground_truth.tif, reconstruction.tif, dip_model.pt, and per
        <method>/                      method std.tif, mean.tif, result.pt, metrics.json (+ its checkpoints)
    study.json                         the options of the study (a rerun must use the same ones)
    scan/                              the simulated scan (only without --data)

Checkpoints: the DIP fits (``fit_dip`` checkpoints), the linearised inference (``uq_state.pt`` and sample
chunks) and each finished (setting, method) are kept in ``--out``; rerunning the same command skips what is
finished and resumes what is not (the log says which).

Examples::

    python scripts/walnut_study.py --out runs/study                      # simulated walnut, CPU demo settings
    python scripts/walnut_study.py --tiny --out /tmp/study              # seconds: the test's size
    python scripts/walnut_study.py --data /data/Walnut1 --device cuda --preset walnut --iterations 2000 \\
        --lr 1e-4 --tv-weight 6.5e-6 --samples 1024 --out runs/walnut1  # the real walnut on a GPU
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

METHODS = {
    "linearised_sampled": "linearised (sampled)",
    "linearised_exact": "linearised (exact)",
    "mc_dropout": "MC dropout",
}

# The CPU demo (ctuq/configs/demo.yaml: tiny U-Net, lr 3e-3, TV 1e-4, 2500 iterations, ×14) on the bundled-size
# simulated walnut, 60 and 120 angles, with the published inference settings (EM 5 × 16, rank 400, 1024 passes).
DEFAULTS: dict[str, Any] = {
    "scan_preset": "bundled",
    "settings": [60, 120],
    "preset": "tiny",
    "iterations": 2500,
    "lr": 3e-3,
    "tv_weight": 1e-4,
    "clip_grad_norm": 1.0,
    "scale": 14.0,
    "input_std": 0.1,
    "image_shape": None,  # None: the ground-truth grid
    "detector_subsampling": None,  # None: keep about 128 detector columns (the published setting)
    "orbit": 2,
    "slice_index": None,
    "backend": "auto",
    "samples": 256,
    "exact_samples": None,  # None: --samples
    "mc_passes": 1024,
    "mc_batch": 32,
    "dropout": 0.05,
    "em_steps": 5,
    "em_samples": 16,
    "exact_em_steps": 50,
    "rank": 400,
    "gprior": "exact",
    "prior_precision": 100.0,
    "exact": "auto",
    "seed": 0,
}

# --tiny: the end-to-end test's size (tiny simulated scan, 32² grid, a few iterations and samples; seconds).
TINY: dict[str, Any] = {
    "scan_preset": "tiny",
    "settings": [4, 8],
    "image_shape": [32, 32],
    "detector_subsampling": 4,
    "iterations": 20,
    "samples": 8,
    "exact_samples": 16,
    "mc_passes": 16,
    "em_steps": 2,
    "em_samples": 4,
    "exact_em_steps": 10,
    "rank": 32,
}

# Options that do not change the numbers: a rerun may change them freely.
_NEUTRAL = {"device", "progress", "mc_batch", "tiny", "threads"}
PUBLISHED_COLUMNS = 128  # detector columns of the published sparse 2D setting (768 / 6)


class StudyError(RuntimeError):
    """Bad input or an output folder that belongs to another study; the message says what and where."""


# ================================================================================================ options
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="walnut_study.py", description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Outputs in"):], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="DIR", help="Walnut{id} folder (real or simulated); default: simulate one "
                                                 "into OUT/scan (reused when it is there)")
    g.add_argument("--scan-preset", choices=("bundled", "tiny", "walnut"),
                   help=f"simulation preset when --data is not given (default {d['scan_preset']})")
    g.add_argument("--out", metavar="DIR", required=True, help="study folder (created; reruns resume in it)")
    g.add_argument("--settings", type=int, nargs="+", metavar="ANGLES",
                   help=f"angle counts, each dividing the scan's number of distinct angles (default "
                        f"{' '.join(map(str, d['settings']))})")
    g.add_argument("--orbit", type=int, choices=(1, 2, 3), help="source orbit (default 2)")
    g.add_argument("--slice-index", type=int, help="ground-truth slice (default: the central one)")
    g.add_argument("--image-shape", type=int, nargs=2, metavar=("H", "W"),
                   help="reconstruction grid (default: the ground-truth grid)")
    g.add_argument("--detector-subsampling", type=int, metavar="K",
                   help="keep every K-th detector column (default: about 128 columns remain)")
    g.add_argument("--backend", choices=("auto", "sparse", "astra_cuda"), help="ray transform (default auto)")
    g = p.add_argument_group("DIP")
    g.add_argument("--preset", choices=("tiny", "small", "walnut"), help=f"U-Net preset (default {d['preset']})")
    g.add_argument("--iterations", type=int, help=f"DIP iterations (default {d['iterations']})")
    g.add_argument("--lr", type=float, help=f"Adam learning rate (default {d['lr']})")
    g.add_argument("--tv-weight", type=float, help=f"TV weight (default {d['tv_weight']})")
    g.add_argument("--clip-grad-norm", type=float, help=f"gradient-norm clip, 0 disables (default {d['clip_grad_norm']})")
    g.add_argument("--scale", type=float, help=f"data/image scale of the DIP (default {d['scale']})")
    g.add_argument("--input-std", type=float, help=f"std of the fixed noise input (default {d['input_std']})")
    g = p.add_argument_group("linearised inference")
    g.add_argument("--samples", type=int, help=f"prediction samples of the linearised methods (default {d['samples']})")
    g.add_argument("--exact-samples", type=int, help="prediction samples of the exact reference (default: --samples)")
    g.add_argument("--em-steps", type=int, help=f"sampled-EM steps (default {d['em_steps']})")
    g.add_argument("--em-samples", type=int, help=f"samples per sampled-EM step (default {d['em_samples']})")
    g.add_argument("--exact-em-steps", type=int,
                   help=f"EM steps of the exact reference (free there; default {d['exact_em_steps']}, tol 1e-3)")
    g.add_argument("--rank", type=int, help=f"CG preconditioner rank (default {d['rank']})")
    g.add_argument("--gprior", choices=("exact", "stochastic"), help="g-prior scales: exact (c VJPs) or stochastic "
                                                                     "(default exact)")
    g.add_argument("--prior-precision", type=float, help=f"initial prior precision a (default {d['prior_precision']})")
    g.add_argument("--exact", choices=("auto", "always", "never"),
                   help="run the exact reference: auto = when its memory estimate fits the device (default)")
    g = p.add_argument_group("MC dropout")
    g.add_argument("--mc-passes", type=int, help=f"stochastic forward passes (default {d['mc_passes']})")
    g.add_argument("--mc-batch", type=int, help=f"passes per forward call (default {d['mc_batch']})")
    g.add_argument("--dropout", type=float, help=f"dropout rate after every conv block (default {d['dropout']})")
    g = p.add_argument_group("run")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: CUDA if available")
    g.add_argument("--seed", type=int, help="seed of inputs, weights, dropout and samples (default 0)")
    g.add_argument("--tiny", action="store_true",
                   help="tiny preset for tests: tiny simulated scan, 4 and 8 angles, 32² grid, 24 detector columns, "
                        f"{TINY['iterations']} DIP iterations, a few samples (explicit options still win)")
    g.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's choice; on a machine shared with other jobs 1 can be "
                        "several times faster)")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    return p


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Options: explicit command-line values > ``--tiny`` > :data:`DEFAULTS`; validated (``StudyError``)."""
    opts = dict(DEFAULTS)
    if args.tiny:
        opts.update(TINY)
    for key in DEFAULTS:
        value = getattr(args, key, None)
        if value is not None:
            opts[key] = list(value) if isinstance(value, (list, tuple)) else value
    if opts["exact_samples"] is None:
        opts["exact_samples"] = opts["samples"]
    opts["device"] = args.device
    opts["threads"] = args.threads
    opts["tiny"] = bool(args.tiny)
    opts["progress"] = not args.no_progress

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise StudyError(what)

    need(len(opts["settings"]) > 0 and min(opts["settings"]) >= 1, f"--settings: angle counts must be >= 1, got "
                                                                    f"{opts['settings']}")
    need(len(set(opts["settings"])) == len(opts["settings"]), f"--settings: repeated angle count in {opts['settings']}")
    for key in ("iterations", "samples", "exact_samples", "mc_passes", "em_samples", "rank", "mc_batch"):
        need(opts[key] >= 1, f"--{key.replace('_', '-')} must be >= 1, got {opts[key]}")
    for key in ("samples", "exact_samples", "mc_passes"):
        need(opts[key] >= 2, f"--{key.replace('_', '-')} must be >= 2 (a std needs two samples), got {opts[key]}")
    for key in ("em_steps", "exact_em_steps"):
        need(opts[key] >= 0, f"--{key.replace('_', '-')} must be >= 0, got {opts[key]}")
    for key in ("lr", "scale", "input_std", "prior_precision"):
        need(opts[key] > 0 and math.isfinite(opts[key]), f"--{key.replace('_', '-')} must be positive, got {opts[key]}")
    need(opts["tv_weight"] >= 0, f"--tv-weight must be >= 0, got {opts['tv_weight']}")
    need(opts["clip_grad_norm"] >= 0, f"--clip-grad-norm must be >= 0, got {opts['clip_grad_norm']}")
    need(0.0 < opts["dropout"] < 1.0, f"--dropout must lie in (0, 1), got {opts['dropout']}")
    need(opts["seed"] >= 0, f"--seed must be >= 0, got {opts['seed']}")
    need(opts["threads"] is None or opts["threads"] >= 1, f"--threads must be >= 1, got {opts['threads']}")
    if opts["image_shape"] is not None:
        need(min(opts["image_shape"]) >= 4, f"--image-shape must be at least 4 × 4, got {opts['image_shape']}")
    if opts["detector_subsampling"] is not None:
        need(opts["detector_subsampling"] >= 1, f"--detector-subsampling must be >= 1, got "
                                                f"{opts['detector_subsampling']}")
    return opts


# ================================================================================================ helpers
class Log:
    """Timestamped one-line messages on stderr (the progress output of the study)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.t0
        print(f"[walnut_study {elapsed:7.1f} s] {msg}", file=sys.stderr, flush=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StudyError(f"{path} could not be read as JSON ({exc}); delete it to recompute that part") from exc


def _study_fingerprint(opts: dict, data: str) -> dict:
    fp = {k: v for k, v in opts.items() if k not in _NEUTRAL}
    fp["data"] = data
    return fp


def check_study_folder(out: Path, fingerprint: dict, log: Log) -> None:
    """Create ``out/study.json``, or check that the existing one holds the same options (``StudyError`` if not)."""
    from ctuq.utils import atomic_write_json

    path = out / "study.json"
    if path.is_file():
        saved = _read_json(path).get("options", {})
        # settings may grow: a rerun with more angle counts adds them; everything else must match
        diff = sorted(k for k in set(saved) | set(fingerprint) if k != "settings" and saved.get(k) != fingerprint.get(k))
        if diff:
            details = ", ".join(f"{k}: {saved.get(k)!r} there, {fingerprint.get(k)!r} now" for k in diff)
            raise StudyError(f"{out} holds a study with other options ({details}); use another --out, or the same "
                             f"options to resume it")
        log(f"resuming the study in {out} (finished parts are skipped)")
        fingerprint = dict(fingerprint, settings=sorted(set(saved.get("settings", [])) | set(fingerprint["settings"])))
    atomic_write_json(path, {"options": fingerprint})


def prepare_scan(opts: dict, data: str | None, out: Path, log: Log) -> Path:
    """The scan folder: ``--data`` as given, or ``out/scan`` simulated with ``opts['scan_preset']`` (reused when a
    complete simulation of that preset is there)."""
    from ctuq.data import simulate_scan
    from ctuq.data.simulate import SIDECAR_NAME

    if data is not None:
        path = Path(data).expanduser()
        if not path.is_dir():
            raise StudyError(f"--data {data!r} is not a folder (a Walnut{{id}} folder with Projections/ and "
                             f"Reconstructions/ is needed)")
        return path
    path = out / "scan"
    sidecar = path / SIDECAR_NAME
    if sidecar.is_file():
        info = _read_json(sidecar)
        if info.get("complete") and info.get("preset") == opts["scan_preset"]:
            log(f"reusing the simulated scan {path} (preset {opts['scan_preset']})")
            return path
    log(f"simulating a walnut scan (preset {opts['scan_preset']}) into {path}")
    t0 = time.perf_counter()
    simulate_scan(path, preset=opts["scan_preset"], overwrite=sidecar.is_file(), progress=opts["progress"])
    log(f"simulated the scan in {time.perf_counter() - t0:.1f} s")
    return path


def angular_subsampling(n_files: int, n_angles: int, path: Path) -> int:
    """Subsampling factor that leaves ``n_angles`` of the scan's ``n_files − 1`` distinct angles (``StudyError`` if
    ``n_angles`` does not divide that number)."""
    distinct = n_files - 1
    if n_angles > distinct or distinct % n_angles:
        valid = [k for k in range(1, distinct + 1) if distinct % k == 0]
        raise StudyError(f"--settings: {n_angles} angles cannot be taken evenly from the {distinct} distinct angles of "
                         f"{path} ({n_files} projection files); valid angle counts: {valid}")
    return distinct // n_angles


def exact_decision(mode: str, c: int, d: int, opts: dict, device: torch.device) -> tuple[bool, str]:
    """Whether to run the exact reference, and why: ``auto`` compares the exact solver's memory estimate for
    ``c`` measurements and ``d`` weights (:func:`ctuq.inference.estimate_solver_costs`) with half the free memory
    of ``device``."""
    if mode == "never":
        return False, "--exact never"
    if mode == "always":
        return True, "--exact always"
    from ctuq.inference import Workload, estimate_solver_costs

    if device.type == "cuda":
        free = float(torch.cuda.mem_get_info(device)[0])
    else:
        try:
            free = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            free = 8.0 * 1024**3
    budget = 0.5 * free
    wl = Workload(em_steps=opts["exact_em_steps"], em_samples=opts["em_samples"],
                  prediction_samples=opts["exact_samples"], rank=opts["rank"])
    est = estimate_solver_costs(c, d, wl, memory_budget=budget, itemsize=4)["exact"]
    route = "dense TΦ (d < c)" if d < c else "c × c eigendecomposition"
    verdict = f"{route} needs ≈{est.memory_bytes / 2**30:.2f} GiB of a {budget / 2**30:.1f} GiB budget"
    return bool(est.feasible), verdict


def _setting_dir(out: Path, n_angles: int) -> Path:
    return out / f"angles_{n_angles}"


def _load_model(path: Path):
    from ctuq.models import UNet

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        model = UNet.from_config(saved["model_config"])
        model.load_state_dict(saved["state_dict"])
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise StudyError(f"{path} is not a readable DIP model ({exc}); delete it to refit") from exc
    return model, saved


def _save_model(path: Path, model, result, summary: dict) -> None:
    from ctuq.utils import atomic_torch_save

    atomic_torch_save(path, {
        "model_config": model.config.to_dict(),
        "state_dict": result.best_state_dict,
        "net_input": result.net_input,
        "scale": result.scale,
        "summary": summary,
        "reconstruction": result.reconstruction.detach().cpu(),
    })


# ================================================================================================ phases
def fit_or_load_dip(kind: str, sdir: Path, data, opts: dict, device: torch.device, log: Log):
    """The fitted network of ``kind`` ``"dip"`` (no dropout) or ``"mc_dropout"`` (dropout DIP): loaded from
    ``dip_model.pt`` when an earlier run finished it, else fitted (resuming from its checkpoint).

    Returns ``(model, net_input (1, 1, H, W), reconstruction (H, W) mm⁻¹ with dropout off, summary dict)``.
    """
    from ctuq.models import build_unet, count_parameters, make_net_input
    from ctuq.reconstruct import fit_dip, fit_mc_dropout_dip

    folder = sdir if kind == "dip" else sdir / "mc_dropout"
    folder.mkdir(parents=True, exist_ok=True)
    model_path = folder / "dip_model.pt"
    label = "DIP" if kind == "dip" else f"MC-dropout DIP (p = {opts['dropout']})"
    if model_path.is_file():
        model, saved = _load_model(model_path)
        log(f"skipping the {label} fit: finished in an earlier run ({model_path})")
        return model.to(device), saved["net_input"], saved["reconstruction"], saved["summary"]
    ckpt = folder / "dip_checkpoint.pt"
    net_input = make_net_input(data.op.image_shape, channels=1, seed=opts["seed"], std=opts["input_std"])
    common = dict(iterations=opts["iterations"], lr=opts["lr"], tv_weight=opts["tv_weight"],
                  clip_grad_norm=opts["clip_grad_norm"] or None, scale=opts["scale"], seed=opts["seed"],
                  ground_truth=data.ground_truth.to(device), checkpoint_path=ckpt,
                  checkpoint_every=max(50, opts["iterations"] // 10), resume=True, device=device,
                  progress=opts["progress"])
    log(f"fitting the {label}: {opts['iterations']} iterations" + (" (resuming from its checkpoint)"
                                                                    if ckpt.is_file() else ""))
    if kind == "dip":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(opts["seed"])  # same initial weights as `ctuq reconstruct` with this seed
            model = build_unet(opts["preset"], ndim=data.op.ndim)
        result = fit_dip(data.op, data.y, model=model, net_input=net_input, **common)
    else:
        model, result = fit_mc_dropout_dip(data.op, data.y, preset=opts["preset"], dropout=opts["dropout"],
                                           net_input=net_input, **common)
    summary = dict(result.summary(), n_conv_weights=count_parameters(model, conv_weights_only=True))
    _save_model(model_path, model, result, summary)
    ckpt.unlink(missing_ok=True)
    log(f"{label}: {result.time_s:.1f} s, best iteration {result.best_iteration}, "
        f"PSNR {summary['best_psnr_history'] or float('nan'):.2f} dB")
    model_out, saved = _load_model(model_path)  # the saved best weights: identical on reruns
    return model_out.to(device), result.net_input, result.reconstruction.detach().cpu(), saved["summary"]


def _method_done(mdir: Path) -> dict | None:
    metrics, result = mdir / "metrics.json", mdir / "result.pt"
    if metrics.is_file() and result.is_file():
        return _read_json(metrics)
    return None


def _finish_method(mdir: Path, mean: torch.Tensor, std: torch.Tensor, record: dict) -> dict:
    from ctuq.outputs import write_metrics, write_tiff
    from ctuq.utils import atomic_torch_save

    write_tiff(mdir / "std.tif", std)
    write_tiff(mdir / "mean.tif", mean)
    atomic_torch_save(mdir / "result.pt", {"mean": mean.detach().cpu().float(), "std": std.detach().cpu().float()})
    write_metrics(mdir / "metrics.json", record)  # written last: its presence marks the method as finished
    return _read_json(mdir / "metrics.json")


def run_linearised(method: str, sdir: Path, model, net_input, data, opts: dict, log: Log) -> dict:
    """Sampled (``solver="cg"``) or exact (``solver="exact"``) linearised inference around the fitted DIP."""
    from ctuq.metrics import inner_square_roi, uq_summary
    from ctuq.outputs import image_metrics
    from ctuq.uq import SAMPLES_PATTERN, STATE_NAME, UQSettings, run_linearized_uq

    mdir = sdir / method
    mdir.mkdir(parents=True, exist_ok=True)
    if method == "linearised_sampled":
        settings = UQSettings(solver="cg", gprior_method=opts["gprior"], em_steps=opts["em_steps"],
                              em_samples=opts["em_samples"], samples=opts["samples"], rank=opts["rank"],
                              prior_precision=opts["prior_precision"], sample_chunk=min(64, opts["samples"]))
    else:
        settings = UQSettings(solver="exact", gprior_method="exact", em_steps=opts["exact_em_steps"], em_tol=1e-3,
                              em_samples=opts["em_samples"], samples=opts["exact_samples"], rank=opts["rank"],
                              prior_precision=opts["prior_precision"], sample_chunk=min(256, opts["exact_samples"]))
    resumed = (mdir / STATE_NAME).is_file()
    if resumed:
        log(f"{METHODS[method]}: resuming from {mdir / STATE_NAME} (its timings then cover this run only)")
    res = run_linearized_uq(model, net_input, data.op, data.y, scale=opts["scale"], settings=settings,
                            seed=opts["seed"], work_dir=mdir, resume=True, progress=opts["progress"],
                            log=lambda m: log(f"  {METHODS[method]}: {m}"))
    gt = data.ground_truth.detach().cpu()
    summary = uq_summary(gt, res.mean, res.samples, inner_square_roi(tuple(gt.shape)))
    t = res.timings
    record = {
        "method": METHODS[method],
        "solver": res.solver,
        "route": res.stats.get("route"),
        "resumed": resumed,
        "n_samples": int(res.samples.shape[0]),
        "image": image_metrics(res.mean, gt),
        "summary": summary,
        "time_hyperparameters_s": t.get("gprior", 0.0) + t.get("solver_setup", 0.0) + t.get("em", 0.0),
        "time_prediction_s": t.get("prediction", 0.0),
        # tracing the linearisation (paid at the first JVP, in the offset phase) and the offset δ itself
        "time_other_s": t.get("linearize", 0.0) + t.get("route", 0.0) + t.get("offset", 0.0),
        "timings": t,
        "products": res.products,
        "a": res.a,
        "sigma2": res.sigma2,
        "em_steps": len(res.em_trace),
        "stats": res.stats,
        "settings": {k: getattr(settings, k) for k in ("solver", "gprior_method", "em_steps", "em_samples", "samples",
                                                       "rank", "prior_precision", "learn_noise")},
    }
    out = _finish_method(mdir, res.mean, res.std, record)
    # The sample chunks and the solver state only serve a resume; they are large (the exact Q is c × r float64).
    for p in mdir.glob(SAMPLES_PATTERN.replace("{:04d}", "*")):
        p.unlink()
    (mdir / STATE_NAME).unlink(missing_ok=True)
    return out


def run_mc_dropout(sdir: Path, data, opts: dict, device: torch.device, log: Log) -> dict:
    """Fit (or load) the dropout DIP, run the stochastic passes, score them."""
    from ctuq.metrics import inner_square_roi, uq_summary
    from ctuq.outputs import image_metrics
    from ctuq.reconstruct import mc_dropout_predict

    mdir = sdir / "mc_dropout"
    model, net_input, recon_det, fit = fit_or_load_dip("mc_dropout", sdir, data, opts, device, log)
    log(f"MC dropout: {opts['mc_passes']} stochastic passes")
    pred = mc_dropout_predict(model, net_input, opts["mc_passes"], scale=opts["scale"], seed=opts["seed"],
                              batch=opts["mc_batch"], progress=opts["progress"])
    gt = data.ground_truth.detach().cpu()
    summary = uq_summary(gt, pred.mean, pred.passes, inner_square_roi(tuple(gt.shape)), centering="empirical")
    record = {
        "method": METHODS["mc_dropout"],
        "n_samples": pred.n_passes,
        "image": image_metrics(pred.mean, gt),
        "image_dropout_off": image_metrics(recon_det, gt),
        "summary": summary,
        "time_hyperparameters_s": None,  # nothing is learned: the dropout rate is fixed
        "time_prediction_s": pred.time_s,
        "time_fit_s": fit.get("time_s"),
        "fit": fit,
        "prediction": pred.summary(),
    }
    return _finish_method(mdir, pred.mean, pred.std, record)


def figure_paths(out: Path, n_angles: int) -> list[Path]:
    """The four figures of one setting."""
    return [out / f"{kind}_{n_angles}.png" for kind in ("uq", "joint_ll", "calibration", "error_vs_std")]


def make_figures(out: Path, n_angles: int, sdir: Path, gt: torch.Tensor, records: dict, log: Log) -> list[Path]:
    """The four comparison figures of one setting from the finished methods' ``result.pt`` and metrics."""
    from ctuq import figures
    from ctuq.metrics import inner_square_roi

    roi = inner_square_roi(tuple(gt.shape))
    maps = {}
    for method, rec in records.items():
        saved = torch.load(sdir / method / "result.pt", map_location="cpu", weights_only=True)
        maps[METHODS[method]] = (saved["mean"], (saved["mean"] - gt).abs(), saved["std"])
    names = {METHODS[m]: r for m, r in records.items()}
    paths = [
        figures.plot_uq_comparison(out / f"uq_{n_angles}.png", maps, ground_truth=gt, roi=roi),
        figures.plot_joint_ll(out / f"joint_ll_{n_angles}.png", {n: r["summary"]["joint_ll"] for n, r in names.items()},
                              title=f"{n_angles} angles"),
        figures.plot_calibration(out / f"calibration_{n_angles}.png",
                                 {n: (r["summary"]["calibration"]["levels"], r["summary"]["calibration"]["coverage"])
                                  for n, r in names.items()}, title=f"{n_angles} angles"),
        figures.plot_error_vs_std(out / f"error_vs_std_{n_angles}.png",
                                  {n: (m[1], m[2]) for n, m in maps.items()}, roi=roi),
    ]
    log(f"figures for {n_angles} angles: {', '.join(p.name for p in paths)}")
    return paths


# ================================================================================================ table
def table_rows(results: dict) -> list[dict]:
    """One row per (setting, method) in setting order, methods in :data:`METHODS` order (skipped ones included)."""
    rows = []
    for key, setting in results["settings"].items():
        for method, label in METHODS.items():
            rec = setting["methods"].get(method)
            row: dict[str, Any] = {"setting": int(key), "method": method, "label": label}
            if rec is None or rec.get("status") == "skipped":
                row["status"] = "skipped"
                row["reason"] = (rec or {}).get("reason", "not run")
            else:
                s = rec["summary"]
                row.update({
                    "status": "done",
                    "psnr": rec["image"]["psnr"],
                    "marginal_ll": s["marginal_ll"],
                    "joint_ll_10": s["joint_ll"].get("10"),
                    "coverage_90": s["coverage"]["0.9"],
                    "time_hyperparameters_s": rec.get("time_hyperparameters_s"),
                    "time_prediction_s": rec.get("time_prediction_s"),
                    "time_fit_s": rec.get("time_fit_s", setting["dip"].get("time_s")),
                    "n_samples": rec["n_samples"],
                })
            rows.append(row)
    return rows


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return format(v, spec)


def markdown_table(rows: list[dict]) -> str:
    """The Markdown table of :func:`table_rows`."""
    head = ("| angles | method | PSNR (dB) | marginal LL | 10×10 joint LL | coverage@0.9 | hyperparameters (s) "
            "| prediction (s) | samples | fit (s) |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r["status"] != "done":
            lines.append(f"| {r['setting']} | {r['label']} | not run: {r['reason']} |  |  |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['setting']} | {r['label']} | {_fmt(r['psnr'], '.2f')} | {_fmt(r['marginal_ll'], '.3f')} "
            f"| {_fmt(r['joint_ll_10'], '.3f')} | {_fmt(r['coverage_90'], '.3f')} "
            f"| {_fmt(r['time_hyperparameters_s'], '.1f')} | {_fmt(r['time_prediction_s'], '.1f')} "
            f"| {r['n_samples']} | {_fmt(r['time_fit_s'], '.1f')} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    """``results.json`` (everything) and ``results.md`` (the table with its notes), atomically."""
    from ctuq.outputs import write_metrics
    from ctuq.utils import atomic_path

    rows = table_rows(results)
    results = dict(results, table=rows)
    write_metrics(out / "results.json", results)
    info = []
    for key, s in results["settings"].items():
        info.append(f"- {key} angles: c = {s['c']}, d = {s['d']} conv weights (dropout net: same d), "
                    f"image {s['image_shape'][0]}×{s['image_shape'][1]}, DIP PSNR {_fmt(s['dip'].get('psnr'), '.2f')} dB, "
                    f"exact reference: {s['exact_reason']}")
    text = (
        f"# Walnut uncertainty study\n\n"
        f"Scan: `{results['data']['path']}` ({results['data']['kind']}); device {results['device']}; "
        f"created {results['created']}.\n\n"
        f"Command: `{results['command']}`\n\n"
        + markdown_table(rows)
        + "\nLog-likelihoods are in nats per pixel over the inner-square ROI (higher is better); coverage@0.9 is the "
          "fraction of ROI pixels inside their central 90% interval (0.9 is calibrated). Hyperparameters: g-prior, "
          "solver set-up and EM of the linearised methods (MC dropout learns none: its rate is fixed). Prediction: "
          "the prediction samples / stochastic passes. Fit: the DIP fit behind each method's mean (the linearised "
          "methods share one DIP; MC dropout fits its own dropout network).\n\n"
        + "\n".join(info) + "\n"
    )
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text(text)


# ================================================================================================ main
def run_study(opts: dict, data_arg: str | None, out: Path, log: Log | None = None, command: str = "") -> dict:
    """Run (or resume) the study described by ``opts`` into ``out``; returns the results dict (also written).

    ``command`` is recorded in the outputs (the command line that ran the study). ``opts["threads"]`` sets torch's
    CPU threads for the study only (restored afterwards, so a caller's process keeps its own setting)."""
    threads = torch.get_num_threads()
    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    try:
        return _run_study(opts, data_arg, out, log or Log(), command)
    finally:
        torch.set_num_threads(threads)


def _run_study(opts: dict, data_arg: str | None, out: Path, log: Log, command: str) -> dict:
    from ctuq.data import WalnutScan, load_walnut_slice
    from ctuq.models import build_unet, count_parameters
    from ctuq.outputs import image_metrics, package_versions, write_tiff
    from ctuq.utils import resolve_device

    device = resolve_device(opts["device"])
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = _study_fingerprint(opts, str(Path(data_arg).expanduser().resolve()) if data_arg else "simulated")
    check_study_folder(out, fingerprint, log)
    path = prepare_scan(opts, data_arg, out, log)
    try:
        scan = WalnutScan(path, opts["orbit"])
    except Exception as exc:  # noqa: BLE001 - the loader's message names the file; say which option led there
        raise StudyError(f"cannot read the scan {path}: {exc}") from exc
    det_cols = scan.det_shape[1]
    dsub = opts["detector_subsampling"] or max(1, round(det_cols / PUBLISHED_COLUMNS))
    plans = [(n, angular_subsampling(scan.n_files, n, path)) for n in opts["settings"]]  # fail before any work
    results: dict[str, Any] = {
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "device": str(device),
        "data": {"path": str(path), "kind": "given with --data" if data_arg else f"simulated ({opts['scan_preset']})",
                 "projection_files": scan.n_files, "detector_columns": det_cols, "detector_subsampling": dsub},
        "options": fingerprint,
        "settings": {},
        "versions": package_versions(),
    }
    n_steps = len(plans) * (3 + len(METHODS))  # load, DIP, methods, figures
    step = 0

    def stage(msg: str) -> None:
        nonlocal step
        step += 1
        log(f"[{step}/{n_steps}] {msg}")

    for i, (n_angles, ass) in enumerate(plans):
        sdir = _setting_dir(out, n_angles)
        sdir.mkdir(parents=True, exist_ok=True)
        stage(f"setting {i + 1}/{len(plans)}: {n_angles} angles (angular subsampling {ass} of "
              f"{scan.n_files - 1}), loading")
        data = load_walnut_slice(path, slice_index=opts["slice_index"], orbit=opts["orbit"], angular_subsampling=ass,
                                 detector_subsampling=dsub,
                                 image_shape=None if opts["image_shape"] is None else tuple(opts["image_shape"]),
                                 backend=opts["backend"], device=device, progress=opts["progress"])
        if data.ground_truth is None:
            raise StudyError(f"{path} has no ground truth (Reconstructions/full_AGD_50_*.tiff): the study's metrics "
                             f"need one")
        gt = data.ground_truth.detach().cpu().float()
        write_tiff(sdir / "ground_truth.tif", gt)
        c = int(data.op.c)
        d = count_parameters(build_unet(opts["preset"], ndim=data.op.ndim), conv_weights_only=True)
        log(f"{n_angles} angles: sinogram {tuple(data.op.measurement_shape)} (c = {c}), image "
            f"{tuple(data.op.image_shape)}, U-Net '{opts['preset']}' with d = {d} conv weights, device {device}")

        stage(f"{n_angles} angles: DIP")
        model, net_input, recon, dip_summary = fit_or_load_dip("dip", sdir, data, opts, device, log)
        write_tiff(sdir / "reconstruction.tif", recon)
        dip_img = image_metrics(recon, gt)
        setting: dict[str, Any] = {"angles": n_angles, "angular_subsampling": ass, "c": c, "d": d,
                                   "image_shape": list(data.op.image_shape),
                                   "dip": dict(dip_summary, **dip_img), "methods": {}}
        run_exact, reason = exact_decision(opts["exact"], c, d, opts, device)
        setting["exact_reason"] = ("run: " if run_exact else "skipped: ") + reason
        log(f"{n_angles} angles: exact reference {'will run' if run_exact else 'skipped'} ({reason})")
        computed = False  # whether any method of this setting ran now (else its figures are current)
        for method in METHODS:
            stage(f"{n_angles} angles: {METHODS[method]}")
            mdir = sdir / method
            done = _method_done(mdir)
            if method == "linearised_exact" and not run_exact:
                setting["methods"][method] = {"status": "skipped", "reason": reason}
                continue
            if done is not None:
                log(f"skipping {METHODS[method]} for {n_angles} angles: finished in an earlier run "
                    f"({mdir / 'metrics.json'})")
                setting["methods"][method] = done
                continue
            t0 = time.perf_counter()
            computed = True
            if method == "mc_dropout":
                rec = run_mc_dropout(sdir, data, opts, device, log)
            else:
                rec = run_linearised(method, sdir, model, net_input, data, opts, log)
                rec["time_fit_s"] = dip_summary.get("time_s")
            s = rec["summary"]
            log(f"{METHODS[method]} ({n_angles} angles) done in {time.perf_counter() - t0:.1f} s: PSNR "
                f"{_fmt(rec['image']['psnr'], '.2f')} dB, marginal LL {_fmt(s['marginal_ll'], '.3f')}, 10×10 joint LL "
                f"{_fmt(s['joint_ll'].get('10'), '.3f')}, coverage@0.9 {s['coverage']['0.9']:.3f}")
            setting["methods"][method] = rec
        stage(f"{n_angles} angles: figures and table")
        finished = {m: r for m, r in setting["methods"].items() if r.get("status") != "skipped"}
        if not computed and all(p.is_file() for p in figure_paths(out, n_angles)):
            log(f"figures for {n_angles} angles are up to date (no method was recomputed): skipping them")
        else:
            make_figures(out, n_angles, sdir, gt, finished, log)
        results["settings"][str(n_angles)] = setting
        write_results(out, results)  # after every setting: partial results are readable while the next one runs
    log(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input, with the reason on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        opts = resolve_options(args)
        out = Path(args.out)
        command = shlex.join(["python", "scripts/walnut_study.py", *(sys.argv[1:] if argv is None else argv)])
        results = run_study(opts, args.data, out, command=command)
    except StudyError as exc:
        print(f"walnut_study: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(table_rows(results)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
