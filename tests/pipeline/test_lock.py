"""One ctuq process per output folder (ctuq.pipeline.lock): a second process on a folder in use is refused in one line
naming the folder and the holder's PID, before it changes anything there; a lock whose holder was killed is taken over
with a warning; within one process the lock is re-entrant."""

import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from ctuq.cli import main
from ctuq.config import Config
from ctuq.errors import RunFolderLocked, is_user_error
from ctuq.pipeline import lock
from ctuq.studies import Log, check_study_folder

# Holds the lock of argv[1] (and the simulate-style lock beside argv[2]) until its stdin closes.
HOLDER = """
import sys
from ctuq.pipeline.lock import run_lock
with run_lock(sys.argv[1], command="holder"), run_lock(sys.argv[2], beside=True, command="holder"):
    print("held", flush=True)
    sys.stdin.read()
"""


def _holder(*folders):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *map(str, folders)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def _snapshot(folder):
    return {
        p.relative_to(folder): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_a_second_process_is_refused_and_a_killed_holders_lock_is_taken_over(tiny_scan, tmp_path, capsys):
    run, scan = tmp_path / "run", tmp_path / "scan"
    run.mkdir()
    # a run folder as a running `ctuq reconstruct` leaves it before metrics.json (config.yaml, a checkpoint)
    (run / "config.yaml").write_text(yaml.safe_dump(Config().to_dict()))
    (run / "dip_checkpoint.pt").write_bytes(b"weights of the first process")
    proc = _holder(run, scan)
    try:
        before = _snapshot(run)
        assert lock.holder(run)["pid"] == proc.pid
        refusals = [
            (["reconstruct", "--data", str(tiny_scan), "--out", str(run), "--no-uq"], f"--out {run}"),
            (["reconstruct", "--out", str(run), "--resume"], f"--out {run}"),
            (["uq", str(run)], f"RUN_DIR {run}"),
            (["design", "--data", str(tiny_scan), "--out", str(run)], f"--out {run}"),
            (["simulate", "--preset", "tiny", "--out", str(scan)], f"--out {scan}"),
        ]
        for argv, where in refusals:
            capsys.readouterr()
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1, (argv, err)
            assert err[0] == (
                f"ctuq {argv[0]}: {where}: in use by another ctuq process (PID {proc.pid}, `holder`, since "
                f"{lock.holder(run)['started']}); wait until it ends or choose another {where.split()[0]}"
            )
        with pytest.raises(RunFolderLocked, match=f"PID {proc.pid}") as info:
            check_study_folder(run, {"seed": 0}, Log("test"))
        assert is_user_error(info.value)
        assert _snapshot(run) == before  # not even a log line or a config
        assert not scan.exists() or not any(scan.iterdir())
        # the holder is killed: no clean-up, its record stays, the OS drops its lock; the next run takes it over
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert lock.holder(run)["pid"] == proc.pid
        capsys.readouterr()
        with lock.run_lock(run, command="second"):
            rec = json.loads(lock.lock_paths(run)[1].read_text())
            assert rec["pid"] == os.getpid() and rec["command"] == "second"
        err = capsys.readouterr().err
        assert f"--out {run}: taking over the stale lock of PID {proc.pid}, `holder`" in err and "no longer runs" in err
        assert lock.holder(run) is None  # released: the record goes with the lock
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_the_lock_is_reentrant_within_a_process(tmp_path):
    with lock.run_lock(tmp_path, command="outer"):
        with lock.run_lock(tmp_path, command="inner"):
            assert lock.holder(tmp_path)["command"] == "outer"
        assert lock.holder(tmp_path)["command"] == "outer"  # still held by the outer block
    assert lock.holder(tmp_path) is None
    assert lock.lock_paths(tmp_path / "scan", beside=True) == (
        tmp_path / ".scan.ctuq.lock",
        tmp_path / ".scan.ctuq.lock.json",
    )
