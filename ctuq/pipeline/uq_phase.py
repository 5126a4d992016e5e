"""The uncertainty phase of a run: linearised inference around the fitted DIP
(:class:`ctuq.pipeline.uq.UQRun`) → ``std.tif``, the uncertainty figures and the UQ sections of
metrics.json; then the held-out check on the scan's unused angles (:mod:`ctuq.calibration`, on the rows the loaded
problem carries: ``metrics.json["uq"]["heldout"]``, ``heldout_rows.npz``, ``heldout_calibration.png``) and the
calibration method ``uq.calibration`` names applied to ``std.tif`` (``std_uncalibrated.tif`` keeps the posterior's),
every other registered method scored beside it (:data:`ctuq.registry.CALIBRATIONS`).

The run-folder side of the check lives here too: :func:`write_heldout` (the check's files in a run folder).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from ctuq import calibration as cal
from ctuq import figures
from ctuq.data.problem import HELDOUT_GIVEN_IN_CODE
from ctuq.log import duration
from ctuq.metrics import uq_summary_from_moments
from ctuq.metrics.calibration import error_localisation
from ctuq.outputs import write_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.checkpoints import shard_moments_files
from ctuq.pipeline.moments import statistics_roi
from ctuq.pipeline.phases import RunState
from ctuq.pipeline.uq import UQRun
from ctuq.registry import CALIBRATIONS, PRIORS

__all__ = ["phase_uq", "auto_calibration", "write_heldout"]


def phase_uq(state: RunState) -> None:
    """Linearised inference (:class:`ctuq.pipeline.uq.UQRun`) → ``std.tif``, UQ figures and metrics.

    Reads ``state.model``/``state.net_input`` (the fitted DIP), ``state.op``/``state.y`` and the loaded problem's
    variances and held-out rows (``state.data``); checkpoints into the run folder (``uq_state.pt``,
    ``uq_moments.pt``) and resumes from there with ``--resume``. The statistics stream: no image sample is kept in
    memory; ``uq.save_samples`` writes them to ``samples/``.

    Its steps: the inference → the held-out check → the calibration of ``std.tif`` → ``metrics.json["uq"]`` → the
    scores against the ground truth (when the scan has one) → the check's rows, the figures and the clean-up.
    """
    if state.model is None:
        raise RuntimeError("the uncertainty phase needs the fitted DIP (state.model)")
    started = time.perf_counter()
    res = _infer(state)
    state.uq_result = res
    if not state.is_root:  # a rank > 0 of a sharded run: its running sums went to rank 0, which writes
        return
    heldout, skipped = _heldout_check(state, res)
    _log_estimate(state, res, started)
    calibration = _calibrate(state, res, heldout, skipped)
    uq_metrics = _uq_metrics(state, res, heldout, skipped, calibration)
    state.metrics["em_trace"] = res.em_trace
    if state.ground_truth is not None:
        _score_against_truth(state, res, calibration, uq_metrics)
    state.metrics["uq"] = uq_metrics
    state.uq_result = res
    _write_files(state, res, heldout, calibration)


@dataclasses.dataclass
class _Calibration:
    """What a run did about its std map's calibration (:func:`_calibrate`).

    Attributes
    ----------
    setting, mode : str
        ``uq.calibration`` as configured, and the registered method it resolved to.
    chosen : CalibrationMethod or None
        That method fitted on the held-out rows (``None`` without a held-out check).
    applied : CalibrationMethod or None
        ``chosen`` when it changes the std map (``std.tif`` is then its recalibration), else ``None``.
    scored : list of CalibrationMethod
        The other fitted methods that change the map: scored beside it from the same posterior.
    """

    setting: str
    mode: str
    chosen: cal.CalibrationMethod | None
    applied: cal.CalibrationMethod | None
    scored: list


def _infer(state: RunState):
    """The run's :class:`~ctuq.pipeline.uq.UQResult`: the inference around the fitted DIP, checkpointed into (and
    resumed from, with ``--resume``) the run folder."""
    cfg = state.cfg
    return UQRun(
        state.model,
        state.net_input,
        state.op,
        state.y,
        scale=cfg.dip.scale,
        settings=cfg.uq,
        seed=cfg.seed,
        work_dir=state.out_dir,
        resume=state.resume,
        progress=state.progress,
        log=state.log,
        shard=state.shard,
        variances=state.data.variances if state.data is not None else None,
    ).run()


def _log_estimate(state: RunState, res, started: float) -> None:
    """How the cost model did (``solver = auto`` only): the whole inference since ``started``
    (:func:`time.perf_counter`), held-out check included, beside its estimate (into ``stats["estimate"]``)."""
    estimate = res.stats.get("estimate")
    if estimate is not None:
        estimate["actual_seconds"] = time.perf_counter() - started
        state.log(
            f"the inference took {duration(estimate['actual_seconds'])} (estimated {duration(estimate['seconds'])} "
            f"with {estimate['solver']})"
        )


def _calibrate(state: RunState, res, heldout: cal.HeldoutRows | None, skipped: str) -> _Calibration:
    """``uq.calibration`` resolved, every registered method fitted on the check's rows (none without a check), and
    the chosen one applied: ``std.tif`` written (``std_uncalibrated.tif`` beside it when the method changes the map)
    and ``res.std`` replaced by the recalibrated map."""
    cfg = state.cfg
    setting = str(cfg.uq.calibration)
    mode = cal.resolve_calibration(setting, heldout is not None, auto_calibration(cfg.uq.prior))
    if setting == cal.AUTO:
        state.log(f"calibration: {mode} (uq.calibration = auto; {'a held-out check ran' if heldout else skipped})")
        if heldout is None and state.shard is not None and state.shard.distributed:
            # the same run in one process applies the bias model: say so rather than differ silently
            state.warn(
                "uq.calibration = auto: a sharded run has no held-out check, so std.tif is the posterior's own "
                "(a run in one process would add the held-out bias model); rerun `ctuq uq` in one process for it"
            )
    # every registered method fitted on the check's rows (none without a check): the chosen one is applied to
    # std.tif, the others that change the map are scored beside it from the same posterior
    fitted = {name: CALIBRATIONS[name].fit(heldout, res.mean) for name in CALIBRATIONS}
    chosen = fitted[mode]
    applied = chosen if chosen is not None and chosen.changes_std else None
    if chosen is None:
        state.warn(f"uq.calibration = {mode}: no held-out check, so std.tif is the uncalibrated posterior std")
    if applied is not None:
        write_tiff(state.out_dir / rf.STD_UNCALIBRATED_NAME, res.std, voxel_size=state.voxel_size)
        res.std = applied.apply_std(res.std)
        state.log(applied.log_line())
    else:
        (state.out_dir / rf.STD_UNCALIBRATED_NAME).unlink(missing_ok=True)  # a rerun without recalibration
    write_tiff(state.out_dir / rf.STD_NAME, res.std, voxel_size=state.voxel_size)
    scored = [m for m in fitted.values() if m is not None and m.changes_std and m is not applied]
    return _Calibration(setting, mode, chosen, applied, scored)


def _uq_metrics(state: RunState, res, heldout, skipped: str, calibration: _Calibration) -> dict[str, Any]:
    """``metrics.json["uq"]`` before the scores against the ground truth: what ran, its statistics, the held-out
    check's report (or why it was skipped) and the calibration's; the method and the verdict are logged."""
    uq_metrics: dict[str, Any] = {
        "method": _method(res, state.cfg.uq.prior),
        "a": res.a,
        "sigma2": res.sigma2,
        "solver": res.solver,
        "stats": res.stats,
        "timings": res.timings,
        "products": res.products,
        "n_samples": res.n_samples,
        "mean_std": float(res.std.mean()),
    }
    if heldout is not None:
        uq_metrics["heldout"] = heldout.report
    else:
        uq_metrics["heldout_skipped"] = skipped
    mode, chosen = calibration.mode, calibration.chosen
    report = chosen.report() if chosen is not None else CALIBRATIONS[mode].unfitted_report()
    uq_metrics["calibration"] = {"mode": mode, "setting": calibration.setting, **report}
    state.log(f"ran: {uq_metrics['method']}; calibration {mode}")
    if heldout is not None:  # in plain words, with what the run did about it
        state.log(cal.verdict(heldout.report, uq_metrics["calibration"]))
    return uq_metrics


def _score_against_truth(state: RunState, res, calibration: _Calibration, uq_metrics: dict) -> None:
    """The posterior's scores against the ground truth into ``uq_metrics`` (``summary``; with a recalibration also
    ``summary_uncalibrated``; one record per scored method) and the run's headline metrics; ``res.moments``
    recalibrated when ``std.tif`` is."""
    applied = calibration.applied
    gt = state.ground_truth.detach().cpu()
    posterior_moments = res.moments
    if applied is not None:
        # the posterior's own numbers, for the evidence that the recalibration helps (or not)
        uq_metrics["summary_uncalibrated"] = uq_summary_from_moments(gt, res.mean, res.moments)
        res.moments = applied.apply_moments(res.moments)
    for method in calibration.scored:
        # what that uq.calibration would score, from the same posterior: the evidence for (or against) it
        # without a second inference (the calibration study reads it)
        moments = method.apply_moments(posterior_moments)
        uq_metrics[method.summary_name()] = {
            **uq_summary_from_moments(gt, res.mean, moments),
            **method.summary_record(),
        }
    summary = uq_summary_from_moments(gt, res.mean, res.moments)
    # where the errors are: ranks inside the object, AUC of the largest errors, coverage per std decile
    roi = statistics_roi(state.cfg.uq, res.std.shape)
    summary["localisation"] = error_localisation(res.std, (res.mean - gt).abs(), gt, roi)
    if applied is not None:
        uq_metrics["summary_uncalibrated"]["localisation"] = error_localisation(
            posterior_moments.std().float(), (res.mean - gt).abs(), gt, roi
        )
    state.metrics["marginal_ll"] = summary["marginal_ll"]
    state.metrics["joint_ll"] = summary["joint_ll"]
    state.metrics["coverage"] = summary["coverage"]
    uq_metrics["summary"] = summary
    state.uq_summary = summary
    where = summary["localisation"]
    state.log(
        f"UQ: marginal LL {summary['marginal_ll']:.3f}, joint LL (10×10) "
        f"{summary['joint_ll'].get('10', float('nan')) or float('nan'):.3f}, coverage@0.9 "
        f"{summary['coverage']['0.9']:.3f}, Spearman(std, |error|) {summary['spearman']:.3f}; inside the object "
        f"ENCE {_num(where['ence'], 2)}, coverage@0.9 per std decile {_span(where['conditional_coverage_0.9'])}, "
        f"Spearman {_num(where['spearman_inside'], 3)} = {_num(where['spearman_ratio'], 2)} × a calibrated map's"
    )


def _num(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _span(values: list | None) -> str:
    return "n/a" if not values else f"{min(values):.2f}–{max(values):.2f}"


def _write_files(state: RunState, res, heldout: cal.HeldoutRows | None, calibration: _Calibration) -> None:
    """The check's rows (always: ``ctuq uq RUN --check`` rescores them), the figures when asked, and the clean-up:
    the running sums (every rank's) and, unless ``output.keep_checkpoint``, ``uq_state.pt``."""
    cfg = state.cfg
    if heldout is not None:  # the figure only when asked
        write_heldout(state.out_dir, heldout, json_file=False, figure=cfg.output.figure)
    if cfg.output.figure:
        _uq_figures(state, res, calibration.applied, calibration.scored)
    # The running sums are only needed to resume an unfinished prediction; they are large, so drop them now
    # (a sharded run's per-rank files too: each rank wrote its own).
    (state.out_dir / rf.UQ_MOMENTS_NAME).unlink(missing_ok=True)
    for p in shard_moments_files(state.out_dir):
        p.unlink(missing_ok=True)
    if not cfg.output.keep_checkpoint and (state.out_dir / rf.UQ_STATE_NAME).exists():
        (state.out_dir / rf.UQ_STATE_NAME).unlink()


def _reliability_figure(path, summary: dict, before: dict | None, applied) -> None:
    """RMSE against RMV per std decile inside the object for ``std.tif`` and, when it is a recalibration, the
    posterior's own map (skipped when the object is too small for ten bins or a bin has zero error)."""
    maps = {"std.tif" if applied is None else f"std.tif ({applied.label()})": summary["localisation"]}
    if before is not None:
        maps["posterior (uncalibrated)"] = before["localisation"]
    curves = {k: (v["reliability"]["rmv"], v["reliability"]["rmse"]) for k, v in maps.items() if v["reliability"]}
    if curves and all(min(min(a), min(b)) > 0 for a, b in curves.values()):
        figures.plot_reliability(path, curves, ence={k: maps[k]["ence"] for k in curves})


def _method(res, prior: str) -> str:
    """What the inference did, as resolved (not as configured): the prior, the solver and whether it is exact, the
    EM's route and steps, the noise model and the samples (``metrics.json["uq"]["method"]`` and the log)."""
    stats = res.stats
    exact = stats["solver"] == "exact"
    route = stats["route"]
    gammas = {r.get("gamma_method") for r in res.em_trace} - {None}
    em = "exact" if gammas == {"exact"} else "sampled" if gammas else ("exact" if exact else "sampled")
    steps = stats["em_steps"]
    em_text = f"{em} EM ({steps} step{'s' if steps != 1 else ''}{', converged' if stats['em_converged'] else ''})"
    solver = f"{route} ({'exact' if exact else 'iterative'})"
    return (
        f"linearised DIP, {PRIORS[prior].label}: solver {solver}, {em_text}, {stats['noise']['model']} noise, "
        f"{res.n_samples} posterior samples (Matheron's rule)"
    )


def auto_calibration(prior: str) -> str:
    """The calibration method ``uq.calibration = auto`` means for the weight prior ``prior`` (a name of
    :data:`ctuq.registry.PRIORS`) when the scan has held-out angles: the prior class's own ``auto_calibration``
    (the bias model for the g-prior; the global ``k`` for TV-PredCP, whose posterior is 3–5× too narrow everywhere,
    which a bias inside the object does not fix: docs/calibration.md)."""
    return PRIORS[prior].auto_calibration


def _heldout_check(state: RunState, res) -> tuple[cal.HeldoutRows | None, str]:
    """``(rows, "")``: the held-out check of the run's posterior on the loaded problem's held-out rows;
    ``(None, reason)`` with the one-line reason also logged when it cannot run (it goes into
    ``metrics.json["uq"]["heldout_skipped"]``)."""
    held = state.data.heldout if state.data is not None else None
    if state.shard is not None and state.shard.distributed:
        reason = "a sharded run; run `ctuq uq RUN --check` on the finished folder"
    elif held is None:  # why the loaded problem has none (a problem given in code says so too)
        reason = state.data.heldout_reason if state.data is not None else HELDOUT_GIVEN_IN_CODE
    else:
        reason = ""
    if reason:
        state.log(f"held-out check skipped: {reason}")
        return None, reason
    rows = cal.run_heldout_check(
        res.posterior,
        res.mean,
        state.cfg.dip.scale,
        held,
        # the noise model the run resolved (uq.noise = auto) is recorded; the rows' noise comes from its likelihood
        noise_model=res.stats["noise"]["model"],
        # the std map's own first samples (same seed): no more than the run drew (a short run stays short)
        n_samples=min(cal.HELDOUT_SAMPLES, state.cfg.uq.samples),
        chunk_size=state.cfg.uq.sample_chunk,
        seed=state.cfg.seed + 1,
        command=f"ctuq uq {state.out_dir} --check",
        # the other reconstructions, for the calibration methods whose image features use them
        companions={k: state.images[k].detach().cpu() for k in ("fbp", "tv") if k in state.images},
    )
    state.log(f"held-out check: {rows.report['seconds']:.1f} s")
    return rows, ""


def write_heldout(
    out_dir: Path, rows: cal.HeldoutRows, *, json_file: bool = True, figure: bool = True, rows_file: bool = True
) -> None:
    """The check's files in the run folder ``out_dir``: ``heldout.json`` (with ``json_file``),
    ``heldout_calibration.png`` (with ``figure``) and ``heldout_rows.npz`` (with ``rows_file``), each atomically."""
    out_dir = Path(out_dir)
    cal.write_report(
        rows,
        json_path=out_dir / rf.HELDOUT_NAME if json_file else None,
        figure_path=out_dir / rf.HELDOUT_FIGURE if figure else None,
    )
    if rows_file:
        cal.write_rows(out_dir / rf.HELDOUT_ROWS_NAME, rows)


def _uq_figures(state: RunState, res, applied: cal.CalibrationMethod | None, scored: list) -> None:
    """The uncertainty figures of the run folder (names: :mod:`ctuq.pipeline.run_folder`); the calibration figure
    has the curve of the ``applied`` calibration method and of each ``scored`` one."""
    out = state.out_dir
    gt = state.ground_truth.detach().cpu() if state.ground_truth is not None else None
    roi = statistics_roi(state.cfg.uq, res.std.shape)
    abs_err = (res.mean - gt).abs() if gt is not None else None
    # what std.tif is: the posterior's std, or its recalibration (e.g. with the bias term)
    std_title = "posterior std" if applied is None else f"std.tif: {applied.describe()}"
    if res.std.ndim == 3:  # volumes: the three orthogonal planes through the centre
        figures.plot_orthogonal_slices(
            out / rf.UNCERTAINTY_SLICES_FIGURE,
            res.mean,
            abs_err if abs_err is not None else res.mean * 0,
            res.std,
            ground_truth=gt,
            roi=roi,
        )
    if abs_err is not None:
        figures.plot_uq_panels(
            out / rf.UNCERTAINTY_FIGURE,
            res.mean,
            abs_err,
            res.std,
            ground_truth=gt,
            roi=roi,
            titles=["ground truth", "DIP reconstruction", "|error|", std_title],
        )
        summary = state.uq_summary
        posterior_curve = (summary["calibration"]["levels"], summary["calibration"]["coverage"])
        curves = {"linearised DIP": posterior_curve}
        before = state.metrics["uq"].get("summary_uncalibrated")
        if applied is not None:  # the recalibrated std and the posterior's own
            curves = {
                f"linearised DIP, {applied.label()} (held-out)": posterior_curve,
                "linearised DIP (uncalibrated)": (before["calibration"]["levels"], before["calibration"]["coverage"]),
            }
        for method in scored:  # what each other method would give, for comparison
            scores = state.metrics["uq"][method.summary_name()]["calibration"]
            curves[method.label(applied=False)] = (scores["levels"], scores["coverage"])
        figures.plot_calibration(out / rf.CALIBRATION_FIGURE, curves)
        _reliability_figure(out / rf.RELIABILITY_FIGURE, summary, before, applied)
        figures.plot_joint_ll(out / rf.JOINT_LL_FIGURE, {"linearised DIP": summary["joint_ll"]})
        figures.plot_error_vs_std(out / rf.ERROR_VS_STD_FIGURE, abs_err, res.std, roi)
    else:
        figures.plot_uq_panels(
            out / rf.UNCERTAINTY_FIGURE,
            res.mean,
            res.mean * 0,
            res.std,
            titles=["DIP reconstruction", "(no ground truth)", std_title],
            roi=roi,
        )
    if res.em_trace:
        trace = [
            {
                "step": r["step"] + 1,
                "a": r["a_new"],
                "gamma": r["gamma"],
                "w_norm2": r["weight_norm_sq"],
                "sigma2": r["sigma2_new"],
                "log_evidence": r.get("log_evidence"),
            }
            for r in res.em_trace
        ]
        figures.plot_em_trace(out / rf.EM_TRACE_FIGURE, trace)
