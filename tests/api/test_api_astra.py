"""``ctuq.Scan.from_astra`` for every ASTRA geometry kind: the loaded problem is the one ASTRA describes.

For each kind the phantom of :mod:`api_cases` (random ellipses, asymmetric) is projected by ASTRA's own CPU
projector; the scan made from that sinogram, the geometry dicts and the phantom loads a 2D problem whose operator
applied to the ground truth reproduces ASTRA's projection. The same operator applied to the phantom mirrored top to
bottom misses it by ~60 % (asserted): a geometry converted with the wrong orientation, rotation sense, detector
direction or offset would fail.

Tolerance: ``max |T x − ASTRA(x)| / max |ASTRA(x)| < 2e-4``. ctuq converts the geometry to ASTRA vectors, writes
them as text with every digit and builds its operator from ASTRA's ``linear`` (parallel) or ``line_fanflat`` (fan)
kernel in float64; measured: ≤ 2e-7 for the ``_vec`` kinds, ≤ 3e-5 for ASTRA's angle-based kinds (their kernels
work from the angles, ctuq from ``astra.geom_2vec``'s vectors) and ≤ 6e-5 for the central slice of a 3D geometry
(the slice's fan-beam geometry is derived from the 3D vectors).

3D geometries: ASTRA projects volumes only on a GPU, so on the CPU the reference is ASTRA's 2D projection of the
central plane (:func:`api_cases.central_plane_2d`: a 3D geometry's rays through ``z = 0`` are a 2D geometry with the
same x and y components) of a slab phantom (every slice the same image); the scan's projections repeat that
sinogram on every detector row, and ctuq's slice reads the central row. The volume itself (ASTRA CUDA) is checked
against ``astra.create_sino3d_gpu`` where CUDA is present.

Then the views of a scan: ``subset`` (the chosen angles measured, the others held out), ``save``/``load_scan`` (the
same scan bit for bit) and ``from_cil`` (checked against CIL's own projector where CIL is installed; without it, the
``ImportError`` that says what is missing).
"""

import astra
import numpy as np
import pytest
import torch
from api_cases import (
    N_ANGLES,
    N_DET,
    N_ROWS,
    N_Z,
    N,
    angles,
    astra_sino,
    central_plane_2d,
    ellipses,
    geometry_2d,
    geometry_3d,
    relative_error,
    slab,
    slab_projections,
)

import ctuq

KINDS_2D = ["parallel", "fanflat", "parallel_vec", "fanflat_vec"]
KINDS_3D = ["parallel3d", "cone", "parallel3d_vec", "cone_vec"]
TOL = 2e-4
MIRRORED = 0.3  # the mirrored phantom's relative error must exceed this (measured: 0.62 … 0.65)


def _check_operator(data, reference: np.ndarray, mirrored_truth: np.ndarray) -> None:
    """The loaded operator reproduces ``reference`` from the loaded ground truth, and misses it from the mirror."""
    assert data.op.measurement_shape == tuple(reference.shape)
    assert relative_error(data.op(data.ground_truth).numpy(), reference) < TOL
    assert relative_error(data.op(torch.from_numpy(mirrored_truth.copy())).numpy(), reference) > MIRRORED


@pytest.mark.parametrize("kind", KINDS_2D)
def test_a_2d_scan_loads_as_astra_projects_it(kind):
    image = ellipses()
    proj_geom, vol_geom = geometry_2d(kind)
    sino = astra_sino(image, proj_geom, vol_geom)
    scan = ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=image)
    beam = "parallel" if kind.startswith("parallel") else "fan"
    assert (scan.geometry_type, scan.detector_shape, scan.image_shape) == (beam, (1, N_DET), (1, N, N))
    assert scan.voxel_size == 1.0 and scan.has_ground_truth
    # ASTRA's 2D frame is ctuq's mirrored in y, which turns the rotation around: ASTRA's angle θ is 180° − θ here
    assert np.allclose(scan.angles, (180.0 - np.degrees(angles())) % 360.0, rtol=0, atol=1e-9)
    data = scan.load()
    # the arrays come through as they were given (float32 line integrals; ground truth in mm⁻¹ for 1 mm pixels)
    assert np.array_equal(data.y.numpy(), sino)
    assert np.array_equal(data.ground_truth.numpy(), image)
    _check_operator(data, sino, np.flipud(image))
    text = repr(scan)
    for fragment in (
        f"{beam} beam",
        f"{N_ANGLES} of {N_ANGLES} angles",
        f"detector 1×{N_DET}",
        f"grid {N}×{N} of 1 mm",
    ):
        assert fragment in text, text
    assert "with ground truth" in text and "Scan.from_astra" in text


