"""``ctuq reconstruct``: load a scan, reconstruct it with FBP, (TV,) and the deep image prior, write a run folder.

The command runs a list of *phases* over one :class:`RunState`::

    load → fbp → [tv] → dip → [uq] → write

Each phase is a function ``phase(state) -> None`` that reads what earlier phases left in ``state`` and adds
its own results (images go into ``state.images``, numbers into ``state.metrics``); the runner times every
phase into ``metrics.json['timings']``. :func:`build_phases` assembles the list; the linearised-inference
phase plugs in at the marked hook (it finds the fitted network in ``state.model``/``state.net_input`` and the
operator/data in ``state.op``/``state.y``). ``--no-uq`` skips that hook.

Defaults: the bundled ``demo`` config (``ctuq/configs/demo.yaml``) on the bundled simulated scan, written to
``runs/<timestamp>/``. See :mod:`ctuq.outputs` for the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from ctuq.config import Config, ConfigError, load_config

__all__ = ["add_parser", "run", "RunState", "Phase", "build_phases", "run_phases", "reconstruct"]

CHECKPOINT_NAME = "dip_checkpoint.pt"
MODEL_NAME = "dip_model.pt"
CONFIG_NAME = "config.yaml"


@dataclasses.dataclass
class RunState:
    """Everything the phases share.

    ``images`` maps method names (``'fbp'``, ``'tv'``, ``'dip'``) to ``image_shape`` tensors in original units.
    ``metrics`` is merged into metrics.json (phases add their own sections).
    """

    cfg: Config
    out_dir: Path
    device: torch.device
    resume: bool = False
    uq: bool = True
    progress: bool = True
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
    uq_result: Any = None
    uq_summary: dict | None = None

    def log(self, msg: str) -> None:
        print(f"[ctuq reconstruct] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    fn: Callable[[RunState], None]


# ------------------------------------------------------------------------------------------------ phases
def phase_load(state: RunState) -> None:
    """Load the scan named by ``cfg.data`` (default: the bundled simulated scan) onto the device."""
    from ctuq import data as ctdata

    dc = state.cfg.data
    path = Path(dc.path) if dc.path is not None else ctdata.default_data_dir()
    if not path.exists():
        raise FileNotFoundError(f"data.path {str(path)!r} does not exist (set it with --data DIR)")
    kwargs = dict(
        orbit=dc.orbit,
        angular_subsampling=dc.angular_subsampling,
        detector_subsampling=dc.detector_subsampling,
        image_shape=None if dc.image_shape is None else tuple(dc.image_shape),
        backend=dc.backend,
        device=state.device,
        progress=state.progress,
    )
    if dc.ndim == 2:
        d = ctdata.load_walnut_slice(path, slice_index=dc.slice_index, **kwargs)
    else:
        d = ctdata.load_walnut_volume(path, **kwargs)
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
    }
    state.log(f"loaded {path}: image {tuple(d.op.image_shape)}, sinogram {tuple(d.op.measurement_shape)}, "
              f"operator {type(d.op).__name__} on {state.device}")


def phase_fbp(state: RunState) -> None:
    """Filtered back-projection (2D) / FDK (3D) baseline → ``images['fbp']``, ``fbp.tif``."""
    from ctuq.operators.fbp import fbp, fdk
    from ctuq.outputs import write_tiff

    fc = state.cfg.fbp
    analytic = fbp if state.op.ndim == 2 else fdk
    x = analytic(state.op, state.y, filter_type=fc.filter, frequency_scaling=fc.frequency_scaling)
    state.images["fbp"] = x.to(state.device, torch.float32)
    write_tiff(state.out_dir / "fbp.tif", x)


def phase_tv(state: RunState) -> None:
    """TV-regularised baseline with ODL's PDHG → ``images['tv']``, ``tv.tif``."""
    from ctuq.outputs import write_tiff
    from ctuq.reconstruct.classical import tv_reconstruction

    tc = state.cfg.tv
    res = tv_reconstruction(
        state.op, state.y, weight=tc.weight, iterations=tc.iterations, nonnegative=tc.nonnegative,
        isotropic=tc.isotropic, x0=state.images.get("fbp"), progress=state.progress,
    )
    state.images["tv"] = res["reconstruction"]
    state.metrics["tv"] = {k: res[k] for k in ("iterations", "time_s", "objective", "op_norm")}
    write_tiff(state.out_dir / "tv.tif", res["reconstruction"])


