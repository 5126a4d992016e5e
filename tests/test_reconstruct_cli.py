"""``ctuq reconstruct`` end to end on a tiny simulated scan, and its argument/config errors."""

import json
import subprocess
import sys

import pytest

from ctuq.cli import main


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["reconstruct", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--data", "--config", "--set", "--out", "--device", "--seed", "--resume", "--no-uq"):
        assert opt in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--set", "dip.learning_rate=1"], "valid keys of section 'dip': iterations, lr"),
        (["--set", "dip.lr=-1"], "dip.lr must be > 0"),
        (["--config", "no_such_config"], "bundled: demo"),
        (["--resume"], "--resume needs --out"),
    ],
)
def test_config_errors_exit_2_with_clear_message(argv, fragment, capsys, tmp_path):
    rc = main(["reconstruct", "--no-uq", *argv])
    assert rc == 2
    assert fragment in capsys.readouterr().err


def test_refuses_to_overwrite_a_finished_run(tmp_path, capsys):
    (tmp_path / "metrics.json").write_text("{}")
    assert main(["reconstruct", "--no-uq", "--out", str(tmp_path)]) == 2
    assert "already holds a finished run" in capsys.readouterr().err


def test_console_script_entry_point():
    res = subprocess.run([sys.executable, "-m", "ctuq.cli", "reconstruct", "--set", "x=1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "unknown config key 'x'" in res.stderr
