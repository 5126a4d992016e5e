"""Writing a run folder's files: float32 TIFFs, the comparison figure, metrics.json, package versions.

The file names and what each holds are the run-folder contract of :mod:`ctuq.pipeline.run_folder`; this module
only writes. All files are written atomically (``ctuq.utils``), so a killed run never leaves a half-written file.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import math
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from ctuq.utils import atomic_path, atomic_write_json, atomic_write_tiff, to_numpy

__all__ = [
    "new_run_dir",
    "package_versions",
    "write_tiff",
    "write_figure",
    "write_metrics",
    "central_slice",
]


def new_run_dir(root: str | os.PathLike = "runs") -> Path:
    """A fresh folder ``root/<YYYYmmdd-HHMMSS>[-N]`` (created; ``-N`` appended if the second is taken)."""
    root = Path(root)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


def package_versions() -> dict[str, str | None]:
    """Versions of the packages a result depends on (``None`` when a package is missing)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist, key in (
        ("torch", "torch"),
        ("numpy", "numpy"),
        ("scipy", "scipy"),
        ("astra-toolbox", "astra"),
        ("odl", "odl"),
        ("scikit-image", "scikit-image"),
        ("tifffile", "tifffile"),
        ("ctuq", "ctuq"),
    ):
        try:
            out[key] = md.version(dist)
        except md.PackageNotFoundError:
            out[key] = None
    out["cuda"] = torch.version.cuda
    return out


def write_tiff(path: str | os.PathLike, image: torch.Tensor | np.ndarray) -> Path:
    """Write ``image`` as a float32 TIFF atomically; returns the path."""
    path = Path(path)
    atomic_write_tiff(path, to_numpy(image))
    return path


def central_slice(image: np.ndarray) -> np.ndarray:
    """2D images unchanged; 3D volumes ``(D, H, W)``: the central ``(H, W)`` slice (for figures)."""
    return image if image.ndim == 2 else image[image.shape[0] // 2]


def write_figure(
    path: str | os.PathLike,
    images: Mapping[str, torch.Tensor | np.ndarray],
    *,
    ground_truth: torch.Tensor | np.ndarray | None = None,
    psnrs: Mapping[str, float | None] | None = None,
    error_of: str | None = "DIP",
    dpi: int = 120,
) -> Path:
    """A one-row PNG: ground truth (if given), each image in ``images`` (titles with their PSNR), and
    ``|images[error_of] − ground truth|``. Volumes are shown by their central slice. Written atomically.

    Drawn on a stand-alone ``Figure`` (Agg canvas, no pyplot state), as :mod:`ctuq.figures` does."""
    panels: list[tuple[str, np.ndarray, dict]] = []
    gt = central_slice(to_numpy(ground_truth)) if ground_truth is not None else None
    arrays = {k: central_slice(to_numpy(v)) for k, v in images.items()}
    ref = gt if gt is not None else next(iter(arrays.values()))
    vmin, vmax = float(ref.min()), float(ref.max())
    if gt is not None:
        panels.append(("ground truth", gt, {"vmin": vmin, "vmax": vmax, "cmap": "gray"}))
    for name, arr in arrays.items():
        p = (psnrs or {}).get(name)
        title = f"{name}" + (f"\nPSNR {p:.2f} dB" if p is not None else "")
        panels.append((title, arr, {"vmin": vmin, "vmax": vmax, "cmap": "gray"}))
    if gt is not None and error_of in arrays:
        err = np.abs(arrays[error_of] - gt)
        panels.append(
            (f"|{error_of} − ground truth|", err, {"vmin": 0.0, "vmax": float(err.max()) or 1.0, "cmap": "magma"})
        )
    fig = Figure(figsize=(3.2 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (title, arr, kw) in zip(axes[0], panels):
        im = ax.imshow(arr, **kw)
        ax.set_title(title, fontsize=10)
        ax.set_axis_off()
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return path


def write_metrics(path: str | os.PathLike, metrics: Mapping) -> Path:
    """Write ``metrics`` as JSON atomically (non-finite floats become ``null`` so the file is strict JSON)."""
    path = Path(path)
    atomic_write_json(path, _finite(metrics))
    return path


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return _finite(obj.item())
    return obj