def build_model(cfg: Config, ndim: int) -> torch.nn.Module:
    """The U-Net of ``cfg.model`` with seeded initial weights (``cfg.seed``), optionally pretrained."""
    from ctuq.models import build_unet

    mc = cfg.model
    torch.manual_seed(cfg.seed)
    model = build_unet(
        mc.preset, channels=mc.channels, skip_channels=mc.skip_channels, ndim=ndim,
        norm_groups=mc.norm_groups, sigmoid=mc.sigmoid, dropout=mc.dropout,
    )
    if mc.pretrained:
        from ctuq.reconstruct.pretrain import load_pretrained

        load_pretrained(model, mc.pretrained)
    return model


def make_input(cfg: Config, state: RunState) -> torch.Tensor:
    """The fixed network input ``(1, 1, *image_shape)``: seeded noise, or the scaled FBP (educated DIP)."""
    from ctuq.models import make_net_input

    if cfg.model.input == "fbp":
        if "fbp" not in state.images:
            raise ConfigError("model.input = 'fbp' needs the FBP phase")
        return (state.images["fbp"].detach().cpu() * cfg.dip.scale)[None, None].float()
    return make_net_input(state.op.image_shape, channels=1, seed=cfg.seed, std=cfg.model.input_std)


def phase_dip(state: RunState) -> None:
    """Fit the deep image prior → ``images['dip']``, ``reconstruction.tif``, ``dip_model.pt``, checkpoint."""
    from ctuq.models import count_parameters
    from ctuq.outputs import write_tiff
    from ctuq.reconstruct.dip import fit_dip
    from ctuq.utils import atomic_torch_save

    cfg, dc = state.cfg, state.cfg.dip
    model = build_model(cfg, state.op.ndim)
    net_input = make_input(cfg, state)
    ckpt = state.out_dir / CHECKPOINT_NAME
    if state.resume and not ckpt.is_file():
        state.log(f"--resume: no checkpoint {ckpt} yet, starting the DIP from iteration 0")
    state.log(f"DIP: U-Net {count_parameters(model):,} parameters "
              f"({count_parameters(model, conv_weights_only=True):,} conv weights), {dc.iterations} iterations")
    result = fit_dip(
        state.op, state.y, model=model, net_input=net_input, iterations=dc.iterations, lr=dc.lr,
        tv_weight=dc.tv_weight, clip_grad_norm=dc.clip_grad_norm, scale=dc.scale,
        ground_truth=state.ground_truth, checkpoint_path=ckpt, checkpoint_every=dc.checkpoint_every,
        resume=state.resume, seed=cfg.seed, device=state.device, progress=state.progress,
    )
    state.model, state.net_input, state.dip_result = model, result.net_input, result
    state.images["dip"] = result.reconstruction
    state.metrics["dip"] = {
        **result.summary(),
        "n_parameters": count_parameters(model),
        "n_conv_weights": count_parameters(model, conv_weights_only=True),
    }
    write_tiff(state.out_dir / "reconstruction.tif", result.reconstruction)
    if cfg.output.save_model:
        atomic_torch_save(state.out_dir / MODEL_NAME, {
            "model_config": model.config.to_dict(),
            "state_dict": result.best_state_dict,
            "net_input": result.net_input,
            "scale": result.scale,
            "best_iteration": result.best_iteration,
        })
    if not cfg.output.keep_checkpoint and ckpt.exists():
        ckpt.unlink()


def phase_write(state: RunState) -> None:
    """Metrics against the ground truth, the PNG figure, ground_truth.tif and metrics.json."""
    from ctuq import __version__
    from ctuq.outputs import image_metrics, package_versions, write_figure, write_metrics, write_tiff

    names = {"fbp": "FBP", "tv": "TV", "dip": "DIP"}
    psnr: dict[str, float | None] = {}
    ssim: dict[str, float | None] = {}
    if state.ground_truth is not None:
        write_tiff(state.out_dir / "ground_truth.tif", state.ground_truth)
        for key, img in state.images.items():
            m = image_metrics(img, state.ground_truth)
            psnr[key], ssim[key] = m["psnr"], m["ssim"]
    if state.cfg.output.figure:
        order = [k for k in ("fbp", "tv", "dip") if k in state.images]
        write_figure(
            state.out_dir / "reconstruction.png",
            {names[k]: state.images[k] for k in order},
            ground_truth=state.ground_truth,
            psnrs={names[k]: psnr.get(k) for k in order},
            error_of="DIP",
        )
    total = sum(state.timings.values())
    metrics = {
        "ctuq_version": __version__,
        "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": str(state.device),
        "seed": state.cfg.seed,
        "psnr": psnr,
        "ssim": ssim,
        **state.metrics,
        "timings": {**state.timings, "total_before_write": total},
        "config": state.cfg.to_dict(),
        "versions": package_versions(),
    }
    write_metrics(state.out_dir / "metrics.json", metrics)
    if psnr:
        state.log("PSNR " + ", ".join(f"{names[k]} {v:.2f} dB" for k, v in psnr.items() if v is not None))


