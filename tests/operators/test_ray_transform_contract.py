"""The ray-transform contract, run over every backend available on this machine (ODL's ``impl`` fixture pattern)
and over every geometry kind each backend declares (``RayTransform.geometry_kinds``).

``impl`` takes every name of :data:`ctuq.operators.RAY_TRANSFORM_IMPLS`; a backend whose availability flag is false
here (``astra_cuda`` without a CUDA device ASTRA can use) is skipped by that flag. Each test builds its operator
through :func:`ctuq.operators.make_ray_transform`, so a new backend gets the whole contract from its registry line:

* adjointness ⟨Tx, y⟩ = ⟨x, Tᵀy⟩: float64 to round-off for exact adjoints (float32 to 1e-5 relative), and to the
  backend's interpolation accuracy (3 %, smooth inputs) where ``exact_adjoint`` is false;
* a batch equals the images one by one; the flat views equal the shaped ones; autograd's backward is ``Tᵀ``;
* angle subsets: ``T.subset(idx)`` gives the rows of the full operator, and its adjoint the full adjoint of the
  zero-filled sinogram; bad index lists raise;
* agreement with ODL's ``RayTransform`` (ASTRA CPU projectors) on the same 2D parallel and fan geometries;
* bad input (wrong shapes, non-tensors, integer/complex dtypes, wrong device) raises an error naming the problem.
"""

import math
import re

import numpy as np
import odl
import pytest
import torch
from odl.applications import tomo

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import RAY_TRANSFORM_IMPLS, ShapeError, make_ray_transform


# ---------------------------------------------------------------------------------------------- geometries
def fan_vectors(angles, src, det, du, offset=0.0, tilt=0.0, jitter=None):
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


def _cases() -> dict[str, tuple[VolumeGeometry, ProjectionGeometry]]:
    """One small problem per geometry kind (name → (volume, geometry)); grids non-square and off-centre, so an
    axis swap or flip shows. Every geometry has at least 9 angles (the subset tests pick index 7)."""
    vol2 = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))
    ang = np.linspace(0.1, math.pi + 0.1, 9, endpoint=False)
    ang_full = np.linspace(0.0, 2 * math.pi, 12, endpoint=False)
    n_par, d_par, n_fan, d_fan = 41, 0.45, 48, 0.9
    par_vec = []
    for t in ang:
        ray, u = np.array([math.sin(t), -math.cos(t)]), d_par * np.array([math.cos(t), math.sin(t)])
        par_vec.append(np.concatenate([ray, 0.7 * u, u]))  # detector shifted sideways by 0.7 pixel
    jitter = np.random.default_rng(3).normal(0, 0.5, ang_full.size)
    # 3D parallel beam with one detector row per slice (rows at the slices' heights, pitch = voxel size): the
    # geometry both the slice-by-slice sparse operator and a true 3D projector accept.
    vol3 = VolumeGeometry((4, 12, 10), 0.6, (0.4, -0.9, 0.0))
    par3 = ProjectionGeometry("parallel3d", (4, 21), angles=ang, det_spacing=(0.6, 0.45))
    cone_vol = VolumeGeometry((8, 12, 14), 0.5, (0.4, -0.3, 0.2))
    cone = ProjectionGeometry(
        "cone", (10, 16), angles=ang_full, det_spacing=(0.9, 0.9), source_origin=66.0, origin_det=133.0
    )
    return {
        "parallel": (vol2, ProjectionGeometry("parallel", (n_par,), angles=ang, det_spacing=d_par)),
        "parallel_vec": (vol2, ProjectionGeometry("parallel_vec", (n_par,), vectors=np.array(par_vec))),
        "fanflat": (
            vol2,
            ProjectionGeometry(
                "fanflat", (n_fan,), angles=ang_full, det_spacing=d_fan, source_origin=40.0, origin_det=60.0
            ),
        ),
        "fanflat_vec": (
            vol2,
            ProjectionGeometry(
                "fanflat_vec",
                (n_fan,),
                vectors=fan_vectors(ang_full, 40.0, 100.0, d_fan, offset=1.3, tilt=0.04, jitter=jitter),
            ),
        ),
        "parallel3d": (vol3, par3),
        "parallel3d_vec": (vol3, par3.to_vectors()),
        "cone": (cone_vol, cone),
        "cone_vec": (cone_vol, cone.to_vectors()),
    }


