"""Bad input through the public API: a one-line :class:`ctuq.errors.CTUQError` (``DataError``, ``ConfigError``,
``OutDirError``) naming the argument at fault, raised before any work (no run is started: each test takes
milliseconds)."""

import astra
import numpy as np
import pytest
import torch
from api_cases import N, geometry_3d, one_line

import ctuq
from ctuq.config import ConfigError
from ctuq.errors import CTUQError, DataError, OutDirError


@pytest.fixture
def fan(fan_case):
    """``(sinogram, proj_geom, vol_geom, image)`` of the 32² fan-beam case (``conftest.fan_case``)."""
    return fan_case


@pytest.fixture
def scan(fan_scan):
    return fan_scan


def _raises(kind, fragment: str, fn, *args, **kwargs) -> str:
    with pytest.raises(kind) as info:
        fn(*args, **kwargs)
    assert isinstance(info.value, CTUQError)
    text = one_line(info.value)
    assert fragment in text, text
    return text


# ------------------------------------------------------------------------------------------------ Scan.from_astra
@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda s: s[:, :-1], "projections has shape (40, 47); the geometry gives (40, 48)"),
        (lambda s: s.T, "projections has shape (48, 40)"),
        (lambda s: s[None], "projections has shape (1, 40, 48)"),
    ],
)
def test_projections_of_the_wrong_shape(fan, change, fragment):
    sino, proj_geom, vol_geom, _ = fan
    _raises(DataError, fragment, ctuq.Scan.from_astra, change(sino), proj_geom, vol_geom)


def test_projections_that_do_not_match_a_3d_geometry(fan):
    proj_geom, vol_geom = geometry_3d("cone")
    text = _raises(DataError, "projections has shape (40, 48)", ctuq.Scan.from_astra, fan[0], proj_geom, vol_geom)
    assert "(n_rows, n_angles, n_cols)" in text


@pytest.mark.parametrize("array", ["numpy", "torch"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_projections(fan, array, bad):
    sino, proj_geom, vol_geom, _ = fan
    values = sino.copy()
    values[3, 4] = bad
    given = torch.from_numpy(values) if array == "torch" else values
    _raises(
        DataError,
        "projections holds 1 NaN or Inf value(s) (first at (3, 4))",
        ctuq.Scan.from_astra,
        given,
        proj_geom,
        vol_geom,
    )


@pytest.mark.parametrize("array", ["numpy", "torch"])
def test_non_finite_ground_truth_and_variances(fan, array):
    sino, proj_geom, vol_geom, image = fan
    truth = image.copy()
    truth[1, 2] = np.nan
    wrap = torch.from_numpy if array == "torch" else np.asarray
    _raises(DataError, "ground_truth holds 1 NaN", ctuq.Scan.from_astra, sino, proj_geom, vol_geom, wrap(truth))
    var = np.ones_like(sino)
    var[0, 0] = np.inf
    _raises(DataError, "variances holds 1 NaN", ctuq.Scan.from_astra, sino, proj_geom, vol_geom, variances=wrap(var))


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ("abc", "projections must hold numbers, got dtype <U3"),
        (np.ones((40, 48), dtype=np.complex64), "projections must hold numbers, got dtype complex64"),
    ],
)
def test_projections_that_are_not_numbers(fan, given, fragment):
    _raises(DataError, fragment, ctuq.Scan.from_astra, given, fan[1], fan[2])


@pytest.mark.parametrize("kind", ["fanbeam", "cone_beam", None])
def test_an_unknown_geometry_type(fan, kind):
    sino, proj_geom, vol_geom, _ = fan
    text = _raises(
        DataError,
        f"proj_geom type {kind!r} is not one ctuq reads",
        ctuq.Scan.from_astra,
        sino,
        {**proj_geom, "type": kind},
        vol_geom,
    )
    assert "fanflat_vec" in text and "cone_vec" in text  # the valid ones


def test_geometry_dicts_that_are_not_dicts(fan):
    _raises(
        DataError, "proj_geom and vol_geom must be ASTRA geometry dicts", ctuq.Scan.from_astra, fan[0], "fan", fan[2]
    )


def test_a_2d_geometry_with_a_3d_volume(fan):
    _, vol_geom = geometry_3d("cone")
    _raises(
        DataError, "proj_geom 'fanflat_vec' is 2D but vol_geom is 3D", ctuq.Scan.from_astra, fan[0], fan[1], vol_geom
    )