# ------------------------------------------------------------------------------------------------ runner
def phase_uq(state: RunState) -> None:
    """Linearised inference (:func:`ctuq.uq.run_linearized_uq`) → ``std.tif``, UQ figures and metrics.

    Reads ``state.model``/``state.net_input`` (the fitted DIP), ``state.op``/``state.y``; checkpoints into the run
    folder (``uq_state.pt``, ``uq_samples_XXXX.pt``) and resumes from there with ``--resume``.
    """
    from ctuq.outputs import write_tiff
    from ctuq.uq import SAMPLES_PATTERN, STATE_NAME, UQSettings, run_linearized_uq

    cfg = state.cfg
    if state.model is None:
        raise RuntimeError("the uncertainty phase needs the fitted DIP (state.model)")
    res = run_linearized_uq(
        state.model, state.net_input, state.op, state.y, scale=cfg.dip.scale,
        settings=UQSettings.from_config(cfg.uq), seed=cfg.seed, work_dir=state.out_dir, resume=state.resume,
        progress=state.progress, log=state.log,
    )
    write_tiff(state.out_dir / "std.tif", res.std)
    uq_metrics: dict[str, Any] = {
        "method": "linearised DIP, sampled (dual Matheron sampler, sampled EM)",
        "a": res.a,
        "sigma2": res.sigma2,
        "solver": res.solver,
        "stats": res.stats,
        "timings": res.timings,
        "products": res.products,
        "n_samples": int(res.samples.shape[0]),
        "mean_std": float(res.std.mean()),
    }
    state.metrics["em_trace"] = res.em_trace
    if state.ground_truth is not None:
        from ctuq.metrics import inner_square_roi, uq_summary

        roi = inner_square_roi(res.std.shape) if cfg.uq.roi == "inner_square" else None
        summary = uq_summary(state.ground_truth.detach().cpu(), res.mean, res.samples, roi,
                             patch_sizes=cfg.uq.patch_sizes)
        state.metrics["marginal_ll"] = summary["marginal_ll"]
        state.metrics["joint_ll"] = summary["joint_ll"]
        state.metrics["coverage"] = summary["coverage"]
        uq_metrics["summary"] = summary
        state.uq_summary = summary
        state.log(f"UQ: marginal LL {summary['marginal_ll']:.3f}, joint LL (10×10) "
                  f"{summary['joint_ll'].get('10', float('nan')) or float('nan'):.3f}, coverage@0.9 "
                  f"{summary['coverage']['0.9']:.3f}, Spearman(std, |error|) {summary['spearman']:.3f}")
    state.metrics["uq"] = uq_metrics
    state.uq_result = res
    if cfg.output.figure:
        _uq_figures(state, res)
    # The image samples are only needed to resume an unfinished run; they are large, so drop them now.
    for path in state.out_dir.glob(SAMPLES_PATTERN.replace("{:04d}", "*")):
        path.unlink()
    if not cfg.output.keep_checkpoint and (state.out_dir / STATE_NAME).exists():
        (state.out_dir / STATE_NAME).unlink()


def _uq_figures(state: RunState, res) -> None:
    from ctuq import figures
    from ctuq.metrics import inner_square_roi

    out = state.out_dir
    gt = state.ground_truth.detach().cpu() if state.ground_truth is not None else None
    roi = inner_square_roi(res.std.shape) if state.cfg.uq.roi == "inner_square" else None
    abs_err = (res.mean - gt).abs() if gt is not None else None
    if abs_err is not None:
        figures.plot_uq_panels(out / "uncertainty.png", res.mean, abs_err, res.std, ground_truth=gt, roi=roi,
                               titles=["ground truth", "DIP reconstruction", "|error|", "posterior std"])
        summary = state.uq_summary
        cal = summary["calibration"]
        figures.plot_calibration(out / "calibration.png", {"linearised DIP": (cal["levels"], cal["coverage"])})
        figures.plot_joint_ll(out / "joint_ll.png", {"linearised DIP": summary["joint_ll"]})
        figures.plot_error_vs_std(out / "error_vs_std.png", abs_err, res.std, roi)
    else:
        figures.plot_uq_panels(out / "uncertainty.png", res.mean, res.mean * 0, res.std,
                               titles=["DIP reconstruction", "(no ground truth)", "posterior std"], roi=roi)
    if res.em_trace:
        trace = [{"step": r["step"] + 1, "a": r["a_new"], "gamma": r["gamma"], "w_norm2": r["weight_norm_sq"],
                  "sigma2": r["sigma2_new"], "log_evidence": r.get("log_evidence")} for r in res.em_trace]
        figures.plot_em_trace(out / "em_trace.png", trace)


