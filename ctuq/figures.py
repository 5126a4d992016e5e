"""Figures of uncertainty results: std / error panels, method comparisons, calibration, joint LL, EM traces.

Every function draws on a stand-alone ``matplotlib.figure.Figure`` rendered by the Agg canvas (no pyplot
state, no GUI backend, safe in scripts and threads), writes a PNG atomically with
:func:`ctuq.utils.atomic_path` (a failure leaves neither a half-written file nor a temporary one, and an
existing file at ``path`` untouched) and returns the path. The PNG measures exactly
``figsize[0]·dpi × figsize[1]·dpi`` pixels (no tight bounding box; layout is matplotlib's constrained
layout), so callers and tests can rely on its size.

Images are ``(H, W)`` slices or ``(D, H, W)`` volumes (torch tensors on any device, or numpy arrays) in
image units, ``unit`` (default :data:`IMAGE_UNIT`, ctuq's attenuation in mm⁻¹: every colour bar and image axis
carries it); volumes are shown by their central slice ``D // 2``. ROIs take every form :mod:`ctuq.metrics` accepts
and are drawn as a dashed cyan rectangle (or a contour for non-rectangular masks), named in a legend under the
panels. Every text (titles, tick and colour-bar labels, legends) lies inside the figure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ctuq import metrics as _metrics
from ctuq.outputs import central_slice
from ctuq.utils import atomic_path, to_numpy

__all__ = [
    "IMAGE_UNIT",
    "ROI_LABEL",
    "plot_reconstructions",
    "plot_uq_panels",
    "plot_uq_comparison",
    "plot_calibration",
    "plot_heldout_calibration",
    "plot_reliability",
    "plot_joint_ll",
    "plot_error_vs_std",
    "plot_em_trace",
    "plot_orthogonal_slices",
    "new_figure",
    "save_figure",
]

#: The unit of ctuq's images (linear attenuation): the default label of every colour bar and image axis.
IMAGE_UNIT = "mm⁻¹"
#: What the dashed outline on image panels is (the region the statistics are computed in).
ROI_LABEL = "evaluation region (statistics computed inside)"
_PANEL_IN = 3.2  # inches per image panel
_ERR_CMAP = "inferno"
_CLIP_QUANTILE = 0.999  # error/std colour scale: robust to a few hot pixels, shown by the colour bar's arrow


# ================================================================================================ helpers
def new_figure(figsize: Sequence[float] | None, default: Sequence[float], dpi: float) -> Figure:
    """A stand-alone constrained-layout ``Figure`` of ``figsize`` (or ``default``) inches ``(width, height)`` at
    ``dpi``; ``ValueError`` for a size or dpi that is not positive and finite."""
    size = tuple(float(v) for v in (figsize if figsize is not None else default))
    if len(size) != 2 or min(size) <= 0 or not all(math.isfinite(v) for v in size):
        raise ValueError(f"figsize must be (width, height) in inches, both > 0, got {figsize!r}")
    if not (dpi > 0):
        raise ValueError(f"dpi must be > 0, got {dpi!r}")
    return Figure(figsize=size, dpi=dpi, layout="constrained")


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG at ``fig.dpi`` to ``path`` (must end in ``.png``) atomically; returns the path."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"figure path must end in .png, got {os.fspath(path)!r}")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
    return path


def _image(x, name: str, where: str) -> np.ndarray:
    if not isinstance(x, (torch.Tensor, np.ndarray)):
        raise TypeError(f"{where}: {name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.ndim not in (2, 3):
        raise ValueError(f"{where}: {name} must be (H, W) or (D, H, W), got shape {tuple(x.shape)}")
    return to_numpy(x)


def _same_shape(arrays: Mapping[str, np.ndarray], where: str) -> tuple[int, ...]:
    shapes = {name: a.shape for name, a in arrays.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"{where}: images must share one shape, got {shapes}")
    return next(iter(shapes.values()))


def _roi_slice_mask(roi, shape: tuple[int, ...]) -> np.ndarray | None:
    """The ROI's mask on the displayed (central) slice, or ``None`` without an ROI."""
    if roi is None:
        return None
    return central_slice(_metrics.roi_mask(roi, shape).numpy())


def _draw_roi(ax, mask2d: np.ndarray | None) -> None:
    if mask2d is None or not mask2d.any():
        return
    rows, cols = np.nonzero(mask2d.any(axis=1))[0], np.nonzero(mask2d.any(axis=0))[0]
    r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    if mask2d[r0:r1, c0:c1].all():
        # pixel centres sit on integer coordinates, so pixel edges are at ±0.5
        ax.add_patch(Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, ec="cyan", lw=1.0, ls="--"))
    else:
        ax.contour(mask2d.astype(float), levels=[0.5], colors="cyan", linewidths=1.0, linestyles="--")


