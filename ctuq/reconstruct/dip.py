"""Deep-image-prior reconstruction: fit the U-Net weights ``v`` so that ``T g(v) ≈ y``.

Objective (in *scaled* units, see ``scale`` below)::

    L(v) = mean_i ((T g(v) − s·y)_i²) + γ · TV(g(v)),      TV(x) = Σ |x[i+1,j] − x[i,j]| + Σ |x[i,j+1] − x[i,j]|

* the data term is the **mean** squared residual over the ``c`` measurements (``torch.nn.MSELoss``), and
* TV is the anisotropic total variation **summed** (not averaged) over pixel pairs (3D: over all three axes).

This is the convention of the published walnut experiments (dival's ``DeepImagePriorCTReconstructor``:
``MSELoss()(T x, y) + gamma * tv_loss(x)``, with ``tv_loss`` a sum of absolute differences), so the published
TV weights (6.5e-6 for 60 angles, 4e-6 for 120) keep their meaning. Both data and image are multiplied by
``scale`` (14 for the walnut) so the image lies roughly in [0, 1]; the reconstruction handed back is
divided by ``scale`` again, i.e. in the units of ``y``'s image (attenuation per mm for walnut data).

The weights with the lowest loss are kept: the loss evaluated at iteration ``k`` belongs to the weights
*before* the ``k``-th Adam step, so those weights (not the stepped ones) are stored as the best. Given a
:class:`~ctuq.reconstruct.heldout.HeldoutMonitor` (held-out rows of the scan), the fit keeps instead the weights whose
image has the lowest *held-out error*, scored every ``monitor.every`` iterations, and stops once ``monitor.patience``
iterations have passed without a lower one: the stopping point is chosen on measurements the fit does not use.

Checkpoints hold model and optimizer state, iteration, RNG states, best weights and the history; resuming
from one continues exactly where the run stopped, so on CPU an interrupted and resumed run ends bit-identical
to an uninterrupted one. Under :func:`ctuq.interrupt.handling` (the ``ctuq`` commands) a SIGINT/SIGTERM during the
fit finishes the running iteration, writes the checkpoint and raises :class:`ctuq.interrupt.Interrupted`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ctuq import interrupt
from ctuq.errors import CheckpointMismatch
from ctuq.metrics.image import (
    psnr_from_mse,
)
from ctuq.operators.base import RayTransform
from ctuq.reconstruct.heldout import HeldoutMonitor
from ctuq.utils import atomic_torch_save, check_fingerprint
from ctuq.utils import progress as _progress_bar

__all__ = ["DIPResult", "fit_dip", "tv_anisotropic", "load_checkpoint"]

CHECKPOINT_VERSION = 1


@dataclasses.dataclass
class DIPResult:
    """Outcome of :func:`fit_dip`.

    Attributes
    ----------
    reconstruction : torch.Tensor
        ``image_shape``, float32, on the fitting device, original units (``g(ṽ) / scale``, dropout off).
    best_iteration : int
        0-based iteration whose weights are kept (``ṽ``): the lowest loss, or with a held-out monitor the lowest
        held-out error; −1 if no iteration ran.
    best_loss : float
        The loss at ``best_iteration`` (scaled units, see the module docstring).
    loss_history, data_loss_history, tv_history : list[float]
        Per iteration: total loss, mean squared residual, TV (scaled units).
    psnr_history : list[float] | None
        Per iteration PSNR (dB) of ``g(v)/scale`` against the ground truth; ``None`` without ground truth.
    iterations : int
        Iterations completed in total (including those before a resume; fewer than asked when the held-out monitor
        stopped the fit).
    time_s : float
        Wall time of the fit in this call (s); ``iterations_per_s`` counts this call's iterations only.
    best_state_dict, final_state_dict : dict[str, torch.Tensor]
        Weights at ``best_iteration`` (also loaded into the model on return) and after the last step (CPU).
    net_input : torch.Tensor
        The fixed input ``(1, C, *image_shape)`` used (CPU).
    scale : float
        The data/image scale used.
    heldout_history : list[tuple[int, float]] or None
        With a held-out monitor: ``(iteration, held-out error)`` of every scored iterate (data units²).
    stopped_early : bool
        The held-out monitor stopped the fit before the requested iterations.
    """

    reconstruction: torch.Tensor
    best_iteration: int
    best_loss: float
    loss_history: list[float]
    data_loss_history: list[float]
    tv_history: list[float]
    psnr_history: list[float] | None
    iterations: int
    time_s: float
    iterations_per_s: float
    best_state_dict: dict
    final_state_dict: dict
    net_input: torch.Tensor
    scale: float
    resumed_from: int = 0
    heldout_history: list[tuple[int, float]] | None = None
    stopped_early: bool = False

    def summary(self) -> dict:
        """JSON-friendly scalars for metrics.json."""
        return {
            "iterations": self.iterations,
            "best_iteration": self.best_iteration,
            "best_loss": self.best_loss,
            "final_loss": self.loss_history[-1] if self.loss_history else None,
            "best_psnr_history": self.best_psnr,
            "time_s": self.time_s,
            "iterations_per_s": self.iterations_per_s,
            "resumed_from_iteration": self.resumed_from,
            "scale": self.scale,
            **self._heldout_summary(),
        }

    @property
    def heldout_error(self) -> float | None:
        """The held-out error at ``best_iteration`` (data units²); ``None`` without held-out selection."""
        return dict(self.heldout_history).get(self.best_iteration) if self.heldout_history is not None else None

    @property
    def best_psnr(self) -> float | None:
        """The PSNR (dB) at ``best_iteration``; ``None`` without ground truth or iterations."""
        return self.psnr_history[self.best_iteration] if self.psnr_history and self.best_iteration >= 0 else None

    def _heldout_summary(self) -> dict:
        """``selection`` (``loss`` or ``heldout``) and, with held-out selection, the error at the kept iterate and
        whether the fit stopped early; the full curve is ``heldout_history``."""
        if self.heldout_history is None:
            return {"selection": "loss"}
        return {"selection": "heldout", "heldout_error": self.heldout_error, "stopped_early": self.stopped_early}


def tv_anisotropic(x: torch.Tensor, ndim: int | None = None) -> torch.Tensor:
    """Anisotropic total variation, summed: ``Σ_axes Σ |forward difference|`` over the last ``ndim`` axes.

    ``x``: ``(..., H, W)`` (``ndim=2``) or ``(..., D, H, W)`` (``ndim=3``); leading axes are summed too.
    Returns a scalar tensor in the units of ``x`` times pixels.
    """
    ndim = x.ndim if ndim is None else ndim
    if ndim not in (2, 3) or x.ndim < ndim:
        raise ValueError(f"tv_anisotropic: need a 2D or 3D image (ndim={ndim}), got shape {tuple(x.shape)}")
    total = x.new_zeros(())
    for axis in range(x.ndim - ndim, x.ndim):
        total = total + torch.diff(x, dim=axis).abs().sum()
    return total


def _rng_state(device: torch.device) -> dict:
    # Only torch draws random numbers during the fit (dropout masks); numpy is not used.
    state = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)


def _cpu_state(module_or_dict) -> dict:
    sd = module_or_dict.state_dict() if isinstance(module_or_dict, nn.Module) else module_or_dict
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def _device_state(model: nn.Module) -> dict:
    # The best weights change almost every iteration early on: clone on the device, copy to CPU only on save.
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_CHECKPOINT_KEYS = (
    "iteration",
    "model",
    "optimizer",
    "best_state",
    "best_loss",
    "best_iteration",
    "history",
    "rng",
    "net_input",
    "meta",
)
# optional keys (a checkpoint of a fit without a held-out monitor lacks them): "stopped"


#: What restoring the fitted network needs (``ctuq uq`` on a run without ``dip_model.pt``): not the optimiser state.
RESTORE_KEYS = ("best_state", "net_input", "meta")


def load_checkpoint(path: str | os.PathLike, keys: tuple[str, ...] = _CHECKPOINT_KEYS) -> dict:
    """Load a DIP checkpoint written by :func:`fit_dip` (``torch.load(weights_only=True)``).

    ``keys`` are the entries the caller needs (default: all of them, to resume the fit; :data:`RESTORE_KEYS` to
    rebuild the fitted network only).

    Keys: ``version``, ``iteration`` (iterations done), ``model``, ``optimizer``, ``best_state``,
    ``best_loss``, ``best_iteration``, ``history`` (dict of lists), ``rng``, ``net_input``, ``meta``,
    ``model_config`` (``UNet.config.to_dict()`` when the model is a UNet, else ``None``).

    Raises :class:`~ctuq.errors.CheckpointMismatch` (a user error, also a ``ValueError``) naming the file when it
    is unreadable (damaged, truncated, not a torch file), not a DIP checkpoint of this version, or lacks a key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DIP checkpoint {path} does not exist")
    hint = "delete it to start the DIP afresh"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointMismatch(
            f"{path}: not a readable DIP checkpoint ({type(exc).__name__}: {reason}); {hint}"
        ) from exc
    if not isinstance(ckpt, dict) or ckpt.get("version") != CHECKPOINT_VERSION:
        raise CheckpointMismatch(f"{path}: not a ctuq DIP checkpoint (version {CHECKPOINT_VERSION}); {hint}")
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise CheckpointMismatch(f"{path}: a damaged DIP checkpoint (lacks {missing}); {hint}")
    return ckpt


