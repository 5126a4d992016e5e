"""``ctuq design`` as a library: pilot scan → prior → greedy design → outputs (:func:`run_design`).

The runner of the command: it takes the scan and the pilot reconstruction from the pipeline
(:mod:`ctuq.pipeline.scan`, :mod:`ctuq.pipeline.phases`) and the design itself from :mod:`ctuq.design`. A run is a
sequence of named steps (``_run_design``) that pass typed objects along: the scan, its candidate angles and the pilot
(:class:`~ctuq.pipeline.design_scan.DesignScan`), the pilot reconstruction with the prior and the design engine on it
(:class:`~ctuq.pipeline.design_scan.PilotPrior`) and, for a greedy criterion, the error forecast with its plan and the
acquisition hooks (:class:`DesignForecast`).

The output folder (``--out``) holds::

    config.yaml            the resolved config
    design.json            written last (marks the design finished): candidate and pilot angles, the acquired
                           angles in order with their criterion values and times, all criterion traces, the prior
                           (a, σ², scales / lengthscale), timings, and the reconstruction comparison
    angles.txt             pilot then acquired angles (degrees), one per line, in acquisition order
    design_polar.png       the chosen angles on a polar plot over the pilot
    std_pilot.tif, std_design.tif, std.png   posterior std (image units) after the pilot (not with design.forecast
                                             = false) and after the design
    pilot/                 FBP/TV/DIP from the pilot angles (a run folder; its dip_model.pt is the prior's DIP)
    designed/, equidistant/   FBP/TV/DIP from pilot + designed angles and from as many equidistant angles, with
                           PSNR/SSIM against the ground truth in their metrics.json (when the scan has one)
    work/design_state.pt   the design checkpoint (fingerprinted; ``--resume`` continues from it)
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import math
import sys
import time
from pathlib import Path

import torch

from ctuq import __version__, interrupt
from ctuq.design.candidates import DesignError, equidistant_indices
from ctuq.design.dip_prior import DIPTracker
from ctuq.design.forecast import ErrorForecaster, OnlineCalibration, RowPredictor, StopRule, forecast_counts
from ctuq.design.greedy import baseline_design, greedy_design
from ctuq.design.plan import AcquisitionHooks, pilot_rows, plan_curves, recommend, trusted_count
from ctuq.design.plots import plot_design_polar, plot_forecast, plot_online_calibration, plot_std_maps
from ctuq.options import Criterion, values
from ctuq.outputs import voxel_size_of, write_metrics, write_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.design_scan import (
    WORK_DIR,
    DesignScan,
    PilotPrior,
    load_candidates,
    pilot_prior,
    read_angles_file,
    reconstruct_angles,
    rmse_inside,
)
from ctuq.pipeline.lock import run_lock
from ctuq.pipeline.runner import write_config
from ctuq.pipeline.scan import check_device
from ctuq.registry import CALIBRATIONS
from ctuq.utils import atomic_path, resolve_device

__all__ = ["run_design", "read_angles_file", "DESIGN_NAME", "ANGLES_NAME", "STATE_NAME", "TRACK_ITERATIONS"]

DESIGN_NAME = "design.json"
FORECAST_PNG = "forecast.png"
TRACK_ITERATIONS = 300  # design.track_iterations with a stop target (notebook/experimental_design.md)
ONLINE_PNG = "online_calibration.png"
ANGLES_NAME = "angles.txt"
STATE_NAME = f"{WORK_DIR}/design_state.pt"


_logger = logging.getLogger(__name__)


def _log(msg: str) -> None:
    _logger.info(msg)


@dataclasses.dataclass
class DesignForecast:
    """The error forecast of a greedy design (:func:`_forecast_setup`).

    Attributes
    ----------
    forecaster : ErrorForecaster
        The forecast's calibration (``design.calibration``), fitted on the pilot's rows.
    at_pilot : dict
        Its report at the pilot (:meth:`ErrorForecaster.report`).
    plan : dict or None
        The planned curves (``--plan`` or a stop target; :func:`ctuq.design.plan.plan_curves`), else ``None``.
    hooks : AcquisitionHooks
        The acquisition's forecast after each angle, online recalibration and stop rule.
    rule : StopRule
        The stop rule (false without a target).
    predicted_from : str
        What each new angle is predicted from, in words (:func:`_center`).
    """

    forecaster: ErrorForecaster
    at_pilot: dict
    plan: dict | None
    hooks: AcquisitionHooks
    rule: StopRule
    predicted_from: str


def run_design(
    cfg, out_dir, *, pilot_angles=None, resume: bool = False, progress: bool = True, plan: bool = False
) -> dict:
    """Programmatic ``ctuq design`` (module docstring). Returns the ``design.json`` record.

    Parameters
    ----------
    cfg : Config
        Resolved config (``design`` section; ``data``/``model``/``dip``/``fbp``/``tv`` for the scan and the
        reconstructions).
    out_dir : path
        Output folder; one holding a finished design is refused unless ``resume``.
    pilot_angles : array-like, optional
        Pilot angles in degrees (``--pilot-angles``); default ``design.pilot`` equidistant candidates.
    resume : bool
        Continue a killed design (finished reconstructions and the design checkpoint are reused).
    plan : bool
        ``--plan``: forecast the error after ``pilot … pilot + acquire`` angles (designed and equidistant) and write
        it, without acquiring (:mod:`ctuq.design.plan`).

    Raises
    ------
    RunFolderLocked
        Another process is writing ``out_dir`` (:mod:`ctuq.pipeline.lock`); nothing there was changed.
    CheckpointMismatch
        ``resume`` with a design checkpoint of other settings, or a damaged or edited one.
    """
    out = rf.check_writable_folder(out_dir)
    with run_lock(out):  # before anything in the folder is removed or written
        interrupt.note_run_folder(out)
        return _run_design(cfg, out, pilot_angles=pilot_angles, resume=resume, progress=progress, plan=plan)


def _run_design(cfg, out_dir, *, pilot_angles, resume: bool, progress: bool, plan: bool) -> dict:
    """:func:`run_design` in its locked output folder ``out_dir``: checks → output folder → scan, candidates and
    pilot → pilot DIP and prior → forecast (greedy criteria; ``--plan`` ends here) → acquisition → std maps and
    angles → reconstructions from the chosen angles → ``design.json``."""
    t_start = time.perf_counter()
    rule = _check_request(cfg.design, plan)
    device = resolve_device(cfg.device)
    check_device(cfg, device)
    out = _prepare_out(cfg, out_dir, resume)
    scan = load_candidates(cfg, device, pilot_angles, progress, out)
    pilot = pilot_prior(cfg, out, scan, progress)
    forecast = None
    if cfg.design.criterion in values(Criterion) and cfg.design.forecast:  # greedy: the forecast, plan, stop rule
        forecast = _forecast_setup(cfg, scan, pilot, plan=plan, rule=rule, progress=progress)
        if plan:
            return _write_plan(cfg, out, scan, pilot, forecast, t_start)
    result, std = _acquire(cfg, out, scan, pilot, forecast, progress)
    _write_choice(cfg, out, scan, result, std)
    comparison = _compare_reconstructions(cfg, out, scan, result, forecast, progress) if cfg.design.reconstruct else {}
    record = _design_record(cfg, scan, pilot, forecast, result, std, comparison, t_start)
    if forecast is not None:
        _forecast_figures(out, record["forecast"], comparison)
    write_metrics(out / DESIGN_NAME, record)
    n_acquired = len(result.acquired)
    _log(
        f"acquired {n_acquired} angle{'' if n_acquired == 1 else 's'} ({len(result.chosen)} with the pilot) in "
        f"{result.timings['total_s']:.1f} s; wrote {out}"
    )
    return record


def _check_request(ds, plan: bool) -> StopRule:
    """The stop rule of ``design.target_*`` / ``design.min_gain``, checked before any work: it and ``--plan`` need a
    greedy criterion (:class:`DesignError` naming the option)."""
    rule = StopRule.from_settings(ds.target_rmse, ds.target_psnr, ds.min_gain)  # bad targets: before any work
    if (plan or rule) and ds.criterion not in values(Criterion):
        option = "--plan" if plan else "--target-rmse/--target-psnr/--min-gain"
        raise DesignError(f"{option}: needs a greedy criterion ({', '.join(values(Criterion))}), not {ds.criterion}")
    if (plan or rule) and not ds.forecast:
        option = "--plan" if plan else "--target-rmse/--target-psnr/--min-gain"
        raise DesignError(f"{option}: needs the error forecast, but design.forecast = false")
    return rule


def _prepare_out(cfg, out_dir, resume: bool) -> Path:
    """The output folder, checked (a finished design is refused without ``resume``), its design checkpoint removed
    unless ``resume``, ``work/`` created and ``config.yaml`` written."""
    out = rf.check_writable_folder(out_dir)
    state_path = out / STATE_NAME
    if (out / DESIGN_NAME).is_file() and not resume:
        raise DesignError(
            f"--out {out}: already holds a finished design ({DESIGN_NAME}); choose another --out or pass --resume"
        )
    if not resume and state_path.exists():
        state_path.unlink()
    (out / WORK_DIR).mkdir(exist_ok=True)
    write_config(cfg, out)
    return out


def _acquire(cfg, out: Path, scan: DesignScan, pilot: PilotPrior, forecast: DesignForecast | None, progress: bool):
    """``(result, std)``: the greedy design (with ``forecast`` unless ``design.forecast`` is false; checkpointed in
    ``work/design_state.pt``) or the baseline strategy's choice (:class:`~ctuq.design.greedy.DesignResult`), and the
    posterior std maps (image shape, mm⁻¹) after the pilot and after the design. Without the forecast the greedy
    loop runs alone (no std map after the pilot): the engine's sample streams count its resets
    (:meth:`~ctuq.design.engine.DesignEngine.chunk_seed`), so nothing may condition it between the steps."""
    ds, engine, chosen_at_pilot = cfg.design, pilot.engine, scan.pilot
    std: dict[str, torch.Tensor] = {}
    shape = tuple(scan.data.op.image_shape)

    def std_map(chosen) -> torch.Tensor:
        if list(engine.chosen) != list(chosen):
            engine.reset(chosen)
        s = engine.posterior_std(ds.std_samples, seed=cfg.seed + 11) / engine.model.image_scale
        return s.reshape(shape)

    if ds.criterion in values(Criterion):
        hooks = None if forecast is None else forecast.hooks
        result = greedy_design(
            engine,
            chosen_at_pilot,
            ds.acquire,
            criterion=ds.criterion,
            angles_deg=scan.cand_deg,
            jitter=ds.jitter,
            spread=ds.spread,
            updater=pilot.updater,
            checkpoint=out / STATE_NAME,
            fingerprint=pilot.fingerprint,
            progress=progress,
            log=_log,
            update_last=hooks is not None,
            on_setup=None
            if hooks is None
            else lambda eng: (std.__setitem__("after the pilot", std_map(chosen_at_pilot)), hooks.at_pilot(eng)),
            before_acquire=None if hooks is None else hooks.before_acquire,
            after_step=None if hooks is None else hooks.after_step,
        )
    else:
        result = baseline_design(
            ds.criterion, len(scan.cand_idx), chosen_at_pilot, ds.acquire, angles_deg=scan.cand_deg, seed=cfg.seed
        )
        std["after the pilot"] = std_map(chosen_at_pilot)
    std["after the design"] = std_map(result.chosen)
    return result, std


def _write_choice(cfg, out: Path, scan: DesignScan, result, std: dict) -> None:
    """The std maps (``std_pilot.tif`` unless ``design.forecast`` is false, ``std_design.tif``, ``std.png``), the
    polar plot of the angles and ``angles.txt`` (pilot then acquired, in acquisition order)."""
    ds = cfg.design
    if "after the pilot" in std:
        write_tiff(out / "std_pilot.tif", std["after the pilot"], voxel_size=voxel_size_of(scan.cand_op))
    write_tiff(out / "std_design.tif", std["after the design"], voxel_size=voxel_size_of(scan.cand_op))
    plot_std_maps(out / "std.png", std)
    pilot_deg, acq_deg = scan.degrees(scan.pilot), scan.degrees(result.acquired)
    plot_design_polar(out / "design_polar.png", pilot_deg, acq_deg, period_deg=math.degrees(scan.period))
    lines = [f"# ctuq design: {ds.criterion}, prior {ds.prior}; angle_deg role order"]
    lines += [f"{a:.6f} pilot {i + 1}" for i, a in enumerate(pilot_deg)]
    lines += [f"{a:.6f} acquired {i + 1}" for i, a in enumerate(acq_deg)]
    with atomic_path(out / ANGLES_NAME) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def _compare_reconstructions(
    cfg, out: Path, scan: DesignScan, result, forecast: DesignForecast | None, progress: bool
) -> dict:
    """``design.json["comparison"]``: FBP/TV/DIP from the designed angles and from as many equidistant ones (run
    folders ``designed/``, ``equidistant/``, reused when finished), with PSNR/SSIM and, with a forecast and a ground
    truth, the RMS error inside the forecast's mask."""
    gt, comparison = scan.gt, {}
    n_total = len(result.chosen)
    for name, idx in (
        ("designed", sorted(result.chosen)),
        ("equidistant", sorted(equidistant_indices(len(scan.cand_idx), n_total).tolist())),
    ):
        _, m = reconstruct_angles(
            cfg, out / name, scan.cand_op.subset(idx), scan.y_cand[idx], gt, scan.device, progress, need_model=False
        )
        comparison[name] = {
            "n_angles": len(idx),
            "angles_deg": scan.degrees(idx),
            "psnr": m.get("psnr"),
            "ssim": m.get("ssim"),
            "rmse_object": None
            if gt is None or forecast is None
            else rmse_inside(out / name, gt, forecast.forecaster.mask),
        }
        if m.get("psnr"):
            _log(
                f"{name} ({len(idx)} angles): PSNR "
                + ", ".join(f"{k} {v:.2f} dB" for k, v in m["psnr"].items() if v is not None)
            )
    return comparison


