"""The ray-transform contract (:class:`RayTransformContract`, its checks in its docstring), the geometry kinds a
backend may declare (:data:`GEOMETRY_KINDS`) and one small problem per kind (:func:`contract_geometries`)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import RayTransform, ShapeError, make_ray_transform
from ctuq.registry import RAY_TRANSFORMS

__all__ = ["GEOMETRY_KINDS", "contract_geometries", "RayTransformContract"]


#: The geometry kinds a ray-transform backend may declare (:attr:`ctuq.operators.RayTransform.geometry_kinds`).
GEOMETRY_KINDS = (
    "parallel",
    "parallel_vec",
    "fanflat",
    "fanflat_vec",
    "parallel3d",
    "parallel3d_vec",
    "cone",
    "cone_vec",
)


def _fan_vectors(angles, src: float, det: float, du: float, offset: float = 0.0, tilt: float = 0.0, jitter=None):
    """Walnut-like ``fanflat_vec`` rows: source at ``src`` mm, detector ``det`` mm from the source, sideways detector
    offset (mm), in-plane tilt (rad) and per-view source-distance jitter (mm)."""
    rows = []
    for i, b in enumerate(angles):
        e = np.array([math.cos(b), math.sin(b)])
        p = np.array([-math.sin(b), math.cos(b)])
        s = (src + (0.0 if jitter is None else jitter[i])) * e
        d = s - det * e + offset * p
        rows.append(np.concatenate([s, d, du * (math.cos(tilt) * p - math.sin(tilt) * e)]))
    return np.array(rows)


def contract_geometries() -> dict[str, tuple[VolumeGeometry, ProjectionGeometry]]:
    """One small problem per geometry kind, ``case name → (volume, geometry)`` (mm): grids non-square and
    off-centre, so that an axis swap or flip shows; every geometry has at least 9 angles (the subset checks pick
    index 7); the 3D parallel beam has one detector row per slice (rows at the slices' heights, pitch = voxel size),
    the geometry both a slice-by-slice operator and a true 3D projector accept."""
    vol2 = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))
    ang = np.linspace(0.1, math.pi + 0.1, 9, endpoint=False)
    ang_full = np.linspace(0.0, 2 * math.pi, 12, endpoint=False)
    n_par, d_par, n_fan, d_fan = 41, 0.45, 48, 0.9
    par_vec = []
    for t in ang:
        ray, u = np.array([math.sin(t), -math.cos(t)]), d_par * np.array([math.cos(t), math.sin(t)])
        par_vec.append(np.concatenate([ray, 0.7 * u, u]))  # detector shifted sideways by 0.7 pixel
    jitter = np.random.default_rng(3).normal(0, 0.5, ang_full.size)
    vol3 = VolumeGeometry((4, 12, 10), 0.6, (0.4, -0.9, 0.0))
    par3 = ProjectionGeometry("parallel3d", (4, 21), angles=ang, det_spacing=(0.6, 0.45))
    cone_vol = VolumeGeometry((8, 12, 14), 0.5, (0.4, -0.3, 0.2))
    cone = ProjectionGeometry(
        "cone", (10, 16), angles=ang_full, det_spacing=(0.9, 0.9), source_origin=66.0, origin_det=133.0
    )
    fan = ProjectionGeometry(
        "fanflat", (n_fan,), angles=ang_full, det_spacing=d_fan, source_origin=40.0, origin_det=60.0
    )
    fan_vec = _fan_vectors(ang_full, 40.0, 100.0, d_fan, offset=1.3, tilt=0.04, jitter=jitter)
    return {
        "parallel": (vol2, ProjectionGeometry("parallel", (n_par,), angles=ang, det_spacing=d_par)),
        "parallel_vec": (vol2, ProjectionGeometry("parallel_vec", (n_par,), vectors=np.array(par_vec))),
        "fanflat": (vol2, fan),
        "fanflat_vec": (vol2, ProjectionGeometry("fanflat_vec", (n_fan,), vectors=fan_vec)),
        "parallel3d": (vol3, par3),
        "parallel3d_vec": (vol3, par3.to_vectors()),
        "cone": (cone_vol, cone),
        "cone_vec": (cone_vol, cone.to_vectors()),
    }


_RAY_TRANSFORM_CASES: dict[str, tuple[VolumeGeometry, ProjectionGeometry]] = {}


_RAY_TRANSFORMS_BUILT: dict[tuple, RayTransform] = {}


class RayTransformContract:
    """The ray-transform contract (ODL's ``impl`` fixture pattern): every check runs for each backend of
    :meth:`backends` over every case of :meth:`geometries` whose geometry kind the backend declares
    (``geometry_kinds``), skipped where the backend's availability flag is false.

    Subclass and set :attr:`impl` to a registry name (register the backend with one line,
    ``RAY_TRANSFORMS.register(MyRayTransform, name="mine")``), or leave it ``None`` to check every registered
    backend; operators are built by name through :func:`ctuq.operators.make_ray_transform` (override
    :meth:`make_operator` otherwise). Checked:

    * the class facts a backend declares (geometry kinds, devices, dtypes, ``auto_ndims``, the availability flag);
    * shapes, dtypes and devices: an operator of every declared dtype computes in it, on a declared device;
    * adjointness ``⟨Tx, y⟩ = ⟨x, Tᵀy⟩``: to round-off for exact adjoints (float64 ``1e-12``, float32 ``1e-5``
      relative), to :attr:`inexact_adjoint_rtol` on smooth inputs where ``exact_adjoint`` is false;
    * the dense matrix: ``T`` assembled column by column reproduces ``T x`` and ``Tᵀ y`` on random batches, and an
      exact adjoint's matrix is the transpose of the forward one;
    * batches equal the images one by one; the flat views equal the shaped ones; autograd's backward is ``Tᵀ``;
    * angle subsets: rows of the full operator, adjoint of the zero-filled sinogram, bad index lists refused;
    * bad input (wrong shapes, non-tensors, integer/complex dtypes, another device) raises an error naming it.
    """

    impl: str | None = None
    """Registry name of the backend under test; ``None``: every backend in :data:`ctuq.registry.RAY_TRANSFORMS`."""
    inexact_adjoint_rtol: float = 0.03
    """``|⟨Tx, y⟩ − ⟨x, Tᵀy⟩| / |⟨Tx, y⟩|`` on smooth positive inputs where ``exact_adjoint`` is false (ASTRA's
    voxel-driven back-projection is the transpose of its ray-driven projection to ~1–3 %)."""

    # ------------------------------------------------------------------------------------------ what is checked
    def backends(self) -> dict[str, type[RayTransform]]:
        """Name → class of the backends under test (:attr:`impl`, or every registered one)."""
        if self.impl is None:
            return dict(RAY_TRANSFORMS.items())
        return {self.impl: RAY_TRANSFORMS[self.impl]}

    def geometries(self) -> dict[str, tuple[VolumeGeometry, ProjectionGeometry]]:
        """Case name → ``(volume, geometry)`` (default: :func:`contract_geometries`, built once)."""
        if not _RAY_TRANSFORM_CASES:
            _RAY_TRANSFORM_CASES.update(contract_geometries())
        return _RAY_TRANSFORM_CASES

    def device(self, impl: str) -> str:
        """The device a backend is checked on: the CPU where it runs there, else CUDA."""
        return "cpu" if "cpu" in self.backends()[impl].devices else "cuda"

    def make_operator(self, impl: str, case: str, dtype: torch.dtype = torch.float32) -> RayTransform:
        """The operator of backend ``impl`` for the case ``case`` (built by name; cached, since assembling costs
        more than most checks)."""
        key = (self.backends()[impl], impl, case, dtype)
        if key not in _RAY_TRANSFORMS_BUILT:
            vol, geo = self.geometries()[case]
            _RAY_TRANSFORMS_BUILT[key] = make_ray_transform(
                vol, geo, backend=impl, device=self.device(impl), dtype=dtype
            )
        return _RAY_TRANSFORMS_BUILT[key]

    def pytest_generate_tests(self, metafunc):
        """``impl`` over :meth:`backends` (skipped by their availability flags); with ``case``, every case whose
        geometry kind the backend declares."""
        if "impl" not in metafunc.fixturenames:
            return
        params = []
        for name, cls in self.backends().items():
            mark = pytest.mark.skipif(
                not cls.available(), reason=f"backend {name!r} is not available on this machine (its flag)"
            )
            if "case" in metafunc.fixturenames:
                params += [
                    pytest.param(name, case, id=f"{name}-{case}", marks=mark)
                    for case, (_, geo) in self.geometries().items()
                    if geo.kind in cls.geometry_kinds
                ]
            else:
                params.append(pytest.param(name, id=name, marks=mark))
        metafunc.parametrize("impl,case" if "case" in metafunc.fixturenames else "impl", params)

    # ------------------------------------------------------------------------------------------ inputs
    def _first_case(self, impl: str) -> str:
        kinds = self.backends()[impl].geometry_kinds
        return next(c for c, (_, g) in self.geometries().items() if g.kind in kinds)

    @staticmethod
    def smooth_pair(op: RayTransform, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A smooth positive image (Gaussian blobs over the grid, mm⁻¹) and a smooth positive sinogram (the
        projection of a shifted copy plus a constant), on the operator's device: what an interpolating projector
        handles accurately."""
        centres = op.volume.pixel_centers()
        grids = np.meshgrid(*centres, indexing="ij")
        rng = np.random.default_rng(seed)
        img = np.zeros(op.image_shape)
        half = [0.5 * (c[-1] - c[0]) for c in centres]
        for _ in range(3):
            c = [np.mean(ci) + 0.4 * h * rng.uniform(-1, 1) for ci, h in zip(centres, half)]
            width = 0.3 * min(half)
            img += rng.uniform(0.01, 0.02) * np.exp(-sum((g - ci) ** 2 for g, ci in zip(grids, c)) / (2 * width**2))
        x = torch.tensor(img, dtype=op.dtype, device=op.device)
        y = op(torch.roll(x, shifts=2, dims=-1)) + 0.1
        return x, y

    @staticmethod
    def random_pair(op: RayTransform, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard normal images ``(batch, *image_shape)`` and sinograms ``(batch, *measurement_shape)`` in the
        operator's dtype, on its device."""
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *op.image_shape), generator=gen, dtype=torch.float64)
        y = torch.randn((batch, *op.measurement_shape), generator=gen, dtype=torch.float64)
        return x.to(op.device, op.dtype), y.to(op.device, op.dtype)

    # ------------------------------------------------------------------------------------------ class facts
    def test_class_facts(self, impl):
        cls = self.backends()[impl]
        assert isinstance(cls, type) and issubclass(cls, RayTransform), impl
        assert cls.geometry_kinds and set(cls.geometry_kinds) <= set(GEOMETRY_KINDS), cls.geometry_kinds
        assert cls.devices and set(cls.devices) <= {"cpu", "cuda"}, cls.devices
        assert cls.dtypes and set(cls.dtypes) <= {torch.float32, torch.float64}, cls.dtypes
        assert set(cls.auto_ndims) <= {2, 3} and isinstance(cls.exact_adjoint, bool)
        assert isinstance(cls.available(), bool)

    def test_shapes_dtypes_and_devices(self, impl, case):
        cls = self.backends()[impl]
        vol, geo = self.geometries()[case]
        for dtype in cls.dtypes:
            op = self.make_operator(impl, case, dtype)
            assert op.dtype == dtype and op.device.type in cls.devices
            assert op.image_shape == tuple(vol.shape) and op.n_angles == geo.n_angles and op.ndim == vol.ndim
            assert op.c == math.prod(op.measurement_shape) and op.d_x == math.prod(op.image_shape)
            x, y = self.random_pair(op, 2)
            fwd, adj = op(x), op.adjoint(y)
            assert fwd.shape == (2, *op.measurement_shape) and adj.shape == (2, *op.image_shape)
            assert fwd.dtype == adj.dtype == dtype and fwd.device == adj.device == op.device
            assert op(x[0]).shape == tuple(op.measurement_shape)  # no batch dimension in, none out

    # ------------------------------------------------------------------------------------------ adjointness
    def test_adjointness(self, impl, case):
        cls = self.backends()[impl]
        if not cls.exact_adjoint:
            op = self.make_operator(impl, case)
            x, y = self.smooth_pair(op)
            lhs = float((op(x).double() * y.double()).sum())
            rhs = float((x.double() * op.adjoint(y).double()).sum())
            assert abs(lhs - rhs) < self.inexact_adjoint_rtol * abs(lhs), (lhs, rhs)
            return
        for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            if dtype not in cls.dtypes:
                continue
            op = self.make_operator(impl, case, dtype)
            x, y = self.random_pair(op, 3)
            dims = tuple(range(1, 1 + len(op.measurement_shape)))
            img_dims = tuple(range(1, 1 + len(op.image_shape)))
            lhs = (op(x) * y).sum(dim=dims)
            rhs = (x * op.adjoint(y)).sum(dim=img_dims)
            scale = op(x).flatten(1).norm(dim=1) * y.flatten(1).norm(dim=1)
            # float64: the exact transpose to double precision; float32: the sums differ by rounding only
            assert torch.all((lhs - rhs).abs() <= rtol * scale), (dtype, lhs, rhs)

    def test_dense_matrix(self, impl, case):
        cls = self.backends()[impl]
        dtype = torch.float64 if torch.float64 in cls.dtypes else torch.float32
        op = self.make_operator(impl, case, dtype)
        eye_x = torch.eye(op.d_x, dtype=dtype, device=op.device)
        eye_y = torch.eye(op.c, dtype=dtype, device=op.device)
        M = torch.cat([op.forward_flat(eye_x[i : i + 128]) for i in range(0, op.d_x, 128)]).T  # (c, d_x)
        A = torch.cat([op.adjoint_flat(eye_y[i : i + 128]) for i in range(0, op.c, 128)]).T  # (d_x, c)
        rtol = 1e-10 if dtype == torch.float64 else 1e-4
        x, y = self.random_pair(op, 3, seed=5)
        for got, want in (
            (op.forward_flat(x.flatten(1)), x.flatten(1) @ M.T),
            (op.adjoint_flat(y.flatten(1)), y.flatten(1) @ A.T),
        ):
            assert float((got - want).norm()) <= rtol * float(want.norm()), float((got - want).norm() / want.norm())
        if cls.exact_adjoint:
            # the adjoint's matrix is the forward matrix's transpose, entry by entry
            assert float((A - M.T).norm()) <= rtol * float(M.norm()), float((A - M.T).norm() / M.norm())

    # ------------------------------------------------------------------------------------------ batches and views
    def test_batched_equals_looped(self, impl, case):
        op = self.make_operator(impl, case)
        x, y = self.smooth_pair(op)
        xb = torch.stack([x, 2 * torch.flip(x, dims=[-1]), torch.roll(x, 3, dims=-2)])
        yb = torch.stack([y, torch.flip(y, dims=[-1]), 0.5 * y])
        fwd, adj = op(xb), op.adjoint(yb)
        assert fwd.shape == (3, *op.measurement_shape) and adj.shape == (3, *op.image_shape)
        for i in range(3):
            torch.testing.assert_close(fwd[i], op(xb[i]), rtol=1e-4, atol=1e-5 * float(fwd.abs().max()))
            torch.testing.assert_close(adj[i], op.adjoint(yb[i]), rtol=1e-4, atol=1e-5 * float(adj.abs().max()))

    def test_flat_views_match_shaped(self, impl, case):
        op = self.make_operator(impl, case)
        x, y = self.random_pair(op, 2)
        torch.testing.assert_close(op.forward_flat(x.reshape(2, -1)), op(x).reshape(2, -1), rtol=1e-6, atol=0.0)
        torch.testing.assert_close(op.adjoint_flat(y.reshape(2, -1)), op.adjoint(y).reshape(2, -1), rtol=1e-6, atol=0.0)

    def test_backward_is_adjoint(self, impl, case):
        op = self.make_operator(impl, case)
        x, w = self.smooth_pair(op)
        x = x.clone().requires_grad_(True)
        (op(x) * w).sum().backward()
        expected = op.adjoint(w)
        torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))

    # ------------------------------------------------------------------------------------------ angle subsets
    def test_subset_is_row_selection(self, impl, case):
        op = self.make_operator(impl, case)
        x, _ = self.smooth_pair(op)
        xb = torch.stack([x, torch.flip(x, dims=[-1])])
        full = op(xb)
        idx = [7, 0, 3, -1]
        rows = [7, 0, 3, op.n_angles - 1]
        sub = op.subset(idx)
        assert sub.measurement_shape == (4, *op.measurement_shape[1:]) and sub.image_shape == op.image_shape
        np.testing.assert_array_equal(sub.angles, op.angles[rows])
        torch.testing.assert_close(sub(xb), full[:, rows], rtol=1e-4, atol=1e-5 * float(full.abs().max()))
        # the adjoint of the subset is the full adjoint of the zero-filled sinogram
        gen = torch.Generator().manual_seed(1)
        y = torch.rand((2, *sub.measurement_shape), generator=gen).to(op.device, op.dtype)
        y_full = torch.zeros_like(full)
        y_full[:, rows] = y
        expected = op.adjoint(y_full)
        torch.testing.assert_close(sub.adjoint(y), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))

    def test_subset_bad_indices_raise(self, impl):
        op = self.make_operator(impl, self._first_case(impl))
        with pytest.raises(IndexError, match="out of range"):
            op.subset([0, op.n_angles])
        with pytest.raises(IndexError, match="out of range"):
            op.subset([-op.n_angles - 1])
        with pytest.raises(ValueError, match="empty"):
            op.subset([])

    # ------------------------------------------------------------------------------------------ bad input
    def test_bad_input_errors_name_the_problem(self, impl, case):
        op = self.make_operator(impl, case)
        bad = tuple(s + 1 for s in op.image_shape)
        with pytest.raises(ShapeError, match=r"image has shape " + re.escape(f"{bad}; expected {op.image_shape}")):
            op(torch.zeros(bad, device=op.device))
        bad_y = (3, *op.measurement_shape[:-1], op.measurement_shape[-1] - 1)
        with pytest.raises(ShapeError, match=r"sinogram has shape " + re.escape(str(bad_y))):
            op.adjoint(torch.zeros(bad_y, device=op.device))
        with pytest.raises(ShapeError, match=r"forward_flat: expected \(batch, " + str(op.d_x)):
            op.forward_flat(torch.zeros(2, op.d_x - 1, device=op.device))
        with pytest.raises(ShapeError, match=r"adjoint_flat: expected \(batch, " + str(op.c)):
            op.adjoint_flat(torch.zeros(op.c, device=op.device))
        with pytest.raises(TypeError, match="torch.Tensor"):
            op(np.zeros(op.image_shape))
        with pytest.raises(TypeError, match="int64"):
            op(torch.zeros(op.image_shape, dtype=torch.int64, device=op.device))
        with pytest.raises(TypeError, match="complex64"):
            op(torch.zeros(op.image_shape, dtype=torch.complex64, device=op.device))
        with pytest.raises(ValueError, match="lives on .* but the image is on meta"):
            op(torch.zeros(op.image_shape, device="meta"))
        # another floating dtype is cast, and the result is the operator's dtype
        other = torch.float64 if op.dtype == torch.float32 else torch.float32
        assert op(torch.zeros(op.image_shape, dtype=other, device=op.device)).dtype == op.dtype
