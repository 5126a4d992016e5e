"""ctuq.outputs: image TIFFs that ImageJ/Fiji and napari read at physical scale (ImageJ metadata: pixel pitch in mm,
unit, slice spacing), bit-for-bit pixel values, the multi-channel stack (output.stack) and a run's files."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import tifffile
import torch
from tiny import tiny_args

from ctuq.cli import main
from ctuq.config import ConfigError, load_config
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.outputs import (
    read_results_h5,
    read_tiff,
    result_channels,
    voxel_size_of,
    write_results_h5,
    write_stack,
    write_tiff,
)
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.phases import RunState, phase_write


def _awkward(shape, seed=0, special=True):
    """Random float32 values and (``special``) some whose bits must survive the writer: NaN, ±inf, −0, the smallest
    subnormal, the largest."""
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if special:
        a.reshape(-1)[:6] = [np.nan, np.inf, -np.inf, -0.0, np.float32(1e-45), np.finfo(np.float32).max]
    return a


def _same_bits(a, b):
    return (
        a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    )


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7)])
def test_image_tiffs_carry_the_voxel_size_and_keep_every_bit(tmp_path, shape):
    a = _awkward(shape)
    path = write_tiff(tmp_path / "x.tif", torch.from_numpy(a), voxel_size=0.4)
    assert _same_bits(tifffile.imread(path), a)  # readers that ignore the metadata see the same array
    with tifffile.TiffFile(path) as tif:
        meta = tif.imagej_metadata
        assert tif.series[0].axes == ("YX" if len(shape) == 2 else "ZYX")
        xres, yres = tif.pages[0].tags["XResolution"].value, tif.pages[0].tags["YResolution"].value
    assert meta["unit"] == "mm" and xres == yres and xres[0] / xres[1] == pytest.approx(1 / 0.4, rel=1e-9)
    assert ("spacing" in meta) == (len(shape) == 3) and meta.get("spacing", 0.4) == pytest.approx(0.4)
    arr, voxel = read_tiff(path)
    assert _same_bits(arr, a) and voxel == pytest.approx(0.4, rel=1e-9)


def test_without_a_voxel_size_a_tiff_has_no_physical_unit(tmp_path):
    path = write_tiff(tmp_path / "x.tif", np.ones((4, 4), np.float32))
    with tifffile.TiffFile(path) as tif:
        assert tif.imagej_metadata is not None and "unit" not in tif.imagej_metadata
    assert read_tiff(path)[1] is None
    tifffile.imwrite(tmp_path / "plain.tif", np.ones((4, 4), np.float32))  # a TIFF from elsewhere
    assert read_tiff(tmp_path / "plain.tif")[1] is None


def test_voxel_size_of_geometries_operators_and_data():
    vol = VolumeGeometry((4, 4), 0.25)
    assert voxel_size_of(vol) == 0.25 and voxel_size_of(SimpleNamespace(volume=vol)) == 0.25
    assert voxel_size_of(SimpleNamespace(volume=None)) is None and voxel_size_of(None) is None


@pytest.mark.parametrize("shape", [(6, 5), (2, 6, 5)])
def test_stack_holds_the_channels_bit_for_bit(tmp_path, shape):
    rec, std, gt = _awkward(shape, 1, False), np.abs(_awkward(shape, 2)), _awkward(shape, 3, False)
    channels = result_channels(torch.from_numpy(rec), std, gt)
    assert list(channels) == ["reconstruction", "std", "error", "ground truth"]
    assert _same_bits(channels["error"], np.abs(rec - gt))
    path = write_stack(tmp_path / "s.tif", channels, voxel_size=0.4)
    arr, voxel = read_tiff(path)
    caxis = 0 if len(shape) == 2 else 1
    assert arr.shape == (*shape[: len(shape) - 2], 4, *shape[-2:]) and voxel == pytest.approx(0.4)
    for i, image in enumerate(channels.values()):
        assert _same_bits(np.take(arr, i, axis=caxis), image)
    with tifffile.TiffFile(path) as tif:
        assert tif.series[0].axes == ("CYX" if len(shape) == 2 else "ZCYX")
        assert tif.imagej_metadata["Labels"] == list(channels) * (1 if len(shape) == 2 else shape[0])
    assert list(result_channels(rec)) == ["reconstruction"]
    with pytest.raises(ValueError, match="shape"):
        result_channels(rec, std[..., :-1])
    with pytest.raises(ValueError, match="one shape"):
        write_stack(tmp_path / "t.tif", {"a": rec, "b": rec[..., :-1]})


def test_results_h5_round_trip(tmp_path):
    volume = VolumeGeometry((6, 5), 0.4, (0.1, -0.2))
    geometry = ProjectionGeometry("fanflat", (7,), angles=np.linspace(0, 3, 4), det_spacing=0.5, source_origin=50.0,
                                  origin_det=20.0)  # fmt: skip
    images = {"reconstruction": _awkward((6, 5)), "ground truth": _awkward((6, 5), 1, False)}
    path = write_results_h5(tmp_path / "r.h5", images, volume=volume, geometry=geometry, attrs={"seed": 3})
    back, vol, geo = read_results_h5(path)
    assert list(back) == sorted(images) and all(_same_bits(back[k], images[k]) for k in images)
    assert vol == volume
    vec = geometry.to_vectors()  # stored as ASTRA-layout vectors, whatever the kind
    assert geo.kind == "fanflat_vec" and geo.det_shape == (7,) and np.array_equal(geo.vectors, vec.vectors)
    assert np.array_equal(geo.angles, geometry.angles)


@pytest.mark.parametrize("key", ["stack", "hdf5"])
def test_output_stack_and_hdf5_are_validated_config_keys(capsys, key):
    assert getattr(load_config(None, []).output, key) is False
    assert getattr(load_config(None, [f"output.{key}=true"]).output, key) is True
    with pytest.raises(ConfigError, match=f"output.{key} must be true or false, got 'maybe'"):
        load_config(None, [f"output.{key}=maybe"])
    assert main(["reconstruct", "--no-uq", "--set", f"output.{key}=2"]) == 2
    assert capsys.readouterr().err == (
        f"ctuq reconstruct: --set output.{key}=2: output.{key} must be true or false, got 2 (int)\n"
    )


def test_phase_write_puts_the_std_into_the_stack(tmp_path):
    cfg = load_config(None, ["output.stack=true", "output.figure=false"])
    state = RunState(cfg=cfg, out_dir=tmp_path, device=torch.device("cpu"), progress=False)
    rec, std, gt = (torch.from_numpy(np.abs(_awkward((8, 8), s, False))) for s in (4, 5, 6))
    state.op = SimpleNamespace(volume=VolumeGeometry((8, 8), 0.8))
    state.images["dip"], state.ground_truth, state.uq_result = rec, gt, SimpleNamespace(std=std, stats={"route": "cg"})
    phase_write(state)
    arr, voxel = read_tiff(tmp_path / rf.STACK_NAME)
    assert voxel == pytest.approx(0.8) and arr.shape == (4, 8, 8)
    assert _same_bits(arr[1], std.numpy()) and _same_bits(arr[3], gt.numpy())
    assert read_tiff(tmp_path / rf.GROUND_TRUTH_NAME)[1] == pytest.approx(0.8)


def test_a_run_writes_its_images_at_their_voxel_size(tiny_scan, tmp_path):
    out = tmp_path / "run"
    fast = tiny_args("dip.iterations=2", "output.figure=false", "output.stack=true", "output.hdf5=true", uq=False)
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *fast]) == 0
    voxel = json.loads((out / rf.METRICS_NAME).read_text())["data"]["voxel_size_mm"]
    assert voxel > 0
    images = {}
    for name in (rf.RECONSTRUCTION_NAME, rf.FBP_NAME, rf.GROUND_TRUTH_NAME):
        images[name], v = read_tiff(out / name)
        assert images[name].shape == (32, 32) and v == pytest.approx(voxel, rel=1e-9), name
    stack, v = read_tiff(out / rf.STACK_NAME)  # no uncertainty phase: reconstruction, error, ground truth
    assert stack.shape == (3, 32, 32) and v == pytest.approx(voxel, rel=1e-9)
    assert _same_bits(stack[0], images[rf.RECONSTRUCTION_NAME]) and _same_bits(stack[2], images[rf.GROUND_TRUTH_NAME])
    assert _same_bits(stack[1], np.abs(stack[0] - stack[2]))
    h5, volume, geometry = read_results_h5(out / rf.RESULTS_H5_NAME)
    assert sorted(h5) == ["error", "fbp", "ground truth", "reconstruction", "tv"]
    assert _same_bits(h5["reconstruction"], stack[0]) and _same_bits(h5["fbp"], images[rf.FBP_NAME])
    m = json.loads((out / rf.METRICS_NAME).read_text())["data"]
    assert volume.shape == (32, 32) and volume.voxel_size == pytest.approx(voxel)
    assert geometry.measurement_shape == tuple(m["measurement_shape"])
