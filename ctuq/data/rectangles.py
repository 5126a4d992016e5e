"""Synthetic "rectangles" phantoms of the published angle-selection study (Barbano et al. 2022; Antorán's
thesis §7.6) and their parallel-beam geometry.

Each image is the sum of 3 rectangles on the square ``[−1, 1]²``: intensity ``U(0.5, 1)``, half-sides
``U(0.1, 0.8)`` each, centre ``U(−0.75, 0.75)²``; one *preferential angle* ``φ ~ U(0°, 180°)`` per image and each
rectangle rotated by ``N(φ, 2.86°)``, so every image has two perpendicular preferential edge directions that differ
from image to image. Drawn at ``supersampling ×`` the resolution (8 by default) and area-averaged.
"""

from __future__ import annotations

import math

import numpy as np

from ctuq.geometry import ProjectionGeometry, VolumeGeometry

__all__ = ["rectangles_image", "rectangles_stack", "parallel_geometry"]


def rectangles_image(
    rng: np.random.Generator,
    size: int = 128,
    *,
    n_rectangles: int = 3,
    orientation_mean: float | None = None,
    orientation_std: float = 2.86,
    supersampling: int = 8,
) -> tuple[np.ndarray, float]:
    """One phantom ``(size, size)`` float32 and its preferential angle (degrees).

    ``orientation_mean`` (degrees) fixes ``φ`` instead of drawing it from ``U(0, 180)``; ``orientation_std`` is the
    rectangles' spread around it (degrees). Row index ↔ ``y``, column ↔ ``x`` (ctuq's image convention).
    """
    phi = float(rng.uniform(0.0, 180.0)) if orientation_mean is None else float(orientation_mean)
    n = size * supersampling
    c = (np.arange(n) + 0.5) / n * 2.0 - 1.0
    yy, xx = np.meshgrid(c, c, indexing="ij")
    img = np.zeros((n, n), dtype=np.float64)
    for _ in range(n_rectangles):
        value = rng.uniform(0.5, 1.0)
        hx, hy = rng.uniform(0.1, 0.8, size=2)
        cx, cy = rng.uniform(-0.75, 0.75, size=2)
        theta = math.radians(rng.normal(phi, orientation_std))
        u = (xx - cx) * math.cos(theta) + (yy - cy) * math.sin(theta)
        v = -(xx - cx) * math.sin(theta) + (yy - cy) * math.cos(theta)
        img += value * ((np.abs(u) <= hx) & (np.abs(v) <= hy))
    img = img.reshape(size, supersampling, size, supersampling).mean(axis=(1, 3))
    return img.astype(np.float32), phi


def rectangles_stack(
    n_images: int,
    size: int = 128,
    *,
    seed: int = 0,
    orientation_mean: float | None = None,
    orientation_std: float = 2.86,
    supersampling: int = 8,
) -> tuple[np.ndarray, np.ndarray]:
    """``(n_images, size, size)`` phantoms and their preferential angles; image ``i`` depends only on
    ``(seed, i)`` (so a study can add images without changing the earlier ones)."""
    imgs, angles = [], []
    for i in range(n_images):
        rng = np.random.default_rng([int(seed), i])
        im, phi = rectangles_image(
            rng, size, orientation_mean=orientation_mean, orientation_std=orientation_std, supersampling=supersampling
        )
        imgs.append(im)
        angles.append(phi)
    return np.stack(imgs), np.asarray(angles)


def parallel_geometry(size: int, angles_rad, n_det: int | None = None):
    """``(VolumeGeometry, ProjectionGeometry)`` of the study: ``size²`` pixels on ``[−1, 1]²``, parallel beam with
    ``n_det`` detector pixels of one pixel's width (default ``⌈√2·size⌉ + 1``: 183 for 128², covering the
    diagonal)."""
    h = 2.0 / size
    n_det = int(math.ceil(math.sqrt(2.0) * size)) + 1 if n_det is None else int(n_det)
    vol = VolumeGeometry((size, size), h)
    geo = ProjectionGeometry("parallel", (n_det,), angles=np.asarray(angles_rad, dtype=np.float64), det_spacing=h)
    return vol, geo
