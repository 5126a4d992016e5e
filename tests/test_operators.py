"""The ray-transform interface and the sparse 2D backend: adjointness, agreement with ODL, physical units,
orientation (ctuq's coordinate convention), angle subsets, autograd, and clear errors."""

import math

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import ShapeError, SparseRayTransform, make_ray_transform
from ctuq.operators.sparse import assemble_matrix


# ---------------------------------------------------------------------------------------------- geometries
def fan_vectors(angles, src=66.0, det=199.0, n_det=64, du=0.8976, offset=0.0, tilt=0.0, jitter=None):
    """Walnut-like ``fanflat_vec`` vectors: source at ``src`` mm, detector ``det`` mm from the source, optional
    sideways detector offset (mm), in-plane tilt (rad) and per-view source-distance jitter (mm)."""
    rows = []
    for i, b in enumerate(angles):
        e = np.array([math.cos(b), math.sin(b)])
        p = np.array([-math.sin(b), math.cos(b)])
        r = src + (0.0 if jitter is None else jitter[i])
        s = r * e
        d = s - det * e + offset * p
        u = du * (math.cos(tilt) * p - math.sin(tilt) * e)
        rows.append(np.concatenate([s, d, u]))
    return np.array(rows)


def geometries(refine: int = 1):
    """Small 2D geometries of every kind the sparse backend supports (name → geometry); ``refine`` divides the
    detector pixels (same detector width)."""
    ang = np.linspace(0.1, math.pi + 0.1, 9, endpoint=False)
    ang_full = np.linspace(0.0, 2 * math.pi, 12, endpoint=False)
    n_par, d_par = 40 * refine + 1, 0.45 / refine
    n_fan, d_fan = 48 * refine, 0.9 / refine
    par = ProjectionGeometry("parallel", (n_par,), angles=ang, det_spacing=d_par)
    rng = np.random.default_rng(3)
    par_vec_rows = []
    for t in ang:
        ray = np.array([math.sin(t), -math.cos(t)])
        u = d_par * np.array([math.cos(t), math.sin(t)])
        par_vec_rows.append(np.concatenate([ray, 0.7 * u, u]))  # detector shifted sideways by 0.7 pixel
    return {
        "parallel": par,
        "parallel_vec": ProjectionGeometry("parallel_vec", (n_par,), vectors=np.array(par_vec_rows)),
        "fanflat": ProjectionGeometry("fanflat", (n_fan,), angles=ang_full, det_spacing=d_fan, source_origin=40.0,
                                      origin_det=60.0),
        "fanflat_vec": ProjectionGeometry(
            "fanflat_vec", (n_fan,),
            vectors=fan_vectors(ang_full, src=40.0, det=100.0, n_det=n_fan, du=d_fan, offset=1.3, tilt=0.04,
                                jitter=rng.normal(0, 0.5, ang_full.size)),
        ),
    }


VOLUME = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))  # non-square, off-centre: catches axis swaps


@pytest.fixture(scope="module")
def ops():
    return {name: SparseRayTransform(VOLUME, g) for name, g in geometries().items()}


# ---------------------------------------------------------------------------------------------- adjointness
@pytest.mark.parametrize("name", ["parallel", "parallel_vec", "fanflat", "fanflat_vec"])
def test_adjoint_identity_batched(ops, name):
    op = ops[name]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, *op.image_shape), generator=gen)
    y = torch.randn((3, *op.measurement_shape), generator=gen)
    lhs = (op(x) * y).sum(dim=(1, 2))
    rhs = (x * op.adjoint(y)).sum(dim=(1, 2))
    scale = op(x).flatten(1).norm(dim=1) * y.flatten(1).norm(dim=1)
    # float32: the two sums differ only by rounding (~1e-7 relative per term, random signs).
    assert torch.all((lhs - rhs).abs() <= 1e-5 * scale), (lhs, rhs)
    # The float64 operator is the exact transpose to double precision.
    op64 = SparseRayTransform(VOLUME, op.geometry, dtype=torch.float64, matrix=op.matrix)
    x64, y64 = x.double(), y.double()
    lhs64 = (op64(x64) * y64).sum(dim=(1, 2))
    rhs64 = (x64 * op64.adjoint(y64)).sum(dim=(1, 2))
    assert torch.allclose(lhs64, rhs64, rtol=0, atol=1e-12 * float(scale.max()))


def test_flat_views_match_shaped(ops):
    op = ops["fanflat"]
    x = torch.rand((2, *op.image_shape))
    assert torch.equal(op.forward_flat(x.reshape(2, -1)), op(x).reshape(2, -1))
    y = torch.rand((2, *op.measurement_shape))
    assert torch.equal(op.adjoint_flat(y.reshape(2, -1)), op.adjoint(y).reshape(2, -1))
    assert op.c == op.n_angles * op.measurement_shape[1] and op.d_x == 24 * 20