@pytest.mark.parametrize("kind", KINDS_3D)
def test_the_central_slice_of_a_3d_scan_loads_as_astra_projects_its_plane(kind):
    image = ellipses()
    proj_geom, vol_geom = geometry_3d(kind)
    sino = astra_sino(image, central_plane_2d(proj_geom), astra.create_vol_geom(N, N))
    volume = slab(image)
    scan = ctuq.Scan.from_astra(slab_projections(sino), proj_geom, vol_geom, ground_truth=volume)
    beam = "parallel" if kind.startswith("parallel") else "cone"
    assert (scan.geometry_type, scan.detector_shape, scan.image_shape) == (beam, (N_ROWS, N_DET), (N_Z, N, N))
    # 3D geometries are ctuq's frame: the angles are ASTRA's
    assert np.allclose(scan.angles, np.degrees(angles()) % 360.0, rtol=0, atol=1e-9)
    data = scan.load()  # the central slice (z = 0, the source plane): a 2D problem on the CPU
    assert np.allclose(data.y.numpy(), sino, rtol=1e-6, atol=0)
    assert np.array_equal(data.ground_truth.numpy(), volume[N_Z // 2])
    _check_operator(data, sino, image)  # ASTRA's 2D image is this slice mirrored (row 0 at the top)
    text = repr(scan)
    for fragment in (f"{beam} beam", f"{N_ANGLES} of {N_ANGLES} angles", f"detector {N_ROWS}×{N_DET}"):
        assert fragment in text, text
    assert f"grid {N_Z}×{N}×{N} of 1 mm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS_3D)
def test_a_3d_volume_loads_as_astra_cuda_projects_it(kind):
    proj_geom, vol_geom = geometry_3d(kind)
    rng = np.random.default_rng(3)
    volume = rng.uniform(0.0, 0.02, size=(N_Z, N, N)).astype(np.float32)  # no symmetry in any direction
    sid, sino = astra.create_sino3d_gpu(volume, proj_geom, vol_geom)
    astra.data3d.delete(sid)
    scan = ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=volume)
    data = scan.load(ndim=3, backend="astra_cuda", device="cuda")
    ours = data.op(data.ground_truth.to("cuda")).cpu().numpy()  # ctuq's order: (angle, row, column)
    assert relative_error(ours, sino.transpose(1, 0, 2)) < TOL
    assert np.array_equal(data.y.cpu().numpy(), sino.transpose(1, 0, 2))


@pytest.mark.parametrize(("units", "voxel_size", "mm"), [("cm", None, 10.0), ("um", None, 1e-3), ("mm", 0.25, 0.25)])
def test_units_and_voxel_size_scale_the_grid(units, voxel_size, mm):
    """A geometry in ``units`` (ASTRA has none) or with its voxel edge given in mm: the grid's voxel is ``mm`` mm,
    the ground truth (attenuation per unit length) is converted to mm⁻¹ and the operator (mm) still reproduces the
    dimensionless line integrals. A vol_geom with half-unit pixels checks that the scale applies to its window."""
    image = ellipses()
    proj_geom, vol_geom = geometry_2d("fanflat", astra.create_vol_geom(N, N, -N / 4, N / 4, -N / 4, N / 4))
    sino = astra_sino(image, proj_geom, vol_geom)
    scan = ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=image, units=units, voxel_size=voxel_size)
    voxel = mm * (0.5 if voxel_size is None else 1.0)  # units scale the half-unit pixels; voxel_size is the edge
    assert scan.voxel_size == pytest.approx(voxel, rel=1e-12)
    assert f"of {voxel:.4g} mm" in repr(scan)
    data = scan.load()
    assert data.volume.voxel_size == pytest.approx(voxel, rel=1e-12)
    per_unit = mm if voxel_size is None else voxel_size / 0.5  # mm per ASTRA length unit
    assert np.allclose(data.ground_truth.numpy(), image / per_unit, rtol=1e-6, atol=0)
    _check_operator(data, sino, np.flipud(image) / per_unit)


