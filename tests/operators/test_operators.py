"""The sparse 2D backend beyond the ray-transform contract: physical units, orientation (ctuq's coordinate
convention), the exact Jacobian under torch.func, its own constructor errors, and the CUDA round trip.

Adjointness, batching, flat views, angle subsets, agreement with ODL and the bad-input errors every backend shares
are in ``tests/operators/test_ray_transform_contract.py``; the registry and ``make_ray_transform`` in
``tests/operators/test_ray_transform_registry.py``."""

import math

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import SparseRayTransform
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
        "fanflat": ProjectionGeometry(
            "fanflat", (n_fan,), angles=ang_full, det_spacing=d_fan, source_origin=40.0, origin_det=60.0
        ),
        "fanflat_vec": ProjectionGeometry(
            "fanflat_vec",
            (n_fan,),
            vectors=fan_vectors(
                ang_full,
                src=40.0,
                det=100.0,
                n_det=n_fan,
                du=d_fan,
                offset=1.3,
                tilt=0.04,
                jitter=rng.normal(0, 0.5, ang_full.size),
            ),
        ),
    }


VOLUME = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))  # non-square, off-centre: catches axis swaps


@pytest.fixture(scope="module")
def ops():
    return {name: SparseRayTransform(VOLUME, g) for name, g in geometries().items()}


# ---------------------------------------------------------------------------------------------- units
@pytest.mark.parametrize("kind", ["parallel", "fanflat"])
def test_disc_central_value_is_chord_length(kind):
    r, mu, h = 8.0, 0.02, 0.25
    vol = VolumeGeometry((80, 80), h)
    if kind == "parallel":
        g = ProjectionGeometry("parallel", (61,), angles=np.linspace(0, math.pi, 6, endpoint=False), det_spacing=0.5)
    else:
        g = ProjectionGeometry(
            "fanflat",
            (61,),
            angles=np.linspace(0, 2 * math.pi, 6, endpoint=False),
            det_spacing=1.0,
            source_origin=66.0,
            origin_det=133.0,
        )
    # Pixel-average (8×8 supersampled) disc of radius r mm and attenuation mu mm⁻¹ at the origin.
    sub = (np.arange(8) + 0.5) / 8 - 0.5
    yc, xc = vol.pixel_centers()
    img = np.zeros(vol.shape)
    for oy in sub:
        for ox in sub:
            yy, xx = np.meshgrid(yc + oy * h, xc + ox * h, indexing="ij")
            img += xx**2 + yy**2 <= r * r
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


# ---------------------------------------------------------------------------------------------- autograd
def test_gradcheck_forward_and_adjoint():
    vol = VolumeGeometry((6, 5), 1.0)
    g = ProjectionGeometry(
        "fanflat",
        (9,),
        angles=np.linspace(0, 2 * math.pi, 4, endpoint=False),
        det_spacing=1.5,
        source_origin=20.0,
        origin_det=20.0,
    )
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


# ---------------------------------------------------------------------------------------------- errors
def test_sparse_constructor_errors(ops):
    op = ops["fanflat"]
    with pytest.raises(ValueError, match="dtype"):
        SparseRayTransform(VOLUME, op.geometry, dtype=torch.float16)
    with pytest.raises(ValueError, match="matrix has shape"):
        SparseRayTransform(VOLUME, op.geometry, matrix=op.matrix[:-1])
    with pytest.raises(ValueError, match="line_fanflat"):
        assemble_matrix(VOLUME, op.geometry, projector="linear")


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