CASES = _cases()


def _available(name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not RAY_TRANSFORM_IMPLS[name].available(),
        reason=f"backend {name!r} is not available on this machine (its availability flag)",
    )


def pytest_generate_tests(metafunc):
    """``impl`` over every registered backend (skipped by its availability flag); with ``case``, every geometry kind
    that backend declares, and with ``beam``, the ODL comparisons its kinds allow."""
    if "impl" not in metafunc.fixturenames:
        return
    params = []
    for name, cls in RAY_TRANSFORM_IMPLS.items():
        mark = _available(name)
        if "case" in metafunc.fixturenames:
            params += [
                pytest.param(name, case, id=f"{name}-{case}", marks=mark)
                for case, (_, geo) in CASES.items()
                if geo.kind in cls.geometry_kinds
            ]
        elif "beam" in metafunc.fixturenames:
            params += [
                pytest.param(name, beam, id=f"{name}-{beam}", marks=mark)
                for beam, kind in (("parallel", "parallel_vec"), ("fan", "fanflat_vec"))
                if kind in cls.geometry_kinds
            ]
        else:
            params.append(pytest.param(name, id=name, marks=mark))
    names = [n for n in ("impl", "case", "beam") if n in metafunc.fixturenames]
    metafunc.parametrize(",".join(names), params)


def _device(name: str) -> str:
    """The device the contract runs a backend on: the CPU where it runs there, else CUDA."""
    return "cpu" if "cpu" in RAY_TRANSFORM_IMPLS[name].devices else "cuda"


_OPS: dict = {}


def build(impl: str, case: str, dtype: torch.dtype = torch.float32):
    """The operator of ``impl`` for ``CASES[case]`` (cached: assembling costs more than most checks)."""
    key = (impl, case, dtype)
    if key not in _OPS:
        vol, geo = CASES[case]
        _OPS[key] = make_ray_transform(vol, geo, backend=impl, device=_device(impl), dtype=dtype)
    return _OPS[key]


def _first_case(impl: str) -> str:
    return next(c for c, (_, g) in CASES.items() if g.kind in RAY_TRANSFORM_IMPLS[impl].geometry_kinds)


def smooth_pair(op, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth positive image (Gaussian blobs over the grid, mm⁻¹) and a smooth positive sinogram (the projection of
    a shifted copy plus a constant), on the operator's device: what an interpolating projector handles accurately."""
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


def _random_pair(op, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *op.image_shape), generator=gen, dtype=torch.float64)
    y = torch.randn((batch, *op.measurement_shape), generator=gen, dtype=torch.float64)
    return x.to(op.device, op.dtype), y.to(op.device, op.dtype)