def _robust_max(arrays: Sequence[np.ndarray], masks: Sequence[np.ndarray | None]) -> float:
    vals = [a[m] if m is not None and m.any() else a.ravel() for a, m in zip(arrays, masks)]
    top = max(float(np.quantile(v, _CLIP_QUANTILE)) for v in vals if v.size)
    return top if top > 0 else max(float(np.max(v)) for v in vals) or 1.0


def _image_panel(fig, ax, arr, title, kw, roi2d, extend="neither", unit: str | None = IMAGE_UNIT):
    im = ax.imshow(arr, interpolation="nearest", **kw)
    ax.set_title(title, fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    _draw_roi(ax, roi2d)
    cb = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, extend=extend)
    if unit:
        cb.set_label(unit)


def _roi_legend(fig, roi2d) -> None:
    """Name the dashed outline in one legend under the panels (nothing without an ROI)."""
    if roi2d is None or not roi2d.any():
        return
    handle = Line2D([], [], color="cyan", ls="--", lw=1.0)
    fig.legend([handle], [ROI_LABEL], loc="outside lower center", fontsize=8, frameon=False)


def _uq_triplet(reconstruction, abs_error, std, ground_truth, where):
    rec = _image(reconstruction, "reconstruction", where)
    gt = _image(ground_truth, "ground_truth", where) if ground_truth is not None else None
    if abs_error is None:
        if gt is None:
            raise ValueError(f"{where}: abs_error is None and no ground_truth is given to compute it from")
        if gt.shape != rec.shape:
            raise ValueError(f"{where}: ground_truth shape {gt.shape} != reconstruction shape {rec.shape}")
        err = np.abs(rec - gt)
    else:
        err = _image(abs_error, "abs_error", where)
    sd = _image(std, "std", where)
    arrays = {"reconstruction": rec, "abs_error": err, "std": sd}
    if gt is not None:
        arrays["ground_truth"] = gt
    _same_shape(arrays, where)
    if err.min() < 0 or sd.min() < 0:
        raise ValueError(f"{where}: {'abs_error' if err.min() < 0 else 'std'} has negative values")
    return rec, err, sd, gt


# ============================================================================================ image panels
def plot_reconstructions(
    path: str | os.PathLike,
    images: Mapping[str, torch.Tensor | np.ndarray],
    *,
    ground_truth=None,
    psnrs: Mapping[str, float | None] | None = None,
    error_of: str | None = "DIP",
    unit: str | None = IMAGE_UNIT,
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """One row: ground truth (if given), each image of ``images`` (``{name: (H, W) or (D, H, W)}``, image units;
    titles with their PSNR from ``psnrs``, dB) on the ground truth's grey scale, and ``|images[error_of] − ground
    truth|``; every colour bar labelled with ``unit``. Volumes are shown by their central slice. Default size
    ``3.2 in × panels`` by 3.6 in. Returns ``path``."""
    where = "plot_reconstructions"
    if not isinstance(images, Mapping) or not images:
        raise ValueError(f"{where}: images must be a non-empty dict name -> image")
    arrays = {k: central_slice(_image(v, k, where)) for k, v in images.items()}
    gt = central_slice(_image(ground_truth, "ground_truth", where)) if ground_truth is not None else None
    ref = gt if gt is not None else next(iter(arrays.values()))
    grey = {"cmap": "gray", "vmin": float(ref.min()), "vmax": float(ref.max())}
    panels = [("ground truth", gt, grey)] if gt is not None else []
    for name, arr in arrays.items():
        p = (psnrs or {}).get(name)
        panels.append((name + (f"\nPSNR {p:.2f} dB" if p is not None else ""), arr, grey))
    if gt is not None and error_of in arrays:
        err = np.abs(arrays[error_of] - gt)
        panels.append(
            (f"|{error_of} − ground truth|", err, {"cmap": "magma", "vmin": 0.0, "vmax": float(err.max()) or 1.0})
        )
    fig = new_figure(figsize, (_PANEL_IN * len(panels), 3.3), dpi)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, arr, kw) in zip(axes, panels):
        _image_panel(fig, ax, arr, title, kw, None, unit=unit)
    return save_figure(fig, path)


