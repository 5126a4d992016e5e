"""The ASTRA CUDA backend (:class:`AstraCudaRayTransform`).

The ray-transform contract (adjointness to ASTRA's accuracy, batching, angle subsets, agreement with ODL, bad
input) runs on this backend's 2D parallel/fan and 3D operators in ``tests/operators/test_ray_transform_contract.py``
wherever CUDA is available. Here, GPU tests (``@pytest.mark.gpu``; skipped without CUDA) check the same for the
cone-slice operator (which ``make_ray_transform`` does not build), agreement with the sparse CPU backend, a 3D
cone-beam ball against its analytic chord lengths (which pins the 3D orientation convention) and the cone-slice
geometry. The CPU tests check the clear errors without a GPU and the torch back-projection that serves as the
transpose of the fan-beam/cone-slice forward projection.
"""

import math

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import SparseRayTransform, make_ray_transform
from ctuq.operators.astra_cuda import AstraCudaRayTransform, cuda_available
from ctuq.operators.fbp import fbp, fdk, slab_adjoint_backprojection

needs_astra_cuda = pytest.mark.skipif(
    torch.cuda.is_available() and not cuda_available(),
    reason="torch sees a GPU but ASTRA cannot use CUDA (libcudart.so.12 / libcufft.so.11 on LD_LIBRARY_PATH?)",
)


# ---------------------------------------------------------------------------------------------- problems
def fan_vectors(angles, src=66.0, det=199.0, n_det=128, du=0.8976, z=0.0, offset=0.0):
    """Walnut-like one-row fan vectors, lifted to 3D at height ``z`` (mm): ``(A, 12)`` cone_vec rows with the
    detector row step ``v = (0, 0, 0.1)``; columns 0:2, 3:5, 6:8 are the 2D ``fanflat_vec`` vectors."""
    rows = []
    for b in angles:
        e, p = np.array([math.cos(b), math.sin(b), 0.0]), np.array([-math.sin(b), math.cos(b), 0.0])
        s = src * e + np.array([0.0, 0.0, z])
        rows.append(np.concatenate([s, s - det * e + offset * p, du * p, [0.0, 0.0, 0.1]]))
    return np.array(rows)


def gaussian_blobs_2d(volume, blobs):
    """Smooth positive image: Σ a·exp(−|X − c|²/(2σ²)) for ``blobs = [(cx, cy, sigma, a)]`` (mm, mm⁻¹)."""
    yy, xx = np.meshgrid(*volume.pixel_centers(), indexing="ij")
    img = sum(a * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * s * s)) for cx, cy, s, a in blobs)
    return torch.tensor(img, dtype=torch.float32)


BLOBS = [(0.0, 0.0, 8.0, 0.02), (4.0, -3.0, 2.5, 0.01), (-5.0, 4.0, 3.0, 0.015)]
VOL2D = VolumeGeometry((64, 64), 0.55, (0.3, -0.2))
PARALLEL = ProjectionGeometry("parallel", (96,), angles=np.linspace(0, math.pi, 45, endpoint=False), det_spacing=0.4)
FAN_ANGLES = np.linspace(0, 2 * math.pi, 60, endpoint=False)
FAN = ProjectionGeometry("fanflat_vec", (128,), vectors=fan_vectors(FAN_ANGLES, offset=0.7)[:, [0, 1, 3, 4, 6, 7]])


def inner_mismatch(op, x, y):
    """``|⟨Tx, y⟩ − ⟨x, Tᵀy⟩| / ⟨Tx, y⟩`` (float64 sums)."""
    lhs = float((op(x).double() * y.double()).sum())
    rhs = float((x.double() * op.adjoint(y).double()).sum())
    return abs(lhs - rhs) / abs(lhs)


# ---------------------------------------------------------------------------------------------- CPU tests
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_construction_without_cuda_raises_clear_error():
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        AstraCudaRayTransform(VOL2D, PARALLEL)
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        AstraCudaRayTransform.cone_slice(
            VOL2D, 0.0, ProjectionGeometry("cone_vec", (1, 128), vectors=fan_vectors(FAN_ANGLES))
        )