# ---------------------------------------------------------------------------------------------- adjointness
def test_adjointness(impl, case):
    cls = RAY_TRANSFORM_IMPLS[impl]
    if not cls.exact_adjoint:
        # The transpose only to interpolation accuracy: ~1-2 % on smooth inputs (3D cone: plus the obliquity
        # ASTRA's density weight omits).
        op = build(impl, case)
        x, y = smooth_pair(op)
        lhs = float((op(x).double() * y.double()).sum())
        rhs = float((x.double() * op.adjoint(y).double()).sum())
        assert abs(lhs - rhs) < 0.03 * abs(lhs), (lhs, rhs)
        return
    dims = tuple(range(1, 1 + len(build(impl, case).measurement_shape)))
    img_dims = tuple(range(1, 1 + len(build(impl, case).image_shape)))
    if torch.float64 in cls.dtypes:
        op = build(impl, case, torch.float64)
        x, y = _random_pair(op, 3)
        lhs = (op(x) * y).sum(dim=dims)
        rhs = (x * op.adjoint(y)).sum(dim=img_dims)
        scale = op(x).flatten(1).norm(dim=1) * y.flatten(1).norm(dim=1)
        # The float64 operator is the exact transpose to double precision.
        assert torch.all((lhs - rhs).abs() <= 1e-12 * scale), (lhs, rhs)
    op = build(impl, case)
    x, y = _random_pair(op, 3)
    lhs = (op(x) * y).sum(dim=dims)
    rhs = (x * op.adjoint(y)).sum(dim=img_dims)
    scale = op(x).flatten(1).norm(dim=1) * y.flatten(1).norm(dim=1)
    # float32: the two sums differ only by rounding (~1e-7 relative per term, random signs).
    assert torch.all((lhs - rhs).abs() <= 1e-5 * scale), (lhs, rhs)


# ---------------------------------------------------------------------------------------------- batches and views
def test_batched_equals_looped(impl, case):
    op = build(impl, case)
    x, y = smooth_pair(op)
    xb = torch.stack([x, 2 * torch.flip(x, dims=[-1]), torch.roll(x, 3, dims=-2)])
    yb = torch.stack([y, torch.flip(y, dims=[-1]), 0.5 * y])
    fwd, adj = op(xb), op.adjoint(yb)
    assert fwd.shape == (3, *op.measurement_shape) and adj.shape == (3, *op.image_shape)
    for i in range(3):
        torch.testing.assert_close(fwd[i], op(xb[i]), rtol=1e-4, atol=1e-5 * float(fwd.abs().max()))
        torch.testing.assert_close(adj[i], op.adjoint(yb[i]), rtol=1e-4, atol=1e-5 * float(adj.abs().max()))


