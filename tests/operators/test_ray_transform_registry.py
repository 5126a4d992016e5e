"""The ray-transform registry and its factory: names, availability flags, ``auto``, clear errors, and a new backend
added with one registry line."""

import math

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import (
    RAY_TRANSFORM_IMPLS,
    AstraCudaRayTransform,
    RayTransform,
    SlicewiseParallelRayTransform,
    SparseRayTransform,
    available_impls,
    backend_names,
    make_ray_transform,
    resolve_backend,
)
from ctuq.operators.astra_cuda import cuda_available
from ctuq.options import Backend, values

VOLUME = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))
PARALLEL = ProjectionGeometry(
    "parallel", (41,), angles=np.linspace(0.1, math.pi + 0.1, 9, endpoint=False), det_spacing=0.45
)


def test_registry_names_match_the_backend_vocabulary():
    # Configs validate `backend` against ctuq.options.Backend: it must name exactly the registered backends.
    assert backend_names() == values(Backend)
    assert tuple(RAY_TRANSFORM_IMPLS) == tuple(v for v in values(Backend) if v != Backend.AUTO)
    assert RAY_TRANSFORM_IMPLS["sparse"] is SparseRayTransform
    assert RAY_TRANSFORM_IMPLS["astra_cuda"] is AstraCudaRayTransform


def test_every_backend_declares_what_the_contract_needs():
    kinds = {"parallel", "parallel_vec", "fanflat", "fanflat_vec", "cone", "cone_vec", "parallel3d", "parallel3d_vec"}
    for name, cls in RAY_TRANSFORM_IMPLS.items():
        assert issubclass(cls, RayTransform), name
        assert cls.geometry_kinds and set(cls.geometry_kinds) <= kinds, name
        assert cls.devices and set(cls.devices) <= {"cpu", "cuda"}, name
        assert cls.dtypes and set(cls.dtypes) <= {torch.float32, torch.float64}, name
        assert set(cls.auto_ndims) <= {2, 3}, name
        assert isinstance(cls.available(), bool), name


def test_availability_flags():
    assert "sparse" in available_impls()  # ASTRA's CPU projectors: everywhere
    assert ("astra_cuda" in available_impls()) == cuda_available() == AstraCudaRayTransform.available()


def test_auto_picks_sparse_for_slices_and_astra_cuda_for_volumes():
    assert resolve_backend("auto", 2) == "sparse"
    assert resolve_backend(Backend.AUTO, 3) == "astra_cuda"
    assert resolve_backend("sparse", 3) == "sparse"
    op = make_ray_transform(VOLUME, PARALLEL)
    assert isinstance(op, SparseRayTransform) and op.device.type == "cpu"
    vol3 = VolumeGeometry((4, 6, 6), 0.5)
    par3 = ProjectionGeometry("parallel3d", (4, 9), angles=np.linspace(0, 3, 5), det_spacing=(0.5, 0.5))
    assert isinstance(make_ray_transform(vol3, par3, backend="sparse"), SlicewiseParallelRayTransform)


def test_make_ray_transform_errors():
    vol3 = VolumeGeometry((4, 6, 6), 1.0)
    cone = ProjectionGeometry(
        "cone", (5, 8), angles=np.linspace(0, 6, 4), det_spacing=(1.0, 1.0), source_origin=30.0, origin_det=30.0
    )
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        make_ray_transform(vol3, cone, device="cpu")
    with pytest.raises(ValueError, match="2D only"):
        make_ray_transform(vol3, cone, backend="sparse")
    with pytest.raises(ValueError, match=r"backend 'magic' unknown; valid: \['auto', 'sparse', 'astra_cuda'\]"):
        make_ray_transform(VOLUME, PARALLEL, backend="magic")
    with pytest.raises(ValueError, match="3D geometry"):
        make_ray_transform(VOLUME, cone)
    with pytest.raises(RuntimeError, match="CUDA"):
        make_ray_transform(VOLUME, PARALLEL, backend="astra_cuda", device="cpu")


class DenseRayTransform(RayTransform):
    """A toy backend: the sparse backend's matrix held dense (2D parallel beams only)."""

    geometry_kinds = ("parallel",)
    devices = ("cpu",)
    dtypes = (torch.float64,)

    @classmethod
    def from_geometry(cls, volume, geometry, *, device="cpu", dtype=torch.float64):
        return cls(SparseRayTransform(volume, geometry, dtype=torch.float64))

    def __init__(self, sparse: SparseRayTransform):
        self.image_shape, self.measurement_shape = sparse.image_shape, sparse.measurement_shape
        self.angles, self.device, self.dtype = sparse.angles, sparse.device, torch.float64
        self.volume, self.geometry = sparse.volume, sparse.geometry
        self.matrix = torch.from_numpy(sparse.matrix.toarray())

    def _forward_raw(self, x):
        return (x.reshape(x.shape[0], -1) @ self.matrix.T).reshape(x.shape[0], *self.measurement_shape)

    def _adjoint_raw(self, y):
        return (y.reshape(y.shape[0], -1) @ self.matrix).reshape(y.shape[0], *self.image_shape)

    def subset(self, angle_indices):
        return DenseRayTransform(
            SparseRayTransform(self.volume, self.geometry.subset(angle_indices), dtype=torch.float64)
        )

    def to(self, device):
        return self


def test_a_new_backend_is_one_registry_line(monkeypatch):
    monkeypatch.setitem(RAY_TRANSFORM_IMPLS, "dense", DenseRayTransform)
    assert "dense" in backend_names() and "dense" in available_impls()
    op = make_ray_transform(VOLUME, PARALLEL, backend="dense")
    assert isinstance(op, DenseRayTransform)
    x = torch.rand((2, *op.image_shape), dtype=torch.float64)
    ref = make_ray_transform(VOLUME, PARALLEL, backend="sparse", dtype=torch.float64)
    torch.testing.assert_close(op(x), ref(x))
    torch.testing.assert_close(op.subset([2, 0])(x), ref(x)[:, [2, 0]])
