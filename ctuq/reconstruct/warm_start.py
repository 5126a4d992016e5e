"""Warm start of the deep image prior at a classical reconstruction: fit the U-Net's output to an image.

Before the DIP sees the data, its weights ``v`` are fitted by Adam to an image ``x₀`` (the held-out-tuned TV
reconstruction, ``dip.warm_start = tv``)::

    L₀(v) = mean_j ((g(v) − s·x₀)_j²)

in the same scaled units as :func:`ctuq.reconstruct.dip.fit_dip`. The DIP fit then starts where the classical
method ended, and its held-out selection (:class:`~ctuq.reconstruct.heldout.HeldoutMonitor`) scores that start too:
the kept iterate is never worse on held-out angles than the network's copy of ``x₀``. This is the per-scan form of
the pretrained ("educated") start of Barbano et al. (2022), who pretrain on simulated pairs instead.

Each iteration costs one forward and backward pass of the network and no ray transform. The fit is seeded and
deterministic, so a resumed run repeats it bit-identically instead of storing it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ctuq.reconstruct.dip import _device_state, check_fit_settings
from ctuq.utils import progress as _progress_bar

__all__ = ["fit_to_image"]


def fit_to_image(
    model: nn.Module,
    net_input: torch.Tensor,
    target: torch.Tensor,
    *,
    iterations: int,
    lr: float = 1e-2,
    scale: float = 1.0,
    clip_grad_norm: float | None = None,
    seed: int = 0,
    progress: bool = True,
) -> float:
    """Fit ``model(net_input)`` to ``scale · target`` by Adam on the mean squared difference, in place.

    Parameters
    ----------
    model : nn.Module
        Maps ``net_input`` ``(1, C, *image_shape)`` to ``(1, 1, *image_shape)``; trained in place (its device).
    net_input : torch.Tensor
        The DIP's fixed input ``(1, C, *image_shape)``.
    target : torch.Tensor
        ``image_shape`` image in the units of the reconstruction (e.g. mm⁻¹).
    iterations : int
        Adam iterations (≥ 0; 0 leaves the model as it is).
    lr : float
        Adam learning rate. The default 1e-2, unclipped, copies a 128² TV image into the ``tiny`` U-Net (its input
        that image) to 50 dB in 1500 iterations; the DIP fit's 3e-3 clipped at 1 reaches 41 dB in 500 (measured
        with the held-out-tuned TV image of a textured 128² scan at 300 angles). A cosine decay did worse.
    scale : float
        ``s``: the target is multiplied by it, as the DIP's image is (:func:`ctuq.reconstruct.dip.fit_dip`).
    clip_grad_norm : float or None
        Clip the global gradient 2-norm to this before each step (``None``/``0``: no clipping).
    seed : int
        Seeds torch first (dropout masks).
    progress : bool
        Show a tqdm bar.

    Returns
    -------
    float
        The PSNR (dB) of the fitted output against ``target``, over ``target``'s range. The model keeps the weights
        with the lowest loss of all iterations (Adam at ``lr`` 1e-2 has occasional loss spikes: a warm start that
        ended on one copied the TV image to 38 dB instead of 49).

    Raises
    ------
    ValueError
        A target whose shape is not the input's image shape, negative ``iterations``, a non-positive ``lr`` or
        ``scale``.
    FloatingPointError
        The loss became NaN or infinite (lower ``lr``).
    """
    image_shape = tuple(net_input.shape[2:])
    if tuple(target.shape) != image_shape:
        raise ValueError(
            f"fit_to_image: target has shape {tuple(target.shape)}; the input's image shape is {image_shape}"
        )
    check_fit_settings("fit_to_image", iterations, lr, scale)
    device = next(model.parameters()).device
    v = net_input.to(device=device, dtype=torch.float32)
    t = (target.to(device=device, dtype=torch.float32) * scale).contiguous()
    clip = clip_grad_norm if clip_grad_norm else None
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    torch.manual_seed(seed)
    model.train()
    bar = _progress_bar(total=iterations, desc="DIP warm start", disable=None if progress else True)
    best, best_state = math.inf, None
    try:
        for it in range(iterations + 1):  # the last pass only scores the last step's weights
            optimizer.zero_grad(set_to_none=True)
            loss = (model(v)[0, 0] - t).pow(2).mean()
            value = float(loss.detach())
            if not math.isfinite(value):
                raise FloatingPointError(f"fit_to_image: loss became {value} at iteration {it}; lower lr (now {lr})")
            if value < best:  # Adam at this step size spikes now and then: keep the best weights, not the last
                best, best_state = value, _device_state(model)
            if it == iterations:
                break
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            bar.update(1)
    finally:
        bar.close()
    model.load_state_dict(best_state)
    mse = best / scale**2
    span = float(target.max() - target.min())
    return 10 * math.log10(span**2 / mse) if mse > 0 and span > 0 else math.inf
