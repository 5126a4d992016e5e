"""ctuq.log: the terminal lines of the commands, --quiet/--verbose, and a run folder's ctuq.log (timestamped, every
message, no progress bars, appended by --resume, the error that ends a run, untouched by a refused command)."""

import logging
import re

import pytest
from tiny import QUICK, TINY_SETTINGS, sets

from ctuq.cli import main
from ctuq.errors import CTUQError
from ctuq.log import configure_logging, ensure_console_logging, run_log
from ctuq.pipeline.run_folder import LOG_NAME

# A line of ctuq.log: local time to the millisecond, level, logger, message.
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR)\s+ctuq(\.\w+)*: \S")

FAST = ["--no-uq", *sets(*TINY_SETTINGS, *QUICK)]


@pytest.fixture(autouse=True)
def _restore_logging():
    """Each test may reconfigure the ``ctuq`` logger (as ``ctuq.cli.main`` does); later tests get it back."""
    logger = logging.getLogger("ctuq")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def _log_lines(folder):
    text = (folder / LOG_NAME).read_text(encoding="utf-8")
    return text, text.splitlines()


def test_terminal_lines_keep_the_commands_style(capsys):
    configure_logging(0, "uq")
    log = logging.getLogger("ctuq.some.module")
    log.debug("not shown")
    log.info("progress")
    log.warning("careful")
    log.error("x.yaml: broken")
    assert capsys.readouterr().err == "[ctuq uq] progress\nctuq uq: warning: careful\nctuq uq: x.yaml: broken\n"
    configure_logging(-1, "uq")  # --quiet: replaces the handler, warnings and errors only
    log.info("progress")
    log.warning("careful")
    assert capsys.readouterr().err == "ctuq uq: warning: careful\n"
    configure_logging(1, "uq")  # --verbose
    log.debug("detail")
    assert capsys.readouterr().err == "[ctuq uq] detail\n"
    ensure_console_logging()  # a handler exists: nothing changes (no second line per record)
    log.info("once")
    assert capsys.readouterr().err == "[ctuq uq] once\n"


def test_run_log_appends_writes_lazily_and_records_the_error(tmp_path, capsys):
    configure_logging(0, "x")
    path = tmp_path / LOG_NAME
    log = logging.getLogger("ctuq.test")
    with run_log(path):
        pass  # nothing logged: no file (a refused command leaves none)
    assert not path.exists()
    with run_log(path):
        log.debug("first")
    with pytest.raises(CTUQError), run_log(path):  # a user error ends the second run
        log.info("second")
        raise CTUQError("data.path: no scan there")
    lines = path.read_text().splitlines()
    assert all(LINE.match(line) for line in lines), lines
    assert [line.split(": ", 1)[1] for line in lines[1::2]] == ["first", "second"]
    assert "started (pid " in lines[0] and "started (pid " in lines[2]
    assert " ERROR " in lines[4] and lines[4].endswith("ctuq.log: data.path: no scan there") and len(lines) == 5
    log.info("after")  # the file handler is gone with the block
    assert "after" not in path.read_text()
    capsys.readouterr()


def test_a_log_file_that_cannot_be_written_warns_once(tmp_path, capsys):
    configure_logging(0, "x")
    path = tmp_path / LOG_NAME
    path.mkdir()  # opening it fails as a full disk would: the run goes on, one warning, no logging traceback
    log = logging.getLogger("ctuq.test")
    with run_log(path):
        log.info("one")
        log.info("two")
    err = capsys.readouterr().err
    assert err.count(f"ctuq x: warning: cannot write {path} (") == 1, err
    assert "[ctuq x] one\n" in err and "[ctuq x] two\n" in err and "Traceback" not in err


def test_simulate_log_has_timestamps_and_no_progress_bars(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CTUQ_NO_PROGRESS")  # draw the bars, to see that none reaches the file
    out = tmp_path / "scan"
    assert main(["simulate", "--preset", "tiny", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "it/s" in err and "\r" in err  # the bars were drawn on the terminal
    assert f"[ctuq simulate] wrote {out} (" in err
    text, lines = _log_lines(out)
    assert all(LINE.match(line) for line in lines), text
    assert "started (pid" in lines[0] and "simulate --preset tiny" in lines[0]
    assert lines[-1].split(": ", 1)[1] == err.strip().splitlines()[-1].split("] ", 1)[1].split("\r")[0]
    assert "\r" not in text and "it/s" not in text and "%|" not in text


def test_quiet_and_verbose(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CTUQ_NO_PROGRESS")
    assert main(["simulate", "--preset", "tiny", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # no progress line, no bar
    assert "wrote" in _log_lines(tmp_path / "a")[0]  # the file still gets everything
    assert main(["-v", "simulate", "--preset", "tiny", "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[ctuq simulate] ctuq ") and err[0].endswith(
        f"simulate --preset tiny --out {tmp_path / 'b'} --no-progress"
    )
    # the error contract holds under --quiet: one line, exit 2
    assert main(["reconstruct", "--quiet", "--set", "dip.lr=-1"]) == 2
    assert capsys.readouterr().err == "ctuq reconstruct: --set dip.lr=-1: dip.lr must be > 0.0, got -1.0\n"


def test_reconstruct_log_resume_and_refusal(tiny_scan, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["reconstruct", "--data", str(tiny_scan), "--out", str(out), "--no-progress", *FAST]
    assert main(argv) == 0
    terminal = capsys.readouterr().err
    first, lines = _log_lines(out)
    assert all(LINE.match(line) for line in lines), first
    messages = [line.split(": ", 1)[1] for line in lines if " INFO " in line]
    # every terminal line of the run is in the log, in order
    assert messages == [line.removeprefix("[ctuq reconstruct] ") for line in terminal.splitlines()]
    assert any(" DEBUG " in line and "loading" in line for line in lines)
    # a second run into the finished folder is refused in one line and leaves its log alone
    assert main(argv) == 2
    assert "already holds a finished run" in capsys.readouterr().err
    assert _log_lines(out)[0] == first
    # --resume appends
    assert main([*argv, "--resume"]) == 0
    text, lines = _log_lines(out)
    assert text.startswith(first) and sum("started (pid" in line for line in lines) == 2
    # a run that fails after it began ends its log with the error line of the terminal
    bad = tmp_path / "bad"
    capsys.readouterr()
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(bad), *FAST, "--set", "dip.lr=1e30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    last = _log_lines(bad)[1][-1]
    assert " ERROR " in last and err == "ctuq reconstruct: " + last.split(": ", 1)[1]
