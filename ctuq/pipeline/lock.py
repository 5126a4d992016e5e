"""One ctuq process per output folder: the lock every command holds on the folder it writes.

``ctuq reconstruct``, ``ctuq uq``, ``ctuq design``, the studies and ``ctuq simulate`` take the lock of their output
folder before they write anything there and hold it until they end. A second process on the same folder is refused
at once with one line naming the folder and the PID (and command) of the process that holds it
(:class:`~ctuq.errors.RunFolderLocked`, exit status 2), before it has changed a file.

Two files, both hidden:

* ``.ctuq.lock`` — the lock itself, a :class:`filelock.FileLock` (``flock`` on POSIX, ``LockFileEx`` on Windows).
  The operating system releases it when its process ends, however it ends (a crash, ``kill -9``, a power cut of
  one node), so a lock can never outlive its holder. A process that ends normally removes the file while it still
  holds the lock; one that took a lock verifies that the file it locked is still the one at the path (a process
  that opened the file just before it was removed would otherwise hold a lock nobody else sees) and tries again
  when it is not.
* ``.ctuq.lock.json`` — who holds it: ``{"pid", "host", "command", "started"}``, written after the lock is taken and
  removed before it is released (a file of its own: an old ``filelock`` truncates the lock file on every attempt).

A holder record found when the lock was free belongs to a process that ended without releasing it (killed): it is a
*stale* lock, taken over with a warning naming that PID. On a file system without ``flock`` support ``filelock``
falls back to the existence of the lock file; a lock file left there by a dead process on this host (its PID no
longer runs) is then removed, with the same warning.

Within one process the lock is re-entrant (a command that calls another pipeline function on the same folder does
not refuse itself); :func:`hold_until_exit` keeps it until the process ends (the studies, whose folders are checked
by :func:`ctuq.studies.check_study_folder` but written by many functions).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from ctuq.errors import RunFolderLocked
from ctuq.utils import atomic_write_json

__all__ = ["LOCK_NAME", "OWNER_NAME", "lock_paths", "run_lock", "hold_until_exit", "holder"]

LOCK_NAME = ".ctuq.lock"
OWNER_NAME = ".ctuq.lock.json"

_log = logging.getLogger(__name__)

# Locks this process holds: lock file (resolved) -> [FileLock, owner file, nesting count].
_HELD: dict[Path, list] = {}


def lock_paths(folder: str | os.PathLike, *, beside: bool = False) -> tuple[Path, Path]:
    """``(lock file, holder record)`` of ``folder``: inside it, or with ``beside`` next to it
    (``.<name>.ctuq.lock``: for ``ctuq simulate``, whose output folder must hold nothing but the scan)."""
    folder = Path(folder)
    if beside:
        base = folder.parent / f".{folder.name}"
        return Path(f"{base}{LOCK_NAME}"), Path(f"{base}{OWNER_NAME}")
    return folder / LOCK_NAME, folder / OWNER_NAME


def holder(folder: str | os.PathLike, *, beside: bool = False) -> dict | None:
    """The holder record of ``folder``'s lock (``pid``, ``host``, ``command``, ``started``), or ``None`` when there
    is none or it cannot be read. A record does not mean the lock is held (see the module docstring)."""
    try:
        rec = json.loads(lock_paths(folder, beside=beside)[1].read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _alive(pid: int) -> bool:
    if sys.platform == "win32":  # os.kill(pid, 0) would end the process there: assume it runs
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except (OSError, ValueError, OverflowError):
        return False
    return True


def _describe(rec: dict | None) -> str:
    if rec is None:
        return "PID unknown"
    text = f"PID {rec.get('pid')}"
    if rec.get("host") and rec.get("host") != socket.gethostname():
        text += f" on {rec['host']}"
    if rec.get("command"):
        text += f", `{rec['command']}`"
    if rec.get("started"):
        text += f", since {rec['started']}"
    return text


def _dead_here(rec: dict | None) -> bool:
    """Whether ``rec`` names a process of this host that no longer runs."""
    if rec is None or rec.get("host") != socket.gethostname():
        return False
    try:
        pid = int(rec.get("pid"))
    except (TypeError, ValueError):
        return False
    return pid != os.getpid() and not _alive(pid)


def _acquire(folder: Path, option: str, command: str | None, beside: bool) -> Path:
    """Take the lock of ``folder`` (or nest into this process's hold); returns the key of :data:`_HELD`."""
    lock_file, owner_file = lock_paths(folder, beside=beside)
    key = lock_file.resolve()
    if key in _HELD:
        _HELD[key][2] += 1
        return key
    lock = FileLock(lock_file, thread_local=False)
    where = f"{option} {folder}"
    try:
        _acquire_current(lock, lock_file)
    except Timeout:
        rec = holder(folder, beside=beside)
        if not _dead_here(rec):
            raise RunFolderLocked(
                f"{where}: in use by another ctuq process ({_describe(rec)}); wait until it ends or choose another "
                f"{option}"
            ) from None
        # A file system without flock: filelock's lock is the file's existence, left behind by a dead process.
        _log.warning(f"{where}: taking over the stale lock of {_describe(rec)}, which no longer runs")
        with contextlib.suppress(FileNotFoundError):
            lock_file.unlink()
        try:
            _acquire_current(lock, lock_file)
        except Timeout:
            raise RunFolderLocked(
                f"{where}: in use by another ctuq process ({_describe(holder(folder, beside=beside))}); wait until "
                f"it ends or choose another {option}"
            ) from None
    else:
        rec = holder(folder, beside=beside)
        if rec is not None and rec.get("pid") != os.getpid():
            state = "no longer runs" if _dead_here(rec) else "ended without releasing it"
            _log.warning(f"{where}: taking over the stale lock of {_describe(rec)}, which {state}")
    try:
        atomic_write_json(
            owner_file,
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": command or " ".join(["ctuq", *sys.argv[1:]]),
                "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            },
        )
    except BaseException:
        lock.release()
        raise
    _HELD[key] = [lock, owner_file, 1]
    return key


def _locked_file_is_current(lock: FileLock, lock_file: Path) -> bool:
    """Whether the file ``lock`` holds is the one at ``lock_file`` now (not one its holder removed meanwhile). Where
    filelock does not say which descriptor it locked, the path's existence is all that can be checked."""
    fd = getattr(getattr(lock, "_context", None), "lock_file_fd", None)
    try:
        here = os.stat(lock_file)
    except FileNotFoundError:
        return False
    if not isinstance(fd, int):
        return True
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)


