"""Geometry a CT scanner cannot have is refused in one line; geometry it is unlikely to have (a scan.yaml whose
`units` do not fit its numbers, a source inside the object, truncated projections) loads with one warning line that
names the value, its unit and the plausible range, recorded in metrics.json."""

import copy

import numpy as np
import pytest
import torch

from ctuq.cli import main
from ctuq.data.formats import open_scan
from ctuq.data.plausibility import check_geometry, truncation_warning
from ctuq.data.simulate import simulate_scan
from ctuq.errors import CTUQError
from ctuq.pipeline import run_folder as rf


@pytest.fixture(scope="module")
def yaml_scan(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plausible") / "scan"
    simulate_scan(folder, preset="tiny", layouts=("yaml-npy",), progress=False)
    return folder / "scan.yaml"


def _in_units(scan_yaml, tmp_path, units):
    """The same scan description with its `units` replaced (the numbers stay: 1.2 'units' pixels)."""
    folder = tmp_path / f"in_{units}"
    folder.mkdir()
    for f in scan_yaml.parent.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    text = (folder / "scan.yaml").read_text()
    assert "units: mm" in text
    (folder / "scan.yaml").write_text(text.replace("units: mm", f"units: {units}"))
    return folder / "scan.yaml"


def test_a_plausible_scan_has_no_warning(yaml_scan):
    _, scan = open_scan(yaml_scan)
    assert check_geometry(scan) is None


def test_millimetre_numbers_in_metres_warn_in_one_line_naming_value_unit_range_and_key(yaml_scan, tmp_path):
    _, scan = open_scan(_in_units(yaml_scan, tmp_path, "m"))
    text = check_geometry(scan)
    assert text is not None and "\n" not in text
    assert "detector pixel 1200 mm" in text and "0.1 µm – 10 mm" in text and "`units` in scan.yaml (now m)" in text


def test_the_warning_reaches_the_terminal_and_metrics_json(yaml_scan, tmp_path, capsys):
    path = _in_units(yaml_scan, tmp_path, "m")
    out = tmp_path / "run"
    args = ["reconstruct", "--data", str(path), "--out", str(out), "--no-uq", "--no-progress"]
    args += ["--set", "dip.iterations=2", "--set", "tv.enabled=false", "--set", "data.image_shape=[32, 32]"]
    assert main(args + ["--set", "data.detector_subsampling=3"]) == 0
    err = capsys.readouterr().err
    assert "warning:" in err and "implausible geometry" in err
    warnings = rf.read_metrics(out)["warnings"]
    assert any("implausible geometry" in w and "detector pixel 1200 mm" in w for w in warnings)


def _with_vectors(scan, change):
    other = copy.copy(scan)
    vectors = np.array(scan.vectors, dtype=np.float64)
    change(vectors)
    other.vectors = vectors
    return other


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda v: v.__setitem__((0, 6), np.nan), "non-finite"),
        (lambda v: v.__setitem__((slice(None), slice(6, 9)), 0.0), "zero size"),
        (lambda v: v.__setitem__((slice(None), slice(0, 3)), 0.0), "on the rotation axis"),
        (lambda v: v.__setitem__((slice(None), slice(3, 6)), 0.2 * v[:, 0:3]), "between the source and the rotation"),
    ],
)
def test_impossible_geometry_is_refused_in_one_line(yaml_scan, change, message):
    _, scan = open_scan(yaml_scan)
    with pytest.raises(CTUQError, match=message) as info:
        check_geometry(_with_vectors(scan, change))
    assert str(yaml_scan) in str(info.value) and "\n" not in str(info.value)


def test_a_source_inside_the_object_warns(yaml_scan):
    _, scan = open_scan(yaml_scan)
    near = _with_vectors(scan, lambda v: v.__setitem__((slice(None), slice(0, 3)), v[:, 0:3] * 0.1))
    assert "not larger than the object's radius" in check_geometry(near)


def test_truncated_projections_warn():
    y = torch.zeros(8, 32)
    y[:, 4:28] = 1.0
    assert truncation_warning(y, "scan") is None
    y[:, :] = 1.0  # the object covers the whole detector: it reaches past the field of view
    assert "wider than the field of view" in truncation_warning(y, "scan")
