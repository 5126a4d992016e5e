"""Geometry a CT scanner cannot have is refused in one line; geometry it is unlikely to have (a scan.yaml whose
`units` do not fit its numbers, a source inside the object, truncated projections) loads with one warning line that
names the value, its unit and the plausible range, recorded in metrics.json. Both name the file the value came from
and its line or field, in every format (issue 48)."""

import copy
import dataclasses
import json

import h5py
import numpy as np
import pytest
import torch
import yaml

from ctuq.cli import main
from ctuq.data.formats import open_scan, write_layouts
from ctuq.data.plausibility import check_geometry, truncation_warning
from ctuq.data.simulate import simulate_scan
from ctuq.errors import CTUQError
from ctuq.pipeline import run_folder as rf
from ctuq.testing import small_scan_content


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
    assert text.startswith(f"{scan.path}: implausible") and "voxel 400 mm (volume.voxel_size)" in text, text


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


IMPOSSIBLE = [  # a change of the opened vectors, the refusal, the key of scan.yaml and the field of NXtomo at fault
    (lambda v: v.__setitem__((0, 6), np.nan), "non-finite", "detector.pixel_size", "detector/x_pixel_size"),
    (
        lambda v: v.__setitem__((slice(None), slice(6, 9)), 0.0),
        "zero size",
        "detector.pixel_size",
        "detector/x_pixel_size",
    ),
    (
        lambda v: v.__setitem__((slice(None), slice(9, 12)), 0.0),
        "zero size",
        "detector.row_pixel_size",
        "detector/y_pixel_size",
    ),
    (
        lambda v: v.__setitem__((slice(None), slice(0, 3)), 0.0),
        "rotation axis",
        "geometry.source_object_distance",
        "source/distance",
    ),
    (
        lambda v: v.__setitem__((slice(None), slice(3, 6)), 0.2 * v[:, 0:3]),
        "between the source and the rotation",
        "geometry.object_detector_distance",
        "detector/distance",
    ),
]


@pytest.mark.parametrize("change, message, yaml_key, nxtomo_field", IMPOSSIBLE)
def test_impossible_geometry_is_refused_in_one_line_naming_the_file_and_field(
    yaml_scan, nxtomo_scan, change, message, yaml_key, nxtomo_field
):
    for path, named in ((yaml_scan, f": {yaml_key}: "), (nxtomo_scan, f":/entry/instrument/{nxtomo_field}: ")):
        _, scan = open_scan(path)
        with pytest.raises(CTUQError, match=message) as info:
            check_geometry(_with_vectors(scan, change))
        text = str(info.value)
        assert text.startswith(f"{path}{named}") and "\n" not in text, text


# ------------------------------------------------------------------------------------------- every format (issue 48)
@pytest.fixture(scope="module")
def nxtomo_scan(tmp_path_factory):
    fmt, options = write_layouts()["nxtomo"]
    return fmt.write(tmp_path_factory.mktemp("nxtomo") / "scan", small_scan_content(), **options)


def _written(layout, folder, **geometry):
    """The contract's small scan written in ``layout`` with its orbit's parameters changed by ``geometry``."""
    content = small_scan_content()
    content.orbits = {n: dataclasses.replace(o, geometry=dataclasses.replace(o.geometry, **geometry))
                      for n, o in content.orbits.items()}  # fmt: skip
    fmt, options = write_layouts()[layout]
    return fmt.write(folder / layout, content, **options)


DEGENERATE = {  # a zero detector step, the source on the rotation axis, the detector between the source and the axis
    "zero-pixel": {"pixel_size": 0.0},
    "source-on-axis": {"source_object": 0.0},
    "detector-inside": {"object_detector": -33.0},
}
# per layout and degenerate geometry: the file (relative to what the write returned) and its line or field
NAMED = {
    "walnut": {
        "zero-pixel": ("Projections/tubeV2/scan_geom_corrected.geom", ": line 1, columns 7–9 (u step): "),
        "source-on-axis": ("Projections/tubeV2/scan_geom_corrected.geom", ": line 1, columns 1–3 (source position): "),
        "detector-inside": ("Projections/tubeV2/scan_geom_corrected.geom", ": line 1, columns 4–6 (detector centre): "),
    },
    "yaml-npy": {
        "zero-pixel": ("", ": detector.pixel_size: "),
        "source-on-axis": ("", ": geometry.source_object_distance: "),
        "detector-inside": ("", ": geometry.object_detector_distance: "),
    },
    "nxtomo": {
        "zero-pixel": ("", ":/entry/instrument/detector/x_pixel_size: "),
        "source-on-axis": ("", ":/entry/instrument/source/distance: "),
        "detector-inside": ("", ":/entry/instrument/detector/distance: "),
    },
}


@pytest.mark.parametrize("degenerate", list(DEGENERATE))
@pytest.mark.parametrize("layout", list(NAMED))
def test_a_degenerate_geometry_is_refused_naming_the_file_and_its_line_or_field(layout, degenerate, tmp_path):
    path = _written(layout, tmp_path, **DEGENERATE[degenerate])
    relative, field = NAMED[layout][degenerate]
    with pytest.raises(CTUQError) as info:
        check_geometry(open_scan(path)[1])  # the opener refuses a parameter it checks itself, naming it too
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{path / relative if relative else path}{field}"), text


