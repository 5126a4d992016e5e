"""The uncertainty phase of a run with ``uq.method = mc_dropout``: the MC-dropout baseline around a DIP fitted with
dropout (``model.dropout > 0``) → ``std.tif``, ``mean.tif`` and ``metrics.json["uq"]``.

``uq.samples`` stochastic forward passes of the fitted network with dropout active, ``uq.sample_chunk`` passes per
forward call, pass ``j``'s masks drawn from a generator seeded by ``(seed, j)``
(:func:`ctuq.reconstruct.mc_dropout_predict`): their mean is the predictive mean (``mean.tif``; the DIP with dropout
off is ``reconstruction.tif``), their sample std the error bars (``std.tif``). With a ground truth they are scored by
:func:`ctuq.metrics.uq_summary` with ``centering="empirical"`` (the passes are not zero-mean), in the region
``uq.roi`` and with the patch sizes ``uq.patch_sizes``: the scores of the linearised posterior's runs, so both
methods compare on one table (the walnut study, ``docs/walnut_study.md``).

There is no posterior object behind the passes: no held-out check (it projects posterior samples onto unused
angles), no calibration of ``std.tif``, no ``Run.posterior``. The passes take seconds, so nothing is checkpointed: a
resumed run repeats them, with the same numbers.
"""

from __future__ import annotations

import torch

from ctuq import figures
from ctuq.calibration.base import NONE
from ctuq.config import ConfigError
from ctuq.errors import CTUQError
from ctuq.metrics import uq_summary
from ctuq.metrics.image import image_metrics
from ctuq.options import Centering
from ctuq.outputs import write_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.moments import statistics_roi
from ctuq.pipeline.phases import RunState
from ctuq.reconstruct.mc_dropout import dropout_layers, mc_dropout_predict
from ctuq.registry import CALIBRATIONS

__all__ = ["phase_mc_dropout", "HELDOUT_SKIPPED"]

HELDOUT_SKIPPED = "uq.method = mc_dropout: the held-out check projects posterior samples, and MC dropout has none"

# files of a linearised inference that an MC-dropout rerun in the same folder (`ctuq uq RUN --set uq.method=...`)
# would otherwise leave describing another method
_STALE = (rf.STD_UNCALIBRATED_NAME, rf.HELDOUT_ROWS_NAME, rf.HELDOUT_NAME, rf.UQ_STATE_NAME, rf.UQ_MOMENTS_NAME)


def phase_mc_dropout(state: RunState) -> None:
    """MC dropout around the fitted DIP (``state.model``, its input ``state.net_input``; module docstring) →
    ``std.tif``, ``mean.tif``, ``metrics.json["uq"]`` (with a ground truth its ``summary`` and ``mean_metrics``,
    and the run's headline ``marginal_ll``/``joint_ll``/``coverage``) and, with ``output.figure``, the uncertainty
    figures.

    Raises
    ------
    ConfigError
        The fitted network has no dropout layer (``model.dropout`` was 0 when it was fitted), naming the keys.
    CTUQError
        A sharded run (``torchrun``): the passes run in one process.
    """
    cfg, out = state.cfg, state.out_dir
    if state.model is None:
        raise RuntimeError("the uncertainty phase needs the fitted DIP (state.model)")
    if state.shard is not None and state.shard.distributed:
        raise CTUQError("uq.method = mc_dropout: the stochastic passes run in one process; run `ctuq uq` unsharded")
    if not dropout_layers(state.model):
        raise ConfigError(
            "uq.method = mc_dropout: the fitted DIP has no dropout layer; fit it with model.dropout > 0 (e.g. 0.05)"
        )
    pred = mc_dropout_predict(
        state.model,
        state.net_input,
        cfg.uq.samples,
        scale=cfg.dip.scale,
        seed=cfg.seed,
        batch=cfg.uq.sample_chunk,
        progress=state.progress,
    )
    state.uq_result = pred
    for name in _STALE:
        (out / name).unlink(missing_ok=True)
    write_tiff(out / rf.STD_NAME, pred.std, voxel_size=state.voxel_size)
    write_tiff(out / rf.MEAN_NAME, pred.mean, voxel_size=state.voxel_size)
    rates = ", ".join(f"{p:g}" for p in sorted(set(pred.rates)))
    if cfg.uq.calibration not in ("auto", NONE):
        state.warn(
            f"uq.calibration = {cfg.uq.calibration}: MC dropout has no held-out check; std.tif is not calibrated"
        )
    uq = {
        "method": f"MC dropout: {pred.n_passes} stochastic passes of the DIP fitted with dropout p = {rates}",
        "n_samples": pred.n_passes,
        "mean_std": float(pred.std.mean()),
        "prediction": pred.summary(),
        "timings": {"prediction": pred.time_s},
        "heldout_skipped": HELDOUT_SKIPPED,
        "calibration": {"mode": NONE, "setting": str(cfg.uq.calibration), **CALIBRATIONS[NONE].unfitted_report()},
    }
    state.log(f"ran: {uq['method']} in {pred.time_s:.1f} s")
    if state.ground_truth is not None:
        gt = state.ground_truth.detach().cpu()
        roi = statistics_roi(cfg.uq, tuple(gt.shape))
        summary = uq_summary(
            gt, pred.mean, pred.passes, roi, patch_sizes=cfg.uq.patch_sizes, centering=Centering.EMPIRICAL
        )
        uq["summary"] = summary
        uq["mean_metrics"] = image_metrics(pred.mean, gt)
        state.metrics.update(
            marginal_ll=summary["marginal_ll"], joint_ll=summary["joint_ll"], coverage=summary["coverage"]
        )
        state.uq_summary = summary
        state.log(
            f"UQ: marginal LL {summary['marginal_ll']:.3f}, joint LL (10×10) "
            f"{summary['joint_ll'].get('10', float('nan')) or float('nan'):.3f}, coverage@0.9 "
            f"{summary['coverage']['0.9']:.3f}"
        )
    state.metrics["uq"] = uq
    if cfg.output.figure:
        _figures(state, pred.mean, pred.std, roi=statistics_roi(cfg.uq, tuple(pred.std.shape)))


def _figures(state: RunState, mean: torch.Tensor, std: torch.Tensor, roi) -> None:
    """The run folder's uncertainty figures for the passes' ``mean`` and ``std`` (mm⁻¹; 2D)."""
    out = state.out_dir
    if std.ndim != 2:
        return
    if state.ground_truth is None:
        figures.plot_uq_panels(
            out / rf.UNCERTAINTY_FIGURE,
            mean,
            mean * 0,
            std,
            titles=["MC-dropout mean", "(no ground truth)", "MC-dropout std"],
            roi=roi,
        )
        return
    gt = state.ground_truth.detach().cpu()
    abs_err = (mean - gt).abs()
    figures.plot_uq_panels(
        out / rf.UNCERTAINTY_FIGURE,
        mean,
        abs_err,
        std,
        ground_truth=gt,
        roi=roi,
        titles=["ground truth", "MC-dropout mean", "|error|", "MC-dropout std"],
    )
    summary = state.uq_summary
    levels = (summary["calibration"]["levels"], summary["calibration"]["coverage"])
    figures.plot_calibration(out / rf.CALIBRATION_FIGURE, {"MC dropout": levels})
    figures.plot_joint_ll(out / rf.JOINT_LL_FIGURE, {"MC dropout": summary["joint_ll"]})
    figures.plot_error_vs_std(out / rf.ERROR_VS_STD_FIGURE, abs_err, std, roi)