def test_cpu_device_and_bad_geometries_raise_clear_errors():
    with pytest.raises(RuntimeError, match="needs a CUDA device, got cpu.*SparseRayTransform"):
        AstraCudaRayTransform(VOL2D, PARALLEL, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        make_ray_transform(VOL2D, PARALLEL, backend="astra_cuda", device="cpu")
    cone1 = ProjectionGeometry("cone_vec", (1, 128), vectors=fan_vectors(FAN_ANGLES))
    with pytest.raises(ValueError, match="cone_slice"):
        AstraCudaRayTransform(VOL2D, cone1)  # 2D volume with a 3D geometry: points to cone_slice
    with pytest.raises(ValueError, match=r"det_shape must be \(1, n_cols\)"):
        AstraCudaRayTransform.cone_slice(
            VOL2D, 0.0, ProjectionGeometry("cone_vec", (2, 128), vectors=fan_vectors(FAN_ANGLES))
        )
    with pytest.raises(ValueError, match="one-row 'cone_vec'"):
        AstraCudaRayTransform.cone_slice(VOL2D, 0.0, FAN)
    with pytest.raises(ValueError, match="2D VolumeGeometry"):
        AstraCudaRayTransform.cone_slice(VolumeGeometry((4, 64, 64), 0.5), 0.0, cone1)
    with pytest.raises(ValueError, match="z must be finite"):
        AstraCudaRayTransform.cone_slice(VOL2D, float("nan"), cone1)


def test_slab_backprojection_is_the_fan_beam_transpose():
    # In-plane fan beam: the pixel-driven slab back-projection (the CUDA backend's Tᵀ for fan beams) against the
    # exact transpose of ASTRA's CPU line_fanflat matrix, which integrates the same rays exactly.
    sparse = SparseRayTransform(VOL2D, FAN)
    cone1 = ProjectionGeometry("cone_vec", (1, 128), vectors=fan_vectors(FAN_ANGLES, offset=0.7))
    k, a = np.arange(128), np.arange(60)
    y = torch.tensor(
        1.0 + 0.5 * np.cos(6 * math.pi * k / 128)[None] * np.sin(4 * math.pi * a / 60)[:, None], dtype=torch.float32
    )
    bp = slab_adjoint_backprojection(VOL2D, 0.0, cone1, y[None, :, None, :]).reshape(VOL2D.shape)
    exact = sparse.adjoint(y)
    yy, xx = np.meshgrid(*VOL2D.pixel_centers(), indexing="ij")
    fov = torch.tensor(xx**2 + yy**2 < 15**2)
    # Pixel by pixel within a few per cent (aliasing of the ray sampling), and in inner products with smooth
    # images to ~1e-4 (measured 1e-5 .. 1e-4).
    ratio = (bp / exact)[fov]
    assert float((ratio - 1).abs().max()) < 0.1 and abs(float(ratio.mean()) - 1) < 0.005
    x = gaussian_blobs_2d(VOL2D, BLOBS)
    lhs = float((sparse(x) * y).sum())
    assert abs(float((x * bp).sum()) / lhs - 1) < 1e-3


def test_slab_backprojection_follows_the_slab_height():
    # Source and detector row in the plane z = 2 mm: rays run horizontally at z = 2. A slab centred there sees
    # them fully; half a voxel off, ASTRA's linear interpolation across the one-voxel slab gives half; beyond one
    # voxel nothing. The back-projection mirrors that profile.
    h = VOL2D.voxel_size
    cone1 = ProjectionGeometry("cone_vec", (1, 128), vectors=fan_vectors(FAN_ANGLES, z=2.0))
    y = torch.rand((1, 60, 1, 128), generator=torch.Generator().manual_seed(0))
    at = slab_adjoint_backprojection(VOL2D, 2.0, cone1, y)
    half = slab_adjoint_backprojection(VOL2D, 2.0 + 0.5 * h, cone1, y)
    off = slab_adjoint_backprojection(VOL2D, 2.0 - 1.2 * h, cone1, y)
    assert torch.allclose(half, 0.5 * at, rtol=1e-4, atol=1e-6 * float(at.abs().max()))
    assert float(off.abs().max()) == 0.0
    planar = slab_adjoint_backprojection(
        VOL2D, 0.0, ProjectionGeometry("cone_vec", (1, 128), vectors=fan_vectors(FAN_ANGLES)), y
    )
    assert torch.allclose(at, planar, rtol=1e-4, atol=1e-6 * float(at.abs().max()))


# ---------------------------------------------------------------------------------------------- GPU tests
@pytest.fixture(scope="module")
def cuda_ops():
    if not torch.cuda.is_available() or not cuda_available():
        pytest.skip("needs a CUDA device that ASTRA can use")
    cone1 = ProjectionGeometry("cone_vec", (1, 128), vectors=fan_vectors(FAN_ANGLES, z=1.3, offset=0.7))
    return {
        "parallel2d": AstraCudaRayTransform(VOL2D, PARALLEL),
        "fan2d": AstraCudaRayTransform(VOL2D, FAN),
        "cone_slice": AstraCudaRayTransform.cone_slice(VOL2D, 1.3, cone1),
        "3d": make_ray_transform(VOL3D, CONE, device="cuda"),
    }


VOL3D = VolumeGeometry((40, 48, 56), 0.5, (0.4, -0.3, 0.2))  # non-cubic, off-centre: catches axis swaps
CONE = ProjectionGeometry(
    "cone",
    (64, 72),
    angles=np.linspace(0, 2 * math.pi, 40, endpoint=False),
    det_spacing=(0.9, 0.9),
    source_origin=66.0,
    origin_det=133.0,
)


def smooth_input(op, seed=0):
    """A smooth positive image and a smooth positive sinogram for ``op`` (CUDA tensors)."""
    if op.ndim == 2:
        x = gaussian_blobs_2d(op.volume, BLOBS)
    else:
        zc, yc, xc = op.volume.pixel_centers()
        zz, yy, xx = np.meshgrid(zc, yc, xc, indexing="ij")
        x = torch.tensor(
            0.02 * np.exp(-(xx**2 + yy**2 + zz**2) / (2 * 5.0**2))
            + 0.01 * np.exp(-((xx - 3) ** 2 + (yy + 2) ** 2 + (zz - 1) ** 2) / 8.0),
            dtype=torch.float32,
        )
    # A smooth sinogram: the projection of another smooth image, plus a constant.
    y = op(torch.roll(x.cuda(), shifts=3, dims=-1)) + 0.1
    return x.cuda(), y


@pytest.mark.gpu
@needs_astra_cuda
@pytest.mark.parametrize("mode", ["cone_slice"])  # the other modes: the contract tests
def test_adjointness_to_astra_accuracy(cuda_ops, mode):
    op = cuda_ops[mode]
    x, y = smooth_input(op)
    mismatch = inner_mismatch(op, x, y)
    gen = torch.Generator().manual_seed(1)
    xr = torch.rand(op.image_shape, generator=gen).cuda()
    yr = torch.rand(op.measurement_shape, generator=gen).cuda()
    print(
        f"{mode}: <Tx,y> vs <x,T'y> relative mismatch {mismatch:.2e} (smooth), "
        f"{inner_mismatch(op, xr, yr):.2e} (uniform random)"
    )
    # ASTRA's back-projector is voxel-driven, its projector ray-driven: they are transposes only to
    # interpolation accuracy. Smooth inputs: ~1–2 % (3D cone: plus the obliquity ASTRA's density weight omits).
    assert mismatch < 0.03


@pytest.mark.gpu
@needs_astra_cuda
@pytest.mark.parametrize("mode, geometry", [("parallel2d", PARALLEL), ("fan2d", FAN)])
def test_agrees_with_sparse_backend(cuda_ops, mode, geometry):
    op = cuda_ops[mode]
    sparse = SparseRayTransform(VOL2D, geometry)
    x = gaussian_blobs_2d(VOL2D, BLOBS)
    xb = torch.stack([x, torch.flip(x, dims=[0]), 0.5 * x])
    y_cuda = op(xb.cuda()).cpu()
    y_sparse = sparse(xb)
    rel = float((y_cuda - y_sparse).norm() / y_sparse.norm())
    print(f"{mode}: ASTRA CUDA vs sparse projections of a smooth phantom: {rel:.2e}")
    # Texture-interpolated (Joseph-like) rays against ASTRA's CPU kernels: a few per cent at most.
    assert rel < 0.03
    # The back-projections of a smooth sinogram agree as well.
    ys = y_sparse[0] + 0.1
    bp_rel = float((op.adjoint(ys.cuda()).cpu() - sparse.adjoint(ys)).norm() / sparse.adjoint(ys).norm())
    assert bp_rel < 0.03


@pytest.mark.gpu
@needs_astra_cuda
@pytest.mark.parametrize("mode", ["cone_slice"])  # the other modes: the contract tests
def test_subset_is_row_selection(cuda_ops, mode):
    op = cuda_ops[mode]
    x, _ = smooth_input(op)
    idx = [5, 0, 17, -1]
    sub = op.subset(idx)
    full = op(x)
    expected = full[[5, 0, 17, op.n_angles - 1]]
    assert sub.measurement_shape == tuple(expected.shape)
    torch.testing.assert_close(sub(x), expected, rtol=1e-4, atol=1e-5 * float(full.abs().max()))
    with pytest.raises(IndexError):
        op.subset([op.n_angles])


@pytest.mark.gpu
@needs_astra_cuda
@pytest.mark.parametrize("mode", ["cone_slice"])  # the other modes: the contract tests
def test_batched_equals_one_by_one(cuda_ops, mode):
    op = cuda_ops[mode]
    x, y = smooth_input(op)
    xb = torch.stack([x, 2 * torch.flip(x, dims=[-1]), torch.roll(x, 5, dims=-2)])
    yb = torch.stack([y, torch.flip(y, dims=[-1]), 0.5 * y])
    fwd, adj = op(xb), op.adjoint(yb)
    for i in range(3):
        torch.testing.assert_close(fwd[i], op(xb[i]), rtol=1e-4, atol=1e-5 * float(fwd.abs().max()))
        torch.testing.assert_close(adj[i], op.adjoint(yb[i]), rtol=1e-4, atol=1e-5 * float(adj.abs().max()))


@pytest.mark.gpu
@needs_astra_cuda
def test_cone_beam_ball_matches_chord_lengths(cuda_ops):
    op = cuda_ops["3d"]
    centre, r, mu = np.array([2.0, -3.0, 1.5]), 5.0, 0.02
    # Voxel averages of the ball (3×3×3 sub-samples) in ctuq's convention (array [z, y, x], index ↔ coordinate).
    zc, yc, xc = op.volume.pixel_centers()
    h = op.volume.voxel_size
    ball = np.zeros(op.volume.shape)
    for oz in (-h / 3, 0, h / 3):
        for oy in (-h / 3, 0, h / 3):
            for ox in (-h / 3, 0, h / 3):
                zz, yy, xx = np.meshgrid(zc + oz, yc + oy, xc + ox, indexing="ij")
                ball += ((xx - centre[0]) ** 2 + (yy - centre[1]) ** 2 + (zz - centre[2]) ** 2) <= r * r
    ball *= mu / 27
    proj = op(torch.tensor(ball, dtype=torch.float32).cuda()).cpu().numpy()
    # Analytic: 2·sqrt(r² − dist²), dist from the ball centre to the ray source → detector pixel centre.
    q = CONE.detector_centers()
    s = CONE.sources()[:, None, None, :]
    d = (q - s) / np.linalg.norm(q - s, axis=-1, keepdims=True)
    w = centre - s
    dist2 = (w * w).sum(-1) - ((w * d).sum(-1)) ** 2
    chord = mu * 2 * np.sqrt(np.clip(r * r - dist2, 0, None))
    core = chord > 0.3 * chord.max()
    rel = np.linalg.norm((proj - chord)[core]) / np.linalg.norm(chord[core])
    print(f"3D cone ball: relative error of the projections inside the shadow {rel:.2e}")
    assert rel < 0.03
    # The shadow sits where the geometry says (each axis, each view): centre of mass per projection.
    rows, cols = np.meshgrid(np.arange(q.shape[1]), np.arange(q.shape[2]), indexing="ij")
    for img, ref in zip(proj, chord):
        c_img = np.array([(img * rows).sum(), (img * cols).sum()]) / img.sum()
        c_ref = np.array([(ref * rows).sum(), (ref * cols).sum()]) / ref.sum()
        np.testing.assert_allclose(c_img, c_ref, atol=0.25)  # detector pixels; a flipped axis moves it by >5
    # FDK (torch) of the ASTRA projections brings the ball back at its place and value.
    rec = fdk(op, torch.tensor(proj).cuda(), filter_type="Ram-Lak").cpu().numpy()
    zz, yy, xx = np.meshgrid(zc, yc, xc, indexing="ij")
    inner = ((xx - centre[0]) ** 2 + (yy - centre[1]) ** 2 + (zz - centre[2]) ** 2) < (r - 1.2) ** 2
    assert abs(rec[inner].mean() / mu - 1) < 0.03


@pytest.mark.gpu
@needs_astra_cuda
def test_cone_slice_matches_fan_beam_when_source_in_plane(cuda_ops):
    # Source and detector row in the slice plane z = 1.3 mm: the cone slice is the fan beam of that slice.
    op = cuda_ops["cone_slice"]
    assert op.image_shape == (64, 64) and op.measurement_shape == (60, 128) and op.slab_z == 1.3
    sparse = SparseRayTransform(VOL2D, FAN)
    x = gaussian_blobs_2d(VOL2D, BLOBS)
    rel = float((op(x.cuda()).cpu() - sparse(x)).norm() / sparse(x).norm())
    assert rel < 0.03
    # The in-plane fan operator (fan2d) is the same computation at z = 0.
    torch.testing.assert_close(op(x.cuda()), cuda_ops["fan2d"](x.cuda()), rtol=1e-4, atol=1e-6)
    # ASTRA interpolates linearly across the one-voxel slab (what the torch back-projection assumes): a slab
    # half a voxel above the rays sees half the attenuation. The GPU's texture unit stores the interpolation weight
    # with 8 fractional bits (CUDA Programming Guide, "Linear Filtering"), so a weight meant to be 0.5 can come out a
    # 1/256 step off: up to ~0.4 % of a value (measured on an H100: 0.49 % at one small edge value of 7680).
    h = VOL2D.voxel_size
    half = AstraCudaRayTransform.cone_slice(VOL2D, 1.3 + 0.5 * h, op.geometry)
    torch.testing.assert_close(half(x.cuda()), 0.5 * op(x.cuda()), rtol=1e-2, atol=1e-5)
    assert float(AstraCudaRayTransform.cone_slice(VOL2D, 1.3 + 1.5 * h, op.geometry)(x.cuda()).abs().max()) == 0.0


@pytest.mark.gpu
@needs_astra_cuda
def test_devices_autograd_fbp_and_lifetime(cuda_ops):
    op = cuda_ops["parallel2d"]
    assert op.to(op.device) is op and op.to("cuda") is op
    with pytest.raises(RuntimeError, match="SparseRayTransform"):
        op.to("cpu")
    x = gaussian_blobs_2d(VOL2D, BLOBS)
    with pytest.raises(ValueError, match="lives on"):
        op(x)  # CPU tensor
    # Autograd: the gradient of ⟨w, T x⟩ is Tᵀ w.
    xg = x.cuda().requires_grad_(True)
    w = torch.rand(op.measurement_shape, device="cuda")
    (op(xg) * w).sum().backward()
    torch.testing.assert_close(xg.grad, op.adjoint(w))
    # FBP runs on the operator's device and agrees with the CPU FBP of the same data.
    y = op(x.cuda())
    rec = fbp(op, y)
    assert rec.device == op.device
    torch.testing.assert_close(rec.cpu(), fbp((VOL2D, PARALLEL), y.cpu()), rtol=1e-4, atol=1e-6)
    # FBP of a cone-slice operator uses its 3D vectors (the CPU fan-beam FBP of the sparse projections of the
    # same blobs is 0.4 % off inside the 15 mm radius; ASTRA's projections add their few-per-cent difference).
    cs = cuda_ops["cone_slice"]
    rec_cs = fbp(cs, cs(x.cuda())).cpu()
    yy, xx = np.meshgrid(*VOL2D.pixel_centers(), indexing="ij")
    fov = torch.tensor(xx**2 + yy**2 < 15**2)
    assert float((rec_cs - x)[fov].norm() / x[fov].norm()) < 0.05
    tmp = AstraCudaRayTransform(VOL2D, PARALLEL)
    tmp(x.cuda())
    tmp.close()
    with pytest.raises(RuntimeError, match="closed"):
        tmp(x.cuda())