def _vectors_yaml(tmp_path, change):
    """The small scan as scan.yaml with its geometry as a vectors file (a comment line, then one row per angle),
    the rows changed by ``change``."""
    path = _written("yaml-npy", tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["geometry"] = {"type": "cone", "vectors": "geometry.txt"}
    for key in ("row_offset", "tilt"):
        doc["detector"].pop(key)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    vectors = small_scan_content().orbits[2].geometry.vectors()
    change(vectors)
    np.savetxt(path.parent / "geometry.txt", vectors, fmt="%.17g", header="cone_vec rows (mm)")
    return path


@pytest.mark.parametrize(
    "change, named, message",
    [
        (lambda v: v.__setitem__((2, slice(6, 9)), 0.0), "line 4, columns 7–9 (u step)", "zero size"),
        (lambda v: v.__setitem__((1, slice(0, 3)), 0.0), "line 3, columns 1–3 (source position)", "rotation axis"),
        (
            lambda v: v.__setitem__((0, slice(3, 6)), 0.2 * v[0, 0:3]),
            "line 2, columns 4–6 (detector centre)",
            "between",
        ),
    ],
)
def test_a_vectors_file_of_scan_yaml_is_named_with_the_line(tmp_path, change, named, message):
    path = _vectors_yaml(tmp_path, change)
    with pytest.raises(CTUQError, match=message) as info:
        check_geometry(open_scan(path)[1])
    assert str(info.value).startswith(f"{path.parent / 'geometry.txt'}: {named}: "), str(info.value)


def test_the_issue_48_walnut_scan_with_zero_geometry_rows_names_the_geom_file(tmp_path, capsys):
    folder = _written("walnut", tmp_path)
    geom = folder / "Projections" / "tubeV2" / "scan_geom_corrected.geom"
    geom.write_text("\n".join(" ".join(["0"] * 12) for _ in geom.read_text().splitlines()) + "\n")
    assert main(["reconstruct", "--data", str(folder), "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ctuq reconstruct: {geom}: line 1, columns 7–9 (u step): a detector pixel has zero size", err


def test_implausible_sizes_name_their_file_and_field_in_every_format(tmp_path):
    # 3 m detector pixels: one warning naming the file that states them
    big = {"pixel_size": 3000.0, "row_pixel_size": 3000.0}
    walnut = _written("walnut", tmp_path, **big)
    text = check_geometry(open_scan(walnut)[1])
    assert text.startswith(f"{walnut / 'Projections/tubeV2/scan_geom_corrected.geom'}: implausible geometry"), text
    yaml_path = _written("yaml-npy", tmp_path, **big)
    text = check_geometry(open_scan(yaml_path)[1])
    assert text.startswith(f"{yaml_path}: implausible geometry") and "3000 mm (detector.pixel_size, " in text, text
    nxs = _written("nxtomo", tmp_path, **big)
    text = check_geometry(open_scan(nxs)[1])
    assert text.startswith(f"{nxs}: implausible geometry") and "(/entry/instrument/detector/x_pixel_size, " in text
    # a voxel size from the walnut sidecar and a pixel from the .geom file: the scan leads, each value names its file
    side = walnut / "ctuq_simulation.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "gt_voxel_size_mm": 400.0}))
    text = check_geometry(open_scan(walnut)[1])
    assert text.startswith(f"{walnut}: implausible geometry") and f"voxel 400 mm ({side}: gt_voxel_size_mm)" in text
    assert "3000 mm (" + str(walnut / "Projections/tubeV2/scan_geom_corrected.geom") + ")" in text, text
    # an NXtomo ground-truth voxel in metres
    with h5py.File(nxs, "r+") as f:
        f["entry/instrument/detector/x_pixel_size"][()] = 3.0
        f["entry/instrument/detector/y_pixel_size"][()] = 3.0
        f["entry/ctuq_ground_truth/voxel_size"].attrs["units"] = "m"
    text = check_geometry(open_scan(nxs)[1])
    assert text.startswith(f"{nxs}: implausible geometry") and "(/entry/ctuq_ground_truth/voxel_size)" in text, text


def test_a_non_positive_voxel_size_names_its_file(tmp_path):
    walnut = _written("walnut", tmp_path)
    side = walnut / "ctuq_simulation.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "gt_voxel_size_mm": -1.0}))
    with pytest.raises(CTUQError, match="voxel size must be finite and positive") as info:
        check_geometry(open_scan(walnut)[1])
    assert str(info.value).startswith(f"{side}: gt_voxel_size_mm: ")


def test_the_truncation_warning_names_the_projections(yaml_scan, nxtomo_scan, tmp_path):
    walnut = _written("walnut", tmp_path)
    assert str(open_scan(walnut)[1].origin("projections")) == str(walnut / "Projections" / "tubeV2")
    assert str(open_scan(yaml_scan)[1].origin("projections")) == str(yaml_scan.parent / "projections.npy")
    assert str(open_scan(nxtomo_scan)[1].origin("projections")) == f"{nxtomo_scan}:/entry/instrument/detector/data"


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
