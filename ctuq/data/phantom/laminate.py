"""The laminate phantom: a round matrix with parallel plates along one seeded direction (:func:`laminate_phantom`),
the CT counterpart of the rectangles phantoms of the angle-selection study (:mod:`ctuq.data.rectangles`): an object
whose edges share one orientation, where the angles along the plates carry most of the information."""

from __future__ import annotations

import math

import numpy as np

from ctuq.data.phantom.ellipsoid import Ellipsoid, EllipsoidPhantom, rotation_from_euler
from ctuq.data.phantom.walnut import _inside, _separated

__all__ = ["laminate_phantom"]


def laminate_phantom(
    seed: int = 0,
    *,
    radius: float = 14.0,
    plates: int = 8,
    spacing: float = 3.0,
    orientation_deg: float | None = None,
    orientation_std_deg: float = 1.5,
) -> EllipsoidPhantom:
    """A laminate as an :class:`EllipsoidPhantom` (mm, mm⁻¹), random but reproducible from ``seed``.

    A matrix ellipsoid elongated along the rotation axis (semi-axes ``radius`` × ``radius`` × 60 mm, ≈ 0.02 mm⁻¹) holds
    ``plates`` parallel flat plates (thin ellipsoids, half-thickness 0.35–0.7 mm, 30 mm half-height, ≈ 0.03–0.045 mm⁻¹
    above the matrix) ``spacing`` mm apart (±15 %), each turned from the common direction by N(0,
    ``orientation_std_deg``²) and shortened to lie inside the matrix. Plates that would touch another are left out, so
    the attenuation never exceeds matrix + the largest plate value (< 0.068 mm⁻¹; times 14 it lies in [0, 1], the DIP's
    scale), and the object stays within 18 mm of the rotation axis (the real walnut detector's field of view).

    Parameters
    ----------
    seed : int
        Seeds the direction, the plates' offsets, thicknesses and values, and the centre's offset.
    radius : float
        The matrix's radius in the slice plane (mm), at most 16.
    plates : int
        Plates tried (at least 1).
    spacing : float
        Mean distance between neighbouring plates (mm), positive.
    orientation_deg : float, optional
        The plates' common direction in the slice plane (degrees from the x axis); default U(0, 180).
    orientation_std_deg : float
        Spread of each plate's direction around it (degrees).
    """
    if not 0 < radius <= 16:
        raise ValueError(f"laminate_phantom: radius must be in (0, 16] mm, got {radius}")
    if plates < 1 or not spacing > 0:
        raise ValueError(f"laminate_phantom: plates must be >= 1 and spacing > 0, got {plates} and {spacing}")
    rng = np.random.default_rng([int(seed), 0x1A41])
    theta = math.radians(rng.uniform(0.0, 180.0) if orientation_deg is None else float(orientation_deg))
    shift = np.array([rng.uniform(-1.0, 1.0), rng.uniform(-1.0, 1.0), 0.0])
    mu_matrix = rng.uniform(0.017, 0.022)
    matrix = Ellipsoid((0.0, 0.0, 0.0), (radius, radius, 60.0), mu_matrix, name="matrix")
    normal = np.array([-math.sin(theta), math.cos(theta), 0.0])
    parts = [matrix]
    kept: list[Ellipsoid] = []
    for k in range(plates):
        d = (k - (plates - 1) / 2) * spacing * rng.uniform(0.85, 1.15)
        half_t = rng.uniform(0.35, 0.7)
        turn = theta + math.radians(rng.normal(0.0, orientation_std_deg))
        value = rng.uniform(0.03, 0.045)
        reach = radius**2 - (abs(d) + 2 * half_t) ** 2
        if reach <= 4.0:  # the plate would be shorter than 4 mm: it is left out
            continue
        plate = Ellipsoid(
            tuple(d * normal), (0.85 * math.sqrt(reach), half_t, 30.0), value, rotation_from_euler(turn), name="plate"
        )
        if _inside(plate, matrix, 0.01) and all(_separated(plate, o, 0.2) for o in kept):
            kept.append(plate)
    parts += kept
    pose = rotation_from_euler(0.0, 0.0, 0.0)
    return EllipsoidPhantom(e.transformed(pose, shift) for e in parts)