def _design_record(
    cfg, scan: DesignScan, pilot: PilotPrior, forecast: DesignForecast | None, result, std, comparison, t_start
) -> dict:
    """``design.json``: the scan and candidates, the pilot and the acquired angles with their criterion values and
    times, the prior, the std maps' means, the reconstructions' comparison, the forecast and the timings."""
    ds, cand_idx = cfg.design, scan.cand_idx
    pilot_deg, acq_deg = scan.degrees(scan.pilot), scan.degrees(result.acquired)
    return {
        "ctuq_version": __version__,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": str(scan.device),
        "scan": str(scan.path),
        "strategy": ds.criterion,
        "route": pilot.route if ds.criterion in values(Criterion) else None,
        "period_deg": math.degrees(scan.period),
        "candidates": {"n": len(cand_idx), "scan_indices": cand_idx.tolist(), "angles_deg": scan.cand_deg.tolist()},
        "pilot": {"candidates": scan.pilot, "angles_deg": pilot_deg},
        "acquired": [
            {
                "step": s["step"],
                "candidate": s["candidate"],
                "scan_index": int(cand_idx[s["candidate"]]),
                "angle_deg": s["angle_deg"],
                "criterion": s["criterion"],
                "jitter": s["jitter"],
                "time_s": s["time_s"],
                "update_s": s["update_s"],
            }
            for s in result.steps
        ],
        "angles_deg": pilot_deg + acq_deg,
        "criterion_traces": [s["values"] for s in result.steps],
        "prior": {**pilot.engine.model.summary(), "evidence_grid": pilot.engine.model.info.get("evidence_grid")},
        "std_mean": {k: float(v.mean()) for k, v in std.items()},
        "pilot_reconstruction": {"psnr": pilot.metrics.get("psnr"), "ssim": pilot.metrics.get("ssim")},
        "comparison": comparison,
        "forecast": _forecast_record(forecast, result, comparison),
        "timings": {
            "prior_s": pilot.seconds,
            **result.timings,
            "resumed_steps": result.resumed_steps,
            "total_s": time.perf_counter() - t_start,
        },
        "config": cfg.to_dict(),
    }


