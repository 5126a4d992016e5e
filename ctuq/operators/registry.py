"""The ray-transform backends by name, and the one factory that builds an operator from a name (``backend=``).

In the manner of ODL's ``RAY_TRAFO_IMPLS`` (``odl.applications.tomo``): :data:`ctuq.registry.RAY_TRANSFORMS` maps
each backend name to its :class:`~ctuq.operators.base.RayTransform` class, and each class carries its availability
flag (:meth:`~ctuq.operators.base.RayTransform.available`), the geometry kinds, devices and dtypes it supports,
whether its adjoint is exact, and its builder (:meth:`~ctuq.operators.base.RayTransform.from_geometry`).
:func:`available_impls` is the mapping restricted to the backends whose flag holds on this machine.

Adding a backend is one file (the class, with those attributes) plus one registry line below (or
``@RAY_TRANSFORMS.register`` on a class with a ``name`` attribute, wherever it is defined). It is then a value of
``data.backend`` (the config reads the registry) and of ``make_ray_transform(backend=...)``, and the shipped
contract :class:`ctuq.testing.RayTransformContract`, which ``tests/operators/test_ray_transform_contract.py`` runs
over every registered backend, checks it over every geometry kind it declares, wherever it is available.

The availability flags are evaluated when asked, not at import: probing CUDA at import would initialise the
driver in every process that imports ctuq, and naming a backend that is not available here must still give that
backend's own clear error (e.g. "needs a CUDA device") rather than "unknown backend".
"""

from __future__ import annotations

import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators.astra_cuda import AstraCudaRayTransform
from ctuq.operators.base import RayTransform
from ctuq.operators.sparse import SparseRayTransform
from ctuq.options import Backend
from ctuq.registry import RAY_TRANSFORMS

__all__ = [
    "RAY_TRANSFORMS",
    "available_impls",
    "backend_names",
    "resolve_backend",
    "make_ray_transform",
]

RAY_TRANSFORMS.set_base(RayTransform)
# The registry lines, in the order backend="auto" prefers them.
RAY_TRANSFORMS.register(SparseRayTransform, name=Backend.SPARSE.value)
RAY_TRANSFORMS.register(AstraCudaRayTransform, name=Backend.ASTRA_CUDA.value)


def available_impls() -> dict[str, type[RayTransform]]:
    """The backends of :data:`RAY_TRANSFORMS` whose availability flag holds now (``sparse`` everywhere,
    ``astra_cuda`` where torch and ASTRA see a CUDA device)."""
    return {name: cls for name, cls in RAY_TRANSFORMS.items() if cls.available()}


def backend_names() -> tuple[str, ...]:
    """The valid values of a ``backend`` option: ``"auto"`` and every registered backend
    (:meth:`ctuq.registry.Registry.choices`)."""
    return RAY_TRANSFORMS.choices()


def resolve_backend(backend: str, ndim: int) -> str:
    """The registered backend name that ``backend`` means for ``ndim``-dimensional images.

    ``"auto"`` is the first backend in :data:`RAY_TRANSFORMS` whose ``auto_ndims`` holds ``ndim``: the sparse
    matrix for 2D (fastest on CPU and GPU for slices), ASTRA CUDA for 3D. It does not fall back to another
    backend when that one is unavailable: a 3D volume on a machine without CUDA gets the CUDA backend's clear
    error, never a silently different operator. ``ValueError`` for an unknown name (listing the valid ones).
    """
    if backend not in backend_names():
        raise ValueError(f"make_ray_transform: backend {backend!r} unknown; valid: {list(backend_names())}")
    if backend != Backend.AUTO:
        return str(backend)
    for name, cls in RAY_TRANSFORMS.items():
        if ndim in cls.auto_ndims:
            return name
    raise ValueError(f"make_ray_transform: no backend builds {ndim}D images; registered: {list(RAY_TRANSFORMS)}")


def make_ray_transform(
    volume: VolumeGeometry,
    geometry: ProjectionGeometry,
    *,
    backend: str = Backend.AUTO,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> RayTransform:
    """Build ``T`` (``c × d_x``) for ``volume`` (pixel grid, mm) and ``geometry`` (mm) on ``device``.

    ``backend`` is ``"auto"`` or a key of :data:`RAY_TRANSFORMS` (:func:`resolve_backend`): ``auto`` takes the
    sparse matrix for 2D and ASTRA CUDA for 3D. 3D, and ``'astra_cuda'`` in general, need a CUDA device; asking
    for them on the CPU raises a clear error. The exception: ``backend='sparse'`` with a ``parallel3d`` geometry
    whose detector rows are the volume's slices gives the slice-by-slice
    :class:`~ctuq.operators.sparse.SlicewiseParallelRayTransform` (CPU and CUDA). ``dtype`` is honoured by
    backends that compute in it (``sparse``: float32 or float64; ``astra_cuda`` is float32 only).
    """
    name = resolve_backend(backend, volume.ndim)
    if volume.ndim != geometry.ndim:
        raise ValueError(
            f"make_ray_transform: {volume.ndim}D volume {volume.shape} with a {geometry.ndim}D geometry "
            f"{geometry.kind!r}"
        )
    return RAY_TRANSFORMS[name].from_geometry(volume, geometry, device=torch.device(device), dtype=dtype)