def _fingerprint(op: RayTransform, y: torch.Tensor, net_input: torch.Tensor, lr, tv_weight, scale, clip) -> dict:
    # Enough to catch resuming the wrong run; the sum of y is a cheap data checksum.
    return {
        "image_shape": list(op.image_shape),
        "measurement_shape": list(op.measurement_shape),
        "y_sum": float(y.double().sum()),
        "net_input_shape": list(net_input.shape),
        "net_input_sum": float(net_input.double().sum()),
        "lr": float(lr),
        "tv_weight": float(tv_weight),
        "scale": float(scale),
        "clip_grad_norm": None if clip is None else float(clip),
    }


def _check_fingerprint(saved: dict, now: dict, path: Path) -> None:
    check_fingerprint(
        saved,
        now,
        what=f"cannot resume from {path}",
        error=CheckpointMismatch,
        abs_tol=1e-9,
        hint="start a fresh run in a new folder, or use the same data/settings",
    )


def fit_dip(
    op: RayTransform,
    y: torch.Tensor,
    *,
    model: nn.Module,
    net_input: torch.Tensor,
    iterations: int,
    lr: float = 1e-4,
    tv_weight: float = 0.0,
    clip_grad_norm: float | None = 1.0,
    scale: float = 1.0,
    ground_truth: torch.Tensor | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = True,
    callback: Callable[[int, dict], None] | None = None,
    monitor: HeldoutMonitor | None = None,
) -> DIPResult:
    """Fit a deep image prior: Adam on ``mean((T g(v) − s y)²) + γ TV(g(v))`` (see the module docstring).

    Parameters
    ----------
    op : RayTransform
        ``T`` with ``image_shape`` ``(H, W)``/``(D, H, W)`` and ``measurement_shape``; lives on ``device``.
    y : torch.Tensor
        ``measurement_shape`` sinogram in data units (line integrals).
    model : nn.Module
        Maps ``net_input`` ``(1, C, *image_shape)`` to ``(1, 1, *image_shape)`` (e.g. :class:`ctuq.models.UNet`).
        Trained in place; on return it holds the best weights.
    net_input : torch.Tensor
        Fixed input ``(1, C, *image_shape)``.
    iterations : int
        Total number of iterations (a resumed run continues up to this number).
    lr : float
        Adam learning rate.
    tv_weight : float
        ``γ``, TV weight in the scaled objective (≥ 0).
    clip_grad_norm : float or None
        Clip the global gradient 2-norm to this before each step (``None``/``0`` disables).
    scale : float
        ``s``: data and image are multiplied by it during fitting (walnut: 14).
    ground_truth : torch.Tensor, optional
        ``image_shape`` image in original units, only for the PSNR history/progress bar.
    checkpoint_path : path, optional
        Where to write the checkpoint (atomically) every ``checkpoint_every`` iterations and at the end.
    checkpoint_every : int
        Checkpoint period in iterations (0: only at the end, when ``checkpoint_path`` is given).
    resume : bool
        Continue from ``checkpoint_path`` if it exists (a missing file starts afresh); the checkpoint must
        match the data, input and hyper-parameters (:class:`CheckpointMismatch` otherwise).
    seed : int
        Seeds torch before the first iteration (dropout masks); resumed runs restore torch's RNG states.
    device : torch.device or str, optional
        Fitting device (default: ``op.device``).
    progress : bool
        Show a tqdm bar with loss (and PSNR with ground truth).
    callback : callable, optional
        ``callback(iteration, info)`` after each iteration with ``info`` keys ``loss``, ``data_loss``, ``tv``,
        ``psnr`` (or ``None``), ``best_loss``. An exception raised there stops the fit (after any checkpoint
        of that iteration was written) and propagates.
    monitor : HeldoutMonitor, optional
        Held-out rows on ``op.device``: keep the iterate with the lowest held-out error instead of the lowest loss,
        and stop once ``monitor.patience`` iterations pass without a lower one (the module docstring).

    Returns
    -------
    DIPResult
    """
    device = _checked_device(
        op, y, net_input, ground_truth, device, iterations, lr, tv_weight, scale, clip_grad_norm, checkpoint_every
    )
    clip = clip_grad_norm if clip_grad_norm else None
    ckpt_path = Path(checkpoint_path) if checkpoint_path is not None else None
    if resume and ckpt_path is None:
        raise ValueError("fit_dip: resume=True needs a checkpoint_path")

    model = model.to(device)
    net_input_dev = net_input.to(device=device, dtype=torch.float32)
    y_s = (y.to(device=device, dtype=torch.float32) * scale).contiguous()
    gt = ground_truth.to(device=device, dtype=torch.float32) if ground_truth is not None else None
    gt_range = float(gt.max() - gt.min()) if gt is not None else None
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    fingerprint = _fingerprint(op, y, net_input, lr, tv_weight, scale, clip)
    if monitor is not None:
        if monitor.op.device.type != device.type:
            raise ValueError(f"fit_dip: the held-out monitor lives on {monitor.op.device}, the fit on {device}")
        if tuple(monitor.op.image_shape) != tuple(op.image_shape):
            raise ValueError(
                f"fit_dip: the held-out monitor's image shape {tuple(monitor.op.image_shape)} differs from the "
                f"operator's {tuple(op.image_shape)}"
            )
        fingerprint.update(monitor.fingerprint())
    state = _start_state(model, optimizer, ckpt_path if resume else None, fingerprint, iterations, seed, device)

    def save(done: int) -> None:
        _save_checkpoint(ckpt_path, done, model, optimizer, state, device, net_input, fingerprint)

    model.train()
    t0 = time.perf_counter()
    bar = _progress_bar(total=iterations, initial=state.start, desc="DIP", disable=None if progress else True)
    try:
        # Ctrl-C/SIGTERM under ctuq.interrupt.handling: noted, acted upon after the running iteration
        with interrupt.safe_points(enabled=ckpt_path is not None):
            for it in range(state.start, iterations if state.stopped is None else state.start):
                x_s, data_loss, tv, loss_value = _loss_and_gradient(
                    model, optimizer, op, net_input_dev, y_s, tv_weight, clip, it, lr
                )
                if _is_best(state, monitor, x_s, loss_value, scale, it, iterations):
                    # These are the weights that produced this image: the step below has not happened yet.
                    state.best_loss, state.best_iteration = loss_value, it
                    state.best_state = _device_state(model)
                optimizer.step()
                psnr_value = _record_iteration(state.hist, x_s, data_loss, tv, loss_value, scale, gt, gt_range)
                done = it + 1
                if checkpoint_every and done % checkpoint_every == 0 and done < iterations:
                    save(done)
                bar.update(1)
                _show_progress(bar, done, iterations, loss_value, state.best_loss, psnr_value)
                if callback is not None:
                    callback(it, _callback_info(state, loss_value, psnr_value))
                if interrupt.requested() is not None:  # a signal arrived: checkpoint this iteration, then stop
                    save(done)
                    interrupt.stop(f"the DIP fit after iteration {done} of {iterations}", ckpt_path)
                if _passed_minimum(state, monitor, it):
                    state.stopped = done
                    break
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    final_state = _cpu_state(model)
    done = iterations if state.stopped is None else state.stopped
    save(done)
    return _best_result(model, net_input, net_input_dev, state, final_state, done, elapsed, scale, gt)