def test_variances_come_through_in_astra_order():
    """Per-ray variances in ASTRA's order reach the loaded problem beside their rays (3D: ``(rows, angles, cols)``)."""
    image = ellipses()
    proj_geom, vol_geom = geometry_3d("cone")
    sino = astra_sino(image, central_plane_2d(proj_geom), astra.create_vol_geom(N, N))
    variances = np.random.default_rng(1).uniform(1e-4, 2e-4, size=(N_ROWS, N_ANGLES, N_DET)).astype(np.float32)
    variances[:] = variances[N_ROWS // 2]  # constant along the rows: the slice's interpolation changes nothing
    scan = ctuq.Scan.from_astra(slab_projections(sino), proj_geom, vol_geom, variances=variances)
    data = scan.load()
    assert np.allclose(data.variances.numpy(), variances[N_ROWS // 2], rtol=1e-6, atol=0)
    assert not scan.has_ground_truth and data.ground_truth is None


def test_torch_tensors_are_taken_like_arrays():
    image = ellipses()
    proj_geom, vol_geom = geometry_2d("parallel")
    sino = astra_sino(image, proj_geom, vol_geom)
    a = ctuq.Scan.from_astra(torch.from_numpy(sino), proj_geom, vol_geom, ground_truth=torch.from_numpy(image))
    b = ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=image)
    da, db = a.load(), b.load()
    assert torch.equal(da.y, db.y) and torch.equal(da.ground_truth, db.ground_truth)


# ------------------------------------------------------------------------------------------------ subset, save
def test_a_subset_measures_its_angles_and_holds_out_the_others(fan_case):
    """``Scan.subset``: the loaded problem has the chosen angles' rows, in scan order, and the other angles as its
    held-out rows; the printed scan says so. A full scan holds out what ``angular_subsampling`` skips."""
    sino, proj_geom, vol_geom, image = fan_case
    scan = ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=image)
    full = scan.load()
    assert scan.used_angles.tolist() == list(range(N_ANGLES)) and scan.heldout_angles.size == 0
    assert full.heldout is None or full.heldout.y.shape[0] == 0
    chosen = [31, 2, 17, 8, 25]
    sub = scan.subset(chosen)
    assert sub.is_subset and not scan.is_subset
    assert sub.used_angles.tolist() == sorted(chosen)
    assert sub.heldout_angles.tolist() == [i for i in range(N_ANGLES) if i not in chosen]
    assert np.array_equal(sub.angles, scan.angles)  # every angle of the scan, the held-out ones too
    data = sub.load()
    assert np.array_equal(data.y.numpy(), sino[sorted(chosen)])
    assert np.array_equal(data.heldout.y.numpy(), sino[sub.heldout_angles])
    assert np.array_equal(data.ground_truth.numpy(), image)
    assert f"5 of {N_ANGLES} angles measured ({N_ANGLES - 5} held out)" in repr(sub)
    assert "held-out angles: those data.angular_subsampling skips" in repr(scan)
    # a subset of a subset picks among the whole scan's angles
    assert sub.subset([2, 3]).used_angles.tolist() == [2, 3]
    # a full scan thinned by angular_subsampling: the skipped angles are its held-out rows
    thinned = scan.load(angular_subsampling=2)
    assert np.array_equal(thinned.y.numpy(), sino[::2])
    assert np.array_equal(thinned.heldout.y.numpy(), sino[1::2])


def test_a_saved_scan_loads_as_the_same_scan(fan_case, tmp_path):
    """``Scan.save`` writes ``scan.yaml`` that ``ctuq.load_scan`` reads as the very scan: bitwise the same
    sinogram, ground truth and angles, the same operator; a subset saves its whole scan."""
    sino, proj_geom, vol_geom, image = fan_case
    scan = ctuq.Scan.from_astra(sino, proj_geom, vol_geom, ground_truth=image)
    path = scan.subset([0, 1, 2, 3]).save(tmp_path / "scan")
    assert path == tmp_path / "scan" / "scan.yaml" and path.is_file()
    again = ctuq.load_scan(path)
    assert ctuq.load_scan(tmp_path / "scan").angles.tolist() == again.angles.tolist()  # the folder names it too
    assert not again.is_subset and np.array_equal(again.angles, scan.angles)
    assert repr(again).replace(str(again.origin), "X") == repr(scan).replace(str(scan.origin), "X")
    a, b = scan.load(), again.load()
    assert np.array_equal(a.y.numpy(), b.y.numpy()) and np.array_equal(a.ground_truth.numpy(), b.ground_truth.numpy())
    x = torch.from_numpy(np.random.default_rng(0).uniform(size=(N, N)).astype(np.float32))
    assert torch.equal(a.op(x), b.op(x))


def test_from_cil_without_cil_says_what_it_needs():
    try:
        import cil.plugins.astra  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CIL is installed: test_from_cil_loads_as_cil_projects checks it")
    with pytest.raises(ImportError, match="Scan.from_cil needs CIL with its ASTRA plugin"):
        ctuq.Scan.from_cil(object())


def test_from_cil_loads_as_cil_projects():
    """A CIL fan-beam acquisition (``AcquisitionGeometry.create_Cone2D``) projected by CIL's own ASTRA CPU operator:
    the scan made by ``Scan.from_cil`` loads an operator that reproduces that projection (skipped without CIL)."""
    pytest.importorskip("cil.plugins.astra")
    from cil.framework import AcquisitionGeometry
    from cil.plugins.astra import ProjectionOperator

    geometry = (
        AcquisitionGeometry.create_Cone2D(source_position=[0, -100.0], detector_position=[0, 50.0])
        .set_panel(N_DET, pixel_size=1.5)
        .set_angles(np.degrees(angles()), angle_unit="degree")
    )
    grid = geometry.get_ImageGeometry()
    phantom = grid.allocate(0)
    phantom.fill(ellipses(n=grid.voxel_num_x)[: grid.voxel_num_y])
    projection = ProjectionOperator(grid, geometry, device="cpu").direct(phantom)
    scan = ctuq.Scan.from_cil(projection, phantom)
    assert (scan.geometry_type, scan.detector_shape, len(scan.angles)) == ("fan", (1, N_DET), N_ANGLES)
    data = scan.load()
    reference = projection.as_array()
    assert np.array_equal(data.y.numpy(), reference)
    # CIL's lengths are taken as mm: the phantom (per unit length) is the ground truth in mm⁻¹ as it is
    assert np.array_equal(data.ground_truth.numpy(), phantom.as_array())
    _check_operator(data, reference, np.flipud(phantom.as_array()))
