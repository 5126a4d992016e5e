"""Tuning a reconstruction on held-out angles: the ground-truth-free way to choose a regularisation weight and a
stopping point.

A scan loaded at ``data.angular_subsampling > 1`` has angles the reconstruction does not use (``CTData.heldout``).
Projected onto those angles, a reconstruction ``x`` predicts the held-out rows; its *held-out error*

    e(x) = Σ_i w_i (T_h x − y_h)_i² / Σ_i w_i          (data units², i over the held-out measurements)

with ``w_i = 1 / Var y_h,i`` when the scan gives per-measurement variances (else ``w_i = 1``) is, up to the noise
variance that no ``x`` can remove, the error of ``x`` seen through those rays. It is smallest near the weight or the
iteration with the best reconstruction, so it replaces the ground truth a simulation would use.

:class:`HeldoutMonitor` scores images on the tuning rows; :func:`fit_dip <ctuq.reconstruct.dip.fit_dip>` takes one to
keep the iterate with the lowest held-out error and to stop once the error has clearly passed its minimum, and
:func:`tv_weight_path` chooses the TV baseline's weight ``λ`` on a warm-started path. The rows used here are the
*tuning* half of the held-out angles (:meth:`ctuq.data.HeldoutData.split`); the held-out check that scores the std map
uses the other half, so the check never sees the rows the reconstruction was tuned on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from ctuq.operators.base import RayTransform

__all__ = ["HeldoutMonitor", "TVPath", "TV_CRITERIA", "tv_weight_path", "weight_grid"]

#: How :func:`tv_weight_path` chooses ``λ`` from the path (``tv.criterion``): the lowest held-out error, or the
#: discrepancy principle with the noise level the held-out angles measure.
TV_CRITERIA = ("heldout", "discrepancy")


@dataclasses.dataclass(frozen=True, eq=False)
class HeldoutMonitor:
    """The held-out error of images on held-out rows, and how a DIP fit uses it.

    Attributes
    ----------
    op : RayTransform
        ``T_h`` onto the tuning rows (``measurement_shape`` ``(n_angles, n_cols)``), on the image's device.
    y : torch.Tensor
        ``op.measurement_shape`` held-out line integrals (dimensionless), on ``op.device``.
    variances : torch.Tensor or None
        ``op.measurement_shape`` per-measurement variances (any common scale): the error weighs each row by their
        inverse; ``None``: equal weights.
    every : int
        A DIP fit scores its iterate every ``every`` iterations (and at the last one).
    patience : int or None
        A DIP fit stops once ``patience`` iterations have passed since the lowest held-out error without a lower one;
        ``None``: it runs all its iterations.
    """

    op: RayTransform
    y: torch.Tensor
    variances: torch.Tensor | None = None
    every: int = 25
    patience: int | None = 750

    def __post_init__(self):
        if tuple(self.y.shape) != tuple(self.op.measurement_shape):
            raise ValueError(
                f"HeldoutMonitor: y has shape {tuple(self.y.shape)}; the operator expects {self.op.measurement_shape}"
            )
        if self.variances is not None:
            if tuple(self.variances.shape) != tuple(self.y.shape):
                raise ValueError(
                    f"HeldoutMonitor: variances have shape {tuple(self.variances.shape)}; y has {tuple(self.y.shape)}"
                )
            if not bool(torch.all(torch.isfinite(self.variances) & (self.variances > 0))):
                raise ValueError("HeldoutMonitor: variances must be finite and positive")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"HeldoutMonitor: every must be a positive int, got {self.every!r}")
        if self.patience is not None and (not isinstance(self.patience, int) or self.patience < 1):
            raise ValueError(f"HeldoutMonitor: patience must be a positive int or None, got {self.patience!r}")
        w = None
        if self.variances is not None:
            w = 1.0 / self.variances.to(self.op.device, torch.float64)
            w = w / w.mean()
        # the weights are fixed: computed once, kept out of the dataclass fields
        object.__setattr__(self, "_weights", w)
        object.__setattr__(self, "_y", self.y.to(self.op.device, torch.float64))

    @property
    def n_angles(self) -> int:
        """Held-out angles the monitor scores on."""
        return int(self.op.measurement_shape[0])

    def error(self, x: torch.Tensor) -> float:
        """``e(x)`` (data units², see the module docstring) of the image ``x`` (``op.image_shape``, original units,
        on ``op.device``)."""
        with torch.no_grad():
            r2 = (self.op(x.detach().to(torch.float32)).to(torch.float64) - self._y).pow(2)
            return float((r2 * self._weights).mean() if self._weights is not None else r2.mean())

    def fingerprint(self) -> dict:
        """What a DIP checkpoint records of the monitor, so that a resumed fit is tuned on the same rows."""
        return {
            "heldout_shape": list(self.y.shape),
            "heldout_y_sum": float(self.y.double().sum()),
            "heldout_every": int(self.every),
            "heldout_patience": None if self.patience is None else int(self.patience),
        }


def weight_grid(low: float, high: float, per_decade: int) -> list[float]:
    """Geometric grid from ``high`` down to ``low`` (both included), ``per_decade`` points a decade."""
    if not (0 < low < high and math.isfinite(high)):
        raise ValueError(f"weight_grid: need 0 < low < high, got low={low}, high={high}")
    if not isinstance(per_decade, int) or per_decade < 1:
        raise ValueError(f"weight_grid: per_decade must be a positive int, got {per_decade!r}")
    n = max(2, int(round(math.log10(high / low) * per_decade)) + 1)
    return [float(v) for v in np.geomspace(high, low, n)]


@dataclasses.dataclass
class TVPath:
    """Outcome of :func:`tv_weight_path`.

    Attributes
    ----------
    weight : float
        The chosen ``λ`` (by ``criterion``; between grid points, see :func:`tv_weight_path`).
    reconstruction : torch.Tensor
        ``image_shape`` TV image of the path at ``path_weight`` (original units, on ``op.device``): where a caller
        continues with ``weight`` (``ctuq reconstruct`` runs ``tv.iterations`` more).
    path_weight : float
        The path's weight nearest the choice (the lowest held-out error; for ``discrepancy`` the one just below).
    weights, errors : list[float]
        The path's ``λ`` (decreasing) and the held-out error ``e`` of each (data units²).
    residuals : list[float]
        Each weight's mean squared residual on the rows it was fitted to, ``mean (T x − y)²`` (data units²).
    criterion : str
        The rule that chose ``weight`` (:data:`TV_CRITERIA`).
    psnrs : list[float] or None
        Each weight's PSNR (dB) against the ground truth, when one was given (for studies; never used to choose).
    iterations : int
        PDHG iterations in all.
    time_s : float
        Wall time (s).
    """

    weight: float
    reconstruction: torch.Tensor
    path_weight: float
    weights: list[float]
    errors: list[float]
    residuals: list[float]
    criterion: str
    psnrs: list[float] | None
    iterations: int
    time_s: float

    def summary(self) -> dict:
        """JSON-friendly record for metrics.json (``tv.tuning``)."""
        return {
            "weight": self.weight,
            "path_weight": self.path_weight,
            "weights": list(self.weights),
            "heldout_error": list(self.errors),
            "residual": list(self.residuals),
            "criterion": self.criterion,
            "psnr": None if self.psnrs is None else list(self.psnrs),
            "iterations": self.iterations,
            "time_s": self.time_s,
        }


def tv_weight_path(
    op: RayTransform,
    y: torch.Tensor,
    monitor: HeldoutMonitor,
    *,
    weights: Sequence[float],
    iterations: int,
    x0: torch.Tensor | None = None,
    nonnegative: bool = True,
    isotropic: bool = True,
    ground_truth: torch.Tensor | None = None,
    stop_early: bool = True,
    criterion: str = "heldout",
    progress: bool = True,
) -> TVPath:
    """The TV weight ``λ`` chosen on held-out angles along a warm-started path.

    From the largest ``λ`` to the smallest, each weight runs ``iterations`` PDHG iterations starting from the previous
    weight's image and dual variable (:func:`ctuq.reconstruct.classical.tv_reconstruction`); the held-out error ``e``
    of each end point is recorded. The path stops early (``stop_early``) once ``e`` has risen for two weights in a
    row past its minimum (smaller weights only fit more noise). Between grid points the minimum is located by the
    parabola through the lowest ``e`` and its neighbours in ``log λ`` (the grid is coarse, the curve smooth): that is
    the ``heldout`` criterion. The ``discrepancy`` criterion (Morozov's principle) takes instead the largest ``λ``
    whose residual on the fitted rows, ``mean (T x − y)²``, is no larger than the lowest held-out error (what the
    held-out rays say noise and model error amount to per measurement), interpolated in ``log λ`` between the two
    path points around the crossing. The path's image at the nearest grid weight is returned for the caller to
    continue at the chosen weight.

    Parameters
    ----------
    op, y : RayTransform, torch.Tensor
        The reconstruction's ``T`` and sinogram (``measurement_shape``, data units).
    monitor : HeldoutMonitor
        The tuning rows.
    weights : sequence of float
        Candidate ``λ > 0`` (see :mod:`ctuq.reconstruct.classical` for its units); tried in decreasing order.
    iterations : int
        PDHG iterations per weight.
    x0 : torch.Tensor, optional
        Starting image of the first weight (e.g. the FBP).
    nonnegative, isotropic : bool
        As :func:`~ctuq.reconstruct.classical.tv_reconstruction`.
    ground_truth : torch.Tensor, optional
        Only to record each weight's PSNR (studies); the choice never uses it.
    stop_early : bool
        Stop the path once it is clearly past the minimum (else every weight is run: the whole curve).
    criterion : str
        ``heldout`` or ``discrepancy`` (:data:`TV_CRITERIA`); ``discrepancy`` compares unweighted means, so it needs
        a monitor without variances.
    progress : bool
        A tqdm bar over the weights.

    Returns
    -------
    TVPath
    """
    from ctuq.metrics.image import psnr
    from ctuq.reconstruct.classical import tv_reconstruction
    from ctuq.utils import progress as _progress_bar

    grid = sorted((float(w) for w in weights), reverse=True)
    if not grid or any(not (w > 0 and math.isfinite(w)) for w in grid):
        raise ValueError(f"tv_weight_path: weights must be positive and finite, got {list(weights)}")
    if len(set(grid)) != len(grid):
        raise ValueError(f"tv_weight_path: weights must be distinct, got {list(weights)}")
    if criterion not in TV_CRITERIA:
        raise ValueError(f"tv_weight_path: criterion must be one of {TV_CRITERIA}, got {criterion!r}")
    if criterion == "discrepancy" and monitor.variances is not None:
        raise ValueError(
            "tv_weight_path: the discrepancy criterion compares unweighted means: a monitor without variances"
        )
    t0 = time.perf_counter()
    op_norm = op.operator_norm(n_iter=30)
    x, dual = x0, None
    errors: list[float] = []
    residuals: list[float] = []
    y_dev = y.to(op.device, torch.float32)
    psnrs: list[float] | None = [] if ground_truth is not None else None
    images: list[torch.Tensor] = []
    total = 0
    bar = _progress_bar(total=len(grid), desc="TV weight path", disable=None if progress else True)
    try:
        for lam in grid:
            res = tv_reconstruction(
                op,
                y,
                weight=lam,
                iterations=iterations,
                nonnegative=nonnegative,
                isotropic=isotropic,
                x0=x,
                dual=dual,
                op_norm=op_norm,
                progress=False,
            )
            total += iterations
            x, dual = res["reconstruction"], res["dual"]
            images.append(x)
            errors.append(monitor.error(x))
            with torch.no_grad():
                residuals.append(float((op(x) - y_dev).double().pow(2).mean()))
            if psnrs is not None:
                psnrs.append(psnr(x.detach().cpu(), ground_truth.detach().cpu()))
            bar.update(1)
            bar.set_postfix({"lambda": f"{lam:.2g}", "heldout": f"{errors[-1]:.3e}"}, refresh=False)
            best = int(np.argmin(errors))
            if stop_early and len(errors) - 1 - best >= 2 and errors[-1] > errors[-2]:  # clearly past the minimum
                break
    finally:
        bar.close()
    best = int(np.argmin(errors))
    if criterion == "heldout":
        weight = _vertex(grid[: len(errors)], errors, best)
    else:
        weight, best = _discrepancy(grid[: len(errors)], residuals, errors)
    return TVPath(
        weight=weight,
        reconstruction=images[best],
        path_weight=grid[best],
        weights=grid[: len(errors)],
        errors=errors,
        residuals=residuals,
        criterion=criterion,
        psnrs=psnrs,
        iterations=total,
        time_s=time.perf_counter() - t0,
    )


def _vertex(weights: Sequence[float], errors: Sequence[float], best: int) -> float:
    """The weight at the vertex of the parabola through ``errors[best - 1 : best + 2]`` against ``log λ`` (equally
    spaced on a geometric grid), clipped to half a grid step either side; ``weights[best]`` at an end of the path."""
    if best == 0 or best == len(errors) - 1:
        return float(weights[best])
    e_hi, e0, e_lo = errors[best - 1], errors[best], errors[best + 1]  # larger λ, best, smaller λ
    curvature = e_hi - 2.0 * e0 + e_lo
    if not curvature > 0:
        return float(weights[best])
    # t = +1 is the larger neighbour: the vertex of e(t) through (-1, e_lo), (0, e0), (1, e_hi)
    t = float(np.clip((e_lo - e_hi) / (2.0 * curvature), -0.5, 0.5))
    step = math.log(weights[best - 1] / weights[best])
    return float(weights[best] * math.exp(t * step))


#: The discrepancy principle's guard: its weight's held-out error may exceed the lowest by at most this fraction.
#: Where the angles are too sparse for the held-out rows to be predicted well, their error measures that
#: interpolation error rather than the noise, and the principle alone would smooth without bound (a 32² scan from
#: 16 angles chose the largest weight of any path); on the reconstruction study's settings the guard never binds
#: (its weights are within 2–13 % of the lowest held-out error).
DISCREPANCY_GUARD = 0.25


def _discrepancy(weights: Sequence[float], residuals: Sequence[float], errors: Sequence[float]) -> tuple[float, int]:
    """``(λ, index)``: the largest ``λ`` whose residual is at most the lowest held-out error, between the path points
    around the crossing by linear interpolation of the residual in ``log λ``, and the index of the path point just
    below it (the image its final iterations start from); the smallest weight when no residual reaches that level.
    When that point's held-out error exceeds the lowest by more than :data:`DISCREPANCY_GUARD`, the largest path
    weight within it instead (no interpolation)."""
    level = min(errors)
    below = [i for i, r in enumerate(residuals) if r <= level]
    if not below:
        return float(weights[-1]), len(weights) - 1
    i = below[0]
    if errors[i] > (1.0 + DISCREPANCY_GUARD) * level:
        i = next(k for k in range(i, len(errors)) if errors[k] <= (1.0 + DISCREPANCY_GUARD) * level)
        return float(weights[i]), i
    if i == 0:
        return float(weights[0]), 0
    r_hi, r_lo = residuals[i - 1], residuals[i]  # at the larger weight (above level) and at weights[i] (below)
    t = (level - r_lo) / (r_hi - r_lo) if r_hi > r_lo else 0.0
    weight = float(weights[i] * (weights[i - 1] / weights[i]) ** t)
    return weight, i
