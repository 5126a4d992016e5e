"""One simulated scan written in every layout (walnut folder, scan.yaml + .npy, scan.yaml + TIFF stacks, NXtomo) loads
to the same operator, bit-identical sinogram, variances and ground truth, and the same reconstruction; the format
registry detects each; hand-written parallel-beam and fan-beam descriptions of line integrals load as stated."""

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tiny import tiny_args

from ctuq.cli import main
from ctuq.data.formats import DATA_FORMATS, UnknownFormatError, detect_format, load_data, read_data, write_layouts
from ctuq.data.loader import read_slice, read_volume
from ctuq.data.scan_file import FORMAT_TAG, ScanFileError, open_scan_file
from ctuq.data.simulate import SimulationParameters, simulate_scan
from ctuq.data.walnut import WalnutScan
from ctuq.geometry import ProjectionGeometry
from ctuq.operators import make_ray_transform
from ctuq.operators.fbp import fbp

LAYOUTS = tuple(write_layouts())
# 16 angles × 4 rows × 32 columns, a 3 × 32² ground truth: the same field of view as the tiny preset, ~1 s
SMALL = dict(
    n_projections=17,
    det_rows=4,
    det_cols=32,
    pixel_size=3.6,
    gt_shape=(3, 32, 32),
    gt_voxel_size=1.6,
    gt_supersampling=1,
    supersampling=1,
    orbits=(2,),
)
LOAD = dict(angular_subsampling=1, detector_subsampling=1, backend="sparse", progress=False)


def _paths(root):
    return {
        "walnut": root / "walnut",
        "yaml-npy": root / "yaml-npy" / "scan.yaml",
        "yaml-tiff": root / "yaml-tiff",  # a folder holding scan.yaml
        "nxtomo": root / "nxtomo" / "scan.nxs",
    }


@pytest.fixture(scope="module")
def every_layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    params = SimulationParameters.preset("tiny", corrections=False, **SMALL)
    simulate_scan(root, params, preset="tiny", progress=False, layouts=LAYOUTS)
    return _paths(root)


@pytest.fixture(scope="module")
def corrected(tmp_path_factory):
    """With the per-orbit detector tilt and offsets (which scan.yaml can state and NXtomo cannot)."""
    root = tmp_path_factory.mktemp("corrected")
    params = SimulationParameters.preset("tiny", **SMALL)
    simulate_scan(root, params, preset="tiny", progress=False, layouts=("walnut", "yaml-npy"))
    return _paths(root)


def _assert_same(a, b, matrices=True):
    assert torch.equal(a.y, b.y)
    assert torch.equal(a.variances, b.variances)
    assert torch.equal(a.ground_truth, b.ground_truth)
    assert a.geometry.kind == b.geometry.kind and np.array_equal(a.geometry.vectors, b.geometry.vectors)
    assert a.volume == b.volume
    if matrices:
        d = (a.op.matrix != b.op.matrix).nnz
        assert d == 0 and np.array_equal(a.op.matrix.indices, b.op.matrix.indices)


def test_registry_detects_every_layout(every_layout):
    want = {"walnut": "walnut", "yaml-npy": "scan_yaml", "yaml-tiff": "scan_yaml", "nxtomo": "nxtomo"}
    for layout, path in every_layout.items():
        assert detect_format(path)[0].name == want[layout]
    assert list(DATA_FORMATS)[:3] == ["walnut", "scan_yaml", "nxtomo"]  # the built-ins, in detection order
    assert LAYOUTS[:4] == ("walnut", "yaml-npy", "yaml-tiff", "nxtomo")


def test_every_layout_loads_to_the_same_problem(every_layout):
    loaded = {k: load_data(p, image_shape=(16, 16), **LOAD) for k, p in every_layout.items()}
    ref = loaded["walnut"]
    assert tuple(ref.y.shape) == (16, 32) and ref.variances is not None
    for layout in LAYOUTS[1:]:
        _assert_same(ref, loaded[layout])
        # the same reconstruction: FBP (the DIP of the CLI test below starts from the same inputs)
        assert torch.equal(fbp(ref.op, ref.y), fbp(loaded[layout].op, loaded[layout].y))


def test_every_layout_gives_the_same_volume_and_subsampling(every_layout):
    walnut = read_volume(
        WalnutScan(every_layout["walnut"]), angular_subsampling=2, detector_subsampling=2, progress=False
    )
    for layout in LAYOUTS[1:]:
        other = read_data(every_layout[layout], ndim=3, angular_subsampling=2, detector_subsampling=2, progress=False)
        _assert_same(walnut, other, matrices=False)
        binned = dict(angular_subsampling=3, detector_subsampling=2, detector_binning=True, progress=False)
        w2 = read_data(every_layout["walnut"], **binned)
        o2 = read_data(every_layout[layout], **binned)
        _assert_same(w2, o2, matrices=False)


def test_detector_corrections_in_scan_yaml_match_the_walnut_layout(corrected):
    a = load_data(corrected["walnut"], image_shape=(16, 16), **LOAD)
    b = load_data(corrected["yaml-npy"], image_shape=(16, 16), **LOAD)
    _assert_same(a, b)


