"""``ctuq view RUN``: a run folder's images as napari layers at physical scale.

Three steps, so that everything but the window is testable without napari's GUI:

* :func:`layer_specs` reads the run folder (``reconstruction.tif``, and ``std.tif``, ``ground_truth.tif`` when
  present) into :class:`LayerSpec`\\ s: plain arrays with a name, the voxel size as scale (mm), a colormap and
  contrast limits. It needs neither napari nor a display.
* :func:`add_layers` adds them to a ``napari.components.ViewerModel``: the headless model (no window, no Qt) or
  the ``napari.Viewer`` window, which is one.
* :func:`view_run` (``ctuq view``) opens the window and runs napari's event loop.

Layers, bottom to top: ``ground truth`` and ``reconstruction`` (gray, the ground truth's value range, else the
reconstruction's), ``error`` = ``|reconstruction − ground truth|`` (only with a ground truth) and ``std`` (the
posterior standard deviation), both ``magma`` with one range from 0 to the 99.5th percentile of both maps, so that
one colour means one value in mm⁻¹ in either. The voxel size comes from the TIFFs' ImageJ metadata
(:func:`ctuq.outputs.read_tiff`), else from ``metrics.json``'s ``data.voxel_size_mm``; a folder that records
neither is shown in pixel units with a warning. By default the viewer shows the layers side by side (napari's
grid mode). Axis order as in the files: ``(y, x)`` or ``(z, y, x)``.

napari is an optional dependency (``pip install 'ctuq[view]'``); it is imported only here, inside functions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import tifffile

from ctuq.errors import CTUQError
from ctuq.outputs import read_tiff, result_channels
from ctuq.pipeline import run_folder as rf

__all__ = [
    "ViewerError",
    "LayerSpec",
    "INSTALL_HINT",
    "layer_specs",
    "add_layers",
    "import_napari",
    "view_run",
]

_log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'ctuq[view]' (napari with a Qt binding)"
IMAGE_COLORMAP = "gray"
UNCERTAINTY_COLORMAP = "magma"
UNCERTAINTY_PERCENTILE = 99.5  # upper contrast limit of std and error: robust to a few extreme pixels


class ViewerError(CTUQError):
    """``ctuq view`` cannot show the run: no run folder, an unreadable or mis-shaped image, napari missing."""


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One napari image layer, described without napari.

    Attributes
    ----------
    name : str
        Layer name: ``"ground truth"``, ``"reconstruction"``, ``"error"`` or ``"std"``.
    data : numpy.ndarray
        ``(H, W)`` or ``(D, H, W)`` float32, mm⁻¹.
    scale : tuple of float
        Voxel size per axis (mm; ones in pixel units).
    units : str
        ``"mm"``, or ``"pixel"`` when the folder records no voxel size.
    colormap : str
        A napari colormap name.
    contrast_limits : tuple of float
        ``(low, high)`` in mm⁻¹, ``low < high``.
    axis_labels : tuple of str
        ``("y", "x")`` or ``("z", "y", "x")``.
    """

    name: str
    data: np.ndarray
    scale: tuple[float, ...]
    units: str
    colormap: str
    contrast_limits: tuple[float, float]
    axis_labels: tuple[str, ...]


def _read(path: Path) -> tuple[np.ndarray, float | None]:
    try:
        arr, voxel = read_tiff(path)
    except (OSError, ValueError, tifffile.TiffFileError) as exc:
        raise ViewerError(f"{path}: not a readable TIFF ({type(exc).__name__}: {exc})") from exc
    if arr.ndim not in (2, 3):
        raise ViewerError(f"{path}: holds an array of shape {arr.shape}; expected (H, W) or (D, H, W)")
    return arr.astype(np.float32, copy=False), voxel