def _is_best(state: _FitState, monitor: HeldoutMonitor | None, x_s, loss_value: float, scale, it: int, iterations):
    """Whether iteration ``it``'s weights are the best so far: the lowest loss; with ``monitor``, the lowest held-out
    error of the image ``x_s / scale`` (scored every ``monitor.every`` iterations and at the last; recorded in
    ``state.hist['heldout']``)."""
    if monitor is None:
        return loss_value < state.best_loss
    if it % monitor.every and it != iterations - 1:
        return False
    error = monitor.error(x_s.detach() / scale)
    state.hist["heldout"].append([it, error])
    if error < state.best_score:
        state.best_score = error
        return True
    return False


def _passed_minimum(state: _FitState, monitor: HeldoutMonitor | None, it: int) -> bool:
    """Whether the held-out error has clearly passed its minimum: ``monitor.patience`` iterations since it, without
    a lower one (never without a monitor or patience)."""
    return monitor is not None and monitor.patience is not None and it - state.best_iteration >= monitor.patience


def check_fit_settings(where: str, iterations, lr, scale) -> None:
    """``ValueError`` naming ``where`` and the first bad setting of an Adam fit of a network: ``iterations`` a
    non-negative int, ``lr`` and ``scale`` positive and finite (:func:`fit_dip`, the warm start's
    :func:`~ctuq.reconstruct.warm_start.fit_to_image`)."""
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"{where}: iterations must be a non-negative int, got {iterations!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"{where}: lr must be positive, got {lr}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"{where}: scale must be positive, got {scale}")


