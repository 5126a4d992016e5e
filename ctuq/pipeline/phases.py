"""The phases of a reconstruction run and the state they share.

A run is a list of *phases* over one :class:`RunState`::

    ctuq reconstruct:  load → fbp → [tv] → dip → [uq] → write
    ctuq uq:           load → fbp → restore_dip → uq → write

Each phase is a function ``phase(state) -> None`` that reads what earlier phases left in ``state`` and adds its
own results (images go into ``state.images``, numbers into ``state.metrics``, warnings into ``state.warnings``);
:func:`ctuq.pipeline.runner.run_phases` times every phase into ``metrics.json['timings']``. The uncertainty
phase lives in :mod:`ctuq.pipeline.uq_phase`; it finds the fitted network in ``state.model``/``state.net_input``
and the operator/data in ``state.op``/``state.y``. File names are those of :mod:`ctuq.pipeline.run_folder`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tifffile
import torch

from ctuq import __version__, figures
from ctuq.config import Config, ConfigError
from ctuq.errors import CTUQError, NonFiniteLossError
from ctuq.metrics.image import image_metrics, psnr
from ctuq.models import UNet, build_unet, count_parameters, make_net_input, read_model_file, write_model_file
from ctuq.operators.fbp import fbp, fdk
from ctuq.options import Tuning, TVCriterion, TVInit, WarmStart
from ctuq.outputs import (
    package_versions,
    result_channels,
    voxel_size_of,
    write_metrics,
    write_results_h5,
    write_stack,
    write_tiff,
)
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.scan import load_scan
from ctuq.reconstruct.classical import tv_reconstruction
from ctuq.reconstruct.dip import RESTORE_KEYS, fit_dip, load_checkpoint
from ctuq.reconstruct.heldout import HeldoutMonitor, tv_weight_path, weight_grid
from ctuq.reconstruct.pretrain import load_pretrained
from ctuq.reconstruct.warm_start import fit_to_image
from ctuq.utils import atomic_path

__all__ = [
    "RunState",
    "Phase",
    "phase_load",
    "split_heldout",
    "phase_fbp",
    "phase_tv",
    "phase_dip",
    "phase_restore_dip",
    "phase_write",
    "build_model",
    "make_input",
]

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunState:
    """Everything the phases share.

    ``images`` maps method names (``'fbp'``, ``'tv'``, ``'dip'``) to ``image_shape`` tensors in original units
    (mm⁻¹). ``metrics`` is merged into metrics.json (phases add their own sections); ``warnings`` (one line
    each) are logged as they arise and go into metrics.json's ``"warnings"``. ``command`` names the ``ctuq``
    sub-command (the terminal lines name the command :func:`ctuq.log.configure_logging` was given).
    """

    cfg: Config
    out_dir: Path
    device: torch.device
    resume: bool = False
    uq: bool = True
    progress: bool = True
    command: str = "reconstruct"
    data: Any = None
    op: Any = None
    y: torch.Tensor | None = None
    ground_truth: torch.Tensor | None = None
    images: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    model: torch.nn.Module | None = None
    net_input: torch.Tensor | None = None
    dip_result: Any = None
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)
    uq_result: Any = None
    uq_summary: dict | None = None
    shard: Any = None  # ctuq.inference.Shard of a sharded `ctuq uq` (torchrun); None: one process
    tuning: Any = None  # ctuq.data.HeldoutData: the held-out rows the reconstructions are tuned on (split_heldout)

    @property
    def voxel_size(self) -> float | None:
        """The reconstruction grid's voxel edge length (mm; ``None`` for an operator without geometry): the
        physical scale written into the TIFFs."""
        return voxel_size_of(self.op) or voxel_size_of(self.data)

    @property
    def is_root(self) -> bool:
        """Whether this process writes results and logs (always, unless it is a rank > 0 of a sharded run)."""
        return self.shard is None or self.shard.is_root

    def log(self, msg: str) -> None:
        """Log the progress line ``msg`` (INFO; ``[ctuq <command>] msg`` on the terminal, :mod:`ctuq.log`; rank 0
        only in a sharded run)."""
        if self.is_root:
            _log.info(msg)

    def warn(self, msg: str) -> None:
        """Record ``msg`` for metrics.json and log it as a warning (``ctuq <command>: warning: msg``)."""
        self.warnings.append(msg)
        _log.warning(msg)


@dataclasses.dataclass(frozen=True)
class Phase:
    """A named step of a run: ``fn(state)`` updates the :class:`RunState` in place."""

    name: str
    fn: Callable[[RunState], None]


# ------------------------------------------------------------------------------------------------ phases
def phase_load(state: RunState) -> None:
    """Load the scan named by ``cfg.data`` (default: the bundled simulated scan) onto the device, after checking
    the setting against it (:func:`ctuq.pipeline.scan.load_scan`)."""
    # the first record of a run: from here on its log file exists, so a scan that fails to load is recorded there
    _log.debug(f"run folder {state.out_dir}, {state.device}; loading {state.cfg.data.path or 'the bundled scan'}")
    d, path, warnings = load_scan(state.cfg, state.device, progress=state.progress, run_dir=state.out_dir)
    state.data = d
    state.op = d.op
    state.y = d.y.to(state.device)
    state.ground_truth = d.ground_truth.to(state.device) if d.ground_truth is not None else None
    state.metrics["data"] = {
        "path": str(path),
        "image_shape": list(d.op.image_shape),
        "measurement_shape": list(d.op.measurement_shape),
        "operator": type(d.op).__name__,
        "has_ground_truth": state.ground_truth is not None,
        "voxel_size_mm": state.voxel_size,
    }
    state.log(
        f"loaded {path}: image {tuple(d.op.image_shape)}, sinogram {tuple(d.op.measurement_shape)}, "
        f"operator {type(d.op).__name__} on {state.device}"
    )
    for msg in warnings:
        state.warn(msg)
    split_heldout(state)


def tunes_on_heldout(cfg: Config) -> bool:
    """Whether a run of ``cfg`` tunes a reconstruction on held-out angles (``tv.tuning``/``dip.tuning`` =
    ``heldout`` for an enabled method): then the held-out angles are split between the tuning and the check."""
    return (cfg.tv.enabled and cfg.tv.tuning == Tuning.HELDOUT) or (
        cfg.dip.enabled and cfg.dip.tuning == Tuning.HELDOUT
    )


def split_heldout(state: RunState) -> None:
    """Split the loaded problem's held-out angles when the run tunes on them (:func:`tunes_on_heldout`): the even
    positions become ``state.tuning`` (what TV and the DIP are tuned on), the odd ones stay ``state.data.heldout``
    (what the held-out check scores the std map on), so the check never scores rows the reconstruction was chosen
    by (:meth:`ctuq.data.HeldoutData.split`). The rule depends on the config alone, so ``ctuq uq RUN`` splits as the
    run did. Recorded in ``metrics["data"]["heldout_split"]``."""
    held = getattr(state.data, "heldout", None)
    if held is None or held.n_angles < 2 or not tunes_on_heldout(state.cfg):
        return
    state.tuning, check = held.split()
    state.data = dataclasses.replace(state.data, heldout=check)  # a copy: a problem given in code is left as it was
    state.metrics.setdefault("data", {})["heldout_split"] = {
        "tuning_angles": state.tuning.n_angles,
        "check_angles": state.data.heldout.n_angles,
    }
    state.log(
        f"held-out angles: {state.tuning.n_angles} tune the reconstructions, {state.data.heldout.n_angles} check "
        "the uncertainty"
    )


def _monitor(state: RunState, *, weighted: bool = True, **kwargs) -> HeldoutMonitor | None:
    """The held-out error on the run's tuning rows (``None`` when it has none), each row weighted by its inverse
    variance when the scan gives variances and ``weighted``."""
    t = state.tuning
    if t is None:
        return None
    var = t.variances.to(t.op.device) if weighted and t.variances is not None else None
    return HeldoutMonitor(t.op, t.y.to(t.op.device), var, **kwargs)


def phase_fbp(state: RunState) -> None:
    """Filtered back-projection (2D) / FDK (3D) baseline → ``images['fbp']``, ``fbp.tif``."""
    fc = state.cfg.fbp
    analytic = fbp if state.op.ndim == 2 else fdk
    x = analytic(state.op, state.y, filter_type=fc.filter, frequency_scaling=fc.frequency_scaling)
    state.images["fbp"] = x.to(state.device, torch.float32)
    write_tiff(state.out_dir / rf.FBP_NAME, x, voxel_size=state.voxel_size)


def phase_tv(state: RunState) -> None:
    """TV-regularised baseline with ODL's PDHG from the FBP or zeros (``tv.init``) → ``images['tv']``, ``tv.tif``;
    with ``output.psnr_trace`` and a ground truth also the PSNR after every iteration (``metrics["tv"]["psnr_trace"]``,
    dB)."""
    tc = state.cfg.tv
    trace = _psnr_trace(state)

    def record(_iteration: int, x: torch.Tensor) -> None:
        trace.append(psnr(x.detach().cpu(), state.ground_truth.cpu()))

    x0 = state.images.get("fbp") if tc.init == TVInit.FBP else None
    weight, tuning = tc.weight, None
    # the discrepancy criterion compares unweighted means of the used and the held-out rows
    monitor = _monitor(state, weighted=tc.criterion == TVCriterion.HELDOUT) if tc.tuning == Tuning.HELDOUT else None
    if monitor is not None:
        path = tv_weight_path(
            state.op,
            state.y,
            monitor,
            weights=weight_grid(tc.weight_min, tc.weight_max, tc.per_decade),
            iterations=tc.path_iterations,
            x0=x0,
            nonnegative=tc.nonnegative,
            isotropic=tc.isotropic,
            ground_truth=state.ground_truth,
            stop_early=tc.path_stop_early,
            criterion=tc.criterion,
            progress=state.progress,
        )
        weight, x0, tuning = path.weight, path.reconstruction, path.summary()
        rule = "the lowest error on" if tc.criterion == TVCriterion.HELDOUT else "the discrepancy principle, noise from"
        state.log(
            f"TV: λ = {weight:.3g} ({rule} {monitor.n_angles} held-out angles) along a path of "
            f"{len(path.weights)} weights ({path.time_s:.1f} s)"
        )
        if path.path_weight in (path.weights[0], tc.weight_min) and len(path.weights) > 1:
            state.warn(
                f"tv.tuning: the chosen λ = {weight:.3g} is at the end of the path [tv.weight_min, tv.weight_max] = "
                f"[{tc.weight_min:g}, {tc.weight_max:g}]; widen it"
            )
    elif tc.tuning == Tuning.HELDOUT:
        state.log(f"TV: no held-out angles to tune on; fixed λ = tv.weight = {weight:g}")
    res = tv_reconstruction(
        state.op,
        state.y,
        weight=weight,
        iterations=tc.iterations,
        nonnegative=tc.nonnegative,
        isotropic=tc.isotropic,
        x0=x0,
        progress=state.progress,
        callback=None if trace is None else record,
    )
    state.images["tv"] = res["reconstruction"]
    state.metrics["tv"] = {k: res[k] for k in ("iterations", "time_s", "objective", "op_norm")}
    state.metrics["tv"]["weight"] = weight
    if tuning is not None:
        state.metrics["tv"]["tuning"] = tuning
    if trace is not None:
        state.metrics["tv"]["psnr_trace"] = trace
    write_tiff(state.out_dir / rf.TV_NAME, res["reconstruction"], voxel_size=state.voxel_size)


def _psnr_trace(state: RunState) -> list[float] | None:
    """An empty list to collect the PSNR (dB) of every iteration in, when ``output.psnr_trace`` asks for it and the
    scan has a ground truth; else ``None``."""
    return [] if state.cfg.output.psnr_trace and state.ground_truth is not None else None


def build_model(cfg: Config, ndim: int) -> torch.nn.Module:
    """The U-Net of ``cfg.model`` (2D or 3D by ``ndim``) with seeded initial weights (``cfg.seed``), optionally
    loaded from ``cfg.model.pretrained`` (:func:`ctuq.reconstruct.pretrain.load_pretrained`)."""
    mc = cfg.model
    torch.manual_seed(cfg.seed)
    model = build_unet(
        mc.preset,
        channels=mc.channels,
        skip_channels=mc.skip_channels,
        ndim=ndim,
        norm_groups=mc.norm_groups,
        sigmoid=mc.sigmoid,
        dropout=mc.dropout,
    )
    if mc.pretrained:
        load_pretrained(model, mc.pretrained)
    return model


def make_input(cfg: Config, state: RunState) -> torch.Tensor:
    """The fixed network input ``(1, 1, *image_shape)``: seeded noise, or the FBP or TV image × ``dip.scale``
    (educated DIP, ``model.input = fbp | tv``; the FBP when a run has no TV image: :func:`_warn_without_tv`)."""
    source = "fbp" if cfg.model.input == "tv" and "tv" not in state.images else cfg.model.input
    if source in ("fbp", "tv"):
        if source not in state.images:
            raise ConfigError("model.input = 'fbp' needs the FBP phase")
        return (state.images[source].detach().cpu() * cfg.dip.scale)[None, None].float()
    return make_net_input(state.op.image_shape, channels=1, seed=cfg.seed, std=cfg.model.input_std)


def phase_dip(state: RunState) -> None:
    """Fit the deep image prior → ``images['dip']``, ``reconstruction.tif``, ``dip_model.pt`` (a model file,
    :mod:`ctuq.models.model_file`), ``dip_checkpoint.pt``.

    With ``dip.tuning = heldout`` and held-out angles to tune on, the fit keeps its iterate with the lowest held-out
    error (:class:`~ctuq.reconstruct.heldout.HeldoutMonitor`); with ``dip.tv_weights`` too, one fit per candidate TV
    weight γ (each from the same initial weights, each checkpointed in ``dip_checkpoint_tv<i>.pt``) and the one whose
    kept iterate has the lowest held-out error wins (its checkpoint is copied to ``dip_checkpoint.pt``). With
    ``dip.warm_start = tv`` the network is first fitted to the TV image (:mod:`ctuq.reconstruct.warm_start`), and with
    ``dip.tv_weight_from_tv`` its γ is TV's λ in the DIP's units (:func:`_tv_weight_from_tv`).

    Raises :class:`~ctuq.errors.NonFiniteLossError` naming ``dip.lr`` when the loss becomes NaN or infinite.
    """
    cfg, dc = state.cfg, state.cfg.dip
    _warn_without_tv(state)
    net_input = make_input(cfg, state)
    ckpt = state.out_dir / rf.CHECKPOINT_NAME
    monitor = _monitor(state, every=dc.heldout_every, patience=dc.patience) if dc.tuning == Tuning.HELDOUT else None
    gammas = list(dc.tv_weights) if monitor is not None and dc.tv_weights else [dc.tv_weight]
    matched = _tv_weight_from_tv(state) if dc.tv_weight_from_tv else None
    if matched is not None:
        gammas = [matched]
    elif dc.tv_weights and monitor is None:
        state.log(f"DIP: no held-out angles to choose among dip.tv_weights; dip.tv_weight = {dc.tv_weight:g}")
    paths = [ckpt]
    if len(gammas) > 1:
        paths = [state.out_dir / rf.CANDIDATE_CHECKPOINT.format(i) for i in range(len(gammas))]
    if state.resume and not any(p.is_file() for p in paths):
        state.log(f"--resume: no checkpoint {paths[0]} yet, starting the DIP from iteration 0")
    model = build_model(cfg, state.op.ndim)
    start, warm_psnr = _warm_start(state, model, net_input)
    stop = f"at most {dc.iterations} iterations" if monitor is not None else f"{dc.iterations} iterations"
    each = f" for each of {len(gammas)} TV weights γ" if len(gammas) > 1 else ""
    state.log(
        f"DIP: U-Net {count_parameters(model):,} parameters "
        f"({count_parameters(model, conv_weights_only=True):,} conv weights), {stop}{each}"
    )
    best, search = None, []
    for i, (gamma, path) in enumerate(zip(gammas, paths)):
        if i > 0:  # the same initial weights
            model = build_model(cfg, state.op.ndim)
            model.load_state_dict(start)
        result = _fit_dip(state, model, net_input, gamma, path, monitor)
        # the held-out error at the kept iterate (inf without held-out selection: one candidate only then)
        score = result.heldout_error if result.heldout_error is not None else math.inf
        if len(gammas) > 1:
            search.append({"tv_weight": gamma, "heldout_error": score, "best_iteration": result.best_iteration,
                           "psnr": result.best_psnr})  # fmt: skip
            state.log(f"DIP: γ = {gamma:g}: held-out error {score:.4g} at iteration {result.best_iteration}")
        if best is None or score < best[2]:
            best = (model, result, score, gamma, path)
    model, result, _, gamma, path = best
    if len(gammas) > 1:
        with atomic_path(ckpt) as tmp:  # the winner's checkpoint under the name `ctuq uq` restores from
            shutil.copyfile(path, tmp)
        state.log(f"DIP: γ = {gamma:g} chosen among dip.tv_weights by the held-out error")
    state.model, state.net_input, state.dip_result = model, result.net_input, result
    state.images["dip"] = result.reconstruction
    state.metrics["dip"] = {
        **result.summary(),
        "tv_weight": gamma,
        "n_parameters": count_parameters(model),
        "n_conv_weights": count_parameters(model, conv_weights_only=True),
    }
    if warm_psnr is not None:
        state.metrics["dip"]["warm_start_psnr_to_tv"] = warm_psnr
    if search:
        state.metrics["dip"]["tv_weight_search"] = search
    if _psnr_trace(state) is not None:  # output.psnr_trace: the fit's own PSNR after every iteration (dB)
        state.metrics["dip"]["psnr_trace"] = list(result.psnr_history or [])
    if result.heldout_history is not None:
        state.metrics["dip"]["heldout_trace"] = [list(p) for p in result.heldout_history]
        state.log(
            f"DIP: kept iteration {result.best_iteration} of {result.iterations}, the lowest error on "
            f"{monitor.n_angles} held-out angles" + (" (stopped early)" if result.stopped_early else "")
        )
    write_tiff(state.out_dir / rf.RECONSTRUCTION_NAME, result.reconstruction, voxel_size=state.voxel_size)
    if cfg.output.save_model:
        write_model_file(
            state.out_dir / rf.MODEL_NAME,
            model,
            scale=result.scale,
            state_dict=result.best_state_dict,
            net_input=result.net_input,
            input=cfg.model.input,
            best_iteration=result.best_iteration,
            meta={"dip": result.summary()},
        )
    if not cfg.output.keep_checkpoint:
        for p in {ckpt, *paths}:
            p.unlink(missing_ok=True)


def _warn_without_tv(state: RunState) -> None:
    """One warning when the DIP's settings ask for the TV image (``model.input = tv``, ``dip.warm_start = tv``,
    ``dip.tv_weight_from_tv``) and the run has none (``tv.enabled = false``, or a volume): the DIP then starts from
    the FBP input, without a warm start, with ``dip.tv_weight(s)``."""
    if "tv" in state.images:
        return
    dc = state.cfg.dip
    asked = [f"model.input = {state.cfg.model.input}"] if state.cfg.model.input == "tv" else []
    asked += ["dip.warm_start = tv"] if dc.warm_start == WarmStart.TV else []
    asked += ["dip.tv_weight_from_tv"] if dc.tv_weight_from_tv else []
    if asked:
        state.warn(
            f"{', '.join(asked)} without the TV baseline (tv.enabled = false, or a volume): the DIP starts from the "
            "FBP input, without a warm start, with dip.tv_weight"
        )


def _tv_weight_from_tv(state: RunState) -> float | None:
    """The DIP's TV weight ``γ`` that balances data and TV as the TV baseline's ``λ`` does (``dip.tv_weight_from_tv``).

    The DIP minimises ``mean((T x_s − s y)²) + γ TV(x_s)`` with ``x_s = s x`` (:func:`ctuq.reconstruct.dip.fit_dip`);
    times ``c / (2 s²)`` that is ``½‖Tx − y‖² + (γ c / 2s) TV(x)``, TV's objective with ``λ = γ c / 2s``, so
    ``γ = 2 s λ / c`` (``c`` measurements, ``s = dip.scale``). Without a TV image: ``None`` (``dip.tv_weight(s)``
    apply; :func:`_warn_without_tv`)."""
    if "tv" not in state.metrics:
        return None
    lam, c = float(state.metrics["tv"]["weight"]), state.y.numel()
    gamma = 2.0 * state.cfg.dip.scale * lam / c
    state.log(f"DIP: γ = {gamma:.3g} from TV's λ = {lam:.3g} (γ = 2 s λ / c, c = {c})")
    return gamma


def _warm_start(state: RunState, model, net_input: torch.Tensor) -> tuple[dict, float | None]:
    """Apply ``dip.warm_start`` to the freshly built ``model`` (:func:`ctuq.reconstruct.warm_start.fit_to_image` on
    the TV image); returns its starting weights (a CPU copy, for the other candidates of ``dip.tv_weights``) and the
    PSNR (dB) of its output against the TV image (``None`` without a warm start)."""
    dc, psnr = state.cfg.dip, None
    if dc.warm_start == WarmStart.TV and "tv" in state.images:  # without TV, :func:`_warn_without_tv` said so
        model.to(state.device)
        psnr = fit_to_image(
            model,
            net_input,
            state.images["tv"],
            iterations=dc.warm_start_iterations,
            scale=dc.scale,
            seed=state.cfg.seed,
            progress=state.progress,
        )
        state.log(f"DIP: warm start at the TV image, {dc.warm_start_iterations} iterations, {psnr:.1f} dB from it")
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, psnr


def _fit_dip(state: RunState, model, net_input, tv_weight: float, ckpt: Path, monitor):
    """One DIP fit of the run (:func:`ctuq.reconstruct.dip.fit_dip`) with TV weight ``tv_weight`` and checkpoint
    ``ckpt``; a diverging fit is a :class:`~ctuq.errors.NonFiniteLossError` naming ``dip.lr``."""
    cfg, dc = state.cfg, state.cfg.dip
    try:
        return fit_dip(
            state.op,
            state.y,
            model=model,
            net_input=net_input,
            iterations=dc.iterations,
            lr=dc.lr,
            tv_weight=tv_weight,
            clip_grad_norm=dc.clip_grad_norm,
            scale=dc.scale,
            ground_truth=state.ground_truth,
            checkpoint_path=ckpt,
            checkpoint_every=dc.checkpoint_every,
            resume=state.resume or ckpt.name != rf.CHECKPOINT_NAME,  # a finished candidate is not fitted again
            seed=cfg.seed,
            device=state.device,
            progress=state.progress,
            monitor=monitor,
        )
    except FloatingPointError as exc:
        if isinstance(exc, CTUQError):
            raise
        detail = str(exc).removeprefix("fit_dip: ")
        raise NonFiniteLossError(f"dip.lr = {dc.lr:g}: the DIP fit diverged: {detail}") from exc


def phase_restore_dip(state: RunState) -> None:
    """Restore the fitted DIP of a finished run (``ctuq uq``): ``dip_model.pt``, else the checkpoint's best weights;
    plus the earlier TV image and DIP/TV metrics.

    Raises
    ------
    FileNotFoundError
        The run folder has neither file.
    ModelFileError
        ``dip_model.pt`` is unreadable, of another version, or holds no fixed input.
    CTUQError
        The DIP was fitted with another ``dip.scale``, or the checkpoint cannot rebuild the network.
    """
    out = state.out_dir
    model_path, ckpt_path = out / rf.MODEL_NAME, out / rf.CHECKPOINT_NAME
    if model_path.is_file():
        source = model_path
        mf = read_model_file(model_path, need_input=True)
        model, net_input, scale = mf.build(state.device), mf.net_input, mf.scale
    elif ckpt_path.is_file():
        source = ckpt_path
        ckpt = load_checkpoint(ckpt_path, RESTORE_KEYS)
        if ckpt.get("model_config") is None:
            raise CTUQError(f"{ckpt_path}: has no model_config; cannot rebuild the network")
        model = UNet.from_config(ckpt["model_config"])
        model.load_state_dict(ckpt["best_state"])
        model.to(state.device).eval()
        net_input, scale = ckpt["net_input"], ckpt["meta"]["scale"]
    else:
        raise FileNotFoundError(
            f"{out}: has neither {rf.MODEL_NAME} nor {rf.CHECKPOINT_NAME}: run `ctuq reconstruct --out {out}` first "
            f"(with output.save_model or output.keep_checkpoint enabled)"
        )
    if abs(float(scale) - state.cfg.dip.scale) > 1e-12 * max(1.0, abs(float(scale))):
        raise CTUQError(
            f"dip.scale = {state.cfg.dip.scale:g}: the DIP in {source} was fitted with scale {scale}; "
            f"use the run's dip.scale"
        )
    with torch.no_grad():
        recon = model(net_input.to(state.device))[0, 0] / float(scale)
    state.model, state.net_input = model, net_input
    state.images["dip"] = recon
    tv_path = out / rf.TV_NAME
    if tv_path.is_file():
        state.images["tv"] = torch.from_numpy(tifffile.imread(tv_path).astype("float32")).to(state.device)
    metrics_path = out / rf.METRICS_NAME
    if metrics_path.is_file():
        old = json.loads(metrics_path.read_text())
        for key in ("dip", "tv"):
            if key in old:
                state.metrics[key] = old[key]
        state.metrics["reconstruct_timings"] = old.get("timings")


def _tuning_figure(state: RunState) -> None:
    """``tuning.png`` (with ``output.figure``) when TV or the DIP was tuned on held-out angles in this run."""
    tv = (state.metrics.get("tv") or {}).get("tuning")
    dip = state.metrics.get("dip") or {}
    if not state.cfg.output.figure or not (tv or dip.get("heldout_trace")):
        return
    psnr = state.dip_result.psnr_history if state.dip_result is not None else None
    figures.plot_tuning(
        state.out_dir / rf.TUNING_FIGURE,
        tv=tv,
        dip=dip.get("heldout_trace"),
        dip_kept=dip.get("best_iteration"),
        dip_psnr=psnr,
    )


def _write_results_h5(state: RunState) -> None:
    """``results.h5`` (output.hdf5): the run's images under the names of its TIFFs, and its geometry."""
    std = state.uq_result.std if state.uq_result is not None else None
    names = {"fbp": "fbp", "tv": "tv", "dip": "reconstruction"}
    images = {names[k]: v for k, v in state.images.items() if k in names}
    if "dip" in state.images:
        images.update(result_channels(state.images["dip"], std, state.ground_truth))
    elif state.ground_truth is not None:
        images["ground truth"] = state.ground_truth
    op = state.op
    volume = getattr(op, "volume", None) or getattr(state.data, "volume", None)
    geometry = getattr(op, "geometry", None) or getattr(state.data, "geometry", None)
    attrs = {"ctuq_version": __version__, "command": state.command, "voxel_size_mm": state.voxel_size or float("nan")}
    write_results_h5(state.out_dir / rf.RESULTS_H5_NAME, images, volume=volume, geometry=geometry, attrs=attrs)


