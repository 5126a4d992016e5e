"""The write side of the scan formats (:mod:`ctuq.data.scan_format`): the circular orbit, the content checks, what
each built-in format refuses to store (one line each), the ``--layout`` vocabulary read from the registry, and the
message for a folder no format reads."""

import numpy as np
import pytest

from ctuq.data import CircularOrbit, NXtomoFormat, ScanContent, ScanYamlFormat, WalnutFormat, WalnutScan
from ctuq.data.formats import UnknownFormatError, detect_format, write_layouts
from ctuq.data.simulate import SimulationParameters, check_layouts, orbit_vectors, simulation_orbit
from ctuq.registry import DATA_FORMATS
from ctuq.testing import small_scan_content


def test_circular_orbit_vectors_and_the_closing_row():
    orbit = CircularOrbit(n_angles=8, pixel_size=1.2, row_pixel_size=1.2, source_object=66.0, object_detector=133.0)
    v = orbit.vectors(closing=True)
    assert v.shape == (9, 12) and v[-1].tobytes() == v[0].tobytes()
    assert v[:-1].tobytes() == orbit.vectors().tobytes()  # row by row: the closing row changes no other
    assert np.array_equal(orbit.angles(), np.radians(45.0 * np.arange(8)))
    radians = CircularOrbit(8, 1.2, 1.2, 66.0, 133.0, degree_angles=False)
    assert np.array_equal(radians.angles(), 2.0 * np.pi * np.arange(8) / 8)
    params = SimulationParameters.preset("tiny")
    for degrees in (False, True):
        want = orbit_vectors(params, 2, degree_angles=degrees)
        assert want.tobytes() == simulation_orbit(params, 2, degree_angles=degrees).vectors(closing=True).tobytes()
    assert (
        simulation_orbit(params, 2).corrected
        and not simulation_orbit(params.preset("tiny", corrections=False), 2).corrected
    )


def test_content_is_checked():
    c = small_scan_content()
    with pytest.raises(ValueError, match=r"ScanContent: ground truth \(3, 8, 8\) is not gt_shape \(3, 8, 9\)"):
        ScanContent(orbits=c.orbits, ground_truth=c.ground_truth, gt_shape=(3, 8, 9), voxel_size=1.0)
    with pytest.raises(ValueError, match="ScanContent: voxel_size must be positive and finite"):
        ScanContent(orbits=c.orbits, ground_truth=None, gt_shape=(3, 8, 8), voxel_size=0.0)
    two = ScanContent(orbits={1: c.orbits[2], 2: c.orbits[2]}, ground_truth=None, gt_shape=(3, 8, 8), voxel_size=1.0)
    with pytest.raises(ValueError, match=r"scan.yaml holds one orbit; this scan has orbits \[1, 2\]"):
        ScanYamlFormat.write("/nonexistent", two)


def test_each_format_refuses_what_it_cannot_store(tmp_path):
    c = small_scan_content()
    orbit = c.orbits[2]
    with pytest.raises(ValueError, match="the walnut layout holds 2 flats and 1 dark per orbit, got 3 and 1"):
        three = small_scan_content()
        three.orbits[2].flats = np.concatenate([orbit.flats, orbit.flats[:1]])
        WalnutFormat.write(tmp_path / "w", three)
    with pytest.raises(ValueError, match=r"the walnut layout holds orbits 1, 2 and 3 \(tubeV1..3\), got orbit 4"):
        WalnutFormat.check_orbits({4: orbit.geometry})
    with pytest.raises(ValueError, match=r"scan.yaml arrays: 'zarr' unknown; valid: npy, tiff"):
        ScanYamlFormat.write(tmp_path / "y", c, arrays="zarr")
    with pytest.raises(TypeError, match=r"unknown options \['colour'\]"):
        NXtomoFormat.write(tmp_path / "n", c, colour="red")
    tilted = CircularOrbit(6, 3.0, 3.0, 66.0, 133.0, tilt_deg=0.1)
    with pytest.raises(ValueError, match="NXtomo has no field for the simulated detector tilt .*--no-corrections"):
        NXtomoFormat.check_orbits({2: tilted})
    raised = CircularOrbit(6, 3.0, 3.0, 66.0, 133.0, source_z=7.5)
    for fmt in (ScanYamlFormat, NXtomoFormat):
        with pytest.raises(ValueError, match=r"holds one circular orbit .*--orbits 2 \(got orbits \[1\]\)"):
            fmt.check_orbits({1: raised})
        with pytest.raises(ValueError, match="states the angles in degrees"):
            fmt.check_orbits({2: CircularOrbit(6, 3.0, 3.0, 66.0, 133.0, degree_angles=False)})
    assert not list(tmp_path.iterdir())  # nothing written by a refused write


def test_the_walnut_layout_repeats_the_first_projection_without_a_closing_one(tmp_path):
    c = small_scan_content(closing=False)
    scan = WalnutScan(WalnutFormat.write(tmp_path / "w", c))
    assert scan.n_files == 7 and scan.n_distinct_angles == 6
    assert np.array_equal(scan.projection(0), scan.projection(6))  # file 0: the closing file, angle 0 again
    assert scan.describe_angles() == "tubeV2 has 7 files, 6 distinct angles"


def test_layouts_come_from_the_registry(tmp_path):
    layouts = write_layouts()
    assert layouts["yaml-tiff"] == (ScanYamlFormat, {"arrays": "tiff"}) and layouts["walnut"][0] is WalnutFormat
    params = SimulationParameters.preset("tiny", corrections=False)
    with pytest.raises(ValueError, match=r"--layout zarr: give distinct layouts among walnut, yaml-npy, yaml-tiff"):
        check_layouts(("zarr",), params)
    with pytest.raises(ValueError, match="--layout walnut walnut: give distinct layouts"):
        check_layouts(("walnut", "walnut"), params)
    with pytest.raises(ValueError, match=r"--layout yaml-npy: scan.yaml holds one circular orbit .*\[1, 2\]"):
        check_layouts(("walnut", "yaml-npy"), SimulationParameters.preset("tiny", orbits=(1, 2)))
    with pytest.raises(ValueError, match="--layout nxtomo: NXtomo has no field .*--no-corrections"):
        check_layouts(("nxtomo",), SimulationParameters.preset("tiny"))
    assert check_layouts("nxtomo", params) == ("nxtomo",)

    class Clash(WalnutFormat):
        name = "clash"

    DATA_FORMATS.register(Clash)
    try:
        with pytest.raises(ValueError, match="--layout 'walnut' is written by both walnut and clash"):
            write_layouts()
    finally:
        DATA_FORMATS.unregister("clash")


def test_a_folder_no_format_reads_says_what_it_lacks(tmp_path):
    with pytest.raises(UnknownFormatError) as info:
        detect_format(tmp_path)
    assert str(info.value) == (
        f"{tmp_path}: not a scan ctuq reads: the folder has no Projections/tubeV* folder (walnut layout), no "
        f"scan.yaml and no single NXtomo file (*.nxs, *.h5)"
    )
    with pytest.raises(FileNotFoundError, match="no such scan file or folder"):
        detect_format(tmp_path / "nowhere")
