"""Scan simulator and ``ctuq simulate``: file layout, geometry, exact (noise-free) values, noise model."""

import json

import numpy as np
import pytest
import tifffile

from ctuq.cli import main
from ctuq.data import EllipsoidPhantom, SimulationParameters, WalnutScan, orbit_vectors, read_slice, read_volume
from ctuq.data.simulate import ORBIT_CORRECTIONS, simulate_scan
from ctuq.geometry import ProjectionGeometry, VolumeGeometry


@pytest.fixture(scope="module")
def exact_scan(tmp_path_factory):
    """Noise-free tiny scan, one ray per detector pixel: loaded values must be the phantom's line integrals."""
    out = tmp_path_factory.mktemp("sim") / "Walnut1"
    params = SimulationParameters.preset("tiny", noise=False, supersampling=1)
    sidecar = simulate_scan(out, params, preset="tiny", progress=False)
    return out, params, EllipsoidPhantom.from_dict(sidecar["phantom"])


@pytest.fixture(scope="module")
def noisy_scan(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "Walnut1"
    params = SimulationParameters.preset("tiny", supersampling=1)
    simulate_scan(out, params, preset="tiny", progress=False)
    return out, params


def test_layout_matches_the_walnut_data_set(exact_scan):
    out, params, _ = exact_scan
    n, rows, cols = params.n_projections, params.det_rows, params.det_cols
    proj = out / "Projections" / "tubeV2"
    names = sorted(p.name for p in proj.iterdir())
    assert names == sorted(
        [f"scan_{k:06}.tif" for k in range(n)]
        + ["di000000.tif", "io000000.tif", "io000001.tif", "scan_geom_corrected.geom"]
    )
    for name in ("scan_000000.tif", "di000000.tif", "io000001.tif"):
        raw = tifffile.imread(proj / name)
        assert raw.shape == (cols, rows) and raw.dtype == np.uint16  # raw files are det_cols × det_rows
    with tifffile.TiffFile(proj / "scan_000007.tif") as tif:
        assert tif.pages[0].compression.name in ("ADOBE_DEFLATE", "DEFLATE")  # zlib
    vec = np.loadtxt(proj / "scan_geom_corrected.geom")
    assert vec.shape == (n, 12)
    np.testing.assert_array_equal(vec, orbit_vectors(params, 2))  # written at full precision
    gt_files = sorted((out / "Reconstructions").iterdir())
    assert [p.name for p in gt_files] == [f"full_AGD_50_{k:06}.tiff" for k in range(params.gt_shape[0])]
    gt = tifffile.imread(gt_files[0])
    assert gt.shape == params.gt_shape[1:] and gt.dtype == np.float32
    side = json.loads((out / "ctuq_simulation.json").read_text())
    assert side["complete"] is True and side["gt_voxel_size_mm"] == params.gt_voxel_size
    assert side["parameters"] == params.to_dict() and len(side["phantom"]["ellipsoids"]) > 20
    # file 0 and file N−1 show the same angle: noise-free they are identical images
    np.testing.assert_array_equal(
        tifffile.imread(proj / "scan_000000.tif"), tifffile.imread(proj / f"scan_{n - 1:06}.tif")
    )


def test_orbit_geometry():
    params = SimulationParameters.preset("tiny", orbits=(1, 2, 3), orbit_height=4.0)
    n = params.n_projections
    for orbit, z in ((1, 4.0), (2, 0.0), (3, -4.0)):
        vec = orbit_vectors(params, orbit)
        src, det, u, v = vec[:, 0:3], vec[:, 3:6], vec[:, 6:9], vec[:, 9:12]
        np.testing.assert_array_equal(vec[0], vec[n - 1])
        np.testing.assert_allclose(np.linalg.norm(src[:, :2], axis=1), params.source_origin, rtol=1e-12)
        np.testing.assert_allclose(src[:, 2], z)
        normal = np.cross(u, v)
        normal /= np.linalg.norm(normal, axis=1, keepdims=True)
        # the detector plane lies source_detector from the source (u × v points back towards the source)
        np.testing.assert_allclose(np.einsum("ij,ij->i", src - det, normal), params.source_detector, rtol=1e-12)
        np.testing.assert_allclose(np.linalg.norm(u, axis=1), params.pixel_size, rtol=1e-12)
        np.testing.assert_allclose(np.einsum("ij,ij->i", u, v), 0.0, atol=1e-15)
        tilt = np.degrees(np.arcsin(u[:, 2] / params.pixel_size))
        np.testing.assert_allclose(tilt, ORBIT_CORRECTIONS[orbit]["tilt_deg"], rtol=1e-9)
        # 32 distinct angles, evenly spread over the circle
        ang = np.unwrap(np.arctan2(src[:-1, 1], src[:-1, 0]))
        np.testing.assert_allclose(np.diff(ang), 2 * np.pi / (n - 1), rtol=1e-9)


def test_noise_free_values_are_the_analytic_line_integrals(exact_scan):
    out, params, phantom = exact_scan
    # 3D read (CPU) with every subsampling the loader supports: angles, rows and columns
    d = read_volume(WalnutScan(out), angular_subsampling=4, detector_subsampling=2, detector_row_subsampling=2)
    rows = np.arange(0, params.n_projections - 1, 4)
    assert d.meta["geometry_rows"] == rows.tolist()
    assert d.meta["projection_files"] == [f"scan_{params.n_projections - 1 - r:06}.tif" for r in rows]
    # geometry read back = the simulated one, restricted to the used angles, rows and columns
    full = ProjectionGeometry("cone_vec", (params.det_rows, params.det_cols), vectors=orbit_vectors(params, 2))
    want = full.subset(rows).detector_centers()[:, ::2, ::2]
    np.testing.assert_allclose(d.geometry.detector_centers(), want, atol=1e-12)
    np.testing.assert_allclose(d.geometry.sources(), full.subset(rows).sources(), atol=1e-12)
    # values: the exact line integrals from the source to each pixel centre
    src = d.geometry.sources()[:, None, None, :]
    ell = phantom.line_integrals(np.broadcast_to(src, want.shape), want)
    assert ell.max() > 0.5  # the rays cross the nut
    # Only integer rounding of the counts remains: |Δy| ≤ 0.5/(p − dark) + 0.5/(flat − dark), with
    # p − dark = I₀·G·e^(−ℓ) and G ≥ 1 − flat_variation.
    i0 = params.flat_counts * (1 - params.flat_variation)
    tol = 0.5 * (np.exp(ell) + 1.0) / i0 * 1.01
    err = np.abs(d.y.double().numpy() - ell)
    assert np.all(err <= tol), float((err / tol).max())
    assert d.ground_truth.shape == params.gt_shape


def test_noise_free_slice_is_the_row_interpolation_of_line_integrals(exact_scan):
    out, params, phantom = exact_scan
    d = read_slice(WalnutScan(out), angular_subsampling=2, detector_subsampling=1)
    assert d.meta["z_mm"] == 0.0 and d.meta["exact_fan_geometry"]
    rows = np.arange(0, params.n_projections - 1, 2)
    full = ProjectionGeometry("cone_vec", (params.det_rows, params.det_cols), vectors=orbit_vectors(params, 2))
    vec = full.subset(rows).vectors
    det, u, v = vec[:, 3:6], vec[:, 6:9], vec[:, 9:12]
    alpha = np.arange(params.det_cols) - (params.det_cols - 1) / 2
    # Independent of the loader: where each detector column crosses the source plane z = 0 …
    beta = -(det[:, 2:3] + alpha[None, :] * u[:, 2:3]) / v[:, 2:3]
    frac = beta + (params.det_rows - 1) / 2
    r0 = np.floor(frac).astype(int)
    w = frac - r0
    centers = full.subset(rows).detector_centers()
    a_idx, c_idx = np.meshgrid(np.arange(len(rows)), np.arange(params.det_cols), indexing="ij")
    src = vec[:, None, 0:3]
    lo = phantom.line_integrals(np.broadcast_to(src, (len(rows), params.det_cols, 3)), centers[a_idx, r0, c_idx])
    hi = phantom.line_integrals(np.broadcast_to(src, (len(rows), params.det_cols, 3)), centers[a_idx, r0 + 1, c_idx])
    expected = (1 - w) * lo + w * hi
    i0 = params.flat_counts * (1 - params.flat_variation)
    tol = 0.5 * (np.exp(np.maximum(lo, hi)) + 1.0) / i0 * 1.01
    assert np.all(np.abs(d.y.double().numpy() - expected) <= tol)
    # … and the 2D geometry's detector pixels are exactly those crossing points, which lie in the slice plane
    points = det[:, None, :] + alpha[None, :, None] * u[:, None, :] + beta[:, :, None] * v[:, None, :]
    np.testing.assert_allclose(points[..., 2], 0.0, atol=1e-12)
    np.testing.assert_allclose(d.geometry.detector_centers(), points[..., :2], atol=1e-10)
    np.testing.assert_allclose(d.slice_cone_geometry.detector_centers()[:, 0], points, atol=1e-10)


def test_ground_truth_slices_follow_the_index_convention(exact_scan):
    out, params, phantom = exact_scan
    nz, ny, nx = params.gt_shape
    h = params.gt_voxel_size
    grid = VolumeGeometry(params.gt_shape, h)
    zc, yc, xc = grid.pixel_centers()
    k = nz // 2
    gt = tifffile.imread(out / "Reconstructions" / f"full_AGD_50_{k:06}.tiff")
    zz, yy, xx = np.meshgrid([zc[k]], yc, xc, indexing="ij")
    point = phantom.values(np.stack([xx[0], yy[0], zz[0]], axis=-1))
    # voxels away from edges equal the point value at their centre; flipped or transposed slices do not
    agree = np.isclose(gt, point, atol=1e-6).mean()
    assert agree > 0.9
    assert np.isclose(gt[::-1], point, atol=1e-6).mean() < agree - 0.05
    assert np.isclose(gt.T, point, atol=1e-6).mean() < agree - 0.05
    assert zc[k] == pytest.approx(0.0)


def test_noise_model_matches_poisson_statistics(exact_scan, noisy_scan):
    exact = read_volume(WalnutScan(exact_scan[0]), angular_subsampling=1, detector_subsampling=1)
    noisy = read_volume(WalnutScan(noisy_scan[0]), angular_subsampling=1, detector_subsampling=1)
    params = noisy_scan[1]
    y0 = exact.y.double().numpy()
    resid = noisy.y.double().numpy() - y0
    # var(−log(p/f)) ≈ 1/(I₀ G T) + 1/(2 I₀ G) (two flats averaged); G ≈ 1 ± flat_variation, so use G = 1 and
    # allow ±10 % on the standardised spread (25 000 pixels, seeded: sampling error of the spread ≈ 1 %).
    var = np.exp(y0) / params.flat_counts + 1 / (2 * params.flat_counts)
    z = resid / np.sqrt(var)
    assert 0.9 < z.std() < 1.1
    # unbiased: the shared flat noise makes pixels correlated across angles (≈ 0.02 std of the mean); 4σ
    assert abs(z.mean()) < 0.08
    assert not np.array_equal(resid, 0)


def test_seeded_and_reproducible(tmp_path):
    params = SimulationParameters.preset("tiny", n_projections=5, gt_shape=(1, 16, 16), seed=3)
    a = simulate_scan(tmp_path / "a", params, progress=False)
    simulate_scan(tmp_path / "b", params, progress=False)
    for name in ("scan_000003.tif", "io000001.tif", "di000000.tif"):
        np.testing.assert_array_equal(
            tifffile.imread(tmp_path / "a/Projections/tubeV2" / name),
            tifffile.imread(tmp_path / "b/Projections/tubeV2" / name),
        )
    other = simulate_scan(
        tmp_path / "c",
        SimulationParameters.preset("tiny", n_projections=5, gt_shape=(1, 16, 16), seed=4),
        progress=False,
    )
    assert a["phantom"] != other["phantom"]


def test_refuses_to_overwrite_and_overwrite_removes_stale_files(tmp_path):
    out = tmp_path / "scan"
    base = ["simulate", "--preset", "tiny", "--out", str(out), "--no-progress", "--gt-shape", "1", "16", "16"]
    assert main(base + ["--projections", "9"]) == 0
    assert main(base + ["--projections", "5"]) == 2
    assert main(base + ["--projections", "5", "--overwrite"]) == 0
    files = sorted(p.name for p in (out / "Projections/tubeV2").glob("scan_*.tif"))
    assert files == [f"scan_{k:06}.tif" for k in range(5)]  # no stale scan_000005 … scan_000008
    # a non-empty folder that is not a simulated scan (it may be real data) is never cleared
    real = tmp_path / "real"
    (real / "Projections").mkdir(parents=True)
    (real / "Projections" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not a scan written by ctuq simulate"):
        simulate_scan(real, SimulationParameters.preset("tiny"), overwrite=True, progress=False)
    assert (real / "Projections" / "keep.txt").exists()


def test_cli_help_and_tiny_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in (
        "--out",
        "--preset",
        "--projections",
        "--det-rows",
        "--orbits",
        "--no-noise",
        "--seed",
        "--overwrite",
        "walnut",
        "bundled",
        "tiny",
        "examples:",
    ):
        assert opt in text
    out = tmp_path / "w"
    rc = main(
        [
            "simulate",
            "--preset",
            "tiny",
            "--out",
            str(out),
            "--projections",
            "5",
            "--det-cols",
            "48",
            "--pixel-size",
            "2.4",
            "--gt-shape",
            "3",
            "32",
            "32",
            "--gt-voxel-size",
            "1.6",
            "--seed",
            "7",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "wrote" in capsys.readouterr().err
    side = json.loads((out / "ctuq_simulation.json").read_text())
    assert side["parameters"]["seed"] == 7 and side["parameters"]["det_cols"] == 48
    assert tifffile.imread(out / "Projections/tubeV2/scan_000004.tif").shape == (48, 8)
    d = read_slice(WalnutScan(out), angular_subsampling=1, detector_subsampling=1)
    assert tuple(d.y.shape) == (4, 48) and tuple(d.ground_truth.shape) == (32, 32)
    assert d.meta["gt_voxel_size_mm"] == 1.6  # from the sidecar


def test_bad_parameters_are_named(capsys):
    with pytest.raises(ValueError, match="uint16"):
        SimulationParameters(flat_counts=7e4)
    with pytest.raises(ValueError, match="source_detector"):
        SimulationParameters(source_origin=100.0, source_detector=50.0)
    with pytest.raises(ValueError, match="unknown simulation preset"):
        SimulationParameters.preset("huge")
    with pytest.raises(ValueError, match="orbits"):
        SimulationParameters(orbits=(2, 4))
    assert main(["simulate", "--out", "/nonexistent/x", "--projections", "1"]) == 2
    assert "n_projections" in capsys.readouterr().err
