"""``ctuq uq RUN_DIR``: rerun only the uncertainty phase on a finished ``ctuq reconstruct`` run.

Reads the run's ``config.yaml`` (``--set uq.KEY=VALUE`` changes the inference settings), reloads the scan, restores
the fitted DIP from ``dip_model.pt`` (no refitting), runs the linearised inference and rewrites ``std.tif``, the
uncertainty figures and ``metrics.json`` (the DIP/FBP/TV numbers of the original run are kept). ``--resume``
continues an interrupted inference from the checkpoints in the run folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

__all__ = ["add_parser", "run", "phase_restore_dip"]


def phase_restore_dip(state) -> None:
    """Load the fitted DIP (``dip_model.pt``, else the checkpoint's best weights) and the earlier images/metrics."""
    from ctuq.models import UNet
    from ctuq.reconstruct.dip import load_checkpoint

    from ctuq.commands.reconstruct import CHECKPOINT_NAME, MODEL_NAME

    out = state.out_dir
    model_path, ckpt_path = out / MODEL_NAME, out / CHECKPOINT_NAME
    if model_path.is_file():
        try:
            blob = torch.load(model_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with the file named
            raise ValueError(f"{model_path} could not be read: {exc}") from exc
        missing = {"model_config", "state_dict", "net_input", "scale"} - set(blob)
        if missing:
            raise ValueError(f"{model_path} lacks {sorted(missing)}; it was not written by ctuq reconstruct")
        config, weights, net_input, scale = blob["model_config"], blob["state_dict"], blob["net_input"], blob["scale"]
    elif ckpt_path.is_file():
        ckpt = load_checkpoint(ckpt_path)
        if ckpt.get("model_config") is None:
            raise ValueError(f"{ckpt_path} has no model_config; cannot rebuild the network")
        config, weights, net_input = ckpt["model_config"], ckpt["best_state"], ckpt["net_input"]
        scale = ckpt["meta"]["scale"]
    else:
        raise FileNotFoundError(
            f"{out} has neither {MODEL_NAME} nor {CHECKPOINT_NAME}: run `ctuq reconstruct --out {out}` first "
            f"(with output.save_model or output.keep_checkpoint enabled)"
        )
    if abs(float(scale) - state.cfg.dip.scale) > 1e-12 * max(1.0, abs(float(scale))):
        raise ValueError(f"{out}: the DIP was fitted with scale {scale} but dip.scale is {state.cfg.dip.scale}")
    model = UNet.from_config(config)
    model.load_state_dict(weights)
    model.to(state.device).eval()
    with torch.no_grad():
        recon = model(net_input.to(state.device))[0, 0] / float(scale)
    state.model, state.net_input = model, net_input
    state.images["dip"] = recon
    tv_path = out / "tv.tif"
    if tv_path.is_file():
        import tifffile

        state.images["tv"] = torch.from_numpy(tifffile.imread(tv_path).astype("float32")).to(state.device)
    metrics_path = out / "metrics.json"
    if metrics_path.is_file():
        old = json.loads(metrics_path.read_text())
        for key in ("dip", "tv"):
            if key in old:
                state.metrics[key] = old[key]
        state.metrics["reconstruct_timings"] = old.get("timings")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "uq",
        help="rerun only the uncertainty phase on a finished reconstruction folder",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  ctuq uq runs/demo                                   # same settings as the run\n"
            "  ctuq uq runs/demo --set uq.samples=256 --set uq.em_steps=10\n"
            "  ctuq uq runs/demo --resume                          # continue an interrupted inference\n"
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="folder written by `ctuq reconstruct`")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config value, e.g. --set uq.samples=256 (repeatable)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), help="overrides the run's device")
    p.add_argument("--resume", action="store_true", help="continue from the inference checkpoints in RUN_DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ctuq.commands.reconstruct import (CONFIG_NAME, Phase, RunState, phase_fbp, phase_load, phase_write,
                                           run_phases, uq_phases)
    from ctuq.config import ConfigError, load_config
    from ctuq.utils import atomic_path, resolve_device

    out_dir = Path(args.run_dir)
    cfg_path = out_dir / CONFIG_NAME
    if not cfg_path.is_file():
        print(f"ctuq uq: {cfg_path} does not exist; RUN_DIR must be a folder written by `ctuq reconstruct`",
              file=sys.stderr)
        return 2
    try:
        cfg = load_config(cfg_path, args.overrides, **{"device": args.device})
    except ConfigError as exc:
        print(f"ctuq uq: {exc}", file=sys.stderr)
        return 2
    device = resolve_device(cfg.device)
    state = RunState(cfg=cfg, out_dir=out_dir, device=device, resume=args.resume, uq=True,
                     progress=not args.no_progress)
    phases = [Phase("load", phase_load), Phase("fbp", phase_fbp), Phase("restore_dip", phase_restore_dip),
              *uq_phases(state), Phase("write", phase_write)]
    from ctuq.uq import UQCheckpointMismatch

    try:
        run_phases(state, phases)
    except (FileNotFoundError, UQCheckpointMismatch) as exc:
        print(f"ctuq uq: {exc}", file=sys.stderr)
        return 2
    with atomic_path(cfg_path) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    state.log(f"updated {out_dir} in {sum(state.timings.values()):.1f} s")
    return 0
