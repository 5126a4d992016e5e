"""The walnut uncertainty study: linearised DIP inference against MC dropout, for several angle counts of one scan.

For one scan and every angle count in ``opts["settings"]`` the study (:func:`run_study`) loads the 2D slice
problem (:func:`ctuq.data.load_slice` of its :class:`~ctuq.data.WalnutScan`), fits the DIP once
(:func:`ctuq.studies.fit_or_load_dip`) and runs the methods of :data:`METHODS`:

* **linearised (sampled)** and **linearised (exact)** (:func:`run_linearised`):
  :class:`ctuq.pipeline.uq.UQRun` around the fitted DIP with ``solver="cg"`` (sampled EM, dual Matheron
  samples) or ``solver="exact"`` (the exact reference, run when :func:`ctuq.studies.exact_decision` says it fits in
  memory); their mean is the DIP reconstruction;
* **linearised, TV-PredCP (exact)**: the exact route with the TV-PredCP block prior (``docs/tv_predcp.md``) in place
  of the g-prior, run and skipped with the exact reference;
* **MC dropout** (:func:`run_mc_dropout`): a second DIP with channel dropout, fitted with dropout active, then
  stochastic passes (:mod:`ctuq.reconstruct.mc_dropout`).

Each method is scored by :func:`ctuq.metrics.uq_summary` in the inner-square region of interest; the results go
to ``results.json`` / ``results.md`` (:func:`write_results`: one row per setting × method, :func:`table_rows`)
and four figures per setting (:func:`make_figures`). The command line is ``scripts/walnut_study.py``; the study
and a measured table are described in ``docs/walnut_study.md``. Images are in mm⁻¹ throughout.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from pathlib import Path
from typing import Any

import torch

from ctuq import figures
from ctuq.data import WalnutScan, load_slice
from ctuq.log import run_log
from ctuq.metrics import inner_square_roi, uq_summary, uq_summary_from_moments
from ctuq.metrics.image import image_metrics
from ctuq.models import build_unet, count_parameters
from ctuq.outputs import package_versions, voxel_size_of, write_metrics, write_tiff
from ctuq.pipeline.run_folder import LOG_NAME as LOG_FILE
from ctuq.pipeline.run_folder import UQ_MOMENTS_NAME, UQ_STATE_NAME
from ctuq.pipeline.uq import UQRun, UQSettings
from ctuq.reconstruct import mc_dropout_predict
from ctuq.registry import PRIORS
from ctuq.studies.common import (
    NEUTRAL_OPTIONS,
    Log,
    StudyError,
    angular_subsampling,
    check_study_folder,
    exact_decision,
    finish_method,
    fit_or_load_dip,
    method_done,
    prepare_scan,
    setting_dir,
    study_fingerprint,
)
from ctuq.utils import atomic_path, resolve_device

__all__ = [
    "METHODS",
    "DEFAULTS",
    "TINY",
    "NEUTRAL",
    "PUBLISHED_COLUMNS",
    "LOG_NAME",
    "run_linearised",
    "run_mc_dropout",
    "figure_paths",
    "make_figures",
    "table_rows",
    "markdown_table",
    "write_results",
    "run_study",
]

METHODS = {
    "linearised_sampled": "linearised (sampled)",
    "linearised_exact": "linearised (exact)",
    "linearised_tv_predcp": "linearised, TV-PredCP (exact)",
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
    "tv_predcp_steps": 100,  # most type-II MAP steps of the TV-PredCP row; it stops once converged (docs/tv_predcp.md)
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
    "tv_predcp_steps": 3,
    "rank": 32,
}

# Options that do not change the numbers: a rerun may change them freely.
NEUTRAL = NEUTRAL_OPTIONS | {"mc_batch"}
PUBLISHED_COLUMNS = 128  # detector columns of the published sparse 2D setting (768 / 6)
LOG_NAME = "walnut_study"  # prefix of the log lines and error messages


# ================================================================================================ methods
def run_linearised(method: str, sdir: Path, model, net_input, data, opts: dict, log: Log) -> dict:
    """Sampled (``solver="cg"``) or exact (``solver="exact"``) linearised inference around the fitted DIP.

    The one place that runs :class:`ctuq.pipeline.uq.UQRun` (and scores its streamed sample moments). It
    resumes from the posterior state and the running sums in ``sdir/method`` and deletes them once the method is
    finished.

    Parameters
    ----------
    method : {"linearised_sampled", "linearised_exact", "linearised_tv_predcp"}
        ``linearised_sampled``: g-prior ``opts["gprior"]``, preconditioned CG (rank ``opts["rank"]``), sampled EM
        (``em_steps`` × ``em_samples``), ``opts["samples"]`` samples; ``linearised_exact``: exact g-prior, exact
        EM (``exact_em_steps``, tol 1e-3), ``opts["exact_samples"]`` exact samples; ``linearised_tv_predcp``: as
        ``linearised_exact`` with the TV-PredCP block prior (at most ``opts["tv_predcp_steps"]`` type-II MAP steps,
        the other ``uq.tv_predcp`` settings at their defaults) instead of the g-prior.
    sdir : Path
        The setting's folder; the method writes into ``sdir/method``.
    model : ctuq.models.UNet
        The fitted DIP (its weights are the linearisation point); not modified.
    net_input : torch.Tensor
        ``(1, 1, H, W)`` its fixed input.
    data : ctuq.data.CTData
        ``op``, ``y`` and ``ground_truth`` (``(H, W)``, mm⁻¹) of the setting.
    opts : dict
        The study's options (also reads ``scale``, ``prior_precision``, ``seed``, ``progress``).
    log : Log
        Progress lines, prefixed with the method's label.

    Returns
    -------
    dict
        The method's record as stored in ``metrics.json``: ``image`` (PSNR, SSIM), ``summary``
        (:func:`ctuq.metrics.uq_summary` in the inner-square ROI), timings in seconds (``time_hyperparameters_s``,
        ``time_prediction_s``, ``time_other_s``, ``timings``), the learned ``a`` and ``sigma2``, solver ``stats``
        and ``settings``.
    """
    mdir = sdir / method
    mdir.mkdir(parents=True, exist_ok=True)
    if method == "linearised_sampled":
        settings = UQSettings(
            solver="cg",
            gprior={"method": opts["gprior"]},
            em_steps=opts["em_steps"],
            em_samples=opts["em_samples"],
            samples=opts["samples"],
            cg={"rank": opts["rank"]},
            prior_precision=opts["prior_precision"],
            sample_chunk=min(64, opts["samples"]),
        )
    else:
        settings = UQSettings(
            solver="exact",
            gprior={"method": "exact"},
            prior="tv_predcp" if method == "linearised_tv_predcp" else "gprior",
            tv_predcp=PRIORS["tv_predcp"].Options(steps=int(opts.get("tv_predcp_steps", DEFAULTS["tv_predcp_steps"]))),
            em_steps=opts["exact_em_steps"],
            em_tol=1e-3,
            em_samples=opts["em_samples"],
            samples=opts["exact_samples"],
            cg={"rank": opts["rank"]},
            prior_precision=opts["prior_precision"],
            sample_chunk=min(256, opts["exact_samples"]),
        )
    resumed = (mdir / UQ_STATE_NAME).is_file()
    if resumed:
        log(f"{METHODS[method]}: resuming from {mdir / UQ_STATE_NAME} (its timings then cover this run only)")
    res = UQRun(
        model,
        net_input,
        data.op,
        data.y,
        scale=opts["scale"],
        settings=settings,
        seed=opts["seed"],
        work_dir=mdir,
        resume=True,
        progress=opts["progress"],
        log=lambda m: log(f"  {METHODS[method]}: {m}"),
    ).run()
    gt = data.ground_truth.detach().cpu()
    summary = uq_summary_from_moments(gt, res.mean, res.moments)  # settings.roi: the inner square
    t = res.timings
    record = {
        "method": METHODS[method],
        "solver": res.solver,
        "route": res.stats.get("route"),
        "resumed": resumed,
        "n_samples": res.n_samples,
        "image": image_metrics(res.mean, gt),
        "summary": summary,
        "time_hyperparameters_s": t.get(PRIORS[settings.prior].timing_key, 0.0)
        + t.get("solver_setup", 0.0)
        + t.get("em", 0.0),
        "time_prediction_s": t.get("prediction", 0.0),
        # tracing the linearisation (paid at the first JVP, in the offset phase) and the offset δ itself
        "time_other_s": t.get("linearize", 0.0) + t.get("route", 0.0) + t.get("offset", 0.0),
        "timings": t,
        "products": res.products,
        "a": res.a,
        "sigma2": res.sigma2,
        "em_steps": len(res.em_trace),
        "stats": res.stats,
        "settings": {
            "solver": settings.solver,
            "prior": settings.prior,
            "gprior_method": settings.gprior.method,  # the record's name of uq.gprior.method
            **{k: getattr(settings, k) for k in ("em_steps", "em_samples", "samples")},
            "rank": settings.cg.rank,  # the record's name of uq.cg.rank
            **{k: getattr(settings, k) for k in ("prior_precision", "learn_noise")},
        },
    }
    out = finish_method(mdir, res.mean, res.std, record)
    # The running sums and the solver state only serve a resume; they are large (the exact Q is c × r float64).
    (mdir / UQ_MOMENTS_NAME).unlink(missing_ok=True)
    (mdir / UQ_STATE_NAME).unlink(missing_ok=True)
    return out


def run_mc_dropout(sdir: Path, data, opts: dict, device: torch.device, log: Log) -> dict:
    """Fit (or load) the dropout DIP, run the stochastic passes, score them.

    Parameters
    ----------
    sdir : Path
        The setting's folder; the method writes into ``sdir/mc_dropout`` (its own ``dip_model.pt`` included).
    data : ctuq.data.CTData
        ``op``, ``y`` and ``ground_truth`` (``(H, W)``, mm⁻¹) of the setting.
    opts : dict
        The study's options (reads the DIP options of :func:`ctuq.studies.fit_or_load_dip`, ``mc_passes``,
        ``mc_batch``, ``scale``, ``seed``, ``progress``).
    device : torch.device
        Where the network is fitted and evaluated.
    log : Log
        Progress lines.

    Returns
    -------
    dict
        The record as stored in ``metrics.json``: ``image`` (of the passes' mean), ``image_dropout_off``,
        ``summary`` (scored with ``centering="empirical"``), ``time_prediction_s`` and ``time_fit_s`` (seconds),
        the fit's summary and the prediction's.
    """
    mdir = sdir / "mc_dropout"
    model, net_input, recon_det, fit = fit_or_load_dip("mc_dropout", sdir, data, opts, device, log)
    log(f"MC dropout: {opts['mc_passes']} stochastic passes")
    pred = mc_dropout_predict(
        model,
        net_input,
        opts["mc_passes"],
        scale=opts["scale"],
        seed=opts["seed"],
        batch=opts["mc_batch"],
        progress=opts["progress"],
    )
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
    return finish_method(mdir, pred.mean, pred.std, record)


def figure_paths(out: Path, n_angles: int) -> list[Path]:
    """The four figures of one setting: ``out/{uq,joint_ll,calibration,error_vs_std}_<n_angles>.png``."""
    return [out / f"{kind}_{n_angles}.png" for kind in ("uq", "joint_ll", "calibration", "error_vs_std")]


def make_figures(out: Path, n_angles: int, sdir: Path, gt: torch.Tensor, records: dict, log: Log) -> list[Path]:
    """The four comparison figures of one setting from the finished methods' ``result.pt`` and metrics.

    Parameters
    ----------
    out : Path
        The study folder (the figures go there, see :func:`figure_paths`).
    n_angles : int
        The setting.
    sdir : Path
        The setting's folder (reads ``sdir/<method>/result.pt``).
    gt : torch.Tensor
        ``(H, W)`` ground truth, mm⁻¹, on the CPU.
    records : dict
        Method key → record (``summary`` used) of the finished methods only.
    log : Log
        Names the figures written.

    Returns
    -------
    list of Path
        The figures, in :func:`figure_paths` order.
    """
    roi = inner_square_roi(tuple(gt.shape))
    maps = {}
    for method, _rec in records.items():
        saved = torch.load(sdir / method / "result.pt", map_location="cpu", weights_only=True)
        maps[METHODS[method]] = (saved["mean"], (saved["mean"] - gt).abs(), saved["std"])
    names = {METHODS[m]: r for m, r in records.items()}
    paths = [
        figures.plot_uq_comparison(out / f"uq_{n_angles}.png", maps, ground_truth=gt, roi=roi),
        figures.plot_joint_ll(
            out / f"joint_ll_{n_angles}.png",
            {n: r["summary"]["joint_ll"] for n, r in names.items()},
            title=f"{n_angles} angles",
        ),
        figures.plot_calibration(
            out / f"calibration_{n_angles}.png",
            {
                n: (r["summary"]["calibration"]["levels"], r["summary"]["calibration"]["coverage"])
                for n, r in names.items()
            },
            title=f"{n_angles} angles",
        ),
        figures.plot_error_vs_std(
            out / f"error_vs_std_{n_angles}.png", {n: (m[1], m[2]) for n, m in maps.items()}, roi=roi
        ),
    ]
    log(f"figures for {n_angles} angles: {', '.join(p.name for p in paths)}")
    return paths


# ================================================================================================ table
def table_rows(results: dict) -> list[dict]:
    """One row per (setting, method) in setting order, methods in :data:`METHODS` order (skipped ones included).

    Parameters
    ----------
    results : dict
        The study's results (:func:`run_study`), ``settings`` holding each setting's ``methods`` records.

    Returns
    -------
    list of dict
        ``setting``, ``method``, ``label``, ``status`` (``"done"`` or ``"skipped"`` with a ``reason``) and, when
        done, ``psnr`` (dB), ``marginal_ll`` and ``joint_ll_10`` (nats per pixel), ``coverage_90``, the times in
        seconds (``time_hyperparameters_s``, ``time_prediction_s``, ``time_fit_s``) and ``n_samples``.
    """
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
                row.update(
                    {
                        "status": "done",
                        "psnr": rec["image"]["psnr"],
                        "marginal_ll": s["marginal_ll"],
                        "joint_ll_10": s["joint_ll"].get("10"),
                        "coverage_90": s["coverage"]["0.9"],
                        "time_hyperparameters_s": rec.get("time_hyperparameters_s"),
                        "time_prediction_s": rec.get("time_prediction_s"),
                        "time_fit_s": rec.get("time_fit_s", setting["dip"].get("time_s")),
                        "n_samples": rec["n_samples"],
                    }
                )
            rows.append(row)
    return rows


def _fmt(v, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return format(v, spec)


def markdown_table(rows: list[dict]) -> str:
    """The Markdown table (with its header) of the rows of :func:`table_rows`; missing numbers show as "—"."""
    head = (
        "| angles | method | PSNR (dB) | marginal LL | 10×10 joint LL | coverage@0.9 | hyperparameters (s) "
        "| prediction (s) | samples | fit (s) |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r["status"] != "done":
            lines.append(f"| {r['setting']} | {r['label']} | not run: {r['reason']} |  |  |  |  |  |  |  |")
            continue
        lines.append(
            f"| {r['setting']} | {r['label']} | {_fmt(r['psnr'], '.2f')} | {_fmt(r['marginal_ll'], '.3f')} "
            f"| {_fmt(r['joint_ll_10'], '.3f')} | {_fmt(r['coverage_90'], '.3f')} "
            f"| {_fmt(r['time_hyperparameters_s'], '.1f')} | {_fmt(r['time_prediction_s'], '.1f')} "
            f"| {r['n_samples']} | {_fmt(r['time_fit_s'], '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def write_results(out: Path, results: dict) -> None:
    """Write ``out/results.json`` (everything, plus the ``table`` rows) and ``out/results.md`` (the table with its
    notes), each atomically.

    Parameters
    ----------
    out : Path
        The study folder.
    results : dict
        The study's results as built by :func:`run_study` (``created``, ``command``, ``device``, ``data``,
        ``options``, ``settings``, ``versions``).
    """
    rows = table_rows(results)
    results = dict(results, table=rows)
    write_metrics(out / "results.json", results)
    info = []
    for key, s in results["settings"].items():
        info.append(
            f"- {key} angles: c = {s['c']}, d = {s['d']} conv weights (dropout net: same d), "
            f"image {s['image_shape'][0]}×{s['image_shape'][1]}, "
            f"DIP PSNR {_fmt(s['dip'].get('psnr'), '.2f')} dB, "
            f"exact reference: {s['exact_reason']}"
        )
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
        "methods share one DIP; MC dropout fits its own dropout network).\n\n" + "\n".join(info) + "\n"
    )
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text(text)


# ================================================================================================ study
def run_study(opts: dict, data_arg: str | None, out: Path, log: Log | None = None, command: str = "") -> dict:
    """Run (or resume) the walnut study described by ``opts`` into ``out``.

    Parameters
    ----------
    opts : dict
        Resolved and validated options: every key of :data:`DEFAULTS` (``exact_samples`` set) plus ``device``
        (``"auto"``, ``"cpu"``, ``"cuda"``), ``threads`` (torch CPU threads for the study only, restored
        afterwards so a caller's process keeps its own setting; ``None``: unchanged), ``tiny`` and ``progress``.
    data_arg : str or None
        The ``--data`` scan folder; ``None`` simulates one into ``out/scan``.
    out : Path
        The study folder (created; a rerun resumes in it, refusing other options). Its ``ctuq.log`` gets every
        log line of the study, appended by a rerun.
    log : Log, optional
        Progress lines (default: a :class:`~ctuq.studies.Log` named ``walnut_study``).
    command : str
        The command line that ran the study, recorded in the outputs.

    Returns
    -------
    dict
        The results, as written to ``results.json`` by :func:`write_results` (without the ``table`` rows).

    Raises
    ------
    StudyError
        Bad input (scan, angle counts, no ground truth) or a folder holding another study.
    """
    threads = torch.get_num_threads()
    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    try:
        with run_log(out / LOG_FILE):
            return _run_study(opts, data_arg, out, log or Log(LOG_NAME), command)
    finally:
        torch.set_num_threads(threads)


def _run_study(opts: dict, data_arg: str | None, out: Path, log: Log, command: str) -> dict:
    device = resolve_device(opts["device"])
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = study_fingerprint(
        opts, str(Path(data_arg).expanduser().resolve()) if data_arg else "simulated", NEUTRAL
    )
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
        "data": {
            "path": str(path),
            "kind": "given with --data" if data_arg else f"simulated ({opts['scan_preset']})",
            "projection_files": scan.n_files,
            "detector_columns": det_cols,
            "detector_subsampling": dsub,
        },
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
        sdir = setting_dir(out, n_angles)
        sdir.mkdir(parents=True, exist_ok=True)
        stage(
            f"setting {i + 1}/{len(plans)}: {n_angles} angles (angular subsampling {ass} of "
            f"{scan.n_files - 1}), loading"
        )
        data = load_slice(
            scan,
            slice_index=opts["slice_index"],
            angular_subsampling=ass,
            detector_subsampling=dsub,
            image_shape=None if opts["image_shape"] is None else tuple(opts["image_shape"]),
            backend=opts["backend"],
            device=device,
            progress=opts["progress"],
        )
        if data.ground_truth is None:
            raise StudyError(
                f"{path} has no ground truth (Reconstructions/full_AGD_50_*.tiff): the study's metrics need one"
            )
        gt = data.ground_truth.detach().cpu().float()
        write_tiff(sdir / "ground_truth.tif", gt, voxel_size=voxel_size_of(data.op))
        c = int(data.op.c)
        d = count_parameters(build_unet(opts["preset"], ndim=data.op.ndim), conv_weights_only=True)
        log(
            f"{n_angles} angles: sinogram {tuple(data.op.measurement_shape)} (c = {c}), image "
            f"{tuple(data.op.image_shape)}, U-Net '{opts['preset']}' with d = {d} conv weights, device {device}"
        )

        stage(f"{n_angles} angles: DIP")
        model, net_input, recon, dip_summary = fit_or_load_dip("dip", sdir, data, opts, device, log)
        write_tiff(sdir / "reconstruction.tif", recon, voxel_size=voxel_size_of(data.op))
        dip_img = image_metrics(recon, gt)
        setting: dict[str, Any] = {
            "angles": n_angles,
            "angular_subsampling": ass,
            "c": c,
            "d": d,
            "image_shape": list(data.op.image_shape),
            "dip": dict(dip_summary, **dip_img),
            "methods": {},
        }
        run_exact, reason = exact_decision(opts["exact"], c, d, opts, device)
        setting["exact_reason"] = ("run: " if run_exact else "skipped: ") + reason
        log(f"{n_angles} angles: exact reference {'will run' if run_exact else 'skipped'} ({reason})")
        computed = False  # whether any method of this setting ran now (else its figures are current)
        for method in METHODS:
            stage(f"{n_angles} angles: {METHODS[method]}")
            mdir = sdir / method
            done = method_done(mdir)
            if method in ("linearised_exact", "linearised_tv_predcp") and not run_exact:
                setting["methods"][method] = {"status": "skipped", "reason": reason}
                continue
            if done is not None:
                log(
                    f"skipping {METHODS[method]} for {n_angles} angles: finished in an earlier run "
                    f"({mdir / 'metrics.json'})"
                )
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
            log(
                f"{METHODS[method]} ({n_angles} angles) done in {time.perf_counter() - t0:.1f} s: PSNR "
                f"{_fmt(rec['image']['psnr'], '.2f')} dB, marginal LL {_fmt(s['marginal_ll'], '.3f')}, 10×10 joint LL "
                f"{_fmt(s['joint_ll'].get('10'), '.3f')}, coverage@0.9 {s['coverage']['0.9']:.3f}"
            )
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
