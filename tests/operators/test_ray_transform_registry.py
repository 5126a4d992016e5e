"""The ray-transform registry (:data:`ctuq.registry.RAY_TRANSFORMS`) and its factory: names, availability flags,
``auto``, clear errors, and a new backend added with one registry line that passes the shipped contract."""

import math

import numpy as np
import pytest
import torch

from ctuq.config import ConfigError, load_config
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import (
    RAY_TRANSFORMS,
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
from ctuq.testing import RayTransformContract

VOLUME = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))
PARALLEL = ProjectionGeometry(
    "parallel", (41,), angles=np.linspace(0.1, math.pi + 0.1, 9, endpoint=False), det_spacing=0.45
)


def test_registry_names_match_the_backend_vocabulary():
    # The built-in backends are the vocabulary's names; data.backend validates against the registry itself. What
    # each backend declares is checked by the contract (tests/operators/test_ray_transform_contract.py).
    assert backend_names() == RAY_TRANSFORMS.choices() == values(Backend)
    assert tuple(RAY_TRANSFORMS) == tuple(v for v in values(Backend) if v != Backend.AUTO)
    assert RAY_TRANSFORMS["sparse"] is SparseRayTransform
    assert RAY_TRANSFORMS["astra_cuda"] is AstraCudaRayTransform
    with pytest.raises(TypeError, match="is not a subclass of RayTransform"):
        RAY_TRANSFORMS.register(object, name="object")
    with pytest.raises(ValueError, match="the name 'auto' is reserved"):
        RAY_TRANSFORMS.register(SparseRayTransform, name="auto")


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


@pytest.fixture
def dense_registered():
    RAY_TRANSFORMS.register(DenseRayTransform, name="dense")  # the one registry line
    yield
    RAY_TRANSFORMS.unregister("dense")


class TestDenseToyContract(RayTransformContract):
    """The toy backend passes the shipped contract (registered for the class's tests only)."""

    impl = "dense"

    @pytest.fixture(autouse=True)
    def _registered(self, dense_registered):
        yield

    def backends(self):
        return {"dense": DenseRayTransform}  # known at collection, before the fixture registers it


def test_a_new_backend_is_one_registry_line(dense_registered):
    assert "dense" in backend_names() and "dense" in available_impls()
    assert load_config("demo", ["data.backend=dense"]).data.backend == "dense"  # a value of data.backend too
    op = make_ray_transform(VOLUME, PARALLEL, backend="dense")
    assert isinstance(op, DenseRayTransform)
    x = torch.rand((2, *op.image_shape), dtype=torch.float64)
    ref = make_ray_transform(VOLUME, PARALLEL, backend="sparse", dtype=torch.float64)
    torch.testing.assert_close(op(x), ref(x))
    torch.testing.assert_close(op.subset([2, 0])(x), ref(x)[:, [2, 0]])
    RAY_TRANSFORMS.unregister("dense")
    with pytest.raises(
        ConfigError, match=r"data.backend must be one of \['auto', 'sparse', 'astra_cuda'\], got 'dense'"
    ):
        load_config("demo", ["data.backend=dense"])
