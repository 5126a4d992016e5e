"""The uncertainty phase of a run: linearised inference around the fitted DIP
(:func:`ctuq.pipeline.uq.run_linearized_uq`) → ``std.tif``, the uncertainty figures and the UQ sections of
metrics.json."""

from __future__ import annotations

from typing import Any

from ctuq import figures
from ctuq.metrics import uq_summary_from_moments
from ctuq.outputs import write_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.checkpoints import shard_moments_files
from ctuq.pipeline.phases import RunState
from ctuq.pipeline.uq import run_linearized_uq, statistics_roi

__all__ = ["phase_uq"]


def phase_uq(state: RunState) -> None:
    """Linearised inference (:func:`ctuq.pipeline.uq.run_linearized_uq`) → ``std.tif``, UQ figures and metrics.

    Reads ``state.model``/``state.net_input`` (the fitted DIP), ``state.op``/``state.y``; checkpoints into the run
    folder (``uq_state.pt``, ``uq_moments.pt``) and resumes from there with ``--resume``. The statistics stream:
    no image sample is kept in memory; ``uq.save_samples`` writes them to ``samples/``.
    """
    cfg = state.cfg
    if state.model is None:
        raise RuntimeError("the uncertainty phase needs the fitted DIP (state.model)")
    res = run_linearized_uq(
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
    )
    state.uq_result = res
    if not state.is_root:  # a rank > 0 of a sharded run: its running sums went to rank 0, which writes
        return
    write_tiff(state.out_dir / rf.STD_NAME, res.std)
    uq_metrics: dict[str, Any] = {
        "method": "linearised DIP, sampled (dual Matheron sampler, sampled EM)",
        "a": res.a,
        "sigma2": res.sigma2,
        "solver": res.solver,
        "stats": res.stats,
        "timings": res.timings,
        "products": res.products,
        "n_samples": res.n_samples,
        "mean_std": float(res.std.mean()),
    }
    state.metrics["em_trace"] = res.em_trace
    if state.ground_truth is not None:
        summary = uq_summary_from_moments(state.ground_truth.detach().cpu(), res.mean, res.moments)
        state.metrics["marginal_ll"] = summary["marginal_ll"]
        state.metrics["joint_ll"] = summary["joint_ll"]
        state.metrics["coverage"] = summary["coverage"]
        uq_metrics["summary"] = summary
        state.uq_summary = summary
        state.log(
            f"UQ: marginal LL {summary['marginal_ll']:.3f}, joint LL (10×10) "
            f"{summary['joint_ll'].get('10', float('nan')) or float('nan'):.3f}, coverage@0.9 "
            f"{summary['coverage']['0.9']:.3f}, Spearman(std, |error|) {summary['spearman']:.3f}"
        )
    state.metrics["uq"] = uq_metrics
    state.uq_result = res
    if cfg.output.figure:
        _uq_figures(state, res)
    # The running sums are only needed to resume an unfinished prediction; they are large, so drop them now
    # (a sharded run's per-rank files too: each rank wrote its own).
    (state.out_dir / rf.UQ_MOMENTS_NAME).unlink(missing_ok=True)
    for p in shard_moments_files(state.out_dir):
        p.unlink(missing_ok=True)
    if not cfg.output.keep_checkpoint and (state.out_dir / rf.UQ_STATE_NAME).exists():
        (state.out_dir / rf.UQ_STATE_NAME).unlink()


def _uq_figures(state: RunState, res) -> None:
    """The uncertainty figures of the run folder (names: :mod:`ctuq.pipeline.run_folder`)."""
    out = state.out_dir
    gt = state.ground_truth.detach().cpu() if state.ground_truth is not None else None
    roi = statistics_roi(state.cfg.uq, res.std.shape)
    abs_err = (res.mean - gt).abs() if gt is not None else None
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
            titles=["ground truth", "DIP reconstruction", "|error|", "posterior std"],
        )
        summary = state.uq_summary
        cal = summary["calibration"]
        figures.plot_calibration(out / rf.CALIBRATION_FIGURE, {"linearised DIP": (cal["levels"], cal["coverage"])})
        figures.plot_joint_ll(out / rf.JOINT_LL_FIGURE, {"linearised DIP": summary["joint_ll"]})
        figures.plot_error_vs_std(out / rf.ERROR_VS_STD_FIGURE, abs_err, res.std, roi)
    else:
        figures.plot_uq_panels(
            out / rf.UNCERTAINTY_FIGURE,
            res.mean,
            res.mean * 0,
            res.std,
            titles=["DIP reconstruction", "(no ground truth)", "posterior std"],
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