# ---------------------------------------------------------------------------------------------- forecast
def _forecast_setup(cfg, scan: DesignScan, pilot: PilotPrior, *, plan: bool, rule: StopRule, progress: bool):
    """The forecaster fitted at the pilot, the plan (``--plan`` or a stop target, which it must be able to meet),
    and the acquisition hooks: a :class:`DesignForecast`."""
    ds, engine = cfg.design, pilot.engine
    x_pilot = pilot.state.images["dip"].detach().cpu().double().reshape(engine.model.op.image_shape)
    forecaster, predictor, rows = _fit_forecaster(cfg, scan, pilot, x_pilot)
    at_pilot = forecaster.report()
    _log(f"forecast calibration at the pilot ({ds.calibration}): " + _describe_fit(at_pilot))
    planned = None
    if plan or rule:
        planned = _plan(cfg, scan, pilot, forecaster, x_pilot, progress)
        best = min((planned["designed"][-1], planned["equidistant"][-1]), key=lambda r: r["rmse"])
        why = None if plan else rule.reachable(best)
        if why is not None:
            raise DesignError(why)
        limit = trusted_count(engine.model.op.image_shape)
        planned["recommendation"] = recommend(planned, rule.target if rule else None, max_designed=limit)
        if not plan:  # --plan says it after its table
            _say_advice(planned["recommendation"], len(scan.pilot), acquiring=True)
    online = OnlineCalibration(forecaster, rows, ds.calibration_update)
    center, source = _center(ds, pilot.prior, rule)
    hooks = AcquisitionHooks(
        predictor,
        online,
        rule,
        n_pilot=len(scan.pilot),
        angles_deg=scan.cand_deg,
        std_samples=ds.forecast_samples,
        seed=cfg.seed,
        center=center,
        log=_log,
    )
    return DesignForecast(forecaster, at_pilot, planned, hooks, rule, source)


