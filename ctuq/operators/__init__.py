"""Ray transforms ``T`` / ``Tᵀ`` (DESIGN.md §1) and analytic reconstructions.

Backends share the :class:`RayTransform` interface (batched, angle-major, differentiable, device-aware) and are
registered by name in :data:`ctuq.registry.RAY_TRANSFORMS` (:mod:`.registry`, ODL's
``RAY_TRAFO_IMPLS`` pattern):

* ``sparse`` (:mod:`.sparse`) — :class:`SparseRayTransform`: 2D parallel/fan geometries as an assembled sparse
  matrix (ASTRA CPU projectors), exact adjoint, CPU and CUDA; and :class:`SlicewiseParallelRayTransform`: 3D
  parallel beam about ``z`` with one detector row per slice (``I_D ⊗ T₂``), the CPU path of the 3D code.
* ``astra_cuda`` (:mod:`.astra_cuda`) — :class:`AstraCudaRayTransform`: matrix-free ASTRA CUDA
  (``astra.experimental.direct_FP3D/BP3D``) on torch CUDA tensors: 3D cone/parallel beam, and batches of 2D slices
  as one 3D volume. GPU only.

:func:`make_ray_transform` builds one by name (``backend="auto"`` picks by dimension); :func:`available_impls`
lists the backends this machine can run. ``fbp``/``fdk`` (:mod:`ctuq.operators.fbp`) give the classical
reconstructions used to initialise and benchmark the DIP.
"""

from __future__ import annotations

from ctuq.operators.astra_cuda import AstraCudaRayTransform
from ctuq.operators.base import RayTransform, ShapeError
from ctuq.operators.fbp import fbp, fdk  # rebinds the names from the submodule to the functions
from ctuq.operators.registry import (
    RAY_TRANSFORMS,
    available_impls,
    backend_names,
    make_ray_transform,
    resolve_backend,
)
from ctuq.operators.sparse import SlicewiseParallelRayTransform, SparseRayTransform

__all__ = [
    "RayTransform",
    "ShapeError",
    "SparseRayTransform",
    "SlicewiseParallelRayTransform",
    "AstraCudaRayTransform",
    "RAY_TRANSFORMS",
    "available_impls",
    "backend_names",
    "resolve_backend",
    "make_ray_transform",
    "fbp",
    "fdk",
]