def _checked_device(
    op, y, net_input, ground_truth, device, iterations, lr, tv_weight, scale, clip_grad_norm, checkpoint_every
) -> torch.device:
    """The fitting device of :func:`fit_dip` (default ``op.device``) after checking its arguments (``ValueError``
    naming the first bad one)."""
    device = torch.device(device) if device is not None else op.device
    if device.type != op.device.type:
        raise ValueError(f"fit_dip: operator lives on {op.device} but device={device} was requested")
    check_fit_settings("fit_dip", iterations, lr, scale)
    if not (tv_weight >= 0 and math.isfinite(tv_weight)):
        raise ValueError(f"fit_dip: tv_weight must be >= 0, got {tv_weight}")
    if clip_grad_norm is not None and clip_grad_norm < 0:
        raise ValueError(f"fit_dip: clip_grad_norm must be >= 0 or None, got {clip_grad_norm}")
    if tuple(y.shape) != tuple(op.measurement_shape):
        raise ValueError(f"fit_dip: y has shape {tuple(y.shape)}; the operator expects {op.measurement_shape}")
    if net_input.ndim != op.ndim + 2 or net_input.shape[0] != 1 or tuple(net_input.shape[2:]) != tuple(op.image_shape):
        raise ValueError(
            f"fit_dip: net_input has shape {tuple(net_input.shape)}; "
            f"expected (1, C, {', '.join(map(str, op.image_shape))})"
        )
    if ground_truth is not None and tuple(ground_truth.shape) != tuple(op.image_shape):
        raise ValueError(f"fit_dip: ground_truth has shape {tuple(ground_truth.shape)}; expected {op.image_shape}")
    if checkpoint_every < 0:
        raise ValueError(f"fit_dip: checkpoint_every must be >= 0, got {checkpoint_every}")
    return device


