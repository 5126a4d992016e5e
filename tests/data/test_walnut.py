"""Walnut loader: the chain test that pins every convention, subsampling, resampling, bad input, bundled scan."""

import json
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch

from ctuq.data import (
    CTData,
    SimulationParameters,
    WalnutFormatError,
    WalnutScan,
    area_average,
    default_data_dir,
    load_slice,
    load_volume,
    read_slice,
    read_volume,
    simulate_scan,
    walnut_phantom,
)
from ctuq.errors import CTUQError, is_user_error
from ctuq.geometry import VolumeGeometry
from ctuq.operators import SparseRayTransform

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scan(tmp_path_factory):
    """A noisy tiny scan (3×3 sub-rays per pixel, Poisson noise) with orbits 1 and 2; orbit 1's source 1 mm up."""
    out = tmp_path_factory.mktemp("walnut") / "Walnut1"
    params = SimulationParameters.preset("tiny", orbits=(1, 2), orbit_height=1.0)
    simulate_scan(out, params, preset="tiny", progress=False)
    return out, params


@pytest.fixture
def broken(scan, tmp_path):
    """A fresh copy of the tiny scan to damage."""
    dst = tmp_path / "Walnut9"
    shutil.copytree(scan[0], dst)
    return dst


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_chain_ground_truth_through_the_operator_reproduces_the_sinogram(scan):
    out, params = scan
    d = load_slice(WalnutScan(out), angular_subsampling=1, detector_subsampling=1)
    assert isinstance(d, CTData) and isinstance(d.op, SparseRayTransform)
    assert tuple(d.y.shape) == d.op.measurement_shape == (params.n_projections - 1, params.det_cols)
    assert tuple(d.ground_truth.shape) == d.op.image_shape == params.gt_shape[1:]
    assert d.y.dtype == torch.float32 and d.ground_truth.dtype == torch.float32
    # T applied to the loaded ground-truth slice vs the loaded (noisy, pixel-integrated) sinogram: agreement to a
    # few % (noise ≈ 1 %, detector-pixel blur, 0.4 mm GT pixels); any flip or transpose of the image is ≥ 5× worse.
    err = _rel(d.op(d.ground_truth), d.y)
    assert err < 0.04
    for wrong in (d.ground_truth.flip(0), d.ground_truth.flip(1), d.ground_truth.T.contiguous()):
        assert _rel(d.op(wrong), d.y) > 5 * err
    # a finely rasterised slice of the phantom (0.2 mm) on the same geometry does as well
    phantom = walnut_phantom(params.seed)
    fine = VolumeGeometry((256, 256), params.gt_voxel_size * params.gt_shape[1] / 256)
    x = phantom.rasterize(fine, z=d.meta["z_mm"], supersampling=2)
    op_fine = SparseRayTransform(fine, d.geometry)
    assert _rel(op_fine(torch.from_numpy(x).float()), d.y) < 0.04


def test_subsampling_picks_rows_files_and_columns(scan):
    out, params = scan
    n = params.n_projections
    full = read_slice(WalnutScan(out), angular_subsampling=1, detector_subsampling=1)
    sub = read_slice(WalnutScan(out), angular_subsampling=4, detector_subsampling=2)
    rows = np.arange(0, n - 1, 4)
    assert sub.meta["geometry_rows"] == rows.tolist()
    assert sub.meta["projection_files"] == [f"scan_{n - 1 - r:06}.tif" for r in rows]
    assert sub.meta["detector_columns"] == {"first": 0, "last": params.det_cols - 2, "step": 2, "mode": "subsample"}
    np.testing.assert_array_equal(sub.y.numpy(), full.y.numpy()[rows][:, ::2])
    np.testing.assert_allclose(
        sub.geometry.detector_centers(), full.geometry.detector_centers()[rows][:, ::2], atol=1e-10
    )
    # binning: wider pixels centred on their column pairs, less noise, same signal
    binned = read_slice(WalnutScan(out), angular_subsampling=4, detector_subsampling=2, detector_binning=True)
    c_full = full.geometry.detector_centers()[rows]
    np.testing.assert_allclose(
        binned.geometry.detector_centers(), 0.5 * (c_full[:, 0::2] + c_full[:, 1::2]), atol=1e-10
    )
    pair_mean = 0.5 * (full.y.numpy()[rows][:, 0::2] + full.y.numpy()[rows][:, 1::2])
    assert np.abs(binned.y.numpy() - pair_mean).max() < 0.03  # −log of a mean vs mean of −log: a small gap
    json.dumps(sub.meta)  # JSON-serialisable


