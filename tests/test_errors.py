"""The error contract of every command: a user error prints one line ``ctuq <command>: <file or option>: <problem>``
on stderr and exits 2; ``--debug`` / ``CTUQ_DEBUG=1`` show the traceback; programming errors keep theirs. Also the
minimum-angle refusals and the published-setting warning. A damaged scan or a setting the scan cannot meet is refused
while the scan loads: those cases check the user error :func:`~ctuq.pipeline.scan.load_scan` raises (the line the
command prints after ``ctuq reconstruct: ``), and one of them the command itself."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
import torch
from tiny import QUICK, TINY_SETTINGS, tiny_args

from ctuq.cli import main
from ctuq.config import load_config
from ctuq.data import SimulationParameters, simulate_scan
from ctuq.errors import CTUQError, DataError, OutDirError, format_user_error, is_user_error
from ctuq.pipeline.scan import load_scan

REPO = Path(__file__).resolve().parents[1]
FAST = tiny_args(*QUICK, uq=False)  # seconds per run: 16 angles × 32 columns, 32², 2 DIP iterations, no inference


@pytest.fixture
def broken(tiny_scan, tmp_path):
    """A fresh copy of the tiny scan to damage."""
    dst = tmp_path / "Walnut9"
    shutil.copytree(tiny_scan, dst)
    return dst


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("CTUQ_DEBUG", raising=False)


def _proj(folder: Path) -> Path:
    return folder / "Projections" / "tubeV2"


def _rewrite(path: Path, fn) -> None:
    tifffile.imwrite(path, fn(tifffile.imread(path)))


def load_error(scan, *overrides) -> str:
    """Load ``scan`` with the tiny settings and ``overrides``; check the error is a user error of one line; return
    that line (what ``ctuq reconstruct`` prints after ``ctuq reconstruct: ``)."""
    cfg = load_config(None, [*TINY_SETTINGS, *QUICK, *overrides], **{"data.path": str(scan)})
    with pytest.raises(Exception) as info:
        load_scan(cfg, torch.device("cpu"), progress=False)
    assert is_user_error(info.value), info.value
    line = format_user_error(info.value)
    assert "\n" not in line
    return line


def one_line_error(capsys, argv, *, command="reconstruct", only_line=True) -> str:
    """Run ``ctuq argv``; check exit 2, one ``ctuq <command>: `` line (the last; with ``only_line`` the only line
    on stderr) and no traceback; return that line."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    prefixed = [line for line in lines if line.startswith(f"ctuq {command}: ")]
    assert len(prefixed) == 1 and prefixed[0] == lines[-1], err
    if only_line:
        assert len(lines) == 1, err
    return prefixed[0]


# ------------------------------------------------------------------------------------------------ data errors
def _missing_projection(scan):
    (_proj(scan) / "scan_000005.tif").unlink()
    return r"first scan_000005\.tif"


def _corrupt_projection(scan):
    (_proj(scan) / "scan_000032.tif").write_bytes(b"not a tiff")
    return r"scan_000032\.tif: not a readable TIFF"


def _misshaped_projection(scan):
    _rewrite(_proj(scan) / "scan_000032.tif", lambda a: a[:-1])  # file 32 ↔ geometry row 0: always used
    return r"scan_000032\.tif: image shape"


def _flat_not_above_dark(scan):
    dark = tifffile.imread(_proj(scan) / "di000000.tif")
    for name in ("io000000.tif", "io000001.tif"):
        _rewrite(_proj(scan) / name, lambda a: dark)
    return re.escape(f"{_proj(scan)}: flat field ≤ dark")


def _nan_projection(scan):
    _rewrite(_proj(scan) / "scan_000032.tif", lambda a: np.where(a == a.max(), np.nan, a.astype(np.float32)))
    return r"scan_000032\.tif: \d+ pixels are NaN or Inf"


def _bad_geometry(scan):
    geom = _proj(scan) / "scan_geom_corrected.geom"
    lines = geom.read_text().splitlines()
    lines[3] = " ".join(lines[3].split()[:11])
    geom.write_text("\n".join(lines) + "\n")
    return r"scan_geom_corrected\.geom: line 4 has 11 columns"


def _bad_ground_truth(scan):
    _rewrite(scan / "Reconstructions" / "full_AGD_50_000002.tiff", lambda a: a[:, :100])  # the central slice
    return r"full_AGD_50_000002\.tiff: shape"