@dataclasses.dataclass
class _FitState:
    """What :func:`fit_dip` carries from iteration to iteration and into its checkpoint: the first iteration of this
    call, the lowest loss so far with its iteration and weights (on the device, or CPU after a resume), and the
    per-iteration history (``loss``, ``data_loss``, ``tv``, ``psnr``; ``heldout``: ``[iteration, error]`` of each
    scored iterate); with a held-out monitor the best is by held-out error (``best_score``), and ``stopped`` is the
    iterations done when the monitor stopped the fit (``None`` while it runs)."""

    start: int
    best_loss: float
    best_iteration: int
    best_state: dict
    hist: dict[str, list]
    best_score: float = math.inf
    stopped: int | None = None


def _start_state(model, optimizer, resume_from: Path | None, fingerprint: dict, iterations: int, seed: int, device):
    """A fresh :class:`_FitState` after seeding torch with ``seed``, or the one of the checkpoint ``resume_from``
    when that file exists (its model, optimiser and RNG states restored; :class:`CheckpointMismatch` when it belongs
    to another run or has done more than ``iterations``)."""
    hist: dict[str, list] = {"loss": [], "data_loss": [], "tv": [], "psnr": [], "heldout": []}
    state = _FitState(0, math.inf, -1, _device_state(model), hist)
    torch.manual_seed(seed)
    if resume_from is not None and resume_from.is_file():
        ckpt = load_checkpoint(resume_from)
        _check_fingerprint(ckpt["meta"], fingerprint, resume_from)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state = _FitState(
            start=int(ckpt["iteration"]),
            best_loss=float(ckpt["best_loss"]),
            best_iteration=int(ckpt["best_iteration"]),
            best_state=ckpt["best_state"],
            hist={"heldout": [], **{k: list(v) for k, v in ckpt["history"].items()}},
            stopped=ckpt.get("stopped"),
        )
        # the held-out error of the kept iterate (a checkpoint of a fit without a monitor has no errors)
        state.best_score = min((e for _, e in state.hist["heldout"]), default=math.inf)
        _set_rng_state(ckpt["rng"], device)
        if state.start > iterations:
            raise CheckpointMismatch(
                f"cannot resume from {resume_from}: it has already done {state.start} iterations, more than the "
                f"requested {iterations}"
            )
    return state


