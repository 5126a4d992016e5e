"""MC-dropout deep image prior: the standard uncertainty baseline for DIP reconstructions in CT.

The network carries dropout after its convolutions (:func:`ctuq.models.build_unet` with ``dropout=0.05``: channel
dropout after every conv block) and is fitted as an ordinary DIP with dropout active (:func:`fit_mc_dropout_dip`,
a thin wrapper around :func:`ctuq.reconstruct.dip.fit_dip`). At test time, ``N`` stochastic forward passes with
dropout on and every other layer in eval behaviour give the predictive mean (their average) and, through their
spread, the uncertainty (:func:`mc_dropout_predict`). The passes go to :func:`ctuq.metrics.uq_summary` with
``centering="empirical"``, so MC dropout is scored by exactly the same metrics as the linearised methods.

Reproducibility. Each pass ``j`` draws its dropout masks from its own generator seeded by ``(seed, j)``, in the
order the dropout layers run. Masks therefore do not depend on how the passes are batched: ``batch=1`` and
``batch=64`` give the same passes (up to float round-off of batched convolutions), and so does a rerun with the
same seed on the same device. To do that, the dropout modules are switched to eval mode (identity) and a forward
hook multiplies their output by the per-pass mask, reproducing torch's train-mode dropout exactly in
distribution: every element (``nn.Dropout``) or every channel (``nn.Dropout1d/2d/3d``) is zeroed with
probability ``p`` and the rest are scaled by ``1/(1 − p)``. The model's modes are restored afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
from torch import nn

from ctuq.models import build_unet, make_net_input
from ctuq.reconstruct.dip import fit_dip
from ctuq.utils import derived_seed_words
from ctuq.utils import progress as _progress_bar

__all__ = ["MCDropoutPrediction", "mc_dropout_predict", "fit_mc_dropout_dip", "dropout_layers", "pass_seed"]

# Element-wise dropout and channel dropout (one mask value per (pass, channel)) are what the hook reproduces.
_ELEMENTWISE = (nn.Dropout,)
_CHANNELWISE = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
# Other dropout flavours change the distribution of the kept values; refusing them beats silently mis-sampling.
_UNSUPPORTED = (nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclasses.dataclass
class MCDropoutPrediction:
    """Output of :func:`mc_dropout_predict`.

    Attributes
    ----------
    mean : torch.Tensor
        ``image_shape`` predictive mean: the average of the passes (image units, mm⁻¹ for walnut data), float32,
        on ``passes.device``.
    passes : torch.Tensor
        ``(N, *image_shape)`` stochastic forward passes in image units (``model output / scale``), float32. Not
        zero-mean: score them with ``centering="empirical"`` in :mod:`ctuq.metrics`.
    std : torch.Tensor
        ``image_shape`` unbiased sample standard deviation of the passes (divides by ``N − 1``), image units.
    time_s : float
        Wall time of the forward passes (s; CUDA synchronised), excluding the mean/std reduction.
    n_passes, batch : int
        Number of passes and passes per forward call.
    rates : list[float]
        Dropout rate ``p`` of each active dropout layer, in module order.
    seed : int
        Base seed of the per-pass generators.
    """

    mean: torch.Tensor
    passes: torch.Tensor
    std: torch.Tensor
    time_s: float
    n_passes: int
    batch: int
    rates: list[float]
    seed: int

    def summary(self) -> dict[str, Any]:
        """JSON-friendly scalars."""
        return {
            "n_passes": self.n_passes,
            "batch": self.batch,
            "time_s": self.time_s,
            "dropout_layers": len(self.rates),
            "dropout_rates": sorted(set(self.rates)),
            "seed": self.seed,
        }


def dropout_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every dropout layer with ``p > 0`` that :func:`mc_dropout_predict` can sample.

    Raises ``ValueError`` naming the module for dropout flavours it cannot reproduce (alpha dropout).
    """
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, _UNSUPPORTED):
            raise ValueError(
                f"mc_dropout: module {name!r} is {type(mod).__name__}, which MC-dropout prediction does "
                f"not support (use nn.Dropout or nn.Dropout1d/2d/3d)"
            )
        if isinstance(mod, _ELEMENTWISE + _CHANNELWISE) and float(mod.p) > 0.0:
            found.append((name, mod))
    return found


def pass_seed(seed: int, index: int) -> int:
    """Seed of pass ``index``'s mask generator: a 63-bit hash of ``(seed, index)`` (numpy ``SeedSequence``), so
    neighbouring passes and neighbouring base seeds get unrelated streams."""
    if seed < 0 or index < 0:
        raise ValueError(f"pass_seed: seed and index must be >= 0, got seed={seed}, index={index}")
    lo, hi = derived_seed_words(seed, index)
    return (hi << 32 | lo) >> 1  # the little-endian uint64 of the two words, 63 bits (as in ctuq 0.1)