def _say_advice(advice: dict, n_pilot: int, *, acquiring: bool) -> None:
    """Log the plan's recommendation (:func:`ctuq.design.plan.recommend`), and how to scan the equidistant protocol
    when it is the one recommended for a target."""
    _log(f"the plan recommends {advice['recommended']} angles ({advice['reason']})")
    if advice["recommended"] == "designed":  # the forecast is the DIP's; FBP sees the designs' gaps
        _log(
            "the designed angles serve the DIP and TV: FBP from them is worse than from as many equidistant angles "
            "(up to 6 dB in the protocol study, docs/experimental_design.md §9); for an FBP protocol take the "
            "equidistant scan"
        )
    need = (advice["counts"] or {}).get("equidistant")
    if advice["recommended"] == "equidistant" and need is not None:
        _log(
            f"for the equidistant protocol: {math.ceil(need)} evenly spaced angles (`--criterion equidistant "
            f"--acquire {max(1, math.ceil(need) - n_pilot)}` with this pilot)"
            + ("; the design goes on as asked" if acquiring else "")
        )


def _fit_forecaster(cfg, scan: DesignScan, pilot: PilotPrior, x_pilot: torch.Tensor):
    """``(forecaster, predictor, rows)``: the forecast's calibration ``design.calibration`` fitted on the rows the
    pilot predicts for its own angles (``design.calibration_angles``), and the row predictor around the pilot DIP
    ``x_pilot`` (image shape, float64)."""
    ds, engine = cfg.design, pilot.engine
    data_range = ds.intensity_range
    if data_range is None and scan.gt is not None:
        data_range = float(scan.gt.max() - scan.gt.min())
    # the pilot's FBP/TV, for a calibration method whose image features use them
    companions = {k: pilot.state.images[k].detach().cpu() for k in ("fbp", "tv") if k in pilot.state.images}
    forecaster = ErrorForecaster(ds.calibration, x_pilot, companions=companions, data_range=data_range, seed=cfg.seed)
    predictor = RowPredictor(
        x_pilot.reshape(-1), scan.y_cand, engine.model, forecaster.mask, seed=cfg.seed, features=forecaster.features
    )
    engine.reset(scan.pilot)
    rows = pilot_rows(engine, predictor, scan.pilot, ds.calibration_angles)
    forecaster.fit(rows)
    return forecaster, predictor, rows


