"""The uncertainty phase of a run: linearised inference around the fitted DIP
(:func:`ctuq.pipeline.uq.run_linearized_uq`) → ``std.tif``, the uncertainty figures and the UQ sections of
metrics.json; then the held-out check on the scan's unused angles (:mod:`ctuq.pipeline.calibration`,
``metrics.json["uq"]["heldout"]``, ``heldout_calibration.png``) and, with ``uq.calibration: heldout``, the std map
rescaled by its ``k``, with ``uq.calibration: bias``, ``sqrt(std² + τ² M)`` with its bias std ``τ`` inside the object
mask ``M`` (``std.tif``; ``std_uncalibrated.tif`` keeps the posterior's)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ctuq import figures
from ctuq.metrics import SampleMoments, uq_summary_from_moments
from ctuq.options import Calibration, NoiseModel, Prior
from ctuq.outputs import write_tiff
from ctuq.pipeline import calibration as calib
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.checkpoints import shard_moments_files
from ctuq.pipeline.phases import RunState
from ctuq.pipeline.uq import run_linearized_uq, statistics_roi

__all__ = ["phase_uq", "resolve_calibration", "scaled_moments", "biased_moments"]


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
        variances=state.data.variances if state.data is not None else None,
    )
    state.uq_result = res
    if not state.is_root:  # a rank > 0 of a sharded run: its running sums went to rank 0, which writes
        return
    heldout, skipped = _heldout_check(state, res)
    mode = resolve_calibration(cfg.uq.calibration, heldout is not None, prior=cfg.uq.prior)
    if cfg.uq.calibration == Calibration.AUTO:
        state.log(f"calibration: {mode} (uq.calibration = auto; {'a held-out check ran' if heldout else skipped})")
        if heldout is None and state.shard is not None and state.shard.distributed:
            # the same run in one process applies the bias model: say so rather than differ silently
            state.warn(
                "uq.calibration = auto: a sharded run has no held-out check, so std.tif is the posterior's own "
                "(a run in one process would add the held-out bias model); rerun `ctuq uq` in one process for it"
            )
    k = heldout.k if heldout is not None and mode == Calibration.HELDOUT else None
    # the bias model (τ², its mask): applied with uq.calibration = bias, scored for comparison otherwise
    bias = _bias_model(heldout, res.mean)
    applied_bias = bias if mode == Calibration.BIAS else None
    if mode != Calibration.NONE and k is None and applied_bias is None:
        state.warn(f"uq.calibration = {mode}: no held-out check, so std.tif is the uncalibrated posterior std")
    if k is not None:
        write_tiff(state.out_dir / rf.STD_UNCALIBRATED_NAME, res.std, voxel_size=state.voxel_size)
        res.std = res.std * k
        state.log(f"uq.calibration = heldout: std.tif = posterior std × {k:.3f}")
    elif applied_bias is not None:
        write_tiff(state.out_dir / rf.STD_UNCALIBRATED_NAME, res.std, voxel_size=state.voxel_size)
        if applied_bias["tau"] > 0:  # τ = 0 leaves the posterior's map bit for bit
            res.std = (res.std.double().pow(2) + applied_bias["variance"]).sqrt().to(res.std.dtype)
        state.log(
            f"uq.calibration = bias: std.tif = sqrt(posterior std² + τ² M), τ = {applied_bias['tau']:.3g} mm⁻¹ "
            f"inside {100 * applied_bias['mask_fraction']:.0f} % of the pixels"
        )
    else:
        (state.out_dir / rf.STD_UNCALIBRATED_NAME).unlink(missing_ok=True)  # a rerun without recalibration
    write_tiff(state.out_dir / rf.STD_NAME, res.std, voxel_size=state.voxel_size)
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
    if heldout is not None:
        uq_metrics["heldout"] = heldout.report
    else:
        uq_metrics["heldout_skipped"] = skipped
    uq_metrics["calibration"] = {"mode": str(mode), "setting": str(cfg.uq.calibration), "k": k}
    if mode == Calibration.BIAS:
        uq_metrics["calibration"].update(
            {key: (applied_bias or {}).get(key) for key in ("tau", "tau_se", "tau_interval_95", "mask_fraction")}
        )
    state.metrics["em_trace"] = res.em_trace
    if state.ground_truth is not None:
        gt = state.ground_truth.detach().cpu()
        posterior_moments = res.moments
        if k is not None or applied_bias is not None:
            # the posterior's own numbers, for the evidence that the recalibration helps (or not)
            uq_metrics["summary_uncalibrated"] = uq_summary_from_moments(gt, res.mean, res.moments)
            res.moments = scaled_moments(res.moments, k) if k is not None else _with_bias(res.moments, applied_bias)
        if heldout is not None and k is None:
            # what uq.calibration = heldout would score, from the same posterior: the evidence for (or against) the
            # rescaling without a second inference (the calibration study reads it)
            rescaled = scaled_moments(posterior_moments, heldout.k)
            uq_metrics["summary_recalibrated"] = {**uq_summary_from_moments(gt, res.mean, rescaled), "k": heldout.k}
        if bias is not None and applied_bias is None:
            # likewise what uq.calibration = bias would score
            biased = _with_bias(posterior_moments, bias)
            uq_metrics["summary_bias"] = {
                **uq_summary_from_moments(gt, res.mean, biased),
                **{key: bias[key] for key in ("tau", "tau_se", "mask_fraction")},
            }
        summary = uq_summary_from_moments(gt, res.mean, res.moments)
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
    if heldout is not None:  # the rows always (`ctuq uq RUN --check` rescores them), the figure when asked
        calib.write_heldout(state.out_dir, heldout, json_file=False, figure=cfg.output.figure)
    if cfg.output.figure:
        _uq_figures(state, res)
    # The running sums are only needed to resume an unfinished prediction; they are large, so drop them now
    # (a sharded run's per-rank files too: each rank wrote its own).
    (state.out_dir / rf.UQ_MOMENTS_NAME).unlink(missing_ok=True)
    for p in shard_moments_files(state.out_dir):
        p.unlink(missing_ok=True)
    if not cfg.output.keep_checkpoint and (state.out_dir / rf.UQ_STATE_NAME).exists():
        (state.out_dir / rf.UQ_STATE_NAME).unlink()


def resolve_calibration(calibration, checked: bool, prior: str = Prior.GPRIOR) -> Calibration:
    """The recalibration a run applies: ``uq.calibration`` itself, except ``auto`` (the default), which is ``none``
    without a held-out check (``checked``: the scan has unused angles) and otherwise ``bias`` for the g-prior and
    ``heldout`` for ``uq.prior = tv_predcp`` (docs/calibration.md: ``bias`` with per-ray noise was the g-prior's best
    combination in the calibration study; TV-PredCP's posterior is 3–5× too narrow everywhere, which the global ``k``
    fixes and a bias inside the object does not)."""
    calibration = Calibration(calibration)
    if calibration != Calibration.AUTO:
        return calibration
    if not checked:
        return Calibration.NONE
    return Calibration.HELDOUT if prior == Prior.TV_PREDCP else Calibration.BIAS


def scaled_moments(moments: SampleMoments, k: float) -> SampleMoments:
    """A copy of ``moments`` whose samples are ``k ×`` those fed to it (covariances × ``k²``): the statistics of the
    recalibrated posterior."""
    out = copy.deepcopy(moments)
    sd = moments.state_dict()
    sd = {
        **sd,
        "sum_sq": sd["sum_sq"] * (k * k),
        "patch_sums": {p: t * (k * k) for p, t in sd["patch_sums"].items()},
    }
    return out.load_state_dict(sd)


def biased_moments(moments: SampleMoments, variance: torch.Tensor) -> SampleMoments:
    """A copy of ``moments`` whose covariance has ``diag(variance)`` added (``variance``: ``image_shape``, mm⁻²,
    e.g. the bias model's ``τ² M``): pixel variances and every patch covariance of the joint LL gain it on their
    diagonal, as if the samples had an independent pixel noise of that variance. ``moments`` is left unchanged.

    The sums are exact, not sampled: fed through :meth:`SampleMoments.update` as ``P²`` deterministic images
    (``P`` the largest patch size) that each carry ``sqrt(k · variance)`` on one residue class of (row, column)
    modulo ``P``; two pixels of one patch never share a class, so no cross term appears."""
    k = moments.n_samples
    var = torch.as_tensor(variance, dtype=torch.float64)
    if tuple(var.shape) != moments.image_shape or not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise ValueError(
            f"biased_moments: variance must be finite, ≥ 0 and of shape {moments.image_shape}, got {tuple(var.shape)}"
        )
    sd = moments.state_dict()
    extra = copy.deepcopy(moments).load_state_dict(
        {
            **sd,
            "n_samples": 0,
            "sum_sq": torch.zeros_like(sd["sum_sq"]),
            "patch_sums": {p: torch.zeros_like(t) for p, t in sd["patch_sums"].items()},
        }
    )
    period = max(moments.patch_sizes)
    amp = (var * k).sqrt()
    rows = torch.arange(amp.shape[-2]) % period
    cols = torch.arange(amp.shape[-1]) % period
    for a in range(period):
        on_row = (rows == a).to(torch.float64)[:, None]
        extra.update(torch.stack([amp * (on_row * (cols == b).to(torch.float64)[None, :]) for b in range(period)]))
    ed = extra.state_dict()
    out = copy.deepcopy(moments)
    return out.load_state_dict(
        {
            **sd,
            "sum_sq": sd["sum_sq"] + ed["sum_sq"],
            "patch_sums": {p: t + ed["patch_sums"][p] for p, t in sd["patch_sums"].items()},
        }
    )


def _with_bias(moments: SampleMoments, bias: dict) -> SampleMoments:
    """``moments`` with the bias model's ``τ² M`` added (:func:`biased_moments`); ``moments`` itself when ``τ = 0``."""
    return biased_moments(moments, bias["variance"]) if bias["tau"] > 0 else moments


def _bias_model(heldout: calib.HeldoutResult | None, mean: torch.Tensor) -> dict | None:
    """The held-out check's bias model on the image: ``tau`` (mm⁻¹), ``tau_se`` (bootstrap, else curvature; ``None``
    when ``τ = 0``), ``tau_interval_95``, ``mask_fraction`` and ``variance`` ``τ² M`` (``mean``'s shape, float64
    mm⁻²; :func:`ctuq.pipeline.calibration.bias_variance`); ``None`` without a check or a bias fit."""
    fit = heldout.bias if heldout is not None else None
    if fit is None:
        return None
    tau = float(fit["tau"])
    variance, fraction = calib.bias_variance(mean, tau)
    se = fit["se_bootstrap"] if fit.get("se_bootstrap") is not None else fit.get("se_curvature")
    return {
        "tau": tau,
        "tau_se": se,
        "tau_interval_95": fit.get("interval_95"),
        "mask_fraction": fraction,
        "variance": torch.from_numpy(variance),
    }


def _heldout_check(state: RunState, res) -> tuple[calib.HeldoutResult | None, str]:
    """``(result, "")``: the held-out check of the run's posterior; ``(None, reason)`` with the one-line reason also
    on stderr when it cannot run (it goes into ``metrics.json["uq"]["heldout_skipped"]``)."""
    reason = ""
    if state.metrics.get("data", {}).get("source") == "given in code":
        reason = "the problem was given in code, not as a scan with unused angles"
    elif state.shard is not None and state.shard.distributed:
        reason = "a sharded run; run `ctuq uq RUN --check` on the finished folder"
    held = None
    if not reason:
        held, reason = calib.heldout_data(state.cfg, state.device, progress=False)
    if held is None:
        state.log(f"held-out check skipped: {reason}")
        return None, reason
    result = calib.run_heldout_check(
        res.posterior,
        res.mean,
        state.cfg.dip.scale,
        held,
        # the std map's own first samples (same seed): no more than the run drew (a short run stays short)
        n_samples=min(calib.HELDOUT_SAMPLES, state.cfg.uq.samples),
        chunk_size=state.cfg.uq.sample_chunk,
        seed=state.cfg.seed + 1,
        command=f"ctuq uq {state.out_dir} --check",
        # the noise model the run resolved (uq.noise = auto): the held-out rows get the same one
        per_ray=res.stats["noise"]["model"] == NoiseModel.PER_RAY,
    )
    state.log(calib.verdict(result.report) + f" [{result.report['seconds']:.1f} s]")
    return result, ""


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
        curves = {"linearised DIP": (cal["levels"], cal["coverage"])}
        before = state.metrics["uq"].get("summary_uncalibrated")
        if before is not None:  # uq.calibration = heldout or bias: the recalibrated std and the posterior's own
            cal_metrics = state.metrics["uq"]["calibration"]
            label = (
                f"std × {cal_metrics['k']:.3g}"
                if cal_metrics["k"] is not None
                else f"sqrt(std² + τ² M), τ = {cal_metrics['tau']:.3g}"
            )
            curves = {
                f"linearised DIP, {label} (held-out)": curves["linearised DIP"],
                "linearised DIP (uncalibrated)": (before["calibration"]["levels"], before["calibration"]["coverage"]),
            }
        recal = state.metrics["uq"].get("summary_recalibrated")
        if recal is not None:  # not uq.calibration = heldout: what the held-out k would give, for comparison
            curves[f"std × {recal['k']:.3g} (held-out k, not applied)"] = (
                recal["calibration"]["levels"],
                recal["calibration"]["coverage"],
            )
        bias = state.metrics["uq"].get("summary_bias")
        if bias is not None:  # what the held-out bias model would give
            curves[f"sqrt(std² + τ² M), τ = {bias['tau']:.3g} (not applied)"] = (
                bias["calibration"]["levels"],
                bias["calibration"]["coverage"],
            )
        figures.plot_calibration(out / rf.CALIBRATION_FIGURE, curves)
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