def _save_checkpoint(path: Path | None, done: int, model, optimizer, state: _FitState, device, net_input, meta):
    """Write the checkpoint of the fit after ``done`` iterations atomically to ``path`` (nothing without one)."""
    if path is None:
        return
    atomic_torch_save(
        path,
        {
            "version": CHECKPOINT_VERSION,
            "iteration": done,
            "model": _cpu_state(model),
            "optimizer": optimizer.state_dict(),
            "best_state": _cpu_state(state.best_state),
            "best_loss": state.best_loss,
            "best_iteration": state.best_iteration,
            "history": state.hist,
            "rng": _rng_state(device),
            "net_input": net_input.detach().cpu(),
            "meta": meta,
            **({"stopped": state.stopped} if state.stopped is not None else {}),
            "model_config": model.config.to_dict()
            if hasattr(model, "config") and hasattr(model.config, "to_dict")
            else None,
        },
    )


def _loss_and_gradient(model, optimizer, op, net_input_dev, y_s, tv_weight, clip, it: int, lr):
    """One iteration's forward and backward pass (the step itself is the caller's): ``(x_s, data_loss, tv,
    loss_value)`` with the image ``g(v)`` in scaled units and the gradient, clipped to ``clip``, in the model;
    ``FloatingPointError`` for a non-finite loss."""
    optimizer.zero_grad(set_to_none=True)
    x_s = model(net_input_dev)[0, 0]
    data_loss = (op(x_s) - y_s).pow(2).mean()
    tv = tv_anisotropic(x_s, op.ndim)
    loss = data_loss + tv_weight * tv
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    loss_value = float(loss.detach())
    if not math.isfinite(loss_value):
        raise FloatingPointError(
            f"fit_dip: loss became {loss_value} at iteration {it}; lower lr (now {lr}) or check the data"
        )
    return x_s, data_loss, tv, loss_value


