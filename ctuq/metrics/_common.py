"""Constants and input checks shared by the modules of :mod:`ctuq.metrics` (private).

Kept apart from the public modules so that each of them can import these without import cycles.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ctuq.options import Centering, values

#: Default η of the stabilised patch covariance, relative to the mean pixel variance in the ROI.
DEFAULT_ETA_REL = 1e-4
#: Credible-interval masses 0, 0.05, …, 1 of the calibration curve.
DEFAULT_LEVELS = np.round(np.linspace(0.0, 1.0, 21), 10)
#: The three coverage numbers reported in summaries.
HEADLINE_LEVELS = (0.5, 0.9, 0.95)
#: Bytes of float64 sample data handled per chunk (peak memory is about three times this).
DEFAULT_CHUNK_BYTES = 2**27
_LOG_2PI = math.log(2.0 * math.pi)


def _as_tensor(x, name: str, where: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise TypeError(f"{where}: {name} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _check_samples(samples, where: str) -> torch.Tensor:
    samples = _as_tensor(samples, "samples", where)
    if samples.ndim not in (3, 4):
        raise ValueError(f"{where}: samples must be (k, H, W) or (k, D, H, W), got shape {tuple(samples.shape)}")
    if samples.shape[0] < 1 or samples[0].numel() == 0:
        raise ValueError(f"{where}: samples of shape {tuple(samples.shape)} hold no sample or no pixel")
    if not samples.is_floating_point():
        raise TypeError(f"{where}: samples must be floating point, got {samples.dtype}")
    return samples


def _check_image(x, name: str, shape: tuple[int, ...] | None, where: str, device=None) -> torch.Tensor:
    """An image-shaped float64 tensor on ``device``; shape-checked against ``shape`` and finite."""
    t = _as_tensor(x, name, where)
    if shape is None:
        if t.ndim not in (2, 3):
            raise ValueError(f"{where}: {name} must be (H, W) or (D, H, W), got shape {tuple(t.shape)}")
    elif tuple(t.shape) != shape:
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape} (the image shape)")
    t = t.to(device=device if device is not None else t.device, dtype=torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{where}: {name} contains NaN or Inf")
    return t


def _check_centering(centering: str, mean_given: bool, k: int, where: str) -> None:
    if centering not in values(Centering):
        raise ValueError(f"{where}: centering must be one of {values(Centering)}, got {centering!r}")
    if centering == Centering.MEAN and not mean_given:
        raise ValueError(f"{where}: centering='mean' needs the predictive mean")
    if centering == Centering.EMPIRICAL and k < 2:
        raise ValueError(f"{where}: centering='empirical' needs at least 2 samples, got k = {k}")


def _chunk_count(bytes_per_item: int, chunk_bytes: int) -> int:
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, int(chunk_bytes) // max(1, bytes_per_item))