def test_an_off_centre_volume(fan):
    sino, proj_geom, _, _ = fan
    vol_geom = astra.create_vol_geom(N, N, -N / 2 + 6, N / 2 + 6, -N / 2, N / 2)
    _raises(DataError, "vol_geom's window is centred at (6.0", ctuq.Scan.from_astra, sino, proj_geom, vol_geom)


@pytest.mark.parametrize("dims", [2, 3])
def test_non_cubic_voxels(fan, dims):
    if dims == 2:
        proj_geom, vol_geom = fan[1], astra.create_vol_geom(N, N, -N / 2, N / 2, -N / 4, N / 4)
        sino = fan[0]
    else:
        proj_geom, _ = geometry_3d("cone")
        vol_geom = astra.create_vol_geom(N, N, 5, -N / 2, N / 2, -N / 2, N / 2, -5, 5)
        sino = np.zeros((5, 40, 48), dtype=np.float32)
    _raises(DataError, "vol_geom: voxels are not cubic", ctuq.Scan.from_astra, sino, proj_geom, vol_geom)


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_variances_that_are_not_positive(fan, value):
    sino, proj_geom, vol_geom, _ = fan
    var = np.full_like(sino, 1e-4)
    var[2, :3] = value
    _raises(
        DataError,
        "variances must be positive; 3 are ≤ 0",
        ctuq.Scan.from_astra,
        sino,
        proj_geom,
        vol_geom,
        variances=var,
    )


def test_variances_of_the_wrong_shape(fan):
    sino, proj_geom, vol_geom, _ = fan
    _raises(
        DataError,
        "variances has shape (3, 3)",
        ctuq.Scan.from_astra,
        sino,
        proj_geom,
        vol_geom,
        variances=np.ones((3, 3)),
    )


@pytest.mark.parametrize("shape", [(N, N - 1), (1, N, N), (N * N,)])
def test_a_ground_truth_of_the_wrong_shape(fan, shape):
    sino, proj_geom, vol_geom, _ = fan
    _raises(
        DataError,
        f"ground_truth has shape {shape}; vol_geom's grid is ({N}, {N})",
        ctuq.Scan.from_astra,
        sino,
        proj_geom,
        vol_geom,
        np.zeros(shape),
    )


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"units": "inch"}, "units must be one of ['mm', 'cm', 'm', 'um'], got 'inch'"),
        ({"voxel_size": -1.0}, "voxel_size must be a positive number of mm, got -1.0"),
        ({"voxel_size": float("nan")}, "voxel_size must be a positive number of mm, got nan"),
    ],
)
def test_bad_units_and_voxel_sizes(fan, options, fragment):
    _raises(DataError, fragment, ctuq.Scan.from_astra, fan[0], fan[1], fan[2], **options)


# ------------------------------------------------------------------------------------------------ Scan
@pytest.mark.parametrize(
    ("angles", "fragment"),
    [
        ([0, 40], "angles must be distinct indices in 0 … 39 (at least one), got 2 value(s) in 0 … 40"),
        ([-1, 2], "got 2 value(s) in -1 … 2"),
        ([3, 3], "angles must be distinct indices"),
        ([], "got 0 value(s)"),
        (np.zeros(40, dtype=bool), "got 0 value(s)"),
        (np.ones(39, dtype=bool), "angles is a mask of shape (39,); the scan has 40 angles"),
        ([0.5, 2.0], "angles must be integer indices into Scan.angles (or a boolean mask), got dtype float64"),
        (["a"], "angles must be integer indices"),
        ([[1, 2], [3, 4]], "angles must be one-dimensional, got shape (2, 2)"),
    ],
)
def test_subset_with_bad_indices(scan, angles, fragment):
    _raises(DataError, fragment, scan.subset, angles)


def test_subset_takes_indices_masks_and_tensors(scan):
    """The counterpart of the bad cases: the forms ``subset`` does take pick the same angles."""
    mask = np.zeros(40, dtype=bool)
    mask[[1, 5, 9]] = True
    for given in ([9, 1, 5], np.array([1, 5, 9], dtype=np.int32), mask, torch.tensor([5, 9, 1])):
        assert scan.subset(given).used_angles.tolist() == [1, 5, 9]


def test_save_into_a_folder_that_is_not_empty(scan, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    _raises(
        OutDirError,
        f"Scan.save: folder {tmp_path / 'taken'} exists and is not an empty folder",
        scan.save,
        tmp_path / "taken",
    )
    _raises(OutDirError, "is not an empty folder", scan.save, tmp_path / "taken" / "notes.txt")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"


def test_save_of_a_scan_that_is_on_disk(scan, tmp_path):
    path = scan.save(tmp_path / "scan")
    _raises(DataError, "Scan.save: this scan is already on disk", ctuq.load_scan(path).save, tmp_path / "again")


def test_load_scan_of_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="load_scan: .*: no such scan folder or file"):
        ctuq.load_scan(tmp_path / "nothing")