def _metrics_voxel_size(run: Path) -> float | None:
    """``metrics.json``'s ``data.voxel_size_mm`` (runs whose TIFFs predate the ImageJ metadata)."""
    try:
        value = json.loads((run / rf.METRICS_NAME).read_text())["data"]["voxel_size_mm"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _limits(lo: float, hi: float) -> tuple[float, float]:
    """``(lo, hi)`` made finite and increasing (a constant image gets a range of width 1)."""
    lo = lo if np.isfinite(lo) else 0.0
    hi = hi if np.isfinite(hi) else lo + 1.0
    return (float(lo), float(hi)) if hi > lo else (float(lo), float(lo) + 1.0)


def layer_specs(run_dir: str | os.PathLike) -> list[LayerSpec]:
    """The layers of the run folder ``run_dir``, bottom to top (module docstring); napari is not needed.

    Raises
    ------
    ViewerError
        ``run_dir`` is not a folder or holds no ``reconstruction.tif``; an image is unreadable, not 2D/3D, or of
        another shape than the reconstruction. The message names the file.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ViewerError(f"RUN {run}: no such folder")
    rec_path = run / rf.RECONSTRUCTION_NAME
    if not rec_path.is_file():
        raise ViewerError(f"{rec_path}: does not exist; RUN must be a folder written by `ctuq reconstruct`")
    rec, voxel = _read(rec_path)
    found: dict[str, np.ndarray] = {}
    for key, name in (("std", rf.STD_NAME), ("ground truth", rf.GROUND_TRUTH_NAME)):
        path = run / name
        if path.is_file():
            arr, _ = _read(path)
            if arr.shape != rec.shape:
                raise ViewerError(f"{path}: shape {arr.shape} differs from {rf.RECONSTRUCTION_NAME}'s {rec.shape}")
            found[key] = arr
    voxel = voxel or _metrics_voxel_size(run)
    if voxel is None:
        _log.warning(f"{rec_path}: no voxel size recorded (TIFF metadata or metrics.json); showing pixel units")
    images = result_channels(rec, found.get("std"), found.get("ground truth"))
    ndim = rec.ndim
    scale = (voxel or 1.0,) * ndim
    units = "mm" if voxel else "pixel"
    labels = ("z", "y", "x")[-ndim:]
    ref = images.get("ground truth", rec)
    image_limits = _limits(float(np.nanmin(ref)), float(np.nanmax(ref)))
    spread = [images[k].ravel() for k in ("std", "error") if k in images]
    top = float(np.nanpercentile(np.concatenate(spread), UNCERTAINTY_PERCENTILE)) if spread else 1.0
    spread_limits = _limits(0.0, top)
    specs = []
    for name in ("ground truth", "reconstruction", "error", "std"):
        if name in images:
            uncertain = name in ("error", "std")
            specs.append(
                LayerSpec(
                    name=name,
                    data=images[name],
                    scale=scale,
                    units=units,
                    colormap=UNCERTAINTY_COLORMAP if uncertain else IMAGE_COLORMAP,
                    contrast_limits=spread_limits if uncertain else image_limits,
                    axis_labels=labels,
                )
            )
    return specs


def add_layers(viewer, specs: list[LayerSpec], *, grid: bool = True) -> list:
    """Add ``specs`` to ``viewer`` (a ``napari.components.ViewerModel``, e.g. a ``napari.Viewer``) as image layers,
    in order, with their units (mm: the scale bar shows millimetres) and a scale bar; ``grid``: side by side
    (napari's grid mode) instead of stacked. Returns the layers."""
    layers = [
        viewer.add_image(
            s.data,
            name=s.name,
            scale=s.scale,
            units=(s.units,) * s.data.ndim,
            axis_labels=s.axis_labels,
            colormap=s.colormap,
            contrast_limits=s.contrast_limits,
        )
        for s in specs
    ]
    # napari 0.9 moved grid and scale bar onto viewer.canvas (the old attributes warn); the scale bar takes its
    # unit from the layers' units (napari >= 0.7)
    canvas = getattr(viewer, "canvas", None)
    (canvas.grid if canvas is not None else viewer.grid).enabled = bool(grid)
    (canvas.overlays.scale_bar if canvas is not None else viewer.scale_bar).visible = bool(specs)
    return layers


def import_napari():
    """The ``napari`` module, or a :class:`ViewerError` saying how to install it."""
    try:
        import napari
    except ImportError as exc:
        raise ViewerError(f"ctuq view needs napari, which is not installed: {INSTALL_HINT}") from exc
    return napari


def view_run(run_dir: str | os.PathLike, *, grid: bool = True) -> None:
    """Open the run folder ``run_dir`` in a napari window (:func:`layer_specs`, :func:`add_layers`) and run napari's
    event loop until the window is closed. The folder is read before napari is imported, so its errors come
    first; a napari without a Qt binding is a :class:`ViewerError` naming the extra to install."""
    specs = layer_specs(run_dir)
    napari = import_napari()
    try:
        viewer = napari.Viewer(title=f"ctuq view {run_dir}")
    except ImportError as exc:  # napari installed without a GUI backend (qtpy finds no Qt binding)
        raise ViewerError(f"napari cannot open a window ({exc}): {INSTALL_HINT}") from exc
    add_layers(viewer, specs, grid=grid)
    napari.run()