def _acquire_current(lock: FileLock, lock_file: Path, tries: int = 5) -> None:
    """``lock.acquire(blocking=False)`` on the file that is at ``lock_file`` now (:func:`_locked_file_is_current`);
    :class:`filelock.Timeout` when another process holds it."""
    for _ in range(tries):
        lock.acquire(blocking=False)
        if _locked_file_is_current(lock, lock_file):
            return
        lock.release()  # the holder removed that file as it ended: lock the one at the path now
    raise Timeout(str(lock_file))


def _release(key: Path) -> None:
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[2] -= 1
    if entry[2] > 0:
        return
    del _HELD[key]
    lock, owner_file, _ = entry
    try:
        owner_file.unlink(missing_ok=True)  # while still holding it: no one reads a record of a free lock as stale
        Path(lock.lock_file).unlink(missing_ok=True)  # likewise; a process that locks it meanwhile tries again
    finally:
        lock.release()


@contextlib.contextmanager
def run_lock(
    folder: str | os.PathLike,
    *,
    option: str = "--out",
    command: str | None = None,
    beside: bool = False,
) -> Iterator[Path]:
    """Hold the lock of the output folder ``folder`` (which must exist, unless ``beside``) for the block.

    Parameters
    ----------
    folder : path
        The output folder.
    option : str
        How the user named it (``"--out"``, ``"RUN_DIR"``), for the message.
    command : str, optional
        What the holder record says this process is doing (default: ``ctuq`` and the command line's arguments).
    beside : bool
        Keep the lock files next to ``folder`` instead of inside it (:func:`lock_paths`).

    Raises
    ------
    RunFolderLocked
        Another process holds the lock; the message names ``folder`` and that process's PID.
    """
    folder = Path(folder)
    key = _acquire(folder, option, command, beside)
    try:
        yield folder
    finally:
        _release(key)


def hold_until_exit(
    folder: str | os.PathLike, *, option: str = "--out", command: str | None = None, beside: bool = False
) -> None:
    """Take the lock of ``folder`` (as :func:`run_lock`) and keep it until this process ends; a second call for the
    same folder changes nothing."""
    folder = Path(folder)
    key = lock_paths(folder, beside=beside)[0].resolve()
    if key in _HELD:
        return
    _acquire(folder, option, command, beside)


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        _HELD[key][2] = 1
        with contextlib.suppress(Exception):
            _release(key)