def mc_dropout_predict(
    model: nn.Module,
    net_input: torch.Tensor,
    n_passes: int,
    *,
    scale: float = 1.0,
    seed: int = 0,
    batch: int = 32,
    device: torch.device | str | None = None,
    out_device: torch.device | str = "cpu",
    progress: bool = True,
) -> MCDropoutPrediction:
    """``n_passes`` stochastic forward passes of a dropout network: predictive mean, passes and std.

    Parameters
    ----------
    model : nn.Module
        A fitted network with dropout layers (``nn.Dropout`` or ``nn.Dropout1d/2d/3d`` with ``p > 0``), mapping
        ``(B, C, *image_shape)`` to ``(B, 1, *image_shape)`` in scaled image units (e.g. a
        :class:`ctuq.models.UNet` built with ``dropout > 0``). Dropout is active and everything else (e.g.
        normalisation layers) runs in eval behaviour; the model's train/eval modes are restored on return and
        its weights are not changed.
    net_input : torch.Tensor
        The fixed DIP input ``(1, C, *image_shape)``.
    n_passes : int
        ``N ≥ 2`` passes (the std needs two).
    scale : float
        The DIP's data/image scale: passes are ``model output / scale`` (walnut: 14 → mm⁻¹).
    seed : int
        Base seed (≥ 0); pass ``j`` draws its masks from a generator seeded with :func:`pass_seed` ``(seed, j)``.
    batch : int
        Passes per forward call (the input is repeated ``batch`` times); only speed and memory depend on it.
    device : torch.device or str, optional
        Where to run (default: the device of the model's parameters).
    out_device : torch.device or str
        Where the passes are collected (default CPU: 1024 passes of a 501² slice take 1 GB).
    progress : bool
        Progress bar over passes.

    Returns
    -------
    MCDropoutPrediction
    """
    _check_predict_arguments(net_input, n_passes, scale, seed, batch)
    layers = dropout_layers(model)
    if not layers:
        raise ValueError(
            "mc_dropout_predict: the model has no dropout layer with p > 0 (nn.Dropout or nn.Dropout1d/2d/3d), so "
            "every pass would be identical; build it with dropout, e.g. ctuq.models.build_unet(preset, dropout=0.05), "
            "and fit it with dropout active (fit_mc_dropout_dip)"
        )
    first = next(model.parameters(), None)
    if device is None:
        device = first.device if first is not None else net_input.device
    device = torch.device(device)
    out_device = torch.device(out_device)
    dtype = first.dtype if first is not None else (net_input.dtype if net_input.is_floating_point() else torch.float32)
    x_in = net_input.to(device=device, dtype=dtype)

    gens: list[torch.Generator] = []  # generators of the passes in the current batch, in batch order
    was_training = {m: m.training for m in model.modules()}
    hook = _masking_hook(gens)
    handles = [mod.register_forward_hook(hook) for _, mod in layers]
    model.eval()  # also makes the dropout modules the identity: the hook applies the masks
    bar = _progress_bar(total=n_passes, desc="MC dropout", disable=None if progress else True)
    try:
        chunks, elapsed = _run_passes(model, x_in, n_passes, scale, seed, batch, device, out_device, gens, bar)
    finally:
        bar.close()
        for h in handles:
            h.remove()
        gens.clear()
        for m, flag in was_training.items():
            m.train(flag)
    passes = torch.cat(chunks, dim=0)
    # two-pass moments in float64: the passes' mean is far larger than their spread
    mean64 = passes.double().mean(0)
    var = (passes.double() - mean64).pow(2).sum(0) / (n_passes - 1)
    return MCDropoutPrediction(
        mean=mean64.float(),
        passes=passes,
        std=var.sqrt().float(),
        time_s=elapsed,
        n_passes=n_passes,
        batch=batch,
        rates=[float(m.p) for _, m in layers],
        seed=seed,
    )