# ---------------------------------------------------------------------------------------------- ODL
def _odl_to_ours(g):
    """ODL geometry → ctuq vector geometry, through ODL's own per-angle source/detector/axis positions (world
    coordinates (x0, x1) = (x, y); the detector index increases along ``det_axis``)."""
    from odl.applications import tomo

    cell = float(g.det_partition.cell_sides[0])
    rows = []
    for t in g.angles:
        first = g.src_position(t) if isinstance(g, tomo.FanBeamGeometry) else -g.det_to_src(t, 0.0)
        rows.append(np.concatenate([first, g.det_refpoint(t), g.det_axis(t) * cell]))
    kind = "fanflat_vec" if isinstance(g, tomo.FanBeamGeometry) else "parallel_vec"
    return ProjectionGeometry(kind, (g.det_partition.shape[0],), vectors=np.array(rows))


@pytest.mark.parametrize("beam", ["parallel", "fan"])
def test_sparse_matches_odl_ray_transform(beam):
    odl = pytest.importorskip("odl")
    from odl.applications import tomo

    n, half = 32, 6.4
    space = odl.uniform_discr([-half, -half], [half, half], (n, n), dtype="float32")
    if beam == "parallel":
        g = tomo.Parallel2dGeometry(odl.uniform_partition(0, math.pi, 15), odl.uniform_partition(-9, 9, 45))
    else:
        g = tomo.FanBeamGeometry(odl.uniform_partition(0, 2 * math.pi, 20), odl.uniform_partition(-20, 20, 50),
                                 src_radius=30.0, det_radius=40.0)
    odl_op = tomo.RayTransform(space, g, impl="astra_cpu")
    ours = SparseRayTransform(VolumeGeometry((n, n), 2 * half / n), _odl_to_ours(g))
    # ODL arrays are indexed (x0, x1) = (x, y); ours (row, col) = (y, x): ours = odl.T.
    x = np.random.default_rng(0).random((n, n)).astype(np.float32)
    x[: n // 4, :] = 0.0  # asymmetric in x0 so that a transposition error shows
    y_odl = odl_op(space.element(x)).data
    y_ours = ours(torch.from_numpy(np.ascontiguousarray(x.T))).numpy()
    # Same ASTRA projector (linear / line_fanflat) on the same rays: equal up to float32 rounding.
    assert np.linalg.norm(y_odl - y_ours) <= 1e-4 * np.linalg.norm(y_odl)


# ---------------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("kind", ["parallel", "fanflat"])
def test_disc_central_value_is_chord_length(kind):
    r, mu, h = 8.0, 0.02, 0.25
    vol = VolumeGeometry((80, 80), h)
    if kind == "parallel":
        g = ProjectionGeometry("parallel", (61,), angles=np.linspace(0, math.pi, 6, endpoint=False), det_spacing=0.5)
    else:
        g = ProjectionGeometry("fanflat", (61,), angles=np.linspace(0, 2 * math.pi, 6, endpoint=False),
                               det_spacing=1.0, source_origin=66.0, origin_det=133.0)
    # Pixel-average (8×8 supersampled) disc of radius r mm and attenuation mu mm⁻¹ at the origin.
    sub = (np.arange(8) + 0.5) / 8 - 0.5
    yc, xc = vol.pixel_centers()
    img = np.zeros(vol.shape)
    for oy in sub:
        for ox in sub:
            yy, xx = np.meshgrid(yc + oy * h, xc + ox * h, indexing="ij")
            img += (xx**2 + yy**2 <= r * r)
    img *= mu / 64
    y = SparseRayTransform(vol, g)(torch.tensor(img, dtype=torch.float32))
    # The central detector pixel (odd count, centred detector) sees the ray through the disc centre: 2 r mu mm.
    central = y[:, 30].numpy()
    np.testing.assert_allclose(central, 2 * r * mu, rtol=0.01)


# ---------------------------------------------------------------------------------------------- orientation
def _predicted_column(g: ProjectionGeometry, point: np.ndarray) -> np.ndarray:
    """Fractional detector index (per angle) where the ray through ``point`` (x, y) meets the detector, from
    ``detector_centers()`` and ``sources()`` / ``ray_directions()`` only."""
    centers = g.detector_centers()  # (A, n_det, 2)
    d0, step = centers[:, 0], centers[:, 1] - centers[:, 0]
    out = []
    for a in range(g.n_angles):
        direction = g.ray_directions()[a] if g.is_parallel else point - g.sources()[a]
        # point + t·direction = d0 + k·step  →  solve for k.
        m = np.stack([direction, -step[a]], axis=1)
        _, k = np.linalg.solve(m, d0[a] - point)
        out.append(k)
    return np.array(out)


@pytest.mark.parametrize("name", ["parallel", "parallel_vec", "fanflat", "fanflat_vec"])
def test_bright_pixel_lands_on_predicted_detector_pixel(name):
    # Detector pixels 4× finer than usual, so that one image pixel covers ~5–7 of them and the centre of mass of
    # its footprint locates it to a small fraction of a detector pixel.
    op = SparseRayTransform(VOLUME, geometries(refine=4)[name])
    n_det = op.measurement_shape[1]
    yc, xc = VOLUME.pixel_centers()
    for i, j in [(20, 3), (2, 16), (12, 10)]:
        x = torch.zeros(op.image_shape)
        x[i, j] = 1.0  # row index ↔ y, column index ↔ x (ctuq's convention)
        y = op(x).numpy()
        pred = _predicted_column(op.geometry, np.array([xc[j], yc[i]]))
        seen = (pred > 4) & (pred < n_det - 5)  # footprint fully on the detector
        assert seen.sum() >= 6
        com = (y * np.arange(n_det)).sum(1) / np.maximum(y.sum(1), 1e-12)
        # Within 0.3 detector pixel (0.03–0.07 mm; fan beams: a perspective footprint's centre of mass is not
        # the projection of the pixel centre, ≲ 0.2 px here); a flip or swap of x/y moves it by tens of pixels.
        np.testing.assert_allclose(com[seen], pred[seen], atol=0.3)


def test_row_index_increases_with_y():
    # Parallel beam at 90°: ASTRA's rays run along +x and the detector axis u = (0, 1) points along +y,
    # so a pixel higher up (larger row index = larger y) lands on a larger detector index.
    vol = VolumeGeometry((16, 16), 1.0)
    g = ProjectionGeometry("parallel", (21,), angles=np.array([math.pi / 2]), det_spacing=1.0)
    op = SparseRayTransform(vol, g)
    low, high = torch.zeros(16, 16), torch.zeros(16, 16)
    low[2, 8], high[13, 8] = 1.0, 1.0
    assert int(op(high)[0].argmax()) - int(op(low)[0].argmax()) == 11


# ---------------------------------------------------------------------------------------------- subsets
def test_subset_is_row_selection(ops):
    op = ops["fanflat_vec"]
    x = torch.rand((2, *op.image_shape))
    full = op(x)
    idx = [7, 0, 3, -1]
    sub = op.subset(idx)
    assert sub.measurement_shape == (4, op.measurement_shape[1])
    expected = full[:, [7, 0, 3, op.n_angles - 1]]
    assert torch.allclose(sub(x), expected, rtol=0, atol=1e-6 * float(full.abs().max()))
    np.testing.assert_allclose(sub.geometry.vectors, op.geometry.vectors[[7, 0, 3, -1]])
    y = torch.rand((2, 4, op.measurement_shape[1]))
    # The adjoint of the subset is the full adjoint of the zero-filled sinogram.
    y_full = torch.zeros_like(full)
    y_full[:, [7, 0, 3, op.n_angles - 1]] = y
    assert torch.allclose(sub.adjoint(y), op.adjoint(y_full), atol=1e-5)


def test_subset_bad_indices_raise(ops):
    op = ops["parallel"]
    with pytest.raises(IndexError, match="out of range"):
        op.subset([0, op.n_angles])
    with pytest.raises(IndexError, match="out of range"):
        op.subset([-op.n_angles - 1])
    with pytest.raises(ValueError, match="empty"):
        op.subset([])


# ---------------------------------------------------------------------------------------------- autograd
def test_gradcheck_forward_and_adjoint():
    vol = VolumeGeometry((6, 5), 1.0)
    g = ProjectionGeometry("fanflat", (9,), angles=np.linspace(0, 2 * math.pi, 4, endpoint=False),
                           det_spacing=1.5, source_origin=20.0, origin_det=20.0)
    op = SparseRayTransform(vol, g, dtype=torch.float64)
    x = torch.rand((2, 6, 5), dtype=torch.float64, requires_grad=True)
    y = torch.rand((2, 4, 9), dtype=torch.float64, requires_grad=True)
    # fast_mode: checks random projections of the Jacobian (each sparse product costs ms under thread contention).
    assert torch.autograd.gradcheck(op.forward, (x,), fast_mode=True)
    assert torch.autograd.gradcheck(op.adjoint, (y,), fast_mode=True)
    assert torch.autograd.gradgradcheck(op.forward, (x,), fast_mode=True)
    # Forward mode: T is linear, so its JVP is T applied to the tangent.
    xd = torch.rand((2, 6, 5), dtype=torch.float64)
    out, tangent = torch.func.jvp(op.forward, (x.detach(),), (xd,))
    assert torch.allclose(out, op(x.detach())) and torch.allclose(tangent, op(xd))
    _, tangent_adj = torch.func.jvp(op.adjoint, (y.detach(),), (y.detach(),))
    assert torch.allclose(tangent_adj, op.adjoint(y.detach()))
    # torch.func.vmap folds the mapped dimension into the batch; jacrev/jacfwd recover the matrix itself.
    assert torch.allclose(torch.func.vmap(op.forward)(x.detach()[:, None]), op(x.detach())[:, None])
    jac = torch.func.jacfwd(op.forward)(x.detach()[0]).reshape(op.c, op.d_x).numpy()
    np.testing.assert_allclose(jac, op.matrix.toarray(), atol=1e-12)
    jac_t = torch.func.jacrev(op.adjoint)(y.detach()[0]).reshape(op.d_x, op.c).numpy()
    np.testing.assert_allclose(jac_t, op.matrix.T.toarray(), atol=1e-12)


def test_backward_is_adjoint(ops):
    op = ops["parallel"]
    x = torch.rand(op.image_shape, requires_grad=True)
    w = torch.rand(op.measurement_shape)
    (op(x) * w).sum().backward()
    assert torch.allclose(x.grad, op.adjoint(w), atol=1e-6)


# ---------------------------------------------------------------------------------------------- errors
def test_shape_dtype_device_errors(ops):
    op = ops["fanflat"]
    with pytest.raises(ShapeError, match=r"\(20, 24\).*expected \(24, 20\)"):
        op(torch.zeros(20, 24))
    with pytest.raises(ShapeError, match="sinogram"):
        op.adjoint(torch.zeros(3, 12, 47))
    with pytest.raises(ShapeError, match="forward_flat"):
        op.forward_flat(torch.zeros(2, 10))
    with pytest.raises(ShapeError, match="adjoint_flat"):
        op.adjoint_flat(torch.zeros(10))
    with pytest.raises(TypeError, match="torch.Tensor"):
        op(np.zeros(op.image_shape))
    with pytest.raises(TypeError, match="int64"):
        op(torch.zeros(op.image_shape, dtype=torch.int64))
    with pytest.raises(TypeError, match="complex64"):
        op(torch.zeros(op.image_shape, dtype=torch.complex64))
    with pytest.raises(ValueError, match="meta"):
        op(torch.zeros(op.image_shape, device="meta"))
    # float64 input to a float32 operator is cast, and the result is the operator's dtype.
    assert op(torch.zeros(op.image_shape, dtype=torch.float64)).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        SparseRayTransform(VOLUME, op.geometry, dtype=torch.float16)
    with pytest.raises(ValueError, match="matrix has shape"):
        SparseRayTransform(VOLUME, op.geometry, matrix=op.matrix[:-1])
    with pytest.raises(ValueError, match="line_fanflat"):
        assemble_matrix(VOLUME, op.geometry, projector="linear")


def test_make_ray_transform_errors():
    vol3 = VolumeGeometry((4, 6, 6), 1.0)
    cone = ProjectionGeometry("cone", (5, 8), angles=np.linspace(0, 6, 4), det_spacing=(1.0, 1.0),
                              source_origin=30.0, origin_det=30.0)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        make_ray_transform(vol3, cone, device="cpu")
    with pytest.raises(ValueError, match="2D only"):
        make_ray_transform(vol3, cone, backend="sparse")
    with pytest.raises(ValueError, match="backend 'magic' unknown"):
        make_ray_transform(VOLUME, geometries()["parallel"], backend="magic")
    with pytest.raises(ValueError, match="3D geometry"):
        make_ray_transform(VOLUME, cone)
    with pytest.raises(RuntimeError, match="CUDA"):
        make_ray_transform(VOLUME, geometries()["parallel"], backend="astra_cuda", device="cpu")
    op = make_ray_transform(VOLUME, geometries()["parallel"])
    assert isinstance(op, SparseRayTransform) and op.device.type == "cpu"


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_sparse_to_cuda_round_trip(ops):
    op = ops["fanflat_vec"]
    gpu = op.to("cuda")
    assert gpu.device.type == "cuda" and op.device.type == "cpu"
    x = torch.rand((4, *op.image_shape))
    y = torch.rand((4, *op.measurement_shape))
    assert torch.allclose(gpu(x.cuda()).cpu(), op(x), rtol=1e-5, atol=1e-6)
    assert torch.allclose(gpu.adjoint(y.cuda()).cpu(), op.adjoint(y), rtol=1e-5, atol=1e-6)
    back = gpu.to("cpu")
    assert torch.equal(back(x), op(x))
    with pytest.raises(ValueError, match="lives on"):
        gpu(x)  # a CPU tensor handed to the CUDA operator
