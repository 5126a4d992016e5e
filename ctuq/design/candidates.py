"""Candidate angle sets, pilot selection, the baselines (equidistant, golden-angle and random angles) and the spread
constraint of a greedy design (:func:`spread_mask`).

A design chooses among the angles of a candidate set ``B_a``: ``n`` angles (radians) over one angular period
(``π`` for parallel beams, ``2π`` for a full fan-beam orbit such as the walnut scans), each with its own
operator block ``T^β`` of ``k`` detector pixels. Candidates are identified by their *index* in the set; angles in
degrees are for files and figures. The pilot is a subset of the candidates (a pilot whose angles are not candidates
is refused: its measurements could not enter the same linear model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ctuq.errors import CTUQError

__all__ = [
    "DesignError",
    "equidistant_indices",
    "equidistant_angles",
    "golden_indices",
    "random_indices",
    "spread_mask",
    "match_angles",
    "check_design_sizes",
]


class DesignError(CTUQError):
    """Bad design input (pilot, candidates, counts); the message names the option first."""


def equidistant_indices(n_candidates: int, count: int, offset: int = 0) -> np.ndarray:
    """``count`` candidate indices spread evenly over a grid of ``n_candidates`` equally spaced angles.

    Index ``offset + round(j·n/count)`` (mod ``n``) for ``j = 0 … count−1``; exact multiples when ``count`` divides
    ``n`` (e.g. the published pilot: 5 of 200 → 0, 40, 80, 120, 160). Raises :class:`DesignError` when ``count`` is
    not in ``1 … n_candidates``.
    """
    if not 1 <= count <= n_candidates:
        raise DesignError(f"equidistant: cannot take {count} of {n_candidates} candidate angles")
    idx = (offset + np.floor(np.arange(count) * n_candidates / count + 0.5).astype(np.int64)) % n_candidates
    if len(np.unique(idx)) != count:  # pragma: no cover - round() of distinct multiples of n/count ≥ 1 apart
        raise DesignError(f"equidistant: {count} of {n_candidates} angles collide")
    return idx


def equidistant_angles(count: int, period: float = math.pi, start: float = 0.0) -> np.ndarray:
    """``count`` angles ``start + j·period/count`` (radians): evenly spaced over the period, not tied to a grid."""
    if count < 1:
        raise DesignError(f"equidistant: count must be >= 1, got {count}")
    return start + np.arange(count) * period / count


GOLDEN_FRACTION = (math.sqrt(5.0) - 1.0) / 2.0
"""The golden-angle step as a fraction of the period (0.618…): 111.25° of 180°, 222.5° of 360°."""


def golden_indices(n_candidates: int, count: int) -> np.ndarray:
    """The first ``count`` angles of the golden-angle sequence on a grid of ``n_candidates`` equally spaced angles.

    Angle ``k`` lies at the fraction ``frac(k·0.618…)`` of the period (``k = 0, 1, …``), snapped to the nearest
    candidate not taken yet (ties: the lower index), in acquisition order. Every prefix is spread almost evenly
    (its largest gap at most about 2.6× the equidistant spacing), so the sequence can stop at any count. Raises
    :class:`DesignError` when ``count`` is not in ``1 … n_candidates``.
    """
    if not 1 <= count <= n_candidates:
        raise DesignError(f"golden: cannot take {count} of {n_candidates} candidate angles")
    free = np.ones(n_candidates, dtype=bool)
    out = []
    for k in range(count):
        pos = (k * GOLDEN_FRACTION % 1.0) * n_candidates
        idx = np.flatnonzero(free)
        dist = np.abs((idx - pos + n_candidates / 2) % n_candidates - n_candidates / 2)
        j = int(idx[np.argmin(dist)])  # argmin takes the first: the lower index on a tie
        free[j] = False
        out.append(j)
    return np.asarray(out, dtype=np.int64)


def spread_mask(chosen: Sequence[int], n_candidates: int, spread: float) -> np.ndarray:
    """``(n_candidates,)`` bool: the candidates a design with the spread constraint ``spread`` may take next.

    The chosen angles cut the period (the candidate grid's circle) into gaps; a candidate is allowed when it lies
    inside a gap at least ``spread`` times as wide as the widest (``design.spread``). ``0`` allows every free
    candidate (the plain greedy design); ``1`` only those in the widest gaps, which keeps the largest gap of every
    prefix close to the equidistant spacing. Chosen candidates are never allowed. ``spread`` must lie in [0, 1].
    """
    if not 0.0 <= spread <= 1.0:
        raise DesignError(f"design.spread must be in [0, 1], got {spread}")
    free = np.ones(n_candidates, dtype=bool)
    c = np.unique(np.asarray(list(chosen), dtype=np.int64))
    free[c] = False
    if spread == 0.0 or c.size == 0:
        return free
    nxt = np.roll(c, -1)
    width = (nxt - c) % n_candidates
    width[width == 0] = n_candidates  # one chosen angle: the whole circle is one gap
    allowed = np.zeros(n_candidates, dtype=bool)
    for start, w in zip(c, width):
        if w >= spread * width.max() and w > 1:
            allowed[(start + np.arange(1, w)) % n_candidates] = True
    return allowed & free


def random_indices(n_candidates: int, count: int, exclude: Sequence[int] = (), seed: int = 0) -> np.ndarray:
    """``count`` distinct candidate indices drawn uniformly (without replacement) from those not in ``exclude``.

    Seeded by ``seed`` (numpy ``default_rng``); the order is the order of drawing (the acquisition order).
    """
    pool = np.setdiff1d(np.arange(n_candidates), np.asarray(list(exclude), dtype=np.int64))
    if count > len(pool):
        raise DesignError(f"random: cannot draw {count} angles from the {len(pool)} candidates left")
    return np.random.default_rng(seed).choice(pool, size=count, replace=False)


def match_angles(
    angles_deg: Sequence[float], candidates_rad: np.ndarray, period: float, *, what: str, tol_deg: float | None = None
) -> np.ndarray:
    """Indices of the candidates at ``angles_deg`` (degrees, taken modulo the period).

    A requested angle matches a candidate within ``tol_deg`` (default: 0.05°, or a quarter of the smallest
    candidate spacing if that is less). Raises :class:`DesignError` naming ``what`` and the first angle without a
    candidate, or a repeat.
    """
    cand = np.mod(np.degrees(np.asarray(candidates_rad, dtype=np.float64)), math.degrees(period))
    spacing = np.diff(np.sort(cand))
    if tol_deg is None:
        tol_deg = min(0.05, 0.25 * float(spacing.min())) if spacing.size and spacing.min() > 0 else 0.05
    out = []
    for a in np.asarray(angles_deg, dtype=np.float64).ravel():
        if not math.isfinite(a):
            raise DesignError(f"{what}: angle {a} is not a finite number")
        half = 0.5 * math.degrees(period)  # distance on the circle of one period
        diff = np.abs((cand - np.mod(a, math.degrees(period)) + half) % (2 * half) - half)
        j = int(np.argmin(diff))
        if diff[j] > tol_deg:
            raise DesignError(
                f"{what}: angle {a:g}° is not among the {len(cand)} candidate angles (nearest "
                f"{cand[j]:.4g}°); the pilot's geometry must be part of the candidate set"
            )
        out.append(j)
    if len(set(out)) != len(out):
        raise DesignError(f"{what}: an angle is given twice")
    return np.asarray(out, dtype=np.int64)


def check_design_sizes(n_candidates: int, n_pilot: int, n_acquire: int) -> None:
    """Refuse designs that cannot run: no pilot, nothing to acquire, more angles than candidates.

    Raises :class:`DesignError` naming the option (``--pilot``, ``--acquire``).
    """
    if n_pilot < 1:
        raise DesignError(f"--pilot: the pilot needs at least one angle, got {n_pilot}")
    if n_pilot > n_candidates:
        raise DesignError(
            f"--pilot: {n_pilot} pilot angles but only {n_candidates} candidate angles; the pilot "
            f"must be a subset of the candidates"
        )
    if n_acquire < 1:
        raise DesignError(f"--acquire: must be at least 1, got {n_acquire} (a design acquires angles)")
    if n_pilot + n_acquire > n_candidates:
        raise DesignError(
            f"--acquire: {n_acquire} angles after a {n_pilot}-angle pilot exceed the "
            f"{n_candidates} candidate angles (at most {n_candidates - n_pilot})"
        )