def test_cli_reconstructs_every_layout_identically(every_layout, tmp_path, capsys):
    layout = ("data.image_shape=[16, 16]", "data.angular_subsampling=1", "data.detector_subsampling=1")
    fast = tiny_args(*layout, "dip.iterations=3", "tv.enabled=false", uq=False)
    recs = {}
    for layout in ("walnut", "nxtomo"):
        out = tmp_path / layout
        assert main(["reconstruct", "--data", str(every_layout[layout]), "--out", str(out), *fast]) == 0
        recs[layout] = (out / "reconstruction.tif").read_bytes()
    assert recs["walnut"] == recs["nxtomo"]


def test_nxtomo_with_detector_corrections_is_refused_in_one_line(tmp_path, capsys):
    rc = main(["simulate", "--preset", "tiny", "--layout", "nxtomo", "--out", str(tmp_path / "s"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--no-corrections" in err[0] and err[0].startswith("ctuq simulate: ")
    rc = main(["simulate", "--layout", "zarr", "--out", str(tmp_path / "t"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "yaml-npy" in err[0]
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()


def test_unknown_path_names_what_each_format_expects(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UnknownFormatError, match=r"notes\.txt: not a scan ctuq reads .*scan description"):
        detect_format(tmp_path / "notes.txt")


# ------------------------------------------------------------------------------------------------ line integrals
def _write_description(folder, doc, **arrays):
    for name, a in arrays.items():
        np.save(folder / f"{name}.npy", a)
    path = folder / "scan.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_parallel_beam_line_integrals_load_as_stated(tmp_path):
    """A parallel beam of 3 rows with voxel = pixel: slice k is detector row k exactly, and the geometry is ASTRA's
    parallel geometry (its operator reproduces the file's line integrals)."""
    rng = np.random.default_rng(0)
    n, rows, cols, px = 12, 3, 16, 0.5
    doc = {
        "format": FORMAT_TAG,
        "geometry": {"type": "parallel", "centre_of_rotation_offset": 0.0},
        "detector": {"rows": rows, "columns": cols, "pixel_size": px},
        "angles": {"unit": "radian", "start": 0.0, "stop": float(np.pi), "count": n},
        "measurements": {"type": "line_integrals", "projections": "lines.npy", "variances": "var.npy"},
    }
    lines = rng.uniform(0.1, 2.0, (n, rows, cols))
    var = rng.uniform(0.5, 1.5, (n, rows, cols))
    scan = open_scan_file(_write_description(tmp_path, doc, lines=lines, var=var))
    assert scan.gt_shape == (rows, cols, cols) and scan.voxel_size == px
    for k in range(rows):
        d = read_slice(scan, slice_index=k)
        assert torch.equal(d.y, torch.from_numpy(lines[:, k].astype(np.float32)))
        assert torch.equal(d.variances, torch.from_numpy(var[:, k].astype(np.float32)))
    assert d.geometry.kind == "parallel_vec"
    # the operator of the parallel_vec geometry equals that of ASTRA's angle-based parallel geometry
    ref = make_ray_transform(d.volume, _astra_parallel(n, cols, px))
    op = make_ray_transform(d.volume, d.geometry)
    x = torch.rand(d.volume.shape, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(op(x), ref(x), atol=1e-4)


def _astra_parallel(n, cols, px):
    return ProjectionGeometry("parallel", (cols,), angles=np.arange(n) * np.pi / n, det_spacing=px)


def test_fan_beam_sinogram_of_one_row(tmp_path):
    n, cols = 10, 16
    doc = {
        "format": FORMAT_TAG,
        "units": "cm",
        "geometry": {"type": "fan", "source_object_distance": 10.0, "object_detector_distance": 5.0},
        "detector": {"rows": 1, "columns": cols, "pixel_size": 0.15},
        "angles": {"unit": "degree", "file": "angles.npy"},
        "measurements": {"type": "line_integrals", "projections": "sino.npy"},
    }
    sino = np.linspace(0.0, 1.0, n * cols).reshape(n, cols)  # (angle, column): a one-row detector
    path = _write_description(tmp_path, doc, angles=np.linspace(0.0, 324.0, n), sino=sino)
    d = read_data(path, detector_subsampling=2)
    assert torch.equal(d.y, torch.from_numpy(sino[:, ::2].astype(np.float32)))
    assert d.variances is None and d.geometry.kind == "fanflat_vec"
    src = d.geometry.vectors[0, :2]
    assert np.allclose(src, [0.0, -100.0])  # 10 cm in mm, source at angle 0 on −y (ASTRA)
    assert d.volume.shape == (cols, cols) and np.isclose(d.volume.voxel_size, 1.5 * 100 / 150)


@pytest.mark.parametrize("doc", ["docs/data_formats.md", "docs/guide.md"])
def test_documented_scan_yaml_examples_are_valid(doc, tmp_path):
    """The first ``format: ctuq-scan-1`` YAML block of each document passes every key check; only its arrays are
    missing here."""
    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    block = next(b.split("```", 1)[0] for b in text.split("```yaml\n")[1:] if b.startswith("format: ctuq-scan-1"))
    (tmp_path / "scan.yaml").write_text(block)
    with pytest.raises(ScanFileError, match=r"scan\.yaml: measurements\.projections: .*projections\.npy: file missing"):
        open_scan_file(tmp_path / "scan.yaml")
