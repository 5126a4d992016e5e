"""A small simulated 3D parallel-beam problem: the CPU path of the 3D code.

The walnut data are cone beam and their 3D operator needs ASTRA CUDA. To run (and test) the 3D pipeline — 3D
U-Net DIP, 3D Jacobian products, the posterior over a volume, streaming 3D statistics, orthogonal-slice figures —
on a CPU, :func:`simulate_parallel_volume` scans the synthetic walnut phantom with parallel rays about ``z`` (one
detector row per slice) and returns a :class:`~ctuq.data.problem.CTData` whose operator is the slice-by-slice
:class:`~ctuq.operators.SlicewiseParallelRayTransform`. The measurements are the phantom's *exact* line integrals
(not ``T`` of the rasterised phantom: no inverse crime) plus seeded Gaussian noise; the ground truth is the
phantom averaged over each voxel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ctuq.data.phantom import EllipsoidPhantom, walnut_phantom
from ctuq.data.problem import CTData
from ctuq.geometry import VolumeGeometry
from ctuq.operators import SlicewiseParallelRayTransform

__all__ = ["simulate_parallel_volume"]


def simulate_parallel_volume(
    shape: Sequence[int] = (24, 24, 24),
    *,
    n_angles: int = 20,
    det_count: int | None = None,
    field_of_view: float = 40.0,
    noise: float = 0.01,
    phantom: EllipsoidPhantom | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> CTData:
    """A seeded 3D parallel-beam scan of the synthetic walnut on a ``(D, H, W)`` grid (CPU or CUDA operator).

    Parameters
    ----------
    shape : (D, H, W)
        Voxel grid; cubic voxels of ``field_of_view / max(H, W)`` mm, centred at the origin.
    n_angles : int
        Equally spaced angles over ``[0, π)``.
    det_count : int, optional
        Detector columns at the voxel pitch; default ``⌈√2 · max(H, W)⌉`` (covers the grid's diagonal).
    field_of_view : float
        In-plane extent of the grid (mm); the default 40 mm holds the ≈ 31 × 29 × 34 mm walnut.
    noise : float
        Std of the additive Gaussian noise relative to the mean absolute line integral (≥ 0).
    phantom : EllipsoidPhantom, optional
        Default ``walnut_phantom(seed)``.
    seed : int
        Phantom (when not given) and noise.

    Returns
    -------
    CTData
        ``op`` (:class:`~ctuq.operators.SlicewiseParallelRayTransform`), ``y`` ``(n_angles, D, det_count)``
        (dimensionless line integrals), ``ground_truth`` ``(D, H, W)`` (mm⁻¹), ``volume``, ``geometry``
        (``parallel3d``) and ``meta``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) != 3 or min(shape) < 2:
        raise ValueError(f"simulate_parallel_volume: shape must be 3 ints >= 2 (D, H, W), got {shape}")
    if not isinstance(n_angles, int) or n_angles < 1:
        raise ValueError(f"simulate_parallel_volume: n_angles must be a positive int, got {n_angles!r}")
    if not (noise >= 0 and math.isfinite(noise)):
        raise ValueError(f"simulate_parallel_volume: noise must be >= 0, got {noise!r}")
    if not (field_of_view > 0 and math.isfinite(field_of_view)):
        raise ValueError(f"simulate_parallel_volume: field_of_view must be positive (mm), got {field_of_view!r}")
    voxel = field_of_view / max(shape[1:])
    n_det = int(det_count) if det_count is not None else math.ceil(math.sqrt(2.0) * max(shape[1:]))
    volume = VolumeGeometry(shape, voxel)
    angles = np.linspace(0.0, np.pi, n_angles, endpoint=False)
    op = SlicewiseParallelRayTransform(volume, angles, n_det, voxel, device=device)
    ph = phantom if phantom is not None else walnut_phantom(seed)
    # Exact line integrals along every detector pixel's ray, from far behind the object.
    centres = op.geometry.detector_centers()  # (A, D, n_det, 3)
    dirs = op.geometry.ray_directions()  # (A, 3)
    dirs = dirs / np.linalg.norm(dirs, axis=1, keepdims=True)
    reach = 2.0 * field_of_view + float(np.abs(centres).max())
    starts = centres - reach * dirs[:, None, None, :]
    y = ph.line_integrals(starts, directions=np.broadcast_to(dirs[:, None, None, :], centres.shape))
    rng = np.random.default_rng(seed)
    sigma = noise * float(np.abs(y).mean())
    y = y + sigma * rng.standard_normal(y.shape)
    gt = ph.rasterize(volume, supersampling=2)
    meta = {
        "kind": "simulated 3D parallel beam (slice by slice)",
        "image_shape": list(shape),
        "voxel_size_mm": voxel,
        "n_angles": n_angles,
        "det_count": n_det,
        "noise_std": sigma,
        "noise_relative": noise,
        "seed": seed,
    }
    return CTData(
        op=op,
        y=torch.as_tensor(y, dtype=torch.float32).to(op.device),
        ground_truth=torch.as_tensor(gt, dtype=torch.float32),
        volume=volume,
        geometry=op.geometry,
        meta=meta,
    )
