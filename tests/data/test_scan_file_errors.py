"""Every malformed scan description or NXtomo file gives one line naming the file and the key (a CTUQError: the user
error ``ctuq reconstruct --data`` prints as it is), and the command prints that line and exits 2."""

import re
import shutil

import h5py
import numpy as np
import pytest
import yaml
from tiny import QUICK, tiny_args

from ctuq.cli import main
from ctuq.data.formats import load_data
from ctuq.data.nxtomo import NXtomoError
from ctuq.data.scan_file import ScanFileError
from ctuq.data.simulate import SimulationParameters, simulate_scan
from ctuq.errors import CTUQError, format_user_error, is_user_error

SMALL = dict(
    n_projections=17,
    det_rows=4,
    det_cols=16,
    pixel_size=7.2,
    gt_shape=(3, 16, 16),
    gt_voxel_size=3.2,
    gt_supersampling=1,
    supersampling=1,
    orbits=(2,),
)
FAST = tiny_args("data.angular_subsampling=1", "data.detector_subsampling=1", *QUICK, uq=False)


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("CTUQ_DEBUG", raising=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("scan")
    params = SimulationParameters.preset("tiny", corrections=False, **SMALL)
    simulate_scan(root, params, preset="tiny", progress=False, layouts=("yaml-npy", "nxtomo"))
    return root


@pytest.fixture
def scan(base, tmp_path):
    dst = tmp_path / "scan"
    shutil.copytree(base / "yaml-npy", dst)
    return dst


@pytest.fixture
def nxs(base, tmp_path):
    dst = tmp_path / "scan.nxs"
    shutil.copy(base / "nxtomo" / "scan.nxs", dst)
    return dst


def _edit(folder, fn):
    path = folder / "scan.yaml"
    doc = yaml.safe_load(path.read_text())
    fn(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def _array(folder, name, fn):
    a = np.load(folder / f"{name}.npy")
    np.save(folder / f"{name}.npy", fn(a))


def _set(section, key, value):
    return lambda f: _edit(f, lambda d: d[section].__setitem__(key, value))


def _delete(section, key):
    return lambda f: _edit(f, lambda d: d[section].pop(key))


def _nan_projection(f):
    def put(a):
        a = a.astype(np.float64)
        a[3, 1, 2] = np.nan
        return a

    _array(f, "projections", put)


def _hdf5_projections(dataset):
    def damage(f):
        with h5py.File(f / "proj.h5", "w") as h:
            h["/data/projections"] = np.load(f / "projections.npy")
        _edit(f, lambda d: d["measurements"].__setitem__("projections", {"file": "proj.h5", "dataset": dataset}))

    return damage


# (damage, key named, pattern of the rest of the message)
YAML_CASES = {
    "missing_key": (_delete("detector", "columns"), "detector.columns", r"missing"),
    "missing_section": (lambda f: _edit(f, lambda d: d.pop("angles")), "angles", r"missing"),
    "unknown_key": (_set("geometry", "magnification", 3.0), "geometry.magnification", r"unknown key; valid keys"),
    "unknown_top_key": (lambda f: _edit(f, lambda d: d.__setitem__("pixels", 3)), "pixels", r"unknown key"),
    "wrong_shape": (
        lambda f: _array(f, "projections", lambda a: np.ascontiguousarray(a.transpose(0, 2, 1))),
        "measurements.projections",
        r"projections\.npy: shape \(16, 16, 4\) is not \(angle, row, column\) = \(16, 4, 16\)",
    ),
    "angle_count": (_set("angles", "count", 15), "measurements.projections", r"16 projections but the angles give 15"),
    "negative_source": (_set("geometry", "source_object_distance", -66.0), "geometry.source_object_distance", r"posit"),
    "negative_detector": (
        _set("geometry", "object_detector_distance", -1.0),
        "geometry.object_detector_distance",
        "neg",
    ),
    "flats_not_above_darks": (
        lambda f: shutil.copy(f / "darks.npy", f / "flats.npy"),
        "measurements.flats",
        r"mean flat ≤ mean dark at \d+ pixels",
    ),
    "nan_projection": (_nan_projection, "measurements.projections", r"projections\.npy: 1 values .* NaN or Inf"),
    "nan_flat": (
        lambda f: _array(f, "flats", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a)),
        "measurements.flats",
        r"flats\.npy: 1 values of flats are NaN",
    ),
    "missing_file": (
        _set("measurements", "projections", "nowhere.npy"),
        "measurements.projections",
        r"nowhere\.npy: file missing",
    ),
    "wrong_hdf5_path": (_hdf5_projections("/data/proj"), "measurements.projections", r"no dataset '/data/proj'"),
    "bad_unit": (_set("angles", "unit", "gradian"), "angles.unit", r"'gradian' unknown; valid: degree, radian"),
    "wrong_version": (lambda f: _edit(f, lambda d: d.__setitem__("format", "ctuq-scan-0")), "format", r"must be"),
    "not_yaml": (lambda f: (f / "scan.yaml").write_text("geometry: [unclosed\n"), "", r"not valid YAML"),
    "zero_pixel": (_set("detector", "pixel_size", 0), "detector.pixel_size", r"must be positive"),
    "variances_with_counts": (_set("measurements", "variances", "x.npy"), "measurements.variances", r"only for line"),
}


@pytest.mark.parametrize("case", YAML_CASES, ids=str)
def test_malformed_scan_yaml_is_one_line_naming_file_and_key(case, scan):
    damage, key, pattern = YAML_CASES[case]
    damage(scan)
    with pytest.raises(ScanFileError) as info:
        load_data(scan / "scan.yaml", angular_subsampling=1, detector_subsampling=1, progress=False)
    msg = str(info.value)
    assert isinstance(info.value, CTUQError) and "\n" not in msg
    assert is_user_error(info.value) and format_user_error(info.value) == msg  # what the command prints
    assert msg.startswith(str(scan / "scan.yaml")) and (f": {key}: " in msg or not key), msg
    assert re.search(pattern, msg), msg


def _nx(key, fn):
    def damage(path):
        with h5py.File(path, "r+") as f:
            fn(f, f[f"entry/{key}"] if key in f["entry"] else None)

    return damage


def _replace(f, ds, value):
    name, attrs = ds.name, dict(ds.attrs)
    del f[name]
    new = f.create_dataset(name, data=value)
    new.attrs.update(attrs)


NX_CASES = {
    "no_darks": (
        _nx("instrument/detector/image_key", lambda f, ds: _replace(f, ds, np.where(ds[()] == 2, 1, ds[()]))),
        r"instrument/detector/image_key: no darks \(image_key 2\)",
    ),
    "angle_count": (
        _nx("sample/rotation_angle", lambda f, ds: _replace(f, ds, ds[()][:-1])),
        r"sample/rotation_angle: 18 angles but the data have 19 frames",
    ),
    "negative_distance": (
        _nx("instrument/detector/distance", lambda f, ds: _replace(f, ds, -133.0)),
        r"instrument/detector/distance: must not be negative",
    ),
    "nan_angle": (
        _nx("sample/rotation_angle", lambda f, ds: _replace(f, ds, np.where(np.arange(ds.size) == 4, np.nan, ds[()]))),
        r"sample/rotation_angle: 1 projection angles are NaN",
    ),
    "missing_pixel_size": (
        _nx("instrument/detector/x_pixel_size", lambda f, ds: f.__delitem__(ds.name)),
        r"instrument/detector/x_pixel_size: missing",
    ),
    "flats_not_above_darks": (
        _nx(
            "instrument/detector/image_key",
            lambda f, ds: _replace(f, ds, np.where(ds[()] == 1, 2, np.where(ds[()] == 2, 1, ds[()]))),
        ),
        r"instrument/detector/data: mean flat ≤ mean dark",
    ),
    "bad_units": (
        _nx("instrument/detector/x_pixel_size", lambda f, ds: ds.attrs.__setitem__("units", "furlong")),
        r"x_pixel_size: units 'furlong' unknown",
    ),
}


@pytest.mark.parametrize("case", NX_CASES, ids=str)
def test_malformed_nxtomo_is_one_line_naming_file_and_path(case, nxs):
    damage, pattern = NX_CASES[case]
    damage(nxs)
    with pytest.raises(NXtomoError) as info:
        load_data(nxs, angular_subsampling=1, detector_subsampling=1, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{nxs}:/entry/"), msg
    assert is_user_error(info.value) and format_user_error(info.value) == msg  # what the command prints
    assert re.search(pattern, msg), msg


@pytest.mark.parametrize("kind", ["yaml", "nxtomo"])
def test_the_command_prints_the_line_and_exits_2(kind, scan, nxs, tmp_path, capsys):
    if kind == "yaml":
        data, (damage, _, _) = scan / "scan.yaml", YAML_CASES["missing_key"]
        damage(scan)
    else:
        data, (damage, _) = nxs, NX_CASES["no_darks"]
        damage(nxs)
    with pytest.raises(CTUQError) as info:
        load_data(data, angular_subsampling=1, detector_subsampling=1, progress=False)
    rc = main(["reconstruct", "--data", str(data), "--out", str(tmp_path / "run"), *FAST])
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and lines[-1] == f"ctuq reconstruct: {info.value}", lines
    assert not any("Traceback" in x for x in lines)


def test_nan_in_projection_of_nxtomo(nxs):
    with h5py.File(nxs, "r+") as f:
        data = f["entry/instrument/detector/data"]
        a = data[()].astype(np.float64)
        a[5, 0, 0] = np.nan
        del f["entry/instrument/detector/data"]
        f["entry/instrument/detector/data"] = a
    with pytest.raises(NXtomoError, match=r"scan\.nxs:/entry/instrument/detector/data: 1 values of projection 3"):
        load_data(nxs, angular_subsampling=1, detector_subsampling=1, progress=False)