# ------------------------------------------------------------------------------------------------ set=, runs
@pytest.mark.parametrize(
    ("settings", "kind", "fragment"),
    [
        (
            {"dip.iteratons": 3},
            ConfigError,
            "set dip.iteratons=3: unknown config key 'dip.iteratons'; valid keys of "
            "section 'dip': iterations, lr, tv_weight, scale",
        ),
        (["dip.iteratons=3"], ConfigError, "--set dip.iteratons=3: unknown config key 'dip.iteratons'; valid keys"),
        (
            {"dipp.iterations": 3},
            ConfigError,
            "unknown config key 'dipp'; valid keys of the top level: device, seed, data",
        ),
        (
            {"dip.iterations": "many"},
            ConfigError,
            "set dip.iterations='many': dip.iterations must be an integer, got 'many' (str)",
        ),
        (["dip.iterations=many"], ConfigError, "--set dip.iterations=many: dip.iterations must be an integer"),
        ({"dip.iterations": 0}, ConfigError, "dip.iterations"),
        ({"uq.samples": [1, 2]}, ConfigError, "uq.samples must be an integer"),
        ("dip.iterations=3", ConfigError, "set: a dict of config keys or a list of 'KEY=VALUE' strings, got str"),
        ({3: 1}, ConfigError, "set: keys must be dotted config keys (str), got 3"),
    ],
)
def test_set_keys_and_values_that_do_not_exist(scan, tmp_path, settings, kind, fragment):
    """Refused while the config is resolved: no folder is made (``out`` stays absent)."""
    _raises(kind, fragment, ctuq.reconstruct, scan, config="tiny", set=settings, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_cross_field_error_of_the_default_config_names_it(scan, tmp_path):
    """``config=None`` (what ``ctuq reconstruct`` passes without ``--config``) is the bundled demo config, and a refused
    combination says so (not "config None")."""
    _raises(
        ConfigError,
        "the bundled config demo (the default) with overrides uq.approximation='ella', data.path='scan/scan.yaml': "
        "uq.approximation = 'ella' is for classifiers",
        ctuq.reconstruct,
        scan,
        config=None,
        set={"uq.approximation": "ella"},
        out=tmp_path / "run",
    )
    assert not (tmp_path / "run").exists()


def test_design_angles_names_the_bad_set_key(scan):
    _raises(
        ConfigError,
        "set design.pilott=3: unknown config key 'design.pilott'; valid keys of section 'design'",
        ctuq.design_angles,
        scan,
        config="tiny",
        set={"design.pilott": 3},
    )


def test_an_unknown_config(scan):
    _raises(
        ConfigError,
        "config file 'nonesuch' does not exist and is not a bundled config; bundled: ",
        ctuq.reconstruct,
        scan,
        config="nonesuch",
    )


def test_resume_without_out(scan):
    _raises(OutDirError, "reconstruct(resume=True): needs out=", ctuq.reconstruct, scan, config="tiny", resume=True)


@pytest.mark.parametrize("what", ["missing", "empty", "file", "unfinished"])
def test_load_run_of_a_folder_that_is_not_a_run(tmp_path, what):
    path = tmp_path / "x"
    fragment = {
        "missing": f"load_run: {path} is not a run folder (no such folder)",
        "empty": f"load_run: {path} is not a run folder (no config.yaml)",
        "file": f"load_run: {path} is not a run folder (not a folder)",
        "unfinished": f"load_run: {path} is not a finished run (no metrics.json); finish it with `ctuq reconstruct "
        f"--resume --out {path}`",
    }[what]
    if what == "empty":
        path.mkdir()
    elif what == "file":
        path.write_text("x")
    elif what == "unfinished":  # a run killed during its DIP: its config and a checkpoint, no metrics.json
        path.mkdir()
        (path / "config.yaml").write_text("seed: 0\n")
        (path / "dip_checkpoint.pt").write_bytes(b"")
    _raises(OutDirError, fragment, ctuq.load_run, path)
    _raises(OutDirError, "load_run", ctuq.load_run, str(path))


def test_uncertainty_of_a_folder_that_is_not_a_run(tmp_path):
    _raises(
        OutDirError, f"uncertainty: run {tmp_path} is not a run folder (no config.yaml)", ctuq.uncertainty, tmp_path
    )
