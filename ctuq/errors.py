"""User errors: the one error contract of every ``ctuq`` command.

A *user error* is a problem the person running ``ctuq`` can fix without touching the code: a bad config value, a
damaged or mis-shaped scan, a run folder that cannot be written, a device that is not there, a fit that diverged.
``ctuq.cli.main`` prints it as one line, ``ctuq <command>: <file or option>: <problem>``, on stderr and exits
with status 2; ``ctuq --debug`` (or ``CTUQ_DEBUG=1``) re-raises it to show the traceback. Everything else (a
``TypeError``, ``AttributeError``, ``KeyError``, a generic ``RuntimeError`` from torch) is a programming error and
keeps its traceback.

User errors are

* :class:`CTUQError` and its subclasses (:class:`ctuq.config.ConfigError` is one);
* the library's own error classes, named in :data:`LIBRARY_ERRORS` (the walnut loader's
  ``WalnutFormatError``, ``ModelFileError``, the DIP's and the inference's checkpoint mismatches);
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
import sys

__all__ = ["CTUQError", "DataError", "OutDirError", "DeviceError", "NonFiniteLossError", "CheckpointMismatch", "LIBRARY_ERRORS",
           "user_error_types", "is_user_error", "format_user_error", "debug_requested"]


class CTUQError(ValueError):
    """Base of ctuq's user errors; the message begins with the file or option it is about (one line)."""


class DataError(CTUQError):
    """The scan cannot give the requested setting: too few angles, a slice or subsampling out of range."""


class OutDirError(CTUQError):
    """The output folder (``--out``, ``RUN_DIR``) is a file, lies under a file, is not writable or is taken."""


class DeviceError(CTUQError, RuntimeError):
    """The requested device (e.g. ``cuda``) is not available. Also a ``RuntimeError``, as it was before."""


class CheckpointMismatch(CTUQError):
    """A checkpoint, state file or run folder to resume does not match this run (other settings, data, network or
    version) or is damaged. The one such exception of ctuq: the DIP, the inference, the EM, the design and the
    classifier's state raise it; the message names the file and the setting that differs."""


class NonFiniteLossError(CTUQError, FloatingPointError):
    """A fit's loss became NaN or infinite. Also a ``FloatingPointError``, as ``fit_dip`` raises it."""


# Module → class names of library exceptions that are user errors. Looked up in sys.modules only: an exception
# of a class whose module was never imported cannot have been raised, and the error path imports nothing heavy.
LIBRARY_ERRORS: dict[str, tuple[str, ...]] = {
    "ctuq.data.walnut": ("WalnutFormatError",),
    "ctuq.models.model_file": ("ModelFileError",),
    "ctuq.reconstruct.dip": ("CheckpointMismatch",),
    "ctuq.uq": ("UQCheckpointMismatch",),
    "ctuq.config": ("ConfigError",),
}
# DesignError and DesignCheckpointMismatch (ctuq.design) are CTUQError subclasses: no entry needed.

_BUILTIN_USER_ERRORS: tuple[type[BaseException], ...] = (
    CTUQError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError,
    FloatingPointError,
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes reported as one line (see the module docstring), among those imported so far."""
    found = list(_BUILTIN_USER_ERRORS)
    for module_name, names in LIBRARY_ERRORS.items():
        module = sys.modules.get(module_name)
        if module is not None:
            found += [getattr(module, name) for name in names if hasattr(module, name)]
    return tuple(found)


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
