"""Writing a run folder's files: float32 TIFFs, the comparison figure, metrics.json, package versions.

The file names and what each holds are the run-folder contract of :mod:`ctuq.pipeline.run_folder`; this module
writes them (and reads the TIFFs back with their voxel size). All files are written atomically (``ctuq.utils``), so
a killed run never leaves a half-written file.

Image TIFFs are ImageJ hyperstacks (``tifffile.imwrite(imagej=True)``): axes ``YX`` (2D) or ``ZYX`` (3D), the
pixel pitch as the X/Y resolution (pixels per mm), ``unit=mm`` and, for volumes, ``spacing`` (the slice distance,
mm) in the ImageJ description, so ImageJ/Fiji shows physical sizes; ``ctuq view`` (:mod:`ctuq.viewer`) reads them
back for napari. The pixel values are those of the float32 array, bit for bit; readers that ignore the metadata
(``tifffile.imread``, ASTRA's and ODL's users) see the same ``(H, W)``/``(D, H, W)`` array as before.
"""

from __future__ import annotations

import importlib.metadata as md
import math
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tifffile
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.utils import atomic_path, atomic_write_json, atomic_write_tiff, to_numpy

__all__ = [
    "package_versions",
    "voxel_size_of",
    "imagej_kwargs",
    "write_tiff",
    "read_tiff",
    "result_channels",
    "write_stack",
    "write_results_h5",
    "read_results_h5",
    "write_metrics",
    "central_slice",
]


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


def voxel_size_of(obj) -> float | None:
    """The voxel edge length (mm) of ``obj``: a :class:`~ctuq.geometry.VolumeGeometry`, or anything with a
    ``volume`` attribute holding one (a :class:`~ctuq.operators.RayTransform`, a :class:`~ctuq.data.CTData`);
    ``None`` when unknown (an ad-hoc operator without geometry)."""
    for candidate in (obj, getattr(obj, "volume", None)):
        size = getattr(candidate, "voxel_size", None)
        if isinstance(size, (int, float)) and math.isfinite(size) and size > 0:
            return float(size)
    return None


def imagej_kwargs(ndim: int, voxel_size: float | None, *, channels: list[str] | None = None, depth: int = 1) -> dict:
    """``tifffile.imwrite`` keywords of an ImageJ hyperstack of an ``ndim``-D image (2: ``YX``, 3: ``ZYX``), or of
    ``len(channels)`` such images as channels (``CYX``/``ZCYX``; the channel names label the planes, ``depth`` of
    them per channel), with the isotropic pixel pitch ``voxel_size`` (mm; ``None``: no physical size)."""
    if ndim not in (2, 3):
        raise ValueError(f"imagej_kwargs: ImageJ stacks here are 2D or 3D images, got ndim = {ndim}")
    axes = "YX" if ndim == 2 else "ZYX"
    metadata: dict = {}
    if channels is not None:
        axes = axes[:-2] + "CYX"
        metadata["Labels"] = list(channels) * depth  # ImageJ's plane order: channel fastest, then z
    metadata["axes"] = axes
    kw: dict = {"imagej": True, "metadata": metadata}
    if voxel_size is not None:
        kw["resolution"] = (1.0 / voxel_size, 1.0 / voxel_size)
        metadata["unit"] = "mm"
        if ndim == 3:
            metadata["spacing"] = float(voxel_size)
    return kw


def write_tiff(path: str | os.PathLike, image: torch.Tensor | np.ndarray, *, voxel_size: float | None = None) -> Path:
    """Write ``image`` (``(H, W)`` or ``(D, H, W)``, any device) as a float32 TIFF atomically; returns the path.

    2D and 3D images are ImageJ hyperstacks with the voxel edge length ``voxel_size`` (mm; ``None``: pixel units;
    module docstring); other shapes are plain TIFFs. The values are written bit for bit.
    """
    path = Path(path)
    arr = to_numpy(image)
    kw = imagej_kwargs(arr.ndim, voxel_size) if arr.ndim in (2, 3) else {}
    atomic_write_tiff(path, arr, **kw)
    return path


def read_tiff(path: str | os.PathLike) -> tuple[np.ndarray, float | None]:
    """A TIFF written by :func:`write_tiff` (or any TIFF) and its voxel edge length in mm.

    Returns ``(array, voxel_size)``: the array as stored (``(H, W)``, ``(D, H, W)``, or ``(C, H, W)``/``(D, C, H,
    W)`` for a :func:`write_stack` file), and the pixel pitch from the X resolution when the ImageJ unit is mm
    (``None`` otherwise: a TIFF without physical size).
    """
    with tifffile.TiffFile(path) as tif:
        arr = tif.asarray()
        meta = tif.imagej_metadata or {}
        voxel = None
        if meta.get("unit") == "mm":
            tag = tif.pages[0].tags.get("XResolution")
            if tag is not None:
                num, den = tag.value
                if num > 0 and den > 0:
                    voxel = den / num
    return arr, voxel


