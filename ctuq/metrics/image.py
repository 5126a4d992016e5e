"""Image-quality metrics against a ground truth: PSNR and SSIM (the one home of both in ctuq).

* :func:`psnr` — torch, float64, any device: the DIP's progress and the studies' tables;
* :func:`psnr_from_mse` — the same formula from a mean squared error already at hand (the DIP loop computes it in
  the fit's float32 on the device, once per iteration);
* :func:`image_metrics` — ``{"psnr", "ssim"}`` with ``skimage.metrics`` (float64 numpy on the CPU): the numbers a
  run folder's ``metrics.json`` reports.

Every PSNR here uses ``data_range = max − min`` of the **ground truth** by default, so a number does not depend on
the reconstruction's own range: ``PSNR = 10 log10(data_range² / mse)`` dB, ``+inf`` for a perfect match (and
``None`` in :func:`image_metrics`, whose dict goes to JSON). Images are ``(H, W)`` or ``(D, H, W)`` in any units
(attenuation in mm⁻¹ for walnut data); PSNR is in dB, SSIM dimensionless (≤ 1).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from ctuq.utils import to_numpy

__all__ = ["psnr", "psnr_from_mse", "image_metrics"]


def psnr_from_mse(mse: float, data_range: float) -> float:
    """``10 log10(data_range² / mse)`` dB; ``+inf`` when ``mse`` is 0 (``mse`` in image units², ``data_range`` in
    image units)."""
    return 10.0 * math.log10(data_range**2 / mse) if mse > 0 else math.inf


def psnr(x: torch.Tensor, ground_truth: torch.Tensor, data_range: float | None = None) -> float:
    """Peak signal-to-noise ratio (dB) of ``x`` against ``ground_truth`` (same shape, any device), in float64.

    ``data_range`` defaults to ``max − min`` of the ground truth. Same definition as
    ``skimage.metrics.peak_signal_noise_ratio(gt, x, data_range=...)``; ``+inf`` for ``x == ground_truth``.
    """
    if x.shape != ground_truth.shape:
        raise ValueError(f"psnr: image shape {tuple(x.shape)} != ground-truth shape {tuple(ground_truth.shape)}")
    gt = ground_truth.double()
    if data_range is None:
        data_range = float(gt.max() - gt.min())
    mse = float((x.double() - gt).pow(2).mean())
    if mse == 0.0:
        return math.inf
    return 10.0 * math.log10(data_range**2 / mse)


def image_metrics(x: torch.Tensor | np.ndarray, ground_truth: torch.Tensor | np.ndarray) -> dict[str, float | None]:
    """PSNR (dB) and SSIM of ``x`` against ``ground_truth`` (same shape, 2D or 3D; tensors on any device or arrays).

    Both use ``skimage.metrics`` on float64 copies of the float32 images, with ``data_range = max − min`` of the
    ground truth (so the numbers do not depend on the reconstruction's own range). ``"psnr"`` is ``None`` for a
    perfect match (JSON has no infinity).
    """
    a, gt = to_numpy(x).astype(np.float64), to_numpy(ground_truth).astype(np.float64)
    if a.shape != gt.shape:
        raise ValueError(f"image_metrics: reconstruction shape {a.shape} != ground-truth shape {gt.shape}")
    data_range = float(gt.max() - gt.min())
    if data_range <= 0:
        raise ValueError("image_metrics: the ground truth is constant (data range 0); PSNR/SSIM are undefined")
    value = float(peak_signal_noise_ratio(gt, a, data_range=data_range))
    ssim = float(structural_similarity(gt, a, data_range=data_range))
    return {"psnr": value if math.isfinite(value) else None, "ssim": ssim}