def plot_uq_panels(
    path: str | os.PathLike,
    reconstruction,
    abs_error,
    std,
    ground_truth=None,
    titles: Sequence[str] | None = None,
    *,
    roi=None,
    error_vmax: float | None = None,
    unit: str | None = IMAGE_UNIT,
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """One row: (ground truth |) reconstruction | |error| | std, written as a PNG.

    ``reconstruction``, ``abs_error``, ``std``, ``ground_truth``: ``(H, W)`` or ``(D, H, W)`` of one shape,
    image units (central slice shown for volumes). ``abs_error=None`` computes ``|reconstruction − ground
    truth|``. |error| and std share one colour scale ``[0, error_vmax]`` so they can be compared pixel for
    pixel; by default ``error_vmax`` is the larger 99.9th percentile of the two maps (inside the ROI when
    given). Grey levels follow the ground truth's range when given, else the reconstruction's. ``titles``:
    one per panel (3, or 4 with a ground truth). ``roi``: drawn as a dashed outline on every panel and named in a
    legend under them. ``unit``: every colour bar's label. Default size: ``3.2 in × panels`` wide, 3.3 in high.
    Returns ``path``.
    """
    where = "plot_uq_panels"
    rec, err, sd, gt = _uq_triplet(reconstruction, abs_error, std, ground_truth, where)
    roi2d = _roi_slice_mask(roi, rec.shape)
    rec, err, sd = central_slice(rec), central_slice(err), central_slice(sd)
    panels = [("ground truth", gt)] if gt is not None else []
    panels += [("reconstruction", rec), ("|error|", err), ("std", sd)]
    if titles is not None:
        titles = list(titles)
        if len(titles) != len(panels):
            raise ValueError(f"{where}: {len(panels)} panels need {len(panels)} titles, got {len(titles)}")
    grey = central_slice(gt) if gt is not None else rec
    vmax = error_vmax if error_vmax is not None else _robust_max([err, sd], [roi2d, roi2d])
    if not (vmax > 0 and math.isfinite(vmax)):
        raise ValueError(f"{where}: error_vmax must be finite and > 0, got {error_vmax!r}")
    # one "extend" for both maps keeps their colour bars identical
    extend = "max" if max(err.max(), sd.max()) > vmax else "neither"
    fig = new_figure(figsize, (_PANEL_IN * len(panels), 3.3), dpi)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for i, (ax, (name, arr)) in enumerate(zip(axes, panels)):
        arr = central_slice(arr)
        title = titles[i] if titles is not None else name
        if name in ("|error|", "std"):
            kw = {"cmap": _ERR_CMAP, "vmin": 0.0, "vmax": vmax}
            _image_panel(fig, ax, arr, title, kw, roi2d, extend, unit)
        else:
            kw = {"cmap": "gray", "vmin": float(grey.min()), "vmax": float(grey.max())}
            _image_panel(fig, ax, arr, title, kw, roi2d, unit=unit)
    _roi_legend(fig, roi2d)
    return save_figure(fig, path)


ORTHOGONAL_PLANES = ("axial (z)", "coronal (y)", "sagittal (x)")


def plot_orthogonal_slices(
    path: str | os.PathLike,
    reconstruction,
    abs_error,
    std,
    ground_truth=None,
    *,
    index: Sequence[int] | None = None,
    roi=None,
    error_vmax: float | None = None,
    unit: str | None = IMAGE_UNIT,
    dpi: int = 100,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """Three orthogonal planes of a volume: rows axial / coronal / sagittal, columns (ground truth |)
    reconstruction | |error| | std, written as a PNG.

    ``reconstruction``, ``abs_error``, ``std``, ``ground_truth``: ``(D, H, W)`` volumes of one shape (image units;
    ``abs_error=None`` computes ``|reconstruction − ground truth|``). ``index = (k, i, j)``: the planes
    ``[k, :, :]`` (z), ``[:, i, :]`` (y) and ``[:, :, j]`` (x), default the centre voxel. |error| and std share one
    colour scale over all planes (default the larger 99.9th percentile of the two volumes, inside the ROI when
    given), grey levels follow the ground truth (else the reconstruction). ``roi``: drawn on every plane and named
    in a legend; ``unit``: every colour bar's label. Default size ``3.2 in × columns`` by ``3 in × 3`` rows (plus
    the legend). Returns ``path``.
    """
    where = "plot_orthogonal_slices"
    rec, err, sd, gt = _uq_triplet(reconstruction, abs_error, std, ground_truth, where)
    if rec.ndim != 3:
        raise ValueError(f"{where}: needs (D, H, W) volumes, got shape {rec.shape}; use plot_uq_panels for slices")
    D, H, W = rec.shape
    k, i, j = (D // 2, H // 2, W // 2) if index is None else (int(v) for v in index)
    if not (0 <= k < D and 0 <= i < H and 0 <= j < W):
        raise ValueError(f"{where}: index {(k, i, j)} lies outside the volume {rec.shape}")
    mask = None if roi is None else _metrics.roi_mask(roi, rec.shape).numpy()
    vmax = error_vmax if error_vmax is not None else _robust_max([err, sd], [mask, mask])
    if not (vmax > 0 and math.isfinite(vmax)):
        raise ValueError(f"{where}: error_vmax must be finite and > 0, got {error_vmax!r}")
    grey = gt if gt is not None else rec
    extend = "max" if max(err.max(), sd.max()) > vmax else "neither"
    columns = ([("ground truth", gt)] if gt is not None else []) + [
        ("reconstruction", rec),
        ("|error|", err),
        ("std", sd),
    ]
    cuts = ((lambda a: a[k], f"z = {k}"), (lambda a: a[:, i, :], f"y = {i}"), (lambda a: a[:, :, j], f"x = {j}"))
    fig = new_figure(figsize, (_PANEL_IN * len(columns), 3.0 * 3 + 0.3), dpi)
    axes = fig.subplots(3, len(columns), squeeze=False)
    for r, (cut, label) in enumerate(cuts):
        roi2d = None if mask is None else cut(mask)
        for cidx, (name, arr) in enumerate(columns):
            title = f"{name}, {ORTHOGONAL_PLANES[r].split()[0]} {label}"
            if name in ("|error|", "std"):
                kw = {"cmap": _ERR_CMAP, "vmin": 0.0, "vmax": vmax}
                _image_panel(fig, axes[r, cidx], cut(arr), title, kw, roi2d, extend, unit)
            else:
                kw = {"cmap": "gray", "vmin": float(grey.min()), "vmax": float(grey.max())}
                _image_panel(fig, axes[r, cidx], cut(arr), title, kw, roi2d, unit=unit)
    _roi_legend(fig, None if mask is None else mask[k])
    return save_figure(fig, path)


def plot_uq_comparison(
    path: str | os.PathLike,
    methods: Mapping[str, tuple],
    ground_truth=None,
    *,
    roi=None,
    error_vmax: float | None = None,
    unit: str | None = IMAGE_UNIT,
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """One row per method: reconstruction | |error| | std, written as a PNG.

    ``methods``: ``{name: (reconstruction, abs_error, std)}`` with images of one shape (``(H, W)`` or
    ``(D, H, W)``, image units; ``abs_error`` may be ``None`` when ``ground_truth`` is given). All rows share
    one grey scale and one |error|/std colour scale (default: the largest 99.9th percentile of any error or
    std map, inside the ROI when given), so methods compare at a glance. ``roi``: drawn and named in a legend;
    ``unit``: every colour bar's label. Default size ``9.6 in × 2.9 in per row`` (plus the legend). Returns
    ``path``.
    """
    where = "plot_uq_comparison"
    if not isinstance(methods, Mapping) or not methods:
        raise ValueError(f"{where}: methods must be a non-empty dict name -> (reconstruction, abs_error, std)")
    rows = {}
    for name, triple in methods.items():
        if not isinstance(triple, (tuple, list)) or len(triple) != 3:
            raise ValueError(f"{where}: methods[{name!r}] must be (reconstruction, abs_error, std)")
        rows[name] = _uq_triplet(*triple, ground_truth, f"{where}[{name!r}]")[:3]
    shape = _same_shape({f"{n}.reconstruction": r[0] for n, r in rows.items()}, where)
    roi2d = _roi_slice_mask(roi, shape)
    rows = {n: tuple(central_slice(a) for a in r) for n, r in rows.items()}
    if ground_truth is not None:
        grey = central_slice(_image(ground_truth, "ground_truth", where))
    else:
        grey = np.stack([r[0] for r in rows.values()])
    lo, hi = float(grey.min()), float(grey.max())
    maps = [a for r in rows.values() for a in r[1:]]
    vmax = error_vmax if error_vmax is not None else _robust_max(maps, [roi2d] * len(maps))
    if not (vmax > 0 and math.isfinite(vmax)):
        raise ValueError(f"{where}: error_vmax must be finite and > 0, got {error_vmax!r}")
    extend = "max" if max(float(a.max()) for a in maps) > vmax else "neither"
    fig = new_figure(figsize, (3 * _PANEL_IN, 2.9 * len(rows) + 0.3), dpi)
    axes = fig.subplots(len(rows), 3, squeeze=False)
    for i, (name, (rec, err, sd)) in enumerate(rows.items()):
        col_titles = ("reconstruction", "|error|", "std") if i == 0 else ("", "", "")
        _image_panel(fig, axes[i, 0], rec, col_titles[0], {"cmap": "gray", "vmin": lo, "vmax": hi}, roi2d, unit=unit)
        for j, arr in ((1, err), (2, sd)):
            kw = {"cmap": _ERR_CMAP, "vmin": 0.0, "vmax": vmax}
            _image_panel(fig, axes[i, j], arr, col_titles[j], kw, roi2d, extend, unit)
        axes[i, 0].set_ylabel(name, fontsize=11)
    _roi_legend(fig, roi2d)
    return save_figure(fig, path)


# ================================================================================================= curves
def _curve(values, name: str, where: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    a = np.asarray(values, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{where}: {name} must be a non-empty 1D sequence, got shape {a.shape}")
    return a


def plot_calibration(
    path: str | os.PathLike,
    curves: Mapping[str, tuple],
    *,
    title: str | None = None,
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """Empirical coverage against nominal credible-interval mass, one line per method, with ``y = x``.

    ``curves``: ``{name: (levels, coverage)}``, equal-length 1D sequences in [0, 1] (as returned by
    :func:`ctuq.metrics.coverage`). Lines below the diagonal are over-confident. The legend sits under the axes,
    off the curves; default size 4.8 in wide, 4.4 in plus a line per curve high. Returns ``path``.
    """
    where = "plot_calibration"
    if not isinstance(curves, Mapping) or not curves:
        raise ValueError(f"{where}: curves must be a non-empty dict name -> (levels, coverage)")
    data = {}
    for name, pair in curves.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{where}: curves[{name!r}] must be (levels, coverage)")
        lv, cov = (
            _curve(pair[0], f"curves[{name!r}] levels", where),
            _curve(pair[1], f"curves[{name!r}] coverage", where),
        )
        if lv.shape != cov.shape:
            raise ValueError(f"{where}: curves[{name!r}] has {lv.size} levels but {cov.size} coverage values")
        if (
            not (np.all(np.isfinite(lv)) and np.all(np.isfinite(cov)))
            or min(lv.min(), cov.min()) < 0
            or max(lv.max(), cov.max()) > 1
        ):
            raise ValueError(f"{where}: curves[{name!r}] levels and coverage must lie in [0, 1]")
        data[name] = (lv, cov)
    # the legend goes under the axes (off the curves): the figure grows by a line per entry
    fig = new_figure(figsize, (4.8, 4.4 + 0.22 * (len(data) + 1)), dpi)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], color="0.5", ls="--", lw=1, label="perfect calibration")
    for name, (lv, cov) in data.items():
        ax.plot(lv, cov, marker="o", ms=3, label=name)
    ax.set(
        xlim=(0, 1),
        ylim=(0, 1),
        xlabel="nominal level (credible interval mass)",
        ylabel="empirical coverage",
        aspect="equal",
    )
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", fontsize=8, frameon=False)
    return save_figure(fig, path)


def plot_heldout_calibration(
    path: str | os.PathLike,
    levels,
    coverage,
    z_edges,
    z_density,
    *,
    recalibrated: tuple | None = None,
    title: str | None = None,
    dpi: int = 120,
    figsize: tuple[float, float] | None = (9.0, 4.2),
) -> Path:
    """The held-out check in measurement space (:func:`ctuq.metrics.heldout.heldout_check`): coverage of the
    central predictive intervals of the held-out rows against their nominal mass (left), and the histogram of the
    rows' z-scores against the N(0, 1) density (right).

    ``levels``, ``coverage``: equal-length 1D sequences in [0, 1]; ``z_edges`` ``(n + 1,)`` bin edges and
    ``z_density`` ``(n,)`` (a density: counts / (rows × bin width)); ``recalibrated``: optional
    ``(levels, coverage, k)`` drawn as a second curve for the std × k. Returns ``path``.
    """
    where = "plot_heldout_calibration"
    lv, cov = _curve(levels, "levels", where), _curve(coverage, "coverage", where)
    edges, dens = _curve(z_edges, "z_edges", where), _curve(z_density, "z_density", where)
    if lv.shape != cov.shape:
        raise ValueError(f"{where}: {lv.size} levels but {cov.size} coverage values")
    if edges.size != dens.size + 1:
        raise ValueError(f"{where}: z_edges needs one more entry than z_density, got {edges.size} and {dens.size}")
    fig = new_figure(figsize, (9.0, 4.2), dpi)
    ax_c, ax_z = fig.subplots(1, 2)
    ax_c.plot([0, 1], [0, 1], color="0.5", ls="--", lw=1, label="perfect calibration")
    ax_c.plot(lv, cov, marker="o", ms=3, label="posterior predictive")
    if recalibrated is not None:
        rl, rc, k = recalibrated
        ax_c.plot(
            _curve(rl, "recalibrated levels", where),
            _curve(rc, "recalibrated coverage", where),
            marker="s",
            ms=3,
            label=f"image std × {k:.3g}",
        )
    ax_c.set(xlim=(0, 1), ylim=(0, 1), xlabel="nominal level", ylabel="held-out coverage", aspect="equal")
    ax_c.grid(alpha=0.3)
    ax_c.legend(fontsize=8, loc="lower right")
    centres = 0.5 * (edges[1:] + edges[:-1])
    ax_z.bar(centres, dens, width=np.diff(edges), color="C0", alpha=0.6, label="held-out z")
    grid = np.linspace(edges[0], edges[-1], 301)
    ax_z.plot(grid, np.exp(-0.5 * grid**2) / math.sqrt(2 * math.pi), color="k", lw=1.2, label="N(0, 1)")
    ax_z.set(xlabel="z = (y − T x̂) / predictive std", ylabel="density")
    ax_z.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def _power_label(value: float, _pos=None) -> str:
    """``2×10⁻³`` for a log axis' tick at 2e-3 (``10⁻³`` at a power of ten)."""
    if not value > 0:
        return ""
    exponent = math.floor(math.log10(value) + 1e-9)
    coefficient = round(value / 10**exponent, 6)
    power = f"10^{{{exponent}}}"
    return f"${power}$" if coefficient == 1 else f"${coefficient:g}\\times{power}$"


def plot_reliability(
    path: str | os.PathLike,
    curves: Mapping[str, tuple],
    *,
    ence: Mapping[str, float] | None = None,
    unit: str | None = IMAGE_UNIT,
    title: str | None = "inside the object, per decile of std",
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """Reliability of std maps: the RMSE of the errors against the RMV the map claims (``sqrt(mean std²)``), one point
    per equal-count bin of std (:func:`ctuq.metrics.calibration.reliability`), log–log, with the diagonal.

    ``curves``: ``{name: (rmv, rmse)}``, equal-length 1D sequences > 0 (image units). Points above the diagonal
    are bins whose errors exceed what the map says; a line flatter than the diagonal means the map's contrast is too
    strong, a steeper one too weak. ``ence``: ``{name: ENCE}`` shown in the legend. Default size 4.8 in wide, 4.4 in
    plus a line per curve high. Returns ``path``.
    """
    where = "plot_reliability"
    if not isinstance(curves, Mapping) or not curves:
        raise ValueError(f"{where}: curves must be a non-empty dict name -> (rmv, rmse)")
    data = {}
    for name, pair in curves.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{where}: curves[{name!r}] must be (rmv, rmse)")
        rmv, rmse = _curve(pair[0], f"curves[{name!r}] rmv", where), _curve(pair[1], f"curves[{name!r}] rmse", where)
        if rmv.shape != rmse.shape:
            raise ValueError(f"{where}: curves[{name!r}] has {rmv.size} RMV values but {rmse.size} RMSE values")
        if not (np.all(np.isfinite(rmv)) and np.all(np.isfinite(rmse))) or min(rmv.min(), rmse.min()) <= 0:
            raise ValueError(f"{where}: curves[{name!r}] RMV and RMSE must be finite and > 0")
        data[name] = (rmv, rmse)
    values = np.concatenate([np.concatenate(p) for p in data.values()])
    lo, hi = float(values.min()) / 1.25, float(values.max()) * 1.25
    fig = new_figure(figsize, (4.8, 4.4 + 0.22 * (len(data) + 1)), dpi)
    ax = fig.subplots()
    ax.plot([lo, hi], [lo, hi], color="0.5", ls="--", lw=1, label="RMSE = RMV (calibrated)")
    for name, (rmv, rmse) in data.items():
        label = name if not ence or name not in ence else f"{name} (ENCE {ence[name]:.2f})"
        ax.plot(rmv, rmse, marker="o", ms=4, label=label)
    suffix = f" ({unit})" if unit else ""
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):  # labels at 1, 2, 5 × 10^k only: minor labels of a short log axis collide
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(FuncFormatter(_power_label))
        axis.set_minor_formatter(NullFormatter())
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel=f"RMV: root mean std²{suffix}", ylabel=f"RMSE{suffix}", aspect="equal")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", fontsize=8, frameon=False)
    return save_figure(fig, path)


def plot_joint_ll(
    path: str | os.PathLike,
    curves: Mapping[str, Mapping],
    *,
    title: str | None = None,
    dpi: int = 120,
    figsize: tuple[float, float] | None = (5.0, 3.8),
) -> Path:
    """Patch joint test log-likelihood (nats per pixel) against patch size ``p``, one line per method.

    ``curves``: ``{name: {p: ll}}``; ``p`` may be an int or its string (as in ``uq_summary(...)["joint_ll"]``
    read back from JSON); ``ll`` may be ``None`` (not plotted). Returns ``path``.
    """
    where = "plot_joint_ll"
    if not isinstance(curves, Mapping) or not curves:
        raise ValueError(f"{where}: curves must be a non-empty dict name -> {{patch size: log-likelihood}}")
    data = {}
    for name, pts in curves.items():
        if not isinstance(pts, Mapping) or not pts:
            raise ValueError(f"{where}: curves[{name!r}] must be a non-empty dict {{patch size: log-likelihood}}")
        try:
            items = sorted((int(p), math.nan if v is None else float(v)) for p, v in pts.items())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: curves[{name!r}] needs int patch sizes and float values: {exc}") from exc
        if items[0][0] < 1:
            raise ValueError(f"{where}: curves[{name!r}] has a patch size < 1")
        data[name] = np.array(items, dtype=np.float64)
    fig = new_figure(figsize, (5.0, 3.8), dpi)
    ax = fig.subplots()
    for name, arr in data.items():
        ax.plot(arr[:, 0], arr[:, 1], marker="o", ms=4, label=name)
    ax.set(xlabel="patch size p (p×p pixels)", ylabel="joint test log-likelihood / p² (nats)")
    sizes = sorted({int(p) for arr in data.values() for p in arr[:, 0]})
    ax.set_xticks(sizes)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_error_vs_std(
    path: str | os.PathLike,
    abs_error,
    std=None,
    roi=None,
    *,
    bins: int = 100,
    log: bool = True,
    unit: str | None = IMAGE_UNIT,
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """2D histogram of |error| (y) against std (x) with log colours and the ``y = x`` line.

    Either ``abs_error`` and ``std`` are image-shaped (``(H, W)`` or ``(D, H, W)``, image units, every slice
    counted), or ``abs_error`` is a dict ``{name: (abs_error, std)}`` and ``std`` is ``None``: one panel per
    method, all on the same bins and colour scale. Bins: :func:`ctuq.metrics.error_std_histogram` (shared
    edges for both axes, logarithmic when ``log``). Pixels above the line have larger errors than their std.
    ``unit``: both axes' unit. Default size ``4.2 in per panel × 3.8 in``. Returns ``path``.
    """
    where = "plot_error_vs_std"
    if isinstance(abs_error, Mapping):
        if std is not None:
            raise ValueError(f"{where}: give std inside the dict {{name: (abs_error, std)}}, not separately")
        if not abs_error:
            raise ValueError(f"{where}: the methods dict is empty")
        methods = {}
        for name, pair in abs_error.items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"{where}: methods[{name!r}] must be (abs_error, std)")
            methods[name] = pair
    else:
        if std is None:
            raise ValueError(f"{where}: std is required when abs_error is an image")
        methods = {"": (abs_error, std)}
    # first pass: common range over all methods so panels share bins
    lo_hi = []
    for e, s in methods.values():
        h = _metrics.error_std_histogram(e, s, 1, roi, log=log)
        lo_hi.append((h.edges[0], h.edges[-1]))
    rng = (min(v[0] for v in lo_hi), max(v[1] for v in lo_hi))
    hists = {
        name: _metrics.error_std_histogram(e, s, bins, roi, log=log, range=rng) for name, (e, s) in methods.items()
    }
    vmax = max(1, max(int(h.counts.max()) for h in hists.values()))
    fig = new_figure(figsize, (4.2 * len(hists), 3.8), dpi)
    axes = fig.subplots(1, len(hists), squeeze=False)[0]
    mesh = None
    for ax, (name, h) in zip(axes, hists.items()):
        counts = np.ma.masked_equal(h.counts, 0)
        mesh = ax.pcolormesh(h.edges, h.edges, counts, norm=LogNorm(vmin=1, vmax=vmax), cmap="viridis")
        ax.plot(rng, rng, color="red", lw=1, ls="--", label="|error| = std")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        suffix = f" ({unit})" if unit else ""
        ax.set(xlim=rng, ylim=rng, xlabel=f"std{suffix}", ylabel=f"|error|{suffix}")
        if name:
            ax.set_title(name)
        ax.legend(fontsize=8, loc="upper left")
    fig.colorbar(mesh, ax=list(axes), label="pixels per bin")
    return save_figure(fig, path)


# =============================================================================================== EM trace
_EM_PANELS = (
    ("a", "prior precision a", True, True),
    ("gamma", "effective dimension γ̂", False, True),
    ("w_norm2", "‖w*‖²", False, True),
    ("sigma2", "noise variance σ²", True, False),
    ("log_evidence", "log evidence", False, False),
)


def plot_em_trace(
    path: str | os.PathLike, trace: Sequence[Mapping], *, dpi: int = 120, figsize: tuple[float, float] | None = None
) -> Path:
    """EM diagnostics against step: a (log scale), γ̂, ‖w*‖², and σ² / log evidence when recorded.

    ``trace``: one dict per EM step with any of the keys ``a``, ``gamma``, ``w_norm2``, ``sigma2``,
    ``log_evidence`` (floats, 0-d tensors or ``None``; a missing value leaves a gap) and optionally
    ``step`` (x coordinate; default the list index). The panels for a, γ̂ and ‖w*‖² are always drawn (with a
    "not recorded" note if empty); σ² and the log evidence only when some step recorded them. ``a`` and
    ``σ²`` must be > 0 (log axis). Default size ``3.2 in per panel × 3 in``. Returns ``path``.
    """
    where = "plot_em_trace"
    if isinstance(trace, Mapping) or not isinstance(trace, Sequence) or len(trace) == 0:
        raise ValueError(f"{where}: trace must be a non-empty list of dicts (one per EM step)")
    steps, cols = [], {key: [] for key, *_ in _EM_PANELS}
    for i, entry in enumerate(trace):
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where}: trace[{i}] must be a dict, got {type(entry).__name__}")
        steps.append(float(entry.get("step", i)) if entry.get("step") is not None else float(i))
        for key, _label, positive, _ in _EM_PANELS:
            v = entry.get(key)
            if v is None:
                cols[key].append(math.nan)
                continue
            try:
                v = float(v)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{where}: trace[{i}][{key!r}] must be a number or None, got {v!r}") from exc
            if not math.isfinite(v) or (positive and v <= 0):
                raise ValueError(f"{where}: trace[{i}][{key!r}] = {v} must be finite{' and > 0' if positive else ''}")
            cols[key].append(v)
    shown = [
        (key, label, log)
        for key, label, log, always in _EM_PANELS
        if always or not all(math.isnan(v) for v in cols[key])
    ]
    fig = new_figure(figsize, (_PANEL_IN * len(shown), 3.0), dpi)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    x = np.asarray(steps)
    for ax, (key, label, log) in zip(axes, shown):
        y = np.asarray(cols[key])
        if np.all(np.isnan(y)):
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="0.4")
        else:
            ax.plot(x, y, marker="o", ms=4)
            if log:
                ax.set_yscale("log")
        ax.set(title=label, xlabel="EM step")
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_tuning(
    path: str | os.PathLike,
    *,
    tv: Mapping | None = None,
    dip: Sequence[Sequence[float]] | None = None,
    dip_kept: int | None = None,
    dip_psnr: Sequence[float] | None = None,
    dpi: int = 120,
    figsize: tuple[float, float] | None = None,
) -> Path:
    """How a run was tuned on held-out angles (:mod:`ctuq.reconstruct.heldout`): one panel per tuned method.

    ``tv``: the TV path's record (``metrics.json["tv"]["tuning"]``: ``weights``, ``heldout_error`` in data units²,
    ``weight`` chosen, optional ``psnr`` in dB): the held-out error against ``λ`` (log axes) with the chosen weight
    marked. ``dip``: ``[iteration, held-out error]`` pairs, ``dip_kept`` the iteration kept, ``dip_psnr`` the PSNR of
    every iteration (dB, optional). A PSNR, when given, is drawn on a right-hand axis (it needs the ground truth;
    the choice never uses it). At least one of ``tv`` and ``dip``. Default size ``3.6 in per panel × 3 in``.
    Returns ``path``.
    """
    panels = [k for k, v in (("tv", tv), ("dip", dip)) if v]
    if not panels:
        raise ValueError("plot_tuning: give the TV path (tv) or the DIP's held-out trace (dip)")
    fig = new_figure(figsize, (3.6 * len(panels), 3.0), dpi)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, name in zip(axes, panels):
        if name == "tv":
            x, e = np.asarray(tv["weights"], float), np.asarray(tv["heldout_error"], float)
            ax.loglog(x, e, marker="o", ms=4, color="C0")
            ax.axvline(float(tv["weight"]), color="C3", ls="--", lw=1, label=f"chosen λ = {float(tv['weight']):.3g}")
            ax.set(title="TV: weight path", xlabel="λ", ylabel="held-out error (data units²)")
            psnr = tv.get("psnr")
        else:
            arr = np.asarray(dip, float).reshape(-1, 2)
            x, e = arr[:, 0], arr[:, 1]
            ax.semilogy(x, e, color="C0")
            if dip_kept is not None:
                ax.axvline(dip_kept, color="C3", ls="--", lw=1, label=f"kept iteration {dip_kept}")
            ax.set(title="DIP: stopping iteration", xlabel="iteration", ylabel="held-out error (data units²)")
            psnr = None
            if dip_psnr:
                idx = x.astype(int)
                psnr = [dip_psnr[i] for i in idx if i < len(dip_psnr)]
                x = x[: len(psnr)]
        if psnr:
            twin = ax.twinx()
            twin.plot(x, psnr, color="C2", alpha=0.7)
            twin.set_ylabel("PSNR (dB, ground truth)", color="C2")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper center", fontsize=8)
    return save_figure(fig, path)