def test_flat_views_match_shaped(impl, case):
    op = build(impl, case)
    x, y = _random_pair(op, 2)
    torch.testing.assert_close(op.forward_flat(x.reshape(2, -1)), op(x).reshape(2, -1), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(op.adjoint_flat(y.reshape(2, -1)), op.adjoint(y).reshape(2, -1), rtol=1e-6, atol=0.0)
    assert op.c == math.prod(op.measurement_shape) and op.d_x == math.prod(op.image_shape)
    assert op.n_angles == CASES[case][1].n_angles and op.ndim == CASES[case][0].ndim


def test_backward_is_adjoint(impl, case):
    op = build(impl, case)
    x, w = smooth_pair(op)
    x = x.clone().requires_grad_(True)
    (op(x) * w).sum().backward()
    expected = op.adjoint(w)
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


# ---------------------------------------------------------------------------------------------- angle subsets
def test_subset_is_row_selection(impl, case):
    op = build(impl, case)
    x, _ = smooth_pair(op)
    xb = torch.stack([x, torch.flip(x, dims=[-1])])
    full = op(xb)
    idx = [7, 0, 3, -1]
    rows = [7, 0, 3, op.n_angles - 1]
    sub = op.subset(idx)
    assert sub.measurement_shape == (4, *op.measurement_shape[1:]) and sub.image_shape == op.image_shape
    np.testing.assert_array_equal(sub.angles, op.angles[rows])
    torch.testing.assert_close(sub(xb), full[:, rows], rtol=1e-4, atol=1e-5 * float(full.abs().max()))
    # The adjoint of the subset is the full adjoint of the zero-filled sinogram.
    y = torch.rand((2, *sub.measurement_shape), generator=torch.Generator().manual_seed(1)).to(op.device, op.dtype)
    y_full = torch.zeros_like(full)
    y_full[:, rows] = y
    expected = op.adjoint(y_full)
    torch.testing.assert_close(sub.adjoint(y), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def test_subset_bad_indices_raise(impl):
    op = build(impl, _first_case(impl))
    with pytest.raises(IndexError, match="out of range"):
        op.subset([0, op.n_angles])
    with pytest.raises(IndexError, match="out of range"):
        op.subset([-op.n_angles - 1])
    with pytest.raises(ValueError, match="empty"):
        op.subset([])


# ---------------------------------------------------------------------------------------------- ODL
def _odl_to_ours(g) -> ProjectionGeometry:
    """ODL geometry → ctuq vector geometry, through ODL's own per-angle source/detector/axis positions (world
    coordinates (x0, x1) = (x, y); the detector index increases along ``det_axis``)."""
    cell = float(g.det_partition.cell_sides[0])
    rows = []
    for t in g.angles:
        first = g.src_position(t) if isinstance(g, tomo.FanBeamGeometry) else -g.det_to_src(t, 0.0)
        rows.append(np.concatenate([first, g.det_refpoint(t), g.det_axis(t) * cell]))
    kind = "fanflat_vec" if isinstance(g, tomo.FanBeamGeometry) else "parallel_vec"
    return ProjectionGeometry(kind, (g.det_partition.shape[0],), vectors=np.array(rows))


# The sparse backend uses the same ASTRA CPU projector (linear / line_fanflat) on the same rays as ODL's
# ``astra_cpu``: equal up to float32 rounding, on any image. Other backends interpolate differently (ASTRA CUDA's
# texture-interpolated rays): a few per cent on a smooth image (the default entry).
ODL_REFERENCE = {"sparse": ("random", 1e-4)}


def test_matches_odl_ray_transform(impl, beam):
    n, half = 32, 6.4
    space = odl.uniform_discr([-half, -half], [half, half], (n, n), dtype="float32")
    if beam == "parallel":
        g = tomo.Parallel2dGeometry(odl.uniform_partition(0, math.pi, 15), odl.uniform_partition(-9, 9, 45))
    else:
        g = tomo.FanBeamGeometry(
            odl.uniform_partition(0, 2 * math.pi, 20),
            odl.uniform_partition(-20, 20, 50),
            src_radius=30.0,
            det_radius=40.0,
        )
    odl_op = tomo.RayTransform(space, g, impl="astra_cpu")
    ours = make_ray_transform(VolumeGeometry((n, n), 2 * half / n), _odl_to_ours(g), backend=impl, device=_device(impl))
    image, tolerance = ODL_REFERENCE.get(impl, ("smooth", 0.03))
    # ODL arrays are indexed (x0, x1) = (x, y); ours (row, col) = (y, x): ours = odl.T.
    if image == "random":
        x = np.random.default_rng(0).random((n, n)).astype(np.float32)
    else:
        yy, xx = np.meshgrid(*ours.volume.pixel_centers(), indexing="ij")
        blobs = [(-2.0, 1.5, 1.5, 0.02), (2.5, -1.0, 1.0, 0.01)]
        x = sum(a * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * w * w)) for cx, cy, w, a in blobs).T
        x = x.astype(np.float32)
    x[: n // 4, :] = 0.0  # asymmetric in x0 so that a transposition error shows
    y_odl = odl_op(space.element(x)).data
    y_ours = ours(torch.from_numpy(np.ascontiguousarray(x.T)).to(ours.device)).cpu().numpy()
    assert np.linalg.norm(y_odl - y_ours) <= tolerance * np.linalg.norm(y_odl)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_input_errors_name_the_problem(impl, case):
    op = build(impl, case)
    bad = tuple(s + 1 for s in op.image_shape)
    expected = re.escape(f"{bad}; expected {op.image_shape}")
    with pytest.raises(ShapeError, match=r"image has shape " + expected):
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
    # Another floating dtype is cast, and the result is the operator's dtype.
    other = torch.float64 if op.dtype == torch.float32 else torch.float32
    assert op(torch.zeros(op.image_shape, dtype=other, device=op.device)).dtype == op.dtype
