"""User errors: the one error contract of every ``ctuq`` command.

A *user error* is a problem the person running ``ctuq`` can fix without touching the code: a bad config value, a
damaged or mis-shaped scan, a run folder that cannot be written, a device that is not there, a fit that diverged.
``ctuq.cli.main`` prints it as one line, ``ctuq <command>: <file or option>: <problem>``, on stderr and exits
with status 2; ``ctuq --debug`` (or ``CTUQ_DEBUG=1``) re-raises it to show the traceback. Everything else (a
``TypeError``, ``AttributeError``, ``KeyError``, a generic ``RuntimeError`` from torch) is a programming error and
keeps its traceback.

User errors are

* :class:`CTUQError` and its subclasses: every error class of the library meant for the user is one
  (:class:`ctuq.config.ConfigError`, the walnut loader's ``WalnutFormatError``, ``ModelFileError``,
  :class:`CheckpointMismatch`, the design's ``DesignError``, the studies' ``StudyError``, ...);
* ``FileNotFoundError``, ``PermissionError``, ``NotADirectoryError``, ``IsADirectoryError``, ``FileExistsError``;
* ``FloatingPointError``, which ctuq raises deliberately when a fit diverges (numpy raises it only when asked
  to with ``np.seterr``).

Messages of ctuq's own errors begin with the file or option they are about, e.g.
``data.slice_index: 40 is out of range ...`` or ``/scans/Walnut1/Projections/tubeV2/scan_000003.tif: not a
readable TIFF ...``.

This module imports nothing from ctuq, so every layer may use it.
"""

from __future__ import annotations

import os

__all__ = [
    "CTUQError",
    "DataError",
    "OutDirError",
    "RunFolderLocked",
    "DiskFullError",
    "DeviceError",
    "NonFiniteLossError",
    "CheckpointMismatch",
    "user_error_types",
    "is_user_error",
    "format_user_error",
    "debug_requested",
]


class CTUQError(ValueError):
    """Base of ctuq's user errors; the message begins with the file or option it is about (one line)."""


class DataError(CTUQError):
    """The scan cannot give the requested setting: too few angles, a slice or subsampling out of range."""


class OutDirError(CTUQError):
    """The output folder (``--out``, ``RUN_DIR``) is a file, lies under a file, is not writable or is taken."""


class RunFolderLocked(OutDirError):
    """Another ctuq process is writing the output folder (``ctuq.pipeline.lock``); the message names the folder and
    that process's PID."""


class DiskFullError(OutDirError):
    """A write failed because the file system is full (or the quota is used up): the message names the file; that
    file was not written and every earlier output is intact (all writers write a temporary file and rename it)."""


class DeviceError(CTUQError, RuntimeError):
    """The requested device (e.g. ``cuda``) is not available. Also a ``RuntimeError``, as it was before."""


class CheckpointMismatch(CTUQError):
    """A checkpoint, state file or run folder to resume does not match this run (other settings, data, network or
    version) or is damaged. The one such exception of ctuq: the DIP, the inference, the EM, the design and the
    classifier's state raise it; the message names the file and the setting that differs."""


class NonFiniteLossError(CTUQError, FloatingPointError):
    """A fit's loss became NaN or infinite. Also a ``FloatingPointError``, as ``fit_dip`` raises it."""


# One tuple, no look-up table: a library error meant for the user subclasses CTUQError.
_USER_ERRORS: tuple[type[BaseException], ...] = (
    CTUQError,
    FileNotFoundError,
    PermissionError,
    NotADirectoryError,
    IsADirectoryError,
    FileExistsError,
    FloatingPointError,
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes reported as one line (see the module docstring)."""
    return _USER_ERRORS


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a user error (one line, exit 2) rather than a programming error (traceback)."""
    return isinstance(exc, user_error_types())


def format_user_error(exc: BaseException) -> str:
    """``exc`` as one line ``<file or option>: <problem>``.

    ``OSError``\\ s raised by Python itself (``[Errno 2] No such file or directory: 'x'``) become
    ``x: No such file or directory``; multi-line messages (e.g. YAML parse errors) are joined with ``"; "``.
    """
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        where = os.fsdecode(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {os.fsdecode(exc.filename2)}"
        text = f"{where}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def debug_requested(flag: bool = False) -> bool:
    """``flag`` (``--debug``) or ``CTUQ_DEBUG`` set to anything but empty/``0``: show tracebacks of user errors."""
    return bool(flag) or os.environ.get("CTUQ_DEBUG", "").strip() not in ("", "0")
