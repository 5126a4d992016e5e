"""The walnut uncertainty study: linearised DIP inference against MC dropout, for several angle counts of one scan.

For one scan and every angle count in ``options.settings`` (:class:`WalnutOptions`) the study (:func:`run_study`)
works through the public API, every step a run folder in the setting's folder ``angles_<N>/``:

* **DIP** (``dip/``): :func:`ctuq.reconstruct` with ``uq=False`` on the 2D slice problem (:func:`run_settings`:
  the bundled ``demo`` config with the study's scan, subsampling, U-Net and fit);
* **linearised (sampled)** and **linearised (exact)** (:func:`run_linearised`): :func:`ctuq.uncertainty` on that
  run with ``uq.solver = cg`` (sampled EM, dual Matheron samples) or ``exact`` (the exact reference, run when
  :func:`ctuq.studies.exact_decision` says it fits in memory), :func:`uq_settings`; their mean is the DIP
  reconstruction;
* **linearised, TV-PredCP (exact)**: the exact route with the TV-PredCP block prior (``docs/tv_predcp.md``) in place
  of the g-prior, run and skipped with the exact reference;
* **MC dropout** (:func:`run_mc_dropout`): :func:`ctuq.reconstruct` of a second DIP with channel dropout
  (``model.dropout``), fitted with dropout active, then stochastic passes (``uq.method = mc_dropout``,
  :mod:`ctuq.pipeline.mc_dropout_phase`).

Every call passes ``resume=True, reuse=True``: a finished run is loaded, an interrupted one continues from its
checkpoints, so a rerun of the same command (after a kill, too) computes only what is missing; the run folders are
the study's only state besides ``study.json`` (its options, :func:`ctuq.studies.check_study_folder`). Each method is
scored by :func:`ctuq.metrics.uq_summary` in the inner-square region of interest (the runs' own scores); the
results go to ``results.json`` / ``results.md`` (:func:`write_results`: one row per setting × method,
:func:`table_rows`) and four figures per setting (:func:`make_figures`). The command line is
``scripts/walnut_study.py``; the study and a measured table are described in ``docs/walnut_study.md``. Images are
in mm⁻¹ throughout.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import time
from pathlib import Path
from typing import Any

import torch

from ctuq import figures
from ctuq.config import UQConfig
from ctuq.data import WalnutScan
from ctuq.log import run_log
from ctuq.metrics import inner_square_roi
from ctuq.outputs import package_versions, write_metrics, write_tiff
from ctuq.pipeline.run_folder import LOG_NAME as LOG_FILE
from ctuq.pipeline.run_folder import METRICS_NAME, UQ_STATE_NAME
from ctuq.registry import PRIORS

# the public API (ctuq.reconstruct, ctuq.uncertainty, ctuq.Run), imported from its home module
from ctuq.run import Run, reconstruct, uncertainty
from ctuq.studies.common import (
    NEUTRAL_OPTIONS,
    Log,
    StudyError,
    angular_subsampling,
    check_study_folder,
    exact_decision,
    prepare_scan,
    setting_dir,
    study_fingerprint,
)
from ctuq.studies.study_options import freeze, option, plain
from ctuq.utils import atomic_path, resolve_device

__all__ = [
    "METHODS",
    "WalnutOptions",
    "run_settings",
    "uq_settings",
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


@dataclasses.dataclass(frozen=True)
class WalnutOptions:
    """The options of one walnut study (``scripts/walnut_study.py`` builds them from its flags: explicit flags, then
    ``--tiny`` (:data:`TINY`), then these defaults (:data:`DEFAULTS`): the CPU demo (``ctuq/configs/demo.yaml``:
    tiny U-Net, lr 3e-3, TV 1e-4, 2500 iterations, ×14) on the bundled-size simulated walnut, 60 and 120 angles,
    with the published inference settings (EM 5 × 16, rank 400, 1024 passes)). Every field but :data:`NEUTRAL`
    changes numbers, so ``study.json`` records them and a rerun in the same folder must keep them (``settings`` may
    grow)."""

    scan_preset: str = option("bundled", help="simulation preset when --data is not given (bundled, tiny, walnut)")
    settings: tuple[int, ...] = option((60, 120), help="angle counts, each dividing the scan's distinct angles")
    preset: str = option("tiny", help="U-Net preset")
    iterations: int = option(2500, help="DIP iterations")
    lr: float = option(3e-3, help="Adam learning rate")
    tv_weight: float = option(1e-4, help="TV weight")
    clip_grad_norm: float = option(1.0, help="gradient-norm clip, 0 disables")
    scale: float = option(14.0, help="data/image scale of the DIP")
    input_std: float = option(0.1, help="std of the fixed noise input")
    image_shape: tuple[int, int] | None = option(None, help="reconstruction grid (None: the ground-truth grid)")
    detector_subsampling: int | None = option(
        None, help="keep every K-th detector column (None: about 128 columns remain, the published setting)"
    )
    orbit: int = option(2, help="source orbit (1, 2, 3)")
    slice_index: int | None = option(None, help="ground-truth slice (None: the central one)")
    backend: str = option("auto", help="ray transform (auto, sparse, astra_cuda)")
    samples: int = option(256, help="prediction samples of the linearised methods")
    exact_samples: int | None = option(None, help="prediction samples of the exact reference (None: samples)")
    mc_passes: int = option(1024, help="stochastic forward passes of MC dropout")
    mc_batch: int = option(32, help="MC-dropout passes per forward call")
    dropout: float = option(0.05, help="MC dropout's rate after every conv block")
    em_steps: int = option(5, help="sampled-EM steps")
    em_samples: int = option(16, help="samples per sampled-EM step")
    exact_em_steps: int = option(50, help="EM steps of the exact reference (tol 1e-3)")
    # most type-II MAP steps of the TV-PredCP row; it stops once converged (docs/tv_predcp.md)
    tv_predcp_steps: int = option(100, help="most type-II MAP steps of the TV-PredCP row")
    rank: int = option(400, help="CG preconditioner rank")
    gprior: str = option("exact", help="g-prior scales of the sampled method: exact (c VJPs) or stochastic")
    prior_precision: float = option(100.0, help="initial prior precision a")
    exact: str = option("auto", help="run the exact reference: auto = when its memory estimate fits the device")
    seed: int = option(0, help="seed of inputs, weights, dropout and samples")
    device: str = option("auto", help="auto, cpu or cuda")
    threads: int | None = option(None, help="torch CPU threads for the study (None: unchanged)")
    tiny: bool = option(False, help="the test size (TINY)")
    progress: bool = option(True, help="progress bars")

    def __post_init__(self) -> None:
        freeze(self)

    def resolved(self) -> WalnutOptions:
        """These options with ``exact_samples`` set (``None`` means ``samples``)."""
        return self if self.exact_samples is not None else dataclasses.replace(self, exact_samples=self.samples)

    def validate(self) -> None:
        """One-line :class:`~ctuq.studies.StudyError` for an invalid option (named as its command-line flag)."""
        o = self.resolved()

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise StudyError(what)

        def flag(key: str) -> str:
            return "--" + key.replace("_", "-")

        need(
            len(o.settings) > 0 and min(o.settings) >= 1,
            f"--settings: angle counts must be >= 1, got {list(o.settings)}",
        )
        need(len(set(o.settings)) == len(o.settings), f"--settings: repeated angle count in {list(o.settings)}")
        for key in ("iterations", "samples", "exact_samples", "mc_passes", "em_samples", "rank", "mc_batch"):
            need(getattr(o, key) >= 1, f"{flag(key)} must be >= 1, got {getattr(o, key)}")
        for key in ("samples", "exact_samples", "mc_passes"):
            need(getattr(o, key) >= 2, f"{flag(key)} must be >= 2 (a std needs two samples), got {getattr(o, key)}")
        for key in ("em_steps", "exact_em_steps"):
            need(getattr(o, key) >= 0, f"{flag(key)} must be >= 0, got {getattr(o, key)}")
        for key in ("lr", "scale", "input_std", "prior_precision"):
            v = getattr(o, key)
            need(v > 0 and math.isfinite(v), f"{flag(key)} must be positive, got {v}")
        need(o.tv_weight >= 0, f"--tv-weight must be >= 0, got {o.tv_weight}")
        need(o.clip_grad_norm >= 0, f"--clip-grad-norm must be >= 0, got {o.clip_grad_norm}")
        need(0.0 < o.dropout < 1.0, f"--dropout must lie in (0, 1), got {o.dropout}")
        need(o.seed >= 0, f"--seed must be >= 0, got {o.seed}")
        need(o.threads is None or o.threads >= 1, f"--threads must be >= 1, got {o.threads}")
        if o.image_shape is not None:
            need(min(o.image_shape) >= 4, f"--image-shape must be at least 4 × 4, got {list(o.image_shape)}")
        if o.detector_subsampling is not None:
            need(o.detector_subsampling >= 1, f"--detector-subsampling must be >= 1, got {o.detector_subsampling}")


DEFAULTS = WalnutOptions()

# --tiny: the end-to-end test's size (tiny simulated scan, 32² grid, a few iterations and samples; seconds).
TINY = dataclasses.replace(
    DEFAULTS,
    scan_preset="tiny",
    settings=(4, 8),
    image_shape=(32, 32),
    detector_subsampling=4,
    iterations=20,
    samples=8,
    exact_samples=16,
    mc_passes=16,
    em_steps=2,
    em_samples=4,
    exact_em_steps=10,
    tv_predcp_steps=3,
    rank=32,
    tiny=True,
)

# Options that do not change the numbers: a rerun may change them freely.
NEUTRAL = NEUTRAL_OPTIONS | {"mc_batch"}
PUBLISHED_COLUMNS = 128  # detector columns of the published sparse 2D setting (768 / 6)
LOG_NAME = "walnut_study"  # prefix of the log lines and error messages


# ================================================================================================ methods
def run_settings(options: WalnutOptions, scan: Path, angular_subsampling: int, detector_subsampling: int) -> dict:
    """The config overrides (on the bundled ``demo`` config) of one setting's DIP run: the scan and its subsampling,
    the U-Net and the fit of ``options``; no TV baseline, no figures, the fitted network kept (``dip_model.pt``).
    The fit checkpoints every ``max(50, iterations // 10)`` iterations."""
    return {
        "data.path": str(scan),
        "data.ndim": 2,
        "data.orbit": options.orbit,
        "data.slice_index": options.slice_index,
        "data.angular_subsampling": angular_subsampling,
        "data.detector_subsampling": detector_subsampling,
        "data.image_shape": None if options.image_shape is None else list(options.image_shape),
        "data.backend": options.backend,
        "data.min_angles": 1,
        "model.preset": options.preset,
        "model.input": "noise",
        "model.input_std": options.input_std,
        "model.pretrained": None,
        "dip.iterations": options.iterations,
        "dip.lr": options.lr,
        "dip.tv_weight": options.tv_weight,
        "dip.clip_grad_norm": options.clip_grad_norm,
        "dip.scale": options.scale,
        "dip.checkpoint_every": max(50, options.iterations // 10),
        "tv.enabled": False,
        "output.figure": False,
        "output.save_model": True,
        "seed": options.seed,
        "device": options.device,
    }


def uq_settings(method: str, options: WalnutOptions) -> dict:
    """The ``uq`` overrides of one linearised method (``ctuq uq RUN --set ...``).

    ``linearised_sampled``: g-prior ``options.gprior``, preconditioned CG (rank ``options.rank``), sampled EM
    (``em_steps`` × ``em_samples``), ``options.samples`` samples; ``linearised_exact``: exact g-prior, exact EM
    (``exact_em_steps``, tol 1e-3), ``options.exact_samples`` exact samples; ``linearised_tv_predcp``: as
    ``linearised_exact`` with the TV-PredCP block prior (at most ``options.tv_predcp_steps`` type-II MAP steps, the
    other ``uq.tv_predcp`` settings at their defaults) instead of the g-prior. All: homoscedastic noise learned by
    the EM, initial ``a`` ``options.prior_precision``, no recalibration of the std map.
    """
    common = {
        "uq.method": "linearised",
        "uq.noise": "homoscedastic",
        "uq.learn_noise": True,
        "uq.calibration": "none",
        "uq.roi": "inner_square",
        "uq.prior_precision": options.prior_precision,
        "uq.em_samples": options.em_samples,
        "uq.cg.rank": options.rank,
    }
    if method == "linearised_sampled":
        return {
            **common,
            "uq.prior": "gprior",
            "uq.solver": "cg",
            "uq.gprior.method": options.gprior,
            "uq.em_steps": options.em_steps,
            "uq.em_tol": UQConfig().em_tol,
            "uq.samples": options.samples,
            "uq.sample_chunk": min(64, options.samples),
        }
    return {
        **common,
        "uq.prior": "tv_predcp" if method == "linearised_tv_predcp" else "gprior",
        "uq.solver": "exact",
        "uq.gprior.method": "exact",
        "uq.tv_predcp.steps": options.tv_predcp_steps,
        "uq.em_steps": options.exact_em_steps,
        "uq.em_tol": 1e-3,
        "uq.samples": options.exact_samples,
        "uq.sample_chunk": min(256, options.exact_samples),
    }


def _image(metrics: dict, key: str = "dip") -> dict:
    """PSNR (dB) and SSIM of the run's ``key`` reconstruction against the ground truth (``metrics.json``)."""
    return {"psnr": metrics["psnr"][key], "ssim": metrics["ssim"][key]}


def run_linearised(method: str, dip: Run, sdir: Path, options: WalnutOptions, log: Log) -> tuple[Run, dict]:
    """Sampled (``solver="cg"``) or exact (``solver="exact"``) linearised inference around the setting's DIP run.

    :func:`ctuq.uncertainty` on the DIP run with :func:`uq_settings`, into the run folder ``sdir/method`` with
    ``resume=True, reuse=True``: a finished run there is loaded, an interrupted inference continues from its
    checkpoint (``uq_state.pt`` and the running sums).

    Parameters
    ----------
    method : {"linearised_sampled", "linearised_exact", "linearised_tv_predcp"}
        See :func:`uq_settings`.
    dip : ctuq.Run
        The setting's DIP run (its weights are the linearisation point; left as it is).
    sdir : Path
        The setting's folder.
    options : WalnutOptions
        The study's options (also reads ``progress``).
    log : Log
        Progress lines, prefixed with the method's label.

    Returns
    -------
    (ctuq.Run, dict)
        The method's run and its record: ``image`` (PSNR, SSIM of the mean, the DIP), ``summary``
        (:func:`ctuq.metrics.uq_summary` in the inner-square ROI), timings in seconds (``time_hyperparameters_s``,
        ``time_prediction_s``, ``time_other_s``, ``timings``), the learned ``a`` and ``sigma2``, solver ``stats``
        and ``settings``.
    """
    mdir = sdir / method
    settings = uq_settings(method, options)
    # an interrupted inference: its checkpoint is there, its metrics.json (written last) is not
    resumed = (mdir / UQ_STATE_NAME).is_file() and not (mdir / METRICS_NAME).is_file()
    if resumed:
        log(f"{METHODS[method]}: resuming from {mdir / UQ_STATE_NAME} (its timings then cover this run only)")
    run = uncertainty(dip, set=settings, out=mdir, resume=True, reuse=True, progress=options.progress)
    m = run.metrics
    uq, t = m["uq"], m["uq"]["timings"]
    prior = settings["uq.prior"]
    record = {
        "method": METHODS[method],
        "solver": uq["solver"],
        "route": uq["stats"].get("route"),
        "resumed": resumed,
        "n_samples": uq["n_samples"],
        "image": _image(m),
        "summary": {k: v for k, v in uq["summary"].items() if k != "localisation"},
        "time_hyperparameters_s": t.get(PRIORS[prior].timing_key, 0.0) + t.get("solver_setup", 0.0) + t.get("em", 0.0),
        "time_prediction_s": t.get("prediction", 0.0),
        # tracing the linearisation (paid at the first JVP, in the offset phase) and the offset δ itself
        "time_other_s": t.get("linearize", 0.0) + t.get("route", 0.0) + t.get("offset", 0.0),
        "timings": t,
        "products": uq["products"],
        "a": uq["a"],
        "sigma2": uq["sigma2"],
        "em_steps": len(m.get("em_trace", [])),
        "stats": uq["stats"],
        "settings": {
            "solver": settings["uq.solver"],
            "prior": prior,
            "gprior_method": settings["uq.gprior.method"],  # the record's name of uq.gprior.method
            "em_steps": settings["uq.em_steps"],
            "em_samples": settings["uq.em_samples"],
            "samples": settings["uq.samples"],
            "rank": settings["uq.cg.rank"],  # the record's name of uq.cg.rank
            "prior_precision": settings["uq.prior_precision"],
            "learn_noise": settings["uq.learn_noise"],
        },
    }
    return run, record


def run_mc_dropout(sdir: Path, dip_settings: dict, options: WalnutOptions, log: Log) -> tuple[Run, dict]:
    """MC dropout: a DIP with channel dropout fitted with dropout active, then stochastic passes, scored.

    :func:`ctuq.reconstruct` with the setting's DIP overrides plus ``model.dropout = options.dropout`` and
    ``uq.method = mc_dropout`` (``options.mc_passes`` passes, ``options.mc_batch`` per forward call), into the run
    folder ``sdir/mc_dropout`` with ``resume=True, reuse=True``.

    Returns
    -------
    (ctuq.Run, dict)
        The run and its record: ``image`` (of the passes' mean), ``image_dropout_off``, ``summary`` (scored with
        ``centering="empirical"``), ``time_prediction_s`` and ``time_fit_s`` (seconds), the fit's summary and the
        prediction's.
    """
    settings = {
        **dip_settings,
        "model.dropout": options.dropout,
        "uq.method": "mc_dropout",
        "uq.samples": options.mc_passes,
        "uq.sample_chunk": options.mc_batch,
        "uq.calibration": "none",
        "uq.roi": "inner_square",
    }
    log(f"MC dropout (p = {options.dropout}): {options.iterations} DIP iterations, {options.mc_passes} passes")
    run = reconstruct(
        None, "demo", settings, out=sdir / "mc_dropout", resume=True, reuse=True, progress=options.progress
    )
    m = run.metrics
    uq = m["uq"]
    record = {
        "method": METHODS["mc_dropout"],
        "n_samples": uq["n_samples"],
        "image": uq["mean_metrics"],
        "image_dropout_off": _image(m),
        "summary": uq["summary"],
        "time_hyperparameters_s": None,  # nothing is learned: the dropout rate is fixed
        "time_prediction_s": uq["timings"]["prediction"],
        "time_fit_s": m["dip"].get("time_s"),
        "fit": {k: v for k, v in m["dip"].items() if k != "n_parameters"},
        "prediction": uq["prediction"],
    }
    return run, record


def figure_paths(out: Path, n_angles: int) -> list[Path]:
    """The four figures of one setting: ``out/{uq,joint_ll,calibration,error_vs_std}_<n_angles>.png``."""
    return [out / f"{kind}_{n_angles}.png" for kind in ("uq", "joint_ll", "calibration", "error_vs_std")]


def make_figures(out: Path, n_angles: int, gt: torch.Tensor, runs: dict, records: dict, log: Log) -> list[Path]:
    """The four comparison figures of one setting from the finished methods' runs and records.

    Parameters
    ----------
    out : Path
        The study folder (the figures go there, see :func:`figure_paths`).
    n_angles : int
        The setting.
    gt : torch.Tensor
        ``(H, W)`` ground truth, mm⁻¹, on the CPU.
    runs : dict
        Method key → :class:`ctuq.Run` of the finished methods (``Run.mean``, ``Run.std`` used).
    records : dict
        Method key → record (``summary`` used) of the same methods.
    log : Log
        Names the figures written.

    Returns
    -------
    list of Path
        The figures, in :func:`figure_paths` order.
    """
    roi = inner_square_roi(tuple(gt.shape))
    maps = {}
    for method, run in runs.items():
        mean, std = torch.from_numpy(run.mean), torch.from_numpy(run.std)
        maps[METHODS[method]] = (mean, (mean - gt).abs(), std)
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
def run_study(
    options: WalnutOptions, data_arg: str | None, out: Path, log: Log | None = None, command: str = ""
) -> dict:
    """Run (or resume) the walnut study described by ``options`` into ``out``.

    Parameters
    ----------
    options : WalnutOptions
        The study's options (validated here; ``exact_samples`` ``None`` means ``samples``). ``threads`` sets the
        torch CPU threads for the study only, restored afterwards so a caller's process keeps its own setting.
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
    options = options.resolved()
    options.validate()
    threads = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    try:
        with run_log(out / LOG_FILE):
            return _run_study(options, data_arg, out, log or Log(LOG_NAME), command)
    finally:
        torch.set_num_threads(threads)


def _run_study(options: WalnutOptions, data_arg: str | None, out: Path, log: Log, command: str) -> dict:
    device = resolve_device(options.device)
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = study_fingerprint(
        plain(options), str(Path(data_arg).expanduser().resolve()) if data_arg else "simulated", NEUTRAL
    )
    check_study_folder(out, fingerprint, log)
    path = prepare_scan(options, data_arg, out, log)
    try:
        scan = WalnutScan(path, options.orbit)
    except Exception as exc:  # noqa: BLE001 - the loader's message names the file; say which option led there
        raise StudyError(f"cannot read the scan {path}: {exc}") from exc
    det_cols = scan.det_shape[1]
    dsub = options.detector_subsampling or max(1, round(det_cols / PUBLISHED_COLUMNS))
    plans = [(n, angular_subsampling(scan.n_files, n, path)) for n in options.settings]  # fail before any work
    results: dict[str, Any] = {
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "device": str(device),
        "data": {
            "path": str(path),
            "kind": "given with --data" if data_arg else f"simulated ({options.scan_preset})",
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
        dip_settings = run_settings(options, path.resolve(), ass, dsub)
        stage(f"{n_angles} angles: DIP")
        dip = reconstruct(
            None, "demo", dip_settings, out=sdir / "dip", uq=False, resume=True, reuse=True, progress=options.progress
        )
        if dip.reused:
            log(f"skipping the DIP fit for {n_angles} angles: finished in an earlier run ({dip.path})")
        m = dip.metrics
        if dip.ground_truth is None:
            raise StudyError(
                f"{path} has no ground truth (Reconstructions/full_AGD_50_*.tiff): the study's metrics need one"
            )
        gt = torch.from_numpy(dip.ground_truth)
        voxel = m["data"]["voxel_size_mm"]
        write_tiff(sdir / "ground_truth.tif", gt, voxel_size=voxel)
        write_tiff(sdir / "reconstruction.tif", torch.from_numpy(dip.images["dip"]), voxel_size=voxel)
        c = math.prod(m["data"]["measurement_shape"])
        d = m["dip"]["n_conv_weights"]
        log(
            f"{n_angles} angles: sinogram {tuple(m['data']['measurement_shape'])} (c = {c}), image "
            f"{tuple(m['data']['image_shape'])}, U-Net '{options.preset}' with d = {d} conv weights, device {device}"
        )
        dip_summary = {k: v for k, v in m["dip"].items() if k != "n_parameters"}
        setting: dict[str, Any] = {
            "angles": n_angles,
            "angular_subsampling": ass,
            "c": c,
            "d": d,
            "image_shape": list(m["data"]["image_shape"]),
            "dip": dict(dip_summary, **_image(m)),
            "methods": {},
        }
        run_exact, reason = exact_decision(options.exact, c, d, options, device)
        setting["exact_reason"] = ("run: " if run_exact else "skipped: ") + reason
        log(f"{n_angles} angles: exact reference {'will run' if run_exact else 'skipped'} ({reason})")
        computed = False  # whether any method of this setting ran now (else its figures are current)
        runs: dict[str, Run] = {}
        for method in METHODS:
            stage(f"{n_angles} angles: {METHODS[method]}")
            if method in ("linearised_exact", "linearised_tv_predcp") and not run_exact:
                setting["methods"][method] = {"status": "skipped", "reason": reason}
                continue
            t0 = time.perf_counter()
            if method == "mc_dropout":
                run, rec = run_mc_dropout(sdir, dip_settings, options, log)
            else:
                run, rec = run_linearised(method, dip, sdir, options, log)
                rec["time_fit_s"] = dip_summary.get("time_s")
            runs[method] = run
            setting["methods"][method] = rec
            if run.reused:
                log(f"skipping {METHODS[method]} for {n_angles} angles: finished in an earlier run ({run.path})")
                continue
            computed = True
            s = rec["summary"]
            log(
                f"{METHODS[method]} ({n_angles} angles) done in {time.perf_counter() - t0:.1f} s: PSNR "
                f"{_fmt(rec['image']['psnr'], '.2f')} dB, marginal LL {_fmt(s['marginal_ll'], '.3f')}, 10×10 joint LL "
                f"{_fmt(s['joint_ll'].get('10'), '.3f')}, coverage@0.9 {s['coverage']['0.9']:.3f}"
            )
        stage(f"{n_angles} angles: figures and table")
        finished = {m: r for m, r in setting["methods"].items() if r.get("status") != "skipped"}
        if not computed and all(p.is_file() for p in figure_paths(out, n_angles)):
            log(f"figures for {n_angles} angles are up to date (no method was recomputed): skipping them")
        else:
            make_figures(out, n_angles, gt, runs, finished, log)
        results["settings"][str(n_angles)] = setting
        write_results(out, results)  # after every setting: partial results are readable while the next one runs
    log(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return results