def _plan(cfg, scan: DesignScan, pilot: PilotPrior, forecaster, x_pilot: torch.Tensor, progress: bool) -> dict:
    """The planned error curves after ``pilot … pilot + acquire`` angles, designed and equidistant
    (:func:`ctuq.design.plan.plan_curves`); a DIP prior plans on the pilot reconstruction's projections in place of
    the angles not measured yet (its measurements are restored afterwards)."""
    ds, model, prior, y_cand = cfg.design, pilot.engine.model, pilot.prior, scan.y_cand
    n_max = len(scan.pilot) + ds.acquire
    if prior is not None:  # the angles not measured yet: the pilot reconstruction's projections
        with torch.no_grad():
            guess = model.op.forward_flat(x_pilot.reshape(1, -1).to(model.op.device, model.op.dtype))
        y_plan = guess.reshape(y_cand.shape).to(y_cand.dtype).cpu()
        y_plan[scan.pilot] = y_cand[scan.pilot].cpu()
        measured, prior.y = prior.y, y_plan
    try:
        return plan_curves(
            model,
            prior,
            scan.pilot,
            forecast_counts(len(scan.pilot), n_max, ds.forecast_points),
            forecaster,
            criterion=ds.criterion,
            jitter=ds.jitter,
            spread=ds.spread,
            angles_deg=scan.cand_deg,
            route=pilot.route,
            n_samples=min(ds.samples, ds.plan_samples),
            refresh_every=ds.refresh_every,
            std_samples=ds.forecast_samples,
            seed=cfg.seed,
            progress=progress,
            log=_log,
        )
    finally:
        if prior is not None:
            prior.y = measured


