"""Figures of a design: the chosen angles on a polar plot, std maps before/after, PSNR against angle count.

Like :mod:`ctuq.figures`: stand-alone Agg figures written atomically as PNG; every function returns the path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import cm
from matplotlib.ticker import MaxNLocator, NullFormatter, ScalarFormatter

from ctuq.figures import new_figure, save_figure
from ctuq.outputs import to_numpy

__all__ = ["plot_design_polar", "plot_std_maps", "plot_psnr_curves", "plot_forecast", "plot_online_calibration"]


def plot_design_polar(
    path,
    pilot_deg: Sequence[float],
    acquired_deg: Sequence[float],
    *,
    period_deg: float = 180.0,
    title: str | None = None,
    dpi: int = 120,
):
    """Chosen angles as rays on a polar plot: the pilot grey, acquisitions coloured and numbered by order.

    Parallel-beam angles (``period_deg = 180``) are drawn at ``θ`` and ``θ + 180°`` (the same rays).
    """
    fig = new_figure(None, (5.2, 5.2), dpi)
    ax = fig.add_subplot(projection="polar")
    mirror = period_deg < 359.0
    for a in pilot_deg:
        for t in [a, a + 180.0] if mirror else [a]:
            ax.plot([math.radians(t)] * 2, [0, 1.0], color="0.55", lw=2.2)
    n = max(1, len(acquired_deg))
    colors = cm.viridis(np.linspace(0.0, 0.92, n))
    for i, a in enumerate(acquired_deg):
        for t in [a, a + 180.0] if mirror else [a]:
            ax.plot([math.radians(t)] * 2, [0, 0.9], color=colors[i], lw=1.3)
        ax.text(math.radians(a), 0.97, str(i + 1), fontsize=6, ha="center", va="center", color=colors[i])
    ax.set_yticks([])
    ax.set_title(
        title or f"pilot (grey, {len(pilot_deg)}) and {len(acquired_deg)} acquired angles (order: colour, number)",
        fontsize=9,
    )
    return save_figure(fig, path)


def plot_std_maps(path, maps: Mapping[str, object], *, dpi: int = 120):
    """Posterior std maps side by side on one colour scale (e.g. ``{"after the pilot": …, "after the design": …}``)."""
    arrays = {k: to_numpy(v) for k, v in maps.items()}
    vmax = max(float(np.quantile(a, 0.999)) for a in arrays.values()) or 1.0
    fig = new_figure(None, (3.4 * len(arrays) + 0.6, 3.4), dpi)
    axes = fig.subplots(1, len(arrays), squeeze=False)[0]
    im = None
    for ax, (name, a) in zip(axes, arrays.items()):
        im = ax.imshow(a, cmap="inferno", vmin=0.0, vmax=vmax)
        ax.set_title(f"std {name}\nmean {a.mean():.3g}", fontsize=9)
        ax.axis("off")
    fig.colorbar(im, ax=list(axes), shrink=0.8)
    return save_figure(fig, path)


def plot_psnr_curves(path, curves: Mapping[str, tuple], *, title: str = "", ylabel: str = "PSNR (dB)", dpi: int = 120):
    """PSNR against number of angles: ``curves[name] = (counts, mean, stderr)`` (stderr may be ``None``)."""
    fig = new_figure(None, (6.4, 4.4), dpi)
    ax = fig.add_subplot()
    for name, (x, mean, err) in curves.items():
        x, mean = np.asarray(x, float), np.asarray(mean, float)
        (line,) = ax.plot(x, mean, marker="o", ms=3, label=name)
        if err is not None:
            err = np.asarray(err, float)
            ax.fill_between(x, mean - err, mean + err, color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xlabel("number of angles")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def plot_forecast(
    path,
    plan: Mapping | None,
    online: Sequence[Mapping] = (),
    *,
    actual: Mapping[str, tuple] | None = None,
    target: float | None = None,
    dpi: int = 120,
):
    """ "Predicted error vs number of angles": the plan's curves (``plan["counts"]``, ``plan["designed"]`` and
    ``plan["equidistant"]``, records of :meth:`ctuq.design.forecast.ErrorForecaster.predict`) with their 95 %
    bands, the forecasts made during acquisition (``online``, same records), actual errors (``actual``: label →
    ``(counts, rmse)``) and the target (mm⁻¹), all RMS errors inside the object in mm⁻¹."""
    fig = new_figure(None, (6.4, 4.2), dpi)
    ax = fig.add_subplot()
    styles = {"designed": "C0", "equidistant": "C1"}
    for name, color in styles.items():
        recs = (plan or {}).get(name) or []
        if not recs:
            continue
        n = [r["count"] for r in recs]
        ax.plot(n, [r["rmse"] for r in recs], "-o", ms=3, color=color, label=f"predicted, {name} (plan)")
        ax.fill_between(n, [r["rmse_band"][0] for r in recs], [r["rmse_band"][1] for r in recs], color=color, alpha=0.2)
    if online:
        n = [r["count"] for r in online]
        ax.plot(n, [r["rmse"] for r in online], "-", color="C2", lw=1.2, label="predicted during acquisition")
        ax.fill_between(
            n, [r["rmse_band"][0] for r in online], [r["rmse_band"][1] for r in online], color="C2", alpha=0.15
        )
    for i, (label, (counts, rmse)) in enumerate((actual or {}).items()):
        ax.plot(counts, rmse, "x", ms=7, mew=2, color=f"C{3 + i}", label=f"actual, {label}")
    if target is not None:
        ax.axhline(target, color="0.3", ls="--", lw=1, label=f"target {target:.3g} mm⁻¹")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("number of angles")
    ax.set_ylabel("RMS error inside the object (mm⁻¹)")
    ax.set_title("predicted error vs number of angles (band: 95 %)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_online_calibration(path, records: Sequence[Mapping], *, dpi: int = 120):
    """Each acquired angle scored before it was used (:class:`ctuq.design.forecast.OnlineCalibration` records):
    coverage of its rows' 90 % intervals (calibrated and raw) and of all acquired rows so far; mean ``z²``."""
    fig = new_figure(None, (8.6, 3.6), dpi)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    step = [r["step"] for r in records]
    ax.plot(step, [r["coverage_90"] for r in records], "o", ms=3, label="this angle, calibrated")
    ax.plot(step, [r["coverage_90_raw"] for r in records], ".", ms=3, color="0.5", label="this angle, posterior alone")
    ax.plot(step, [r["cumulative_coverage_90"] for r in records], "-", color="C3", label="all acquired so far")
    ax.axhline(0.9, color="0.3", ls="--", lw=1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("acquisition step")
    ax.set_ylabel("coverage of the 90 % interval (fraction of rows)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.semilogy(step, [r["mean_z2"] for r in records], "o-", ms=3)
    bx.yaxis.set_major_formatter(ScalarFormatter())
    bx.yaxis.set_minor_formatter(NullFormatter())
    bx.axhline(1.0, color="0.3", ls="--", lw=1)
    bx.set_xlabel("acquisition step")
    bx.set_ylabel("mean z² of the angle's rows (1: calibrated)")
    bx.grid(alpha=0.3)
    fig.suptitle("online calibration: each new angle scored before it is used", fontsize=10)
    return save_figure(fig, path)