def _resolved(state: RunState) -> dict[str, str]:
    """What the run resolved ``uq.solver`` to (``auto``, ``exact``: the registry solver it set up), so that
    ``metrics.json``'s config holds that solver's section; nothing when no inference ran."""
    stats = getattr(state.uq_result, "stats", None)  # MC dropout (uq.method) resolves no solver
    if not stats:
        return {}
    return {"uq.solver": stats["route"]}


def phase_write(state: RunState) -> None:
    """Metrics against the ground truth, the PNG figure, ground_truth.tif and metrics.json (with the run's
    ``"warnings"``, an empty list when there were none). Rank 0 only in a sharded run."""
    if not state.is_root:
        return
    names = {"fbp": "FBP", "tv": "TV", "dip": "DIP"}
    psnr: dict[str, float | None] = {}
    ssim: dict[str, float | None] = {}
    if state.ground_truth is not None:
        write_tiff(state.out_dir / rf.GROUND_TRUTH_NAME, state.ground_truth, voxel_size=state.voxel_size)
        for key, img in state.images.items():
            m = image_metrics(img, state.ground_truth)
            psnr[key], ssim[key] = m["psnr"], m["ssim"]
    if state.cfg.output.figure:
        order = [k for k in ("fbp", "tv", "dip") if k in state.images]
        figures.plot_reconstructions(
            state.out_dir / rf.RECONSTRUCTION_FIGURE,
            {names[k]: state.images[k] for k in order},
            ground_truth=state.ground_truth,
            psnrs={names[k]: psnr.get(k) for k in order},
            error_of="DIP",
        )
    _tuning_figure(state)
    if state.cfg.output.stack and "dip" in state.images:
        std = state.uq_result.std if state.uq_result is not None else None
        channels = result_channels(state.images["dip"], std, state.ground_truth)
        write_stack(state.out_dir / rf.STACK_NAME, channels, voxel_size=state.voxel_size)
    if state.cfg.output.hdf5:
        _write_results_h5(state)
    total = sum(state.timings.values())
    metrics = {
        "ctuq_version": __version__,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": str(state.device),
        "seed": state.cfg.seed,
        "warnings": list(state.warnings),
        "psnr": psnr,
        "ssim": ssim,
        **state.metrics,
        "timings": {**state.timings, "total_before_write": total},
        "config": state.cfg.to_dict(resolved=_resolved(state)),
        "versions": package_versions(),
    }
    write_metrics(state.out_dir / rf.METRICS_NAME, metrics)
    if psnr:
        state.log("PSNR " + ", ".join(f"{names[k]} {v:.2f} dB" for k, v in psnr.items() if v is not None))