@pytest.mark.parametrize(
    "damage",
    [
        _missing_projection,
        _corrupt_projection,
        _misshaped_projection,
        _flat_not_above_dark,
        _nan_projection,
        _bad_geometry,
        _bad_ground_truth,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_damaged_scan_is_one_line_naming_the_file(damage, broken):
    pattern = damage(broken)
    line = load_error(broken)
    assert re.search(pattern, line), line


def test_the_command_prints_a_damaged_scans_line_and_exits_2(broken, tmp_path, capsys):
    pattern = _corrupt_projection(broken)
    line = one_line_error(capsys, ["reconstruct", "--data", str(broken), "--out", str(tmp_path / "run"), *FAST])
    assert line == f"ctuq reconstruct: {load_error(broken)}" and re.search(pattern, line)


def test_empty_folder_and_missing_folder_and_wrong_orbit(tiny_scan, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = load_error(empty)
    assert str(empty) in line and "no Projections/tubeV* folder" in line
    line = load_error(tmp_path / "nowhere")
    assert line.startswith(f"data.path '{tmp_path / 'nowhere'}': no such scan folder")
    line = load_error(tiny_scan, "data.orbit=1")
    assert "tubeV1: projection folder missing (orbit 1); this scan has tubeV2" in line


# ------------------------------------------------------------------------------------------------ settings and device
def test_slice_and_subsampling_out_of_range_name_the_option(tiny_scan):
    line = load_error(tiny_scan, "data.slice_index=5")
    assert line.startswith("data.slice_index: 5 is out of range") and "5 ground-truth slices" in line
    line = load_error(tiny_scan, "data.detector_subsampling=200")
    assert line.startswith("data.detector_subsampling: 200 exceeds the 96 detector columns")
    line = load_error(tiny_scan, "data.image_shape=[32, 40]")
    assert line.startswith("data.image_shape: [32, 40] changes the aspect ratio")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_one_line(tiny_scan, tmp_path, capsys):
    out = tmp_path / "run"
    line = one_line_error(
        capsys, ["reconstruct", "--data", str(tiny_scan), "--out", str(out), *FAST, "--device", "cuda"]
    )
    assert line.startswith("ctuq reconstruct: device 'cuda': requested but torch sees no CUDA device")
    assert not out.exists()  # refused before any work, the run folder included
    line = one_line_error(
        capsys, ["reconstruct", "--data", str(tiny_scan), "--out", str(out), *FAST, "--set", "data.backend=astra_cuda"]
    )
    assert "data.backend = 'astra_cuda' needs a CUDA device" in line


def test_non_finite_dip_loss_names_the_learning_rate(tiny_scan, tmp_path, capsys):
    line = one_line_error(
        capsys,
        ["reconstruct", "--data", str(tiny_scan), "--out", str(tmp_path / "run"), *FAST, "--set", "dip.lr=1e30"],
        only_line=False,
    )  # after the load/DIP log lines
    assert line.startswith("ctuq reconstruct: dip.lr = 1e+30: the DIP fit diverged") and "iteration" in line


def test_config_errors_stay_one_line(capsys):
    line = one_line_error(capsys, ["reconstruct", "--no-uq", "--set", "dip.lr=-1"])
    assert line == "ctuq reconstruct: --set dip.lr=-1: dip.lr must be > 0.0, got -1.0"


# ------------------------------------------------------------------------------------------------ --out
def test_out_that_is_a_file_or_under_a_file(tiny_scan, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    line = one_line_error(capsys, ["reconstruct", "--data", str(tiny_scan), "--out", str(f), *FAST])
    assert line == f"ctuq reconstruct: --out {f}: exists and is a file, not a folder; choose another --out"
    line = one_line_error(capsys, ["reconstruct", "--data", str(tiny_scan), "--out", str(f / "sub" / "run"), *FAST])
    assert line.startswith(f"ctuq reconstruct: --out {f / 'sub' / 'run'}: {f} is a file")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only (chmod) folders")
def test_out_in_a_read_only_folder(tiny_scan, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        for out in (ro, ro / "run"):
            line = one_line_error(capsys, ["reconstruct", "--data", str(tiny_scan), "--out", str(out), *FAST])
            assert line.startswith(f"ctuq reconstruct: --out {out}: ")
    finally:
        ro.chmod(0o755)


def test_out_that_cannot_be_written_is_found_by_a_probe_write(tiny_scan, tmp_path, capsys, monkeypatch):
    # As root os.access says yes to read-only folders and a read-only mount cannot be made in a test: the probe
    # write is what decides, so make it fail the way a read-only file system does.
    import errno

    from ctuq.pipeline import run_folder

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_mkstemp = run_folder.tempfile.mkstemp
    monkeypatch.setattr(run_folder.tempfile, "mkstemp", refuse)
    out = tmp_path / "run"
    line = one_line_error(capsys, ["reconstruct", "--data", str(tiny_scan), "--out", str(out), *FAST])
    assert line == f"ctuq reconstruct: --out {out}: not writable (Read-only file system)"
    with pytest.raises(OutDirError, match="not writable"):
        run_folder.prepare_out_dir(tmp_path / "other")
    monkeypatch.setattr(run_folder.tempfile, "mkstemp", real_mkstemp)
    monkeypatch.setattr(run_folder.os, "access", lambda *a, **k: False)  # what a non-root user sees on chmod 555
    with pytest.raises(OutDirError, match=r"^--out .*other: not writable \(permission denied\)$"):
        run_folder.prepare_out_dir(tmp_path / "other")


# ------------------------------------------------------------------------------------------------ --debug
@pytest.mark.slow
def test_debug_flag_and_environment_show_the_traceback(tiny_scan, tmp_path, monkeypatch, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    argv = ["--data", str(tiny_scan), "--out", str(f), *FAST]
    with pytest.raises(OutDirError, match="exists and is a file"):
        main(["--debug", "reconstruct", *argv])
    with pytest.raises(OutDirError):
        main(["reconstruct", "--debug", *argv])  # also after the command
    monkeypatch.setenv("CTUQ_DEBUG", "1")
    with pytest.raises(OutDirError):
        main(["reconstruct", *argv])
    monkeypatch.setenv("CTUQ_DEBUG", "0")
    assert main(["reconstruct", *argv]) == 2
    res = subprocess.run(
        [sys.executable, "-m", "ctuq", "--debug", "reconstruct", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CTUQ_DEBUG": ""},
    )
    assert res.returncode == 1 and "Traceback" in res.stderr and "OutDirError" in res.stderr


def test_programming_errors_keep_their_traceback(tiny_scan, tmp_path, monkeypatch):
    import ctuq.pipeline.runner as runner

    def broken_phase(state):
        raise KeyError("a bug, not a user error")

    monkeypatch.setattr(runner, "phase_load", broken_phase)
    with pytest.raises(KeyError, match="a bug"):
        main(["reconstruct", "--data", str(tiny_scan), "--out", str(tmp_path / "run"), *FAST])


# ------------------------------------------------------------------------------------------------ angles
def test_a_scan_with_two_angles_is_refused(tmp_path):
    scan = tmp_path / "Walnut2"
    simulate_scan(scan, SimulationParameters.preset("tiny", n_projections=3, gt_shape=(1, 32, 32)), progress=False)
    setting = ("data.angular_subsampling=1", "data.image_shape=null")
    line = load_error(scan, *setting)
    assert line.startswith(f"{scan}: only 2 projection angles left")
    assert "3 files, 2 distinct angles" in line and "data.min_angles = 8" in line
    assert "use a scan with more projections, or set data.min_angles=2 to run anyway" in line
    cfg = load_config(None, [*TINY_SETTINGS, *setting, "data.min_angles=2"], **{"data.path": str(scan)})
    assert load_scan(cfg, torch.device("cpu"), progress=False)[0].y.shape[0] == 2  # the stated way to force it works


def test_subsampling_that_leaves_one_angle_is_refused(tiny_scan):
    line = load_error(tiny_scan, "data.angular_subsampling=32")
    assert line.startswith(f"{tiny_scan}: only 1 projection angle left")
    assert "data.angular_subsampling = 32" in line and "lower data.angular_subsampling to at most 4" in line


def test_published_setting_on_the_bundled_scan_warns_and_records_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CTUQ_DATA", raising=False)  # the bundled data/Walnut1
    out = tmp_path / "w60"
    rc = main(
        [
            "reconstruct",
            "--config",
            "walnut_2d_60",
            "--device",
            "cpu",
            "--out",
            str(out),
            "--no-uq",
            "--no-progress",
            "--set",
            "model.preset=tiny",
            "--set",
            "data.image_shape=[32, 32]",
            "--set",
            "dip.iterations=2",
            "--set",
            "tv.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("ctuq reconstruct: warning: ")]
    assert len(warnings) == 1
    assert "states 60 angles × 128 detector columns" in warnings[0] and "gives 12 × 43" in warnings[0]
    assert "--set data.angular_subsampling=4 --set data.detector_subsampling=2 gives 60 × 128" in warnings[0]
    m = json.loads((out / "metrics.json").read_text())
    assert m["warnings"] == [warnings[0].removeprefix("ctuq reconstruct: warning: ")]
    assert m["data"]["measurement_shape"] == [12, 43]


def test_a_run_without_problems_records_no_warnings(tiny_run):
    assert " WARNING " not in (tiny_run / "ctuq.log").read_text()  # the log has every message the terminal had
    assert json.loads((tiny_run / "metrics.json").read_text())["warnings"] == []


# ------------------------------------------------------------------------------------------------ ctuq uq
def test_uq_command_errors_are_one_line(tiny_run_none, tmp_path, capsys):
    line = one_line_error(capsys, ["uq", str(tmp_path / "nowhere")], command="uq")
    assert line.startswith(f"ctuq uq: {tmp_path / 'nowhere' / 'config.yaml'}: does not exist")
    out = shutil.copytree(tiny_run_none, tmp_path / "run")
    (out / "dip_model.pt").write_bytes(b"garbage")
    line = one_line_error(capsys, ["uq", str(out), "--no-progress"], command="uq", only_line=False)
    assert line.startswith(f"ctuq uq: {out / 'dip_model.pt'}: not a readable torch file")
    torch.save(
        {"format": "ctuq.model", "version": 99, "model_config": {}, "state_dict": {}, "scale": 14.0},
        out / "dip_model.pt",
    )
    line = one_line_error(capsys, ["uq", str(out), "--no-progress"], command="uq", only_line=False)
    assert "model file version 99 is newer" in line


# ------------------------------------------------------------------------------------------------ other commands
def test_simulate_errors_are_one_line(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    line = one_line_error(
        capsys, ["simulate", "--out", str(f), "--preset", "tiny", "--no-progress"], command="simulate"
    )
    assert line.startswith(f"ctuq simulate: --out {f}: exists and is a file")
    line = one_line_error(capsys, ["simulate", "--out", str(tmp_path / "x"), "--projections", "1"], command="simulate")
    assert line.startswith("ctuq simulate: SimulationParameters.n_projections = 1: need at least 2")
    real = tmp_path / "real"
    real.mkdir()
    (real / "keep.txt").write_text("x")
    line = one_line_error(
        capsys, ["simulate", "--out", str(real), "--preset", "tiny", "--overwrite"], command="simulate"
    )
    assert line.startswith(f"ctuq simulate: --out {real}: {real} is not empty and holds no ctuq_simulation.json")


def test_pretrain_errors_are_one_line(tiny_scan, tmp_path, capsys):
    line = one_line_error(capsys, ["pretrain", "--out", str(tmp_path / "x.pt"), "--seed", "0"], command="pretrain")
    assert line.startswith("ctuq pretrain: --seed 0: must be >= 1")
    line = one_line_error(capsys, ["pretrain", "--out", str(tmp_path), "--data", str(tiny_scan)], command="pretrain")
    assert line.startswith(f"ctuq pretrain: --out {tmp_path}: is a folder")
    line = one_line_error(
        capsys, ["pretrain", "--out", str(tmp_path / "x.pt"), "--data", str(tmp_path / "nowhere")], command="pretrain"
    )
    assert line.startswith("ctuq pretrain: data.path")


def test_error_types():
    from ctuq.config import ConfigError
    from ctuq.errors import DeviceError, NonFiniteLossError, format_user_error, is_user_error

    assert issubclass(ConfigError, CTUQError) and issubclass(DataError, ValueError)
    assert issubclass(DeviceError, RuntimeError) and issubclass(NonFiniteLossError, FloatingPointError)
    assert is_user_error(FileNotFoundError(2, "No such file or directory", "x.tif"))
    assert (
        format_user_error(FileNotFoundError(2, "No such file or directory", "x.tif"))
        == "x.tif: No such file or directory"
    )
    assert format_user_error(CTUQError("a: line one\n  line two\n")) == "a: line one; line two"
    assert not is_user_error(RuntimeError("CUDA error: an illegal memory access")) and not is_user_error(KeyError("k"))


def test_every_library_user_error_is_a_ctuq_error():
    """One error contract: each error class of the library meant for the user subclasses CTUQError (no table of
    names), so ``is_user_error`` recognises it whether or not its module was imported first."""
    from ctuq.config import ConfigError
    from ctuq.data.walnut import WalnutFormatError
    from ctuq.design import DesignError
    from ctuq.errors import CheckpointMismatch, user_error_types
    from ctuq.linearize import MemoryBudgetError
    from ctuq.models import ModelFileError
    from ctuq.studies import StudyError

    for cls in (
        ConfigError,
        WalnutFormatError,
        ModelFileError,
        CheckpointMismatch,
        DesignError,
        StudyError,
        MemoryBudgetError,
    ):
        assert issubclass(cls, CTUQError), cls
        assert is_user_error(cls("x: problem"))
    assert issubclass(StudyError, RuntimeError)  # as it was before
    assert CTUQError in user_error_types()