def test_coarser_image_shape_area_averages_the_ground_truth(scan):
    out, params = scan
    d = read_slice(WalnutScan(out), image_shape=(60, 60), angular_subsampling=8, detector_subsampling=2)
    fine = read_slice(WalnutScan(out), angular_subsampling=8, detector_subsampling=2)
    assert tuple(d.ground_truth.shape) == (60, 60)
    assert d.volume.voxel_size == pytest.approx(params.gt_voxel_size * 128 / 60)
    assert float(d.ground_truth.double().mean()) == pytest.approx(float(fine.ground_truth.double().mean()), rel=1e-6)
    np.testing.assert_array_equal(d.y.numpy(), fine.y.numpy())  # same data, only the grid differs


def test_area_average_is_exact_for_any_ratio():
    rng = np.random.default_rng(0)
    a = rng.random((501, 501))
    b = area_average(a, (128, 128))
    assert b.shape == (128, 128)
    assert b.mean() == pytest.approx(a.mean(), rel=1e-12)
    np.testing.assert_allclose(area_average(np.full((501, 501), 3.0), (128, 128)), 3.0, rtol=1e-12)
    # integer factors are plain block means; 3D works axis by axis
    c = rng.random((8, 12, 12))
    np.testing.assert_allclose(area_average(c, (4, 3, 3)), c.reshape(4, 2, 3, 4, 3, 4).mean(axis=(1, 3, 5)), rtol=1e-12)
    # one output pixel straddling two inputs takes their overlap-weighted mean: 3 → 2 gives [a0 + a1/2, a1/2 + a2]·2/3
    np.testing.assert_allclose(area_average(np.array([1.0, 4.0, 7.0]), (2,)), [2.0, 6.0])