def _check_predict_arguments(net_input, n_passes, scale, seed, batch) -> None:
    """``ValueError`` naming the first bad argument of :func:`mc_dropout_predict`."""
    if isinstance(n_passes, bool) or not isinstance(n_passes, int) or n_passes < 2:
        raise ValueError(f"mc_dropout_predict: n_passes must be an int >= 2 (a std needs two passes), got {n_passes!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"mc_dropout_predict: batch must be a positive int, got {batch!r}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"mc_dropout_predict: scale must be positive and finite, got {scale}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"mc_dropout_predict: seed must be an int >= 0, got {seed!r}")
    if not isinstance(net_input, torch.Tensor) or net_input.ndim < 3 or net_input.shape[0] != 1:
        shape = tuple(net_input.shape) if isinstance(net_input, torch.Tensor) else type(net_input).__name__
        raise ValueError(f"mc_dropout_predict: net_input must be (1, C, *image_shape), got {shape}")


def _masking_hook(gens: list[torch.Generator]):
    """The forward hook of a dropout layer (in eval mode, the identity) that applies pass ``i``'s mask, drawn from
    ``gens[i]``, to batch entry ``i`` of its input: ``x · mask / (1 − p)`` (per element, or per channel for
    ``nn.Dropout1d/2d/3d``)."""

    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        if x.shape[0] != len(gens):
            raise RuntimeError(
                f"mc_dropout_predict: dropout layer input has batch size {x.shape[0]} but {len(gens)} passes were "
                f"run; the model must keep the batch axis first through its dropout layers"
            )
        p = float(module.p)
        keep = 1.0 - p
        per_pass = (
            ((x.shape[1],) + (1,) * (x.ndim - 2))
            if isinstance(module, _CHANNELWISE) and x.ndim >= 2
            else tuple(x.shape[1:])
        )
        mask = torch.stack(
            [torch.empty(per_pass, device=x.device, dtype=x.dtype).bernoulli_(keep, generator=g) for g in gens]
        )
        return x * mask * (1.0 / keep if keep > 0 else 0.0)

    return hook


def _run_passes(model, x_in, n_passes: int, scale: float, seed: int, batch: int, device, out_device, gens, bar):
    """The ``n_passes`` forward passes, ``batch`` at a time, each batch's mask generators set in ``gens``: the
    chunks ``(b, *image_shape)`` float32 on ``out_device`` (``model output / scale``) and the seconds taken."""
    chunks: list[torch.Tensor] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, n_passes, batch):
            b = min(batch, n_passes - start)
            gens[:] = [torch.Generator(device=device).manual_seed(pass_seed(seed, start + i)) for i in range(b)]
            out = model(x_in.expand(b, *x_in.shape[1:]))
            if out.ndim != x_in.ndim or out.shape[0] != b or out.shape[1] != 1:
                raise ValueError(
                    f"mc_dropout_predict: the model maps input {tuple(x_in.expand(b, *x_in.shape[1:]).shape)} to "
                    f"{tuple(out.shape)}; expected ({b}, 1, *image_shape)"
                )
            chunks.append((out[:, 0] / scale).to(out_device, torch.float32))
            bar.update(b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return chunks, time.perf_counter() - t0


def fit_mc_dropout_dip(
    op,
    y: torch.Tensor,
    *,
    preset: str = "tiny",
    dropout: float = 0.05,
    net_input: torch.Tensor | None = None,
    iterations: int,
    lr: float = 1e-4,
    tv_weight: float = 0.0,
    clip_grad_norm: float | None = 1.0,
    scale: float = 1.0,
    seed: int = 0,
    input_std: float = 0.1,
    model_kwargs: dict | None = None,
    **fit_kwargs,
):
    """Build a U-Net with channel dropout after every conv block and fit it as a DIP (dropout active).

    Parameters
    ----------
    op : RayTransform
        ``T`` (``image_shape`` ``(H, W)``/``(D, H, W)``); the fit runs on its device unless ``device`` is given.
    y : torch.Tensor
        ``op.measurement_shape`` sinogram (data units).
    preset : str
        :func:`ctuq.models.build_unet` preset (``"tiny"``, ``"small"``, ``"walnut"``).
    dropout : float
        Dropout rate ``p`` in (0, 1) (published MC-dropout baseline: 0.05).
    net_input : torch.Tensor, optional
        Fixed input ``(1, 1, *image_shape)``; default :func:`ctuq.models.make_net_input` with ``seed`` and
        ``input_std`` (the same input the CLI's DIP gets for that seed).
    iterations, lr, tv_weight, clip_grad_norm, scale
        As in :func:`ctuq.reconstruct.dip.fit_dip`.
    seed : int
        Seeds the initial weights (drawn inside ``torch.random.fork_rng``, so the global RNG is untouched; same
        values as ``torch.manual_seed(seed)`` followed by ``build_unet``) and the dropout masks of the fit.
    model_kwargs : dict, optional
        Further :func:`~ctuq.models.build_unet` arguments (``channels``, ``skip_channels``, ``norm_groups``, ...).
    **fit_kwargs
        Passed to :func:`~ctuq.reconstruct.dip.fit_dip` (``ground_truth``, ``checkpoint_path``, ``resume``,
        ``device``, ``progress``, ...).

    Returns
    -------
    (model, DIPResult)
        The fitted dropout U-Net (holding the lowest-loss weights, left in train mode by ``fit_dip``) and the
        fit's result; ``result.reconstruction`` is the deterministic output with dropout off, while the MC-dropout
        prediction is the average of :func:`mc_dropout_predict`'s passes.
    """
    if not (0.0 < dropout < 1.0):
        raise ValueError(f"fit_mc_dropout_dip: dropout rate must lie in (0, 1), got {dropout}")
    if net_input is None:
        net_input = make_net_input(op.image_shape, channels=1, seed=seed, std=input_std)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_unet(preset, ndim=op.ndim, dropout=dropout, **(model_kwargs or {}))
    result = fit_dip(
        op,
        y,
        model=model,
        net_input=net_input,
        iterations=iterations,
        lr=lr,
        tv_weight=tv_weight,
        clip_grad_norm=clip_grad_norm,
        scale=scale,
        seed=seed,
        **fit_kwargs,
    )
    return model, result