def _center(ds, prior, rule) -> tuple:
    """``(center, description)``: what each new angle is predicted from (``AcquisitionHooks(center=…)``): the
    tracked DIP (``design.track_iterations``; ``null``: :data:`TRACK_ITERATIONS` with a stop target ``rule``, else
    0), the retrained one (``design.retrain_every``), else the design's linearised update of the pilot DIP
    (``None``)."""
    linear = (None, "the design posterior's mean (the pilot DIP updated linearly)")
    if prior is None:
        return linear
    track = ds.track_iterations if ds.track_iterations is not None else (TRACK_ITERATIONS if rule else 0)
    if track:
        return DIPTracker(prior, track).center, f"the tracked DIP ({track} warm-start Adam steps after each angle)"
    if ds.retrain_every:
        return prior.center, f"the DIP retrained every {ds.retrain_every} angles"
    return linear


def _describe_fit(rep: dict) -> str:
    """The forecaster's fit (:meth:`ErrorForecaster.report`) in a log line: its method's fitted parameters."""
    keys = [k for k in CALIBRATIONS[rep["method"]].parameters if rep.get(k) is not None]
    return ", ".join(f"{k} = {rep[k]:.3g}" for k in keys) + f" on {rep['n_rows']} rows"


def _forecast_record(forecast: DesignForecast | None, result, comparison: dict) -> dict | None:
    """``design.json["forecast"]``: the calibration at the pilot, the plan, the online records and the stop."""
    if forecast is None:
        return None
    hooks, rule = forecast.hooks, forecast.rule
    last = hooks.forecasts[-1] if hooks.forecasts else None
    actual = (comparison.get("designed") or {}).get("rmse_object") or {}
    stop = None
    if rule:
        stop = {
            "target": rule.target.text,
            "target_rmse": rule.target.value if rule.target.kind == "rmse" else None,
            "rule": rule.target.describe(),
            "met": bool(result.stopped_at is not None),
            "n_angles": len(result.chosen),
            "predicted_rmse": last["rmse"] if last else None,
            "predicted_rmse_band": last["rmse_band"] if last else None,
            "predicted_psnr": last["psnr"] if last else None,
            "actual_rmse": actual.get("dip"),
            "actual_psnr": ((comparison.get("designed") or {}).get("psnr") or {}).get("dip"),
        }
        if stop["met"]:
            _log(
                f"stopped after {stop['n_angles']} angles: predicted RMS error {last['rmse']:.4g} mm⁻¹ "
                f"[{last['rmse_band'][0]:.4g}, {last['rmse_band'][1]:.4g}]"
                + (f", actual (DIP) {stop['actual_rmse']:.4g} mm⁻¹" if stop["actual_rmse"] is not None else "")
            )
        else:
            _log(f"the stop rule was not met within --acquire {len(result.acquired)} angles ({rule.target.describe()})")
    return {
        "calibration": forecast.forecaster.name,
        "update": hooks.online.update,
        "predicted_from": forecast.predicted_from,
        "calibration_at_pilot": forecast.at_pilot,
        "plan": forecast.plan,
        "online": hooks.online.records,
        "after_step": hooks.forecasts,
        "stop": stop,
        "time_s": hooks.time_s + (forecast.plan or {}).get("time_s", 0.0),
    }