def _record_iteration(hist: dict, x_s, data_loss, tv, loss_value: float, scale, gt, gt_range) -> float | None:
    """Append the iteration's loss, data loss, TV and PSNR (``None`` without ground truth) to ``hist``; returns the
    PSNR (dB) of ``x_s / scale`` against ``gt``."""
    psnr_value = None
    if gt is not None:
        with torch.no_grad():
            mse = float((x_s.detach() / scale - gt).pow(2).mean())
        psnr_value = psnr_from_mse(mse, gt_range)
    hist["loss"].append(loss_value)
    hist["data_loss"].append(float(data_loss.detach()))
    hist["tv"].append(float(tv.detach()))
    hist["psnr"].append(psnr_value)
    return psnr_value


def _show_progress(bar, done: int, iterations: int, loss_value: float, best_loss: float, psnr_value) -> None:
    """The progress bar's loss, best loss and PSNR, every 10 iterations and at the last."""
    if done % 10 == 0 or done == iterations:
        post = {"loss": f"{loss_value:.3e}", "best": f"{best_loss:.3e}"}
        if psnr_value is not None:
            post["psnr"] = f"{psnr_value:.2f}"
        bar.set_postfix(post, refresh=False)


def _callback_info(state: _FitState, loss_value: float, psnr_value) -> dict:
    """The ``info`` of :func:`fit_dip`'s ``callback`` for the iteration just recorded."""
    return {
        "loss": loss_value,
        "data_loss": state.hist["data_loss"][-1],
        "tv": state.hist["tv"][-1],
        "psnr": psnr_value,
        "best_loss": state.best_loss,
    }


def _best_result(model, net_input, net_input_dev, state: _FitState, final_state, iterations, elapsed, scale, gt):
    """Load the best weights into ``model`` and return the :class:`DIPResult` with their reconstruction
    ``g(ṽ) / scale`` (dropout off)."""
    model.load_state_dict(state.best_state)
    model.eval()
    with torch.no_grad():
        recon = model(net_input_dev)[0, 0] / scale
    model.train()
    ran = iterations - state.start
    return DIPResult(
        reconstruction=recon.detach(),
        best_iteration=state.best_iteration,
        best_loss=state.best_loss,
        loss_history=state.hist["loss"],
        data_loss_history=state.hist["data_loss"],
        tv_history=state.hist["tv"],
        psnr_history=state.hist["psnr"] if gt is not None else None,
        iterations=iterations,
        time_s=elapsed,
        iterations_per_s=ran / elapsed if elapsed > 0 and ran > 0 else 0.0,
        best_state_dict=_cpu_state(state.best_state),
        final_state_dict=final_state,
        net_input=net_input.detach().cpu(),
        scale=float(scale),
        resumed_from=state.start,
        heldout_history=[(int(i), float(e)) for i, e in state.hist["heldout"]] or None,
        stopped_early=state.stopped is not None,
    )
