"""The synthetic walnut: an ellipsoid phantom of a shell with pores, a cavity, a septum and two kernel halves
with folds and pockets (:func:`walnut_phantom`), every carving placed fully inside what it carves."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ctuq.data.phantom.ellipsoid import Ellipsoid, EllipsoidPhantom, rotation_from_euler

__all__ = ["walnut_phantom"]


# ---------------------------------------------------------------------------------------- synthetic walnut
def _inside(child: Ellipsoid, parent: Ellipsoid, margin: float = 0.04, n: int = 1000) -> bool:
    """Whether ``child`` lies inside ``parent`` shrunk by ``margin`` (normalised radius), by dense surface
    sampling; the margin absorbs the sampling error."""
    return bool(np.max(parent.normalized_radius_sq(child.surface_points(n))) <= (1.0 - margin) ** 2)


def _outside_small(child: Ellipsoid, other: Ellipsoid, margin: float = 0.04, n: int = 1000) -> bool:
    """Whether a *small, round* ``child`` misses ``other`` (``other`` grown by ``margin``), by dense sampling of the
    child's surface: if they met, part of the child's surface would lie inside ``other``, and for a small round
    child that part is many samples wide. (Not valid for large thin bodies: use :func:`_separated`.)"""
    return bool(np.min(other.normalized_radius_sq(child.surface_points(n))) >= (1.0 + margin) ** 2)


def _separated(a: Ellipsoid, b: Ellipsoid, gap: float = 0.0) -> bool:
    """Exact sufficient disjointness test: some axis (a principal axis of either ellipsoid, or the line of
    centres) on which the two support intervals are at least ``gap`` mm apart. An ellipsoid's half-width along a
    unit vector ``n`` is ``|diag(a) Rᵀ n|``."""
    ca, cb = np.asarray(a.center), np.asarray(b.center)
    axes = [*np.asarray(a.rotation).T, *np.asarray(b.rotation).T]
    dist = np.linalg.norm(cb - ca)
    if dist > 0:
        axes.append((cb - ca) / dist)
    for n in axes:
        ha = np.linalg.norm(np.asarray(a.semi_axes) * (np.asarray(a.rotation).T @ n))
        hb = np.linalg.norm(np.asarray(b.semi_axes) * (np.asarray(b.rotation).T @ n))
        if abs(float(n @ (cb - ca))) >= ha + hb + gap:
            return True
    return False


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    return rotation_from_euler(rng.uniform(0, 2 * math.pi), math.asin(rng.uniform(-1, 1)), rng.uniform(0, 2 * math.pi))


def _place_carvings(
    rng, parent: Ellipsoid, count: int, make, others: Sequence[Ellipsoid], tries: int = 400
) -> list[Ellipsoid]:
    """Rejection-sample up to ``count`` carving ellipsoids ``make(rng, point)`` inside ``parent``, separated
    (:func:`_separated`, 0.2 mm) from each other and from ``others``."""
    out: list[Ellipsoid] = []
    pc, pr, pa = np.asarray(parent.center), np.asarray(parent.rotation), np.asarray(parent.semi_axes)
    for _ in range(tries):
        if len(out) == count:
            break
        s = rng.normal(size=3)
        s *= rng.uniform(0.0, 0.8) ** (1 / 3) / np.linalg.norm(s)  # uniform in 80 % of the unit ball
        cand = make(rng, pc + pr @ (pa * s))
        if all(_separated(cand, o, 0.2) for o in [*others, *out]) and _inside(cand, parent):
            out.append(cand)
    return out


def walnut_phantom(
    seed: int = 0,
    *,
    size: float = 1.0,
    center: Sequence[float] | None = None,
    shell_value: float | None = None,
    kernel_value: float | None = None,
    septum_value: float | None = None,
    n_folds: int = 14,
    n_pockets: int = 8,
    n_pores: int = 8,
) -> EllipsoidPhantom:
    """A synthetic walnut as an :class:`EllipsoidPhantom` (mm, mm⁻¹), random but reproducible from ``seed``.

    Structure (walnut frame: long axis ``z``, septum in the plane ``x = 0``; the whole nut is then tilted by a
    few degrees, turned about ``z`` and shifted, all seeded):

    * shell: an outer ellipsoid (about 31 × 29 × 34 mm times ``size``, ±4 % per axis) with value
      ``shell_value`` (≈ 0.055 mm⁻¹) minus a concentric inner cavity 1.2–1.8 mm thinner (value −shell) —
      air inside — with a few small pores carved out of the shell wall;
    * septum: a thin plate (≈ 1.2 mm thick) in the plane ``x = 0`` inside the cavity (≈ 0.045 mm⁻¹);
    * kernel: one half on each side of the septum (≈ 0.034 mm⁻¹, ±4 %), leaving air gaps to the shell and the
      septum, each split into two lobes by a deep crease (a thin disc across its middle);
    * up to ``n_folds`` thin folds (flat discs) and ``n_pockets`` small air pockets carved out of each half.

    The shell's outline stays within 18 mm of the rotation axis: the cylinder that the real walnut detector sees
    at every angle has a radius of 18.3 mm, so simulated projections are never truncated.

    Every carving ellipsoid lies inside the ellipsoid it carves (dense surface sampling with a margin; the
    carvings are small or thin against the smooth parent, so the sampling error is far below the margin), and
    carvings of one parent, like the positive parts, are pairwise separated by a plane (an exact test). So the
    attenuation is never negative and never exceeds the largest single value; times 14 it lies in [0, 1] (the
    DIP's scale).

    Parameters
    ----------
    seed : int
        Seeds every random variation (sizes, shapes, orientation, position, folds, pockets, pores).
    size : float
        Overall scale factor (1: ≈ 31–34 mm across).
    center : (3,) float, optional
        Centre (mm); default: a seeded offset of 0.3–1 mm in x and y from the origin.
    shell_value, kernel_value, septum_value : float, optional
        Attenuation values (mm⁻¹); default: seeded around 0.055, 0.034 and 0.045.
    n_folds, n_pockets : int
        Folds and air pockets tried per kernel half (fewer are kept where they do not fit).
    n_pores : int
        Pores tried in the shell wall.
    """
    rng = np.random.default_rng([int(seed), 0x5A1A])
    mu_shell, mu_kernel, mu_septum = _walnut_values(rng, shell_value, kernel_value, septum_value)
    scale = size * rng.uniform(0.95, 1.05)
    outer_axes = np.array([15.5, 14.5, 17.0]) * scale * rng.uniform(0.96, 1.04, size=3)
    thickness = rng.uniform(1.2, 1.8) * size
    cavity_axes = outer_axes - thickness
    outer = Ellipsoid((0, 0, 0), outer_axes, mu_shell, name="shell")
    cavity = Ellipsoid((0, 0, 0), cavity_axes, -mu_shell, name="cavity")
    parts: list[Ellipsoid] = [outer, cavity]
    parts += _shell_pores(rng, outer, cavity, outer_axes, thickness, mu_shell, n_pores)

    septum_half = rng.uniform(0.5, 0.7) * size
    septum = Ellipsoid((0, 0, 0), (septum_half, cavity_axes[1] * 0.93, cavity_axes[2] * 0.93), mu_septum, name="septum")
    if not _inside(septum, cavity, 0.01):  # pragma: no cover - the axes above always fit
        raise RuntimeError("walnut_phantom: septum does not fit into the cavity")
    parts.append(septum)

    halves = _kernel_halves(rng, cavity, cavity_axes, septum, septum_half, mu_kernel, size)
    parts += halves
    for half in halves:
        parts += _kernel_carvings(rng, half, size, n_folds, n_pockets)

    # Pose: a small tilt, a turn about z that avoids the axis-aligned (mirror-symmetric) orientations, a shift.
    turn = rng.uniform(math.radians(12), math.radians(35)) * rng.choice([-1.0, 1.0])
    pose = rotation_from_euler(turn, rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1))
    if center is None:
        # Off-centre, but the shell stays inside the cylinder of radius 18.3 mm that the real detector (768 ×
        # 0.1496 mm at 199 mm, source 66 mm from the axis) sees at every angle: no truncated projections.
        shift = np.array(
            [
                rng.uniform(0.3, 1.0) * rng.choice([-1, 1]),
                rng.uniform(0.3, 1.0) * rng.choice([-1, 1]),
                rng.uniform(-0.5, 0.5),
            ]
        )
    else:
        shift = np.asarray(center, dtype=np.float64).reshape(3)
    return EllipsoidPhantom(e.transformed(pose, shift) for e in parts)


def _walnut_values(rng, shell_value, kernel_value, septum_value) -> tuple[float, float, float]:
    """The shell's, kernel's and septum's attenuation (mm⁻¹): the given ones, else seeded around 0.055, 0.034 and
    0.045 (drawn in that order); ``ValueError`` for one that is not positive."""
    mu_shell = shell_value if shell_value is not None else rng.uniform(0.052, 0.058)
    mu_kernel = kernel_value if kernel_value is not None else rng.uniform(0.031, 0.036)
    mu_septum = septum_value if septum_value is not None else rng.uniform(0.042, 0.048)
    for name, v in (("shell_value", mu_shell), ("kernel_value", mu_kernel), ("septum_value", mu_septum)):
        if not v > 0:
            raise ValueError(f"walnut_phantom: {name} must be positive, got {v}")
    return mu_shell, mu_kernel, mu_septum


def _shell_pores(rng, outer, cavity, outer_axes, thickness: float, mu_shell: float, n_pores: int) -> list[Ellipsoid]:
    """Up to ``n_pores`` pores carved out of the shell wall (``thickness`` mm, value ``mu_shell``): inside the outer
    ellipsoid (semi-axes ``outer_axes``), outside the cavity, pairwise separated (200 tries)."""
    pores: list[Ellipsoid] = []
    for _ in range(200):
        if len(pores) == n_pores:
            break
        s = rng.normal(size=3)
        s /= np.linalg.norm(s)
        p = s * (outer_axes - thickness / 2)
        r = rng.uniform(0.2, 0.4) * thickness
        cand = Ellipsoid(p, (r, r, r * rng.uniform(0.6, 1.0)), -mu_shell, _random_rotation(rng), name="pore")
        if (
            _inside(cand, outer, 0.01)
            and _outside_small(cand, cavity, 0.01)
            and all(_separated(cand, o, 0.2) for o in pores)
        ):
            pores.append(cand)
    return pores


def _kernel_halves(rng, cavity, cavity_axes, septum, septum_half: float, mu_kernel: float, size: float):
    """The two kernel halves (value about ``mu_kernel``), one per side of the septum (half thickness
    ``septum_half``), each shrunk until it fits the cavity (semi-axes ``cavity_axes``) with an air gap."""
    gap = 0.5 * size  # air between kernel and septum / shell
    halves: list[Ellipsoid] = []
    # One kernel half per side of the septum, laid out in the cavity's unit-sphere frame: centred at
    # x = ±(g + α) with semi-axes α, β, γ, about the largest ellipsoid that fits the half-ball with an air gap.
    gx = (septum_half + gap) / cavity_axes[0]
    for side in (-1.0, 1.0):
        alpha = rng.uniform(0.42, 0.46) - gx / 2
        beta, gamma = rng.uniform(0.66, 0.72), rng.uniform(0.66, 0.74)
        centre = np.array([side * (gx + alpha), rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03)]) * cavity_axes
        tilt = rotation_from_euler(rng.uniform(-0.05, 0.05), rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03))
        value = mu_kernel * rng.uniform(0.96, 1.04)
        half = None
        for shrink in np.linspace(1.0, 0.6, 41):  # shrink until it fits the cavity with an air gap
            axes = np.array([alpha, beta, gamma]) * cavity_axes * shrink
            cand = Ellipsoid(centre, axes, value, tilt, name="kernel")
            if _inside(cand, cavity, 0.04) and _separated(cand, septum, 0.3):
                half = cand
                break
        if half is None:  # pragma: no cover - the shrink range always leaves room
            raise RuntimeError("walnut_phantom: a kernel half does not fit into the cavity")
        halves.append(half)
    return halves


def _kernel_carvings(rng, half: Ellipsoid, size: float, n_folds: int, n_pockets: int) -> list[Ellipsoid]:
    """What is carved out of a kernel half: the deep crease that splits it into two lobes, up to ``n_folds``
    folds and ``n_pockets`` air pockets."""
    ha = np.asarray(half.semi_axes)
    # The deep crease that splits each kernel half into two lobes: a thin disc across the middle (y ≈ 0).
    crease = None
    for shrink in np.linspace(0.85, 0.5, 15):
        cand = Ellipsoid(
            half.center,
            (ha[0] * shrink, rng.uniform(0.25, 0.35) * size, ha[2] * shrink),
            -half.value,
            np.asarray(half.rotation) @ rotation_from_euler(rng.uniform(-0.15, 0.15)),
            name="crease",
        )
        if _inside(cand, half, 0.03):
            crease = cand
            break
    carvings = [crease] if crease is not None else []

    def make_fold(rng, point):
        length = rng.uniform(1.2, 2.6) * size
        return Ellipsoid(
            point,
            (rng.uniform(0.15, 0.3) * size, length, length * rng.uniform(1.2, 2.5)),
            -half.value,
            _random_rotation(rng),
            name="fold",
        )

    def make_pocket(rng, point):
        r = rng.uniform(0.25, 0.7) * size
        return Ellipsoid(
            point,
            (r, r * rng.uniform(0.7, 1.0), r * rng.uniform(0.7, 1.0)),
            -half.value,
            _random_rotation(rng),
            name="pocket",
        )

    folds = _place_carvings(rng, half, n_folds, make_fold, carvings)
    pockets = _place_carvings(rng, half, n_pockets, make_pocket, carvings + folds)
    return carvings + folds + pockets