def _forecast_figures(out: Path, fc: dict, comparison: dict) -> None:
    actual = {}
    for name in ("designed", "equidistant"):
        rec = comparison.get(name) or {}
        if (rec.get("rmse_object") or {}).get("dip") is not None:
            actual[f"{name} DIP"] = ([rec["n_angles"]], [rec["rmse_object"]["dip"]])
    target = (fc.get("stop") or {}).get("target_rmse")
    plot_forecast(out / FORECAST_PNG, fc.get("plan"), fc.get("after_step") or [], actual=actual, target=target)
    if fc.get("online"):
        plot_online_calibration(out / ONLINE_PNG, fc["online"])


def _write_plan(cfg, out: Path, scan: DesignScan, pilot: PilotPrior, forecast: DesignForecast, t_start: float) -> dict:
    """``--plan``: design.json with the forecast, forecast.png and the planned angles; nothing acquired."""
    planned = forecast.plan
    order = planned["designed_order"]
    cand_idx, cand_deg, pilot_idx = scan.cand_idx, scan.cand_deg, scan.pilot
    record = {
        "ctuq_version": __version__,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "plan_only": True,
        "scan": str(scan.path),
        "strategy": cfg.design.criterion,
        "route": pilot.route,
        "period_deg": math.degrees(scan.period),
        "candidates": {"n": len(cand_idx), "scan_indices": cand_idx.tolist(), "angles_deg": cand_deg.tolist()},
        "pilot": {"candidates": pilot_idx, "angles_deg": cand_deg[pilot_idx].tolist()},
        "planned": {"candidates": order, "angles_deg": cand_deg[order].tolist()},
        "forecast": {
            "calibration": forecast.forecaster.name,
            "calibration_at_pilot": forecast.at_pilot,
            "plan": planned,
        },
        "timings": {"plan_s": planned["time_s"], "total_s": time.perf_counter() - t_start},
        "config": cfg.to_dict(),
    }
    plot_forecast(out / FORECAST_PNG, planned)
    lines = [f"# ctuq design --plan: {cfg.design.criterion}; angle_deg role order (planned, not acquired)"]
    lines += [f"{a:.6f} pilot {i + 1}" for i, a in enumerate(cand_deg[pilot_idx])]
    lines += [f"{a:.6f} planned {i + 1}" for i, a in enumerate(cand_deg[order])]
    with atomic_path(out / ANGLES_NAME) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    write_metrics(out / DESIGN_NAME, record)
    rows = ["  angles  designed (mm⁻¹)          equidistant (mm⁻¹)"]
    for n, d, e in zip(planned["counts"], planned["designed"], planned["equidistant"]):
        rows.append(
            f"  {n:6d}  {d['rmse']:.4g} [{d['rmse_band'][0]:.3g}, {d['rmse_band'][1]:.3g}]"
            f"   {e['rmse']:.4g} [{e['rmse_band'][0]:.3g}, {e['rmse_band'][1]:.3g}]"
        )
    _log("predicted RMS error inside the object (95 % band):\n" + "\n".join(rows))
    _say_advice(planned["recommendation"], len(pilot_idx), acquiring=False)
    _log(f"planned in {record['timings']['total_s']:.1f} s; wrote {out / DESIGN_NAME} and {out / FORECAST_PNG}")
    return record
