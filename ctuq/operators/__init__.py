"""Ray transforms ``T`` / ``Tᵀ`` (DESIGN.md §1) and analytic reconstructions.

Backends share the :class:`RayTransform` interface (batched, angle-major, differentiable, device-aware):

* :class:`SparseRayTransform` — 2D parallel/fan geometries as an assembled sparse matrix (ASTRA CPU projectors);
  exact adjoint; CPU and CUDA.
* :class:`AstraCudaRayTransform` — matrix-free ASTRA CUDA (``astra.experimental.direct_FP3D/BP3D``) on torch
  CUDA tensors: 3D cone/parallel beam, and batches of 2D slices as one 3D volume. GPU only.
* :class:`SlicewiseParallelRayTransform` — 3D parallel beam about ``z`` with one detector row per slice, assembled
  from the 2D sparse operator (``I_D ⊗ T₂``); CPU and CUDA. The CPU path of the 3D code (small volumes, tests).

:func:`make_ray_transform` picks one. ``fbp``/``fdk`` (:mod:`ctuq.operators.fbp`) give the classical
reconstructions used to initialise and benchmark the DIP.
"""

from __future__ import annotations

import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators.base import RayTransform, ShapeError
from ctuq.operators.fbp import fbp, fdk  # rebinds the names from the submodule to the functions
from ctuq.operators.slicewise import SlicewiseParallelRayTransform
from ctuq.operators.sparse import SparseRayTransform

__all__ = ["RayTransform", "ShapeError", "SparseRayTransform", "SlicewiseParallelRayTransform", "make_ray_transform",
           "BACKENDS", "fbp", "fdk"]

BACKENDS = ("auto", "sparse", "astra_cuda")


def make_ray_transform(
    volume: VolumeGeometry,
    geometry: ProjectionGeometry,
    *,
    backend: str = "auto",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> RayTransform:
    """Build ``T`` for ``volume`` (pixel grid, mm) and ``geometry`` (mm) on ``device``.

    ``backend='auto'`` takes the sparse matrix for 2D (fastest on CPU and GPU for slices) and ASTRA CUDA for 3D.
    3D, and ``'astra_cuda'`` in general, need a CUDA device; asking for them on the CPU raises a clear error. The
    exception: ``backend='sparse'`` with a ``parallel3d`` geometry whose detector rows are the volume's slices gives
    the slice-by-slice :class:`SlicewiseParallelRayTransform` (CPU and CUDA).
    """
    if backend not in BACKENDS:
        raise ValueError(f"make_ray_transform: backend {backend!r} unknown; valid: {list(BACKENDS)}")
    if volume.ndim != geometry.ndim:
        raise ValueError(
            f"make_ray_transform: {volume.ndim}D volume {volume.shape} with a {geometry.ndim}D geometry "
            f"{geometry.kind!r}"
        )
    device = torch.device(device)
    if backend == "auto":
        backend = "sparse" if volume.ndim == 2 else "astra_cuda"
    if backend == "sparse":
        if volume.ndim == 3 and geometry.kind == "parallel3d":
            return SlicewiseParallelRayTransform.from_geometry(volume, geometry, device=device, dtype=dtype)
        if volume.ndim != 2:
            raise ValueError("make_ray_transform: backend 'sparse' is 2D only (and 3D parallel beam with one detector "
                             "row per slice, geometry 'parallel3d'); cone-beam volumes need 'astra_cuda' (GPU)")
        return SparseRayTransform(volume, geometry, device=device, dtype=dtype)
    if device.type != "cuda":
        raise RuntimeError(
            f"make_ray_transform: backend 'astra_cuda' ({volume.ndim}D) needs a CUDA device, got {device}; "
            "ASTRA has no 3D projectors on the CPU (use a 2D slice with backend 'sparse' there)"
        )
    from ctuq.operators.astra_cuda import AstraCudaRayTransform

    return AstraCudaRayTransform(volume, geometry, device=device)


def __getattr__(name):
    # Lazy: importing the CUDA backend touches ASTRA's CUDA bindings.
    if name == "AstraCudaRayTransform":
        from ctuq.operators.astra_cuda import AstraCudaRayTransform

        return AstraCudaRayTransform
    raise AttributeError(f"module 'ctuq.operators' has no attribute {name!r}")