def result_channels(
    reconstruction: torch.Tensor | np.ndarray,
    std: torch.Tensor | np.ndarray | None = None,
    ground_truth: torch.Tensor | np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The images of a run as named float32 arrays of one shape (mm⁻¹), those given, in this order:
    ``reconstruction``, ``std`` (posterior standard deviation), ``error`` (``|reconstruction − ground truth|``,
    as in the figures) and ``ground truth``."""
    rec = to_numpy(reconstruction)
    out = {"reconstruction": rec}
    if std is not None:
        out["std"] = to_numpy(std)
    if ground_truth is not None:
        gt = to_numpy(ground_truth)
        out["error"] = np.abs(rec - gt)
        out["ground truth"] = gt
    for name, arr in out.items():
        if arr.shape != rec.shape:
            raise ValueError(f"result_channels: {name} has shape {arr.shape}, the reconstruction {rec.shape}")
    return out


def write_stack(
    path: str | os.PathLike, channels: Mapping[str, torch.Tensor | np.ndarray], *, voxel_size: float | None = None
) -> Path:
    """Write equally shaped 2D/3D images as one float32 multi-channel ImageJ hyperstack (``CYX`` or ``ZCYX``; the
    names are the channels' labels; :func:`result_channels` gives a run's), atomically; returns the path."""
    names = list(channels)
    arrays = [to_numpy(channels[n]) for n in names]
    if not arrays or any(a.shape != arrays[0].shape for a in arrays) or arrays[0].ndim not in (2, 3):
        raise ValueError(f"write_stack: need 2D or 3D images of one shape, got {[a.shape for a in arrays]}")
    ndim = arrays[0].ndim
    stack = np.stack(arrays, axis=0 if ndim == 2 else 1)
    kw = imagej_kwargs(ndim, voxel_size, channels=names, depth=stack.shape[0] if ndim == 3 else 1)
    path = Path(path)
    atomic_write_tiff(path, stack, **kw)
    return path


def write_results_h5(
    path: str | os.PathLike,
    images: Mapping[str, torch.Tensor | np.ndarray],
    *,
    volume: VolumeGeometry | None = None,
    geometry: ProjectionGeometry | None = None,
    attrs: Mapping[str, str | int | float] | None = None,
) -> Path:
    """Write a run's images and its geometry as one HDF5 file, atomically; returns the path.

    Layout: ``/images/<name>`` float32 datasets (the arrays bit for bit; attribute ``axes`` ``"YX"``/``"ZYX"``,
    ``units`` ``"1/mm"``); ``/geometry/volume`` (attributes ``shape``, ``voxel_size`` in mm, ``center`` ``(x, y[,
    z])`` in mm: a :class:`~ctuq.geometry.VolumeGeometry`); ``/geometry/projection`` (attributes ``kind``,
    ``det_shape``; datasets ``angles`` (rad) and ``vectors`` (``(n_angles, 6|12)``, ASTRA's vector layout in ctuq's
    world frame: :meth:`ctuq.geometry.ProjectionGeometry.to_vectors`)); ``attrs`` on the root. Read back with
    :func:`read_results_h5`.
    """
    import h5py  # optional at import time: only this writer and its reader need it

    path = Path(path)
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        group = f.create_group("images")
        for name, image in images.items():
            arr = to_numpy(image)
            ds = group.create_dataset(name, data=arr)
            ds.attrs["axes"] = "ZYX"[-arr.ndim :]
            ds.attrs["units"] = "1/mm"
        if volume is not None:
            g = f.create_group("geometry/volume")
            g.attrs["shape"] = np.asarray(volume.shape, dtype=np.int64)
            g.attrs["voxel_size"] = float(volume.voxel_size)
            g.attrs["center"] = np.asarray(volume.center, dtype=np.float64)
        if geometry is not None:
            vec = geometry.to_vectors()
            g = f.create_group("geometry/projection")
            g.attrs["kind"] = vec.kind
            g.attrs["det_shape"] = np.asarray(vec.det_shape, dtype=np.int64)
            g.create_dataset("angles", data=np.asarray(vec.angles, dtype=np.float64))
            g.create_dataset("vectors", data=np.asarray(vec.vectors, dtype=np.float64))
    return path


def read_results_h5(
    path: str | os.PathLike,
) -> tuple[dict[str, np.ndarray], VolumeGeometry | None, ProjectionGeometry | None]:
    """The images, volume geometry and (vector) projection geometry of a :func:`write_results_h5` file."""
    import h5py

    with h5py.File(path, "r") as f:
        images = {name: ds[()] for name, ds in f["images"].items()}
        volume = geometry = None
        if "geometry/volume" in f:
            a = f["geometry/volume"].attrs
            volume = VolumeGeometry(tuple(int(n) for n in a["shape"]), float(a["voxel_size"]), tuple(a["center"]))
        if "geometry/projection" in f:
            g = f["geometry/projection"]
            geometry = ProjectionGeometry(
                str(g.attrs["kind"]),
                tuple(int(n) for n in g.attrs["det_shape"]),
                angles=g["angles"][()],
                vectors=g["vectors"][()],
            )
    return images, volume, geometry


def central_slice(image: np.ndarray) -> np.ndarray:
    """2D images unchanged; 3D volumes ``(D, H, W)``: the central ``(H, W)`` slice (for figures)."""
    return image if image.ndim == 2 else image[image.shape[0] // 2]


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