def test_off_plane_slice_warns_with_the_cone_angle(scan):
    out, params = scan
    with pytest.warns(UserWarning, match=r"cone angle up to 0\.69"):  # atan(0.8 mm / 66 mm)
        d = read_slice(WalnutScan(out), slice_index=0, angular_subsampling=8, detector_subsampling=2)
    assert d.meta["z_mm"] == pytest.approx(-0.8) and not d.meta["exact_fan_geometry"]
    with pytest.warns(UserWarning, match="cone angle"):
        read_slice(WalnutScan(out, orbit=1), angular_subsampling=8, detector_subsampling=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the central slice of orbit 2 is exact: no warning
        read_slice(WalnutScan(out), angular_subsampling=8, detector_subsampling=2)
    with pytest.raises(WalnutFormatError, match="outside the 8 detector rows"):
        read_slice(WalnutScan(out, voxel_size=3.0), slice_index=0, angular_subsampling=8)


def test_volume_reads_on_cpu_and_the_operator_needs_cuda(scan):
    out, params = scan
    d = read_volume(WalnutScan(out), angular_subsampling=8, detector_subsampling=2, detector_row_subsampling=1)
    assert d.op is None and d.geometry.kind == "cone_vec"
    assert tuple(d.y.shape) == (4, params.det_rows, params.det_cols // 2) == d.geometry.measurement_shape
    assert tuple(d.ground_truth.shape) == params.gt_shape
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            load_volume(WalnutScan(out), device="cpu")
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            load_slice(WalnutScan(out), backend="astra_cuda", device="cpu")


def test_only_the_needed_projection_files_are_read(broken):
    # with 32 angles and angular_subsampling 4 the files used are 32, 28, …, 4: file 1 is never opened
    (broken / "Projections/tubeV2/scan_000001.tif").write_bytes(b"not a tiff")
    d = read_slice(WalnutScan(broken), angular_subsampling=4, detector_subsampling=2)
    assert "scan_000001.tif" not in d.meta["projection_files"]
    with pytest.raises(WalnutFormatError, match="scan_000001.tif: not a readable TIFF"):
        read_slice(WalnutScan(broken), angular_subsampling=1, detector_subsampling=2)


# ------------------------------------------------------------------------------------------------ bad input
def _proj(folder: Path) -> Path:
    return folder / "Projections" / "tubeV2"


def _rewrite(path: Path, fn) -> None:
    tifffile.imwrite(path, fn(tifffile.imread(path)))


def test_missing_walnut_folder(tmp_path):
    with pytest.raises(WalnutFormatError, match=r"Nope does not exist") as info:
        read_slice(WalnutScan(tmp_path / "Nope"))
    # A user error (one line from the CLI, exit 2), and still a ValueError as it always was.
    assert isinstance(info.value, CTUQError) and isinstance(info.value, ValueError) and is_user_error(info.value)


def test_missing_orbit_folder(broken):
    with pytest.raises(WalnutFormatError, match=r"tubeV3: projection folder missing.*has tubeV1, tubeV2"):
        read_slice(WalnutScan(broken, orbit=3))


def test_missing_projection_file(broken):
    (_proj(broken) / "scan_000005.tif").unlink()
    with pytest.raises(WalnutFormatError, match=r"tubeV2: 1 of the files .* missing, first scan_000005.tif"):
        read_slice(WalnutScan(broken))


def test_projection_count_differs_from_geometry_rows(broken):
    shutil.copy(_proj(broken) / "scan_000000.tif", _proj(broken) / "scan_000033.tif")
    with pytest.raises(WalnutFormatError, match=r"scan_geom_corrected.geom: 33 geometry rows, but the folder has 34"):
        read_slice(WalnutScan(broken))


def test_missing_dark_frame(broken):
    (_proj(broken) / "di000000.tif").unlink()
    with pytest.raises(WalnutFormatError, match=r"di000000.tif: file missing"):
        read_slice(WalnutScan(broken))


def test_geometry_with_wrong_number_of_columns(broken):
    geom = _proj(broken) / "scan_geom_corrected.geom"
    lines = geom.read_text().splitlines()
    lines[3] = " ".join(lines[3].split()[:11])
    geom.write_text("\n".join(lines) + "\n")
    with pytest.raises(WalnutFormatError, match=r"scan_geom_corrected.geom: line 4 has 11 columns; .* needs 12"):
        read_slice(WalnutScan(broken))


def test_geometry_with_nan(broken):
    geom = _proj(broken) / "scan_geom_corrected.geom"
    lines = geom.read_text().splitlines()
    lines[2] = "nan " + " ".join(lines[2].split()[1:])
    geom.write_text("\n".join(lines) + "\n")
    with pytest.raises(WalnutFormatError, match=r"scan_geom_corrected.geom: 1 geometry rows contain NaN or Inf"):
        read_slice(WalnutScan(broken))


def test_projection_with_wrong_shape(broken):
    _rewrite(_proj(broken) / "scan_000032.tif", lambda a: a[:-1])  # file 32 ↔ geometry row 0: always used
    with pytest.raises(WalnutFormatError, match=r"scan_000032.tif: image shape \(95, 8\) differs from the dark"):
        read_slice(WalnutScan(broken))


def test_flat_with_wrong_shape(broken):
    _rewrite(_proj(broken) / "io000001.tif", lambda a: a[:, :-2])
    with pytest.raises(WalnutFormatError, match=r"io000001.tif: image shape \(96, 6\) differs from the dark"):
        read_slice(WalnutScan(broken))


def test_flat_not_above_dark(broken):
    dark = tifffile.imread(_proj(broken) / "di000000.tif")
    for name in ("io000000.tif", "io000001.tif"):
        _rewrite(_proj(broken) / name, lambda a: np.where(np.arange(a.shape[0])[:, None] == 40, dark, a))
    with pytest.raises(WalnutFormatError, match=r"tubeV2: flat field ≤ dark at \d+ used pixels"):
        read_slice(WalnutScan(broken), detector_subsampling=1)


def test_projection_with_nan(broken):
    _rewrite(_proj(broken) / "scan_000032.tif", lambda a: np.where(a == a.max(), np.nan, a.astype(np.float32)))
    with pytest.raises(WalnutFormatError, match=r"scan_000032.tif: 1 pixels are NaN or Inf"):
        read_slice(WalnutScan(broken))


def test_projection_with_non_positive_transmission(broken):
    dark = tifffile.imread(_proj(broken) / "di000000.tif")
    _rewrite(_proj(broken) / "scan_000032.tif", lambda a: np.minimum(a, dark))  # counts at or below dark
    with pytest.raises(
        WalnutFormatError,
        match=r"scan_000032.tif: \d+ used pixels have counts ≤ dark, i.e. "
        r"non-positive transmission",
    ):
        read_slice(WalnutScan(broken))


def test_ground_truth_slice_with_wrong_shape(broken):
    _rewrite(broken / "Reconstructions" / "full_AGD_50_000002.tiff", lambda a: a[:, :100])
    with pytest.raises(WalnutFormatError, match=r"full_AGD_50_000002.tiff: shape \(128, 100\) differs"):
        read_slice(WalnutScan(broken))


def test_unfinished_simulation(broken):
    side = json.loads((broken / "ctuq_simulation.json").read_text())
    side["complete"] = False
    (broken / "ctuq_simulation.json").write_text(json.dumps(side))
    with pytest.raises(WalnutFormatError, match="did not finish"):
        read_slice(WalnutScan(broken))


def test_without_reconstructions_there_is_no_ground_truth(broken):
    shutil.rmtree(broken / "Reconstructions")
    d = read_slice(WalnutScan(broken), angular_subsampling=8, detector_subsampling=2)
    assert d.ground_truth is None and d.volume.shape == (128, 128)  # grid from the sidecar


# ------------------------------------------------------------------------------------------------ bundled scan
def test_default_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("CTUQ_DATA", raising=False)
    assert default_data_dir() == REPO / "data" / "Walnut1"
    monkeypatch.setenv("CTUQ_DATA", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.setenv("CTUQ_DATA", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="CTUQ_DATA"):
        default_data_dir()


def test_bundled_scan_loads_with_the_demo_settings():
    path = REPO / "data" / "Walnut1"
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 4.2e6
    t0 = time.perf_counter()
    d = load_slice(
        WalnutScan(path),
        angular_subsampling=4,
        detector_subsampling=2,
        image_shape=(128, 128),
        backend="sparse",
        progress=False,
    )
    elapsed = time.perf_counter() - t0
    assert tuple(d.y.shape) == d.op.measurement_shape == (60, 128)
    assert d.op.image_shape == (128, 128) and tuple(d.ground_truth.shape) == (128, 128)
    assert d.meta["z_mm"] == 0.0 and d.meta["exact_fan_geometry"]
    assert d.volume.voxel_size == pytest.approx(0.4)
    # the 128 columns span the real detector's width (768 × 0.1496 mm); the plane z = 0 crosses the slightly
    # tilted detector (0.08°) along a line 1/cos(tilt) ≈ 1 + 1e-6 longer than a row
    span = np.linalg.norm(d.geometry.detector_centers()[0, -1] - d.geometry.detector_centers()[0, 0])
    assert span == pytest.approx(127 * 2 * 3 * 0.1496, rel=1e-5)
    assert 14 * float(d.ground_truth.max()) <= 1.0
    assert _rel(d.op(d.ground_truth), d.y) < 0.05
    assert elapsed < 5.0, elapsed  # generous: measured ≈ 1 s on a 2-core CPU


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_cone_slice_backend_matches_the_fan_slice_in_the_source_plane(scan):
    out, _ = scan
    fan = load_slice(WalnutScan(out), angular_subsampling=2, detector_subsampling=1, device="cuda")
    cone = load_slice(
        WalnutScan(out), angular_subsampling=2, detector_subsampling=1, backend="astra_cuda", device="cuda"
    )
    assert cone.op.image_shape == fan.op.image_shape and cone.op.measurement_shape == fan.op.measurement_shape
    torch.testing.assert_close(cone.y, fan.y)
    gt = fan.ground_truth.cuda()
    # different discretisations (line kernel vs ASTRA CUDA's), same exact geometry in the plane z = 0
    assert _rel(cone.op(gt), fan.op(gt)) < 0.03
    assert _rel(cone.op(gt), cone.y) < 0.05


@pytest.mark.gpu
def test_volume_loads_on_gpu_and_reproduces_the_projections(scan):
    out, params = scan
    d = load_volume(WalnutScan(out), angular_subsampling=2, detector_subsampling=1, device="cuda")
    assert d.op.image_shape == params.gt_shape and d.op.measurement_shape == tuple(d.y.shape)
    # the 2 mm thick GT slab explains the detector rows that look through it only: compare those rows
    rows = slice(2, 5)
    proj = d.op(d.ground_truth.cuda())
    assert _rel(proj[:, rows], d.y[:, rows]) < 0.1
