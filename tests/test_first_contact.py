"""A newcomer's first contact with the command line: help without the heavy libraries, docstring markup gone from
it, a refused run that leaves nothing behind, no lock file after a run, no empty folder after a failed fetch."""

import subprocess
import sys

import pytest

from ctuq.cli import main

HEAVY = ("torch", "matplotlib", "scipy", "ctuq.pipeline.runner", "ctuq.inference")


def _imported_by(argv: list[str]) -> set[str]:
    """Modules a fresh interpreter has imported after printing ``ctuq ARGV`` (help only)."""
    code = (
        "import sys\nfrom ctuq.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print('\\n'.join(sys.modules), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    return set(done.stderr.split())


@pytest.mark.parametrize("command", ["", "simulate", "reconstruct", "uq", "design", "pretrain", "view", "fetch"])
def test_help_loads_no_heavy_library(command):
    """`ctuq --help` and `ctuq COMMAND --help` import neither torch nor the pipeline (they print in well under a
    second; scripts/benchmark_cli.py measures it)."""
    modules = _imported_by([command, "--help"] if command else ["--help"])
    assert "ctuq.cli" in modules
    assert not [m for m in HEAVY if m in modules]


def test_help_shows_no_docstring_markup(capsys):
    with pytest.raises(SystemExit):
        main(["uq", "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and "RUN_DIR" in text


def test_config_keys_lists_every_key_with_its_meaning(capsys):
    assert main(["reconstruct", "--config-keys", "uq"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("uq.samples = 1024  # ") for line in lines)
    assert any(line.startswith("uq.cg.rank = ") for line in lines)  # the solver sections too
    assert main(["reconstruct", "--config-keys", "nope"]) == 2


def test_a_refused_run_writes_nothing(tmp_path, capsys):
    new = tmp_path / "new"
    assert main(["reconstruct", "--data", str(tmp_path / "missing"), "--out", str(new), "--no-progress"]) == 2
    assert not new.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["reconstruct", "--data", str(tmp_path / "missing"), "--out", str(empty), "--no-progress"]) == 2
    assert list(empty.iterdir()) == []
    assert "no such scan folder or file" in capsys.readouterr().err


def test_a_finished_run_leaves_no_lock_file(tiny_scan, tmp_path):
    out = tmp_path / "run"
    args = ["reconstruct", "--data", str(tiny_scan), "--out", str(out), "--no-uq", "--no-progress"]
    args += ["--set", "dip.iterations=2", "--set", "tv.enabled=false", "--set", "data.image_shape=[32, 32]"]
    assert main(args + ["--set", "data.detector_subsampling=3"]) == 0
    names = {p.name for p in out.iterdir()}
    assert "metrics.json" in names and not {".ctuq.lock", ".ctuq.lock.json"} & names


def test_a_failed_fetch_leaves_no_empty_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CTUQ_ZENODO_URL", "http://127.0.0.1:9")  # nothing listens there: refused at once
    dest = tmp_path / "data" / "walnuts"
    assert main(["fetch", "walnut", "1", "--dest", str(dest), "--timeout", "2", "--retries", "0"]) == 2
    assert not (tmp_path / "data").exists()


def test_simulate_help_names_the_built_in_layouts_of_the_registry():
    from ctuq.commands.simulate import BUILT_IN_LAYOUTS
    from ctuq.data.formats import write_layouts

    assert tuple(write_layouts())[: len(BUILT_IN_LAYOUTS)] == BUILT_IN_LAYOUTS