def uq_phases(state: RunState) -> list[Phase]:
    """Phases of the linearised inference, run after the DIP and before writing (``--no-uq``: none)."""
    return [Phase("uq", phase_uq)]


def build_phases(state: RunState) -> list[Phase]:
    """The phase list for ``state.cfg``: load → fbp → [tv] → dip → [uq] → write."""
    phases = [Phase("load", phase_load), Phase("fbp", phase_fbp)]
    if state.cfg.tv.enabled:
        phases.append(Phase("tv", phase_tv))
    phases.append(Phase("dip", phase_dip))
    if state.uq:
        phases.extend(uq_phases(state))
    phases.append(Phase("write", phase_write))
    return phases


def run_phases(state: RunState, phases: list[Phase]) -> RunState:
    """Run ``phases`` in order, recording each one's wall time (s) in ``state.timings``."""
    for phase in phases:
        t0 = time.perf_counter()
        phase.fn(state)
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        state.timings[phase.name] = time.perf_counter() - t0
    return state


def reconstruct(cfg: Config, out_dir: str | Path, *, resume: bool = False, uq: bool = True,
                progress: bool = True) -> RunState:
    """Programmatic ``ctuq reconstruct``: run all phases for ``cfg`` into ``out_dir``; returns the final state."""
    from ctuq.utils import atomic_path, resolve_device

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    with atomic_path(out_dir / CONFIG_NAME) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    state = RunState(cfg=cfg, out_dir=out_dir, device=device, resume=resume, uq=uq, progress=progress)
    return run_phases(state, build_phases(state))


# ------------------------------------------------------------------------------------------------ CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "reconstruct",
        help="DIP reconstruction with FBP/TV baselines; writes a run folder",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  ctuq reconstruct --no-uq                       # bundled demo scan, CPU, ~75 s\n"
            "  ctuq reconstruct --config walnut_2d_60 --data /data/Walnut1 --device cuda\n"
            "  ctuq reconstruct --set dip.iterations=300 --set tv.enabled=true --out runs/quick\n"
            "  ctuq reconstruct --resume --out runs/quick     # continue an interrupted run\n"
        ),
    )
    p.add_argument("--data", metavar="DIR", help="scan folder (default: the bundled simulated scan)")
    p.add_argument("--config", metavar="FILE",
                   help="YAML config file or bundled name (demo, walnut_2d_60, walnut_2d_120, walnut_3d); "
                        "default: demo, or the run folder's config.yaml with --resume")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config value, e.g. --set dip.lr=1e-3 (repeatable)")
    p.add_argument("--out", metavar="DIR", help="run folder (default: runs/<timestamp>)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the config's device")
    p.add_argument("--seed", type=int, help="overrides the config's seed")
    p.add_argument("--resume", action="store_true",
                   help="continue the DIP from the checkpoint in --out (which must be given)")
    p.add_argument("--no-uq", action="store_true", help="skip the uncertainty phase (reconstruction only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.resume and not args.out:
        print("ctuq reconstruct: --resume needs --out DIR (the run folder to continue)", file=sys.stderr)
        return 2
    config_path = args.config
    if args.resume and config_path is None and (Path(args.out) / CONFIG_NAME).is_file():
        config_path = Path(args.out) / CONFIG_NAME
    try:
        cfg = load_config(config_path, args.overrides,
                          **{"data.path": args.data, "device": args.device, "seed": args.seed})
    except ConfigError as exc:
        print(f"ctuq reconstruct: {exc}", file=sys.stderr)
        return 2
    if args.out:
        out_dir = Path(args.out)
        if out_dir.exists() and not args.resume and (out_dir / "metrics.json").exists():
            print(f"ctuq reconstruct: {out_dir} already holds a finished run; choose another --out "
                  f"or pass --resume", file=sys.stderr)
            return 2
    else:
        from ctuq.outputs import new_run_dir

        out_dir = new_run_dir("runs")
    from ctuq.reconstruct.dip import CheckpointMismatch
    from ctuq.uq import UQCheckpointMismatch

    try:
        state = reconstruct(cfg, out_dir, resume=args.resume, uq=not args.no_uq, progress=not args.no_progress)
    except (CheckpointMismatch, UQCheckpointMismatch) as exc:
        print(f"ctuq reconstruct: {exc}", file=sys.stderr)
        return 2
    state.log(f"wrote {out_dir} in {sum(state.timings.values()):.1f} s")
    return 0
