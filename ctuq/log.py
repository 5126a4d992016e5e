"""Logging of ctuq: the terminal lines of the ``ctuq`` commands and the run folder's ``ctuq.log``.

Every module logs through ``logging.getLogger(__name__)`` (all under the ``ctuq`` logger); nothing here prints.
Two handlers, installed on the ``ctuq`` logger:

* the terminal (:func:`configure_logging`, called once by :func:`ctuq.cli.main`): stderr, in the style the
  commands always had — ``[ctuq reconstruct] message`` for progress lines, ``ctuq reconstruct: warning: message``
  for warnings, ``ctuq reconstruct: message`` for errors; level INFO, WARNING with ``--quiet``, DEBUG with
  ``--verbose``. Lines go through ``tqdm.write``, so a line printed while a progress bar runs does not break it.
* the log file (:func:`run_log`, a context manager around a command's work): every record (DEBUG and up) with
  its timestamp, level and logger, appended to the file (a resumed run adds to the log of the interrupted one).
  Progress bars are drawn by tqdm straight onto stderr and never reach a log record, so none is in the file.

Library users who never call :func:`configure_logging` get Python's default: warnings and errors on stderr
through the last-resort handler, progress lines nowhere (configure the ``ctuq`` logger to see them).

This module imports nothing from ctuq but :mod:`ctuq.errors`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from ctuq.errors import format_user_error, is_user_error

__all__ = [
    "ROOT_LOGGER",
    "FILE_FORMAT",
    "verbosity_level",
    "configure_logging",
    "ensure_console_logging",
    "run_log",
    "duration",
]

ROOT_LOGGER = "ctuq"
FILE_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s"
_FILE_DATEFMT = "%Y-%m-%d %H:%M:%S"

_log = logging.getLogger(__name__)
_command_line: str | None = None  # what configure_logging was told runs; run_log's first line


def verbosity_level(verbosity: int) -> int:
    """The terminal's ``logging`` level for ``verbosity``: ``< 0`` (``--quiet``) WARNING, ``0`` INFO, ``> 0``
    (``--verbose``) DEBUG."""
    if verbosity < 0:
        return logging.WARNING
    return logging.INFO if verbosity == 0 else logging.DEBUG


class _ConsoleFormatter(logging.Formatter):
    """``[ctuq CMD] msg`` (DEBUG, INFO), ``ctuq CMD: warning: msg`` (WARNING), ``ctuq CMD: msg`` (ERROR and up).

    A record with a ``console_prefix`` attribute (``extra={"console_prefix": ...}``) gets that prefix instead:
    the studies' ``[walnut_study   12.3 s] msg`` lines.
    """

    def __init__(self, command: str | None) -> None:
        super().__init__()
        self.name = f"ctuq {command}" if command else "ctuq"

    def format(self, record: logging.LogRecord) -> str:
        prefix = getattr(record, "console_prefix", None)
        if prefix is None:
            if record.levelno >= logging.ERROR:
                prefix = f"{self.name}: "
            elif record.levelno >= logging.WARNING:
                prefix = f"{self.name}: warning: "
            else:
                prefix = f"[{self.name}] "
        text = prefix + record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _ConsoleHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is when the record arrives (a redirect or pytest's capture installed after
    :func:`configure_logging` still gets the lines), through ``tqdm.write`` so that live bars are redrawn below."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


class _RunFileHandler(logging.FileHandler):
    """The run's log file: opened on the first record (a command refused before it logs anything leaves no file,
    and no line in an earlier run's file), then appended and flushed record by record.

    ``header`` records are written just before the first record. A write that fails (a full disk, a folder that
    went away) switches the file off with one warning on the terminal instead of a logging traceback per line.
    ``deferred``: records are held in memory until :meth:`release` writes them.
    """

    def __init__(self, path: Path, header: list[logging.LogRecord], deferred: bool = False) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)
        self.header = header
        self.failed = False
        self.held: list[logging.LogRecord] | None = [] if deferred else None

    @property
    def opened(self) -> bool:
        """Whether the file has been written to in this run."""
        return self.stream is not None

    def release(self) -> None:
        """Write the records held back (``deferred``) and write through from now on."""
        held, self.held = self.held or [], None
        for rec in held:
            self.handle(rec)

    def emit(self, record: logging.LogRecord) -> None:
        if self.held is not None:
            self.held.append(record)
            return
        if self.failed:
            return
        # FileHandler.emit lets an error opening the file escape to the caller; handleError switches the file off.
        try:
            if self.stream is None and self.header:
                header, self.header = self.header, []
                for rec in header:
                    super().emit(rec)
            if not self.failed:
                super().emit(record)
        except Exception:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if self.failed:
            return
        self.failed = True
        exc = sys.exc_info()[1]
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
        with contextlib.suppress(Exception):
            self.close()
        _log.warning("cannot write %s (%s); the log continues on the terminal only", self.baseFilename, reason)


def configure_logging(verbosity: int = 0, command: str | None = None, command_line: str | None = None) -> None:
    """Send the ``ctuq`` loggers' records to stderr as the ``ctuq`` commands show them (module docstring).

    Replaces the terminal handler of an earlier call (the command line may run several times in one process);
    a file handler of an open :func:`run_log` stays. The ``ctuq`` logger passes everything (DEBUG) to its handlers
    and no longer propagates to the root logger, so a root handler set up by some library does not print every
    line a second time.

    Parameters
    ----------
    verbosity : int
        ``-1`` (``--quiet``: warnings and errors only), ``0`` (progress lines too), ``1`` (``--verbose``: debug).
    command : str, optional
        The sub-command named in every line (``"reconstruct"`` → ``[ctuq reconstruct] ...``).
    command_line : str, optional
        The command line being run, for the first line of each :func:`run_log` file (default: ``sys.argv``).
    """
    global _command_line
    _command_line = command_line
    logger = logging.getLogger(ROOT_LOGGER)
    for h in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
        logger.removeHandler(h)
    handler = _ConsoleHandler(verbosity_level(verbosity))
    handler.setFormatter(_ConsoleFormatter(command))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False


def ensure_console_logging() -> None:
    """:func:`configure_logging` with the defaults unless a terminal handler is installed already (the studies'
    scripts, which show their progress lines without going through :func:`ctuq.cli.main`)."""
    if not any(isinstance(h, _ConsoleHandler) for h in logging.getLogger(ROOT_LOGGER).handlers):
        configure_logging()


def _is_root_rank() -> bool:
    # torchrun sets RANK; the other ranks of a sharded `ctuq uq` log to their terminal only (rank 0 writes the file)
    return os.environ.get("RANK", "0").strip() in ("", "0")


@contextlib.contextmanager
def run_log(path: str | os.PathLike, *, deferred: bool = False) -> Iterator[Path]:
    """Append every ``ctuq`` log record to the file ``path`` (``OUT/ctuq.log``) while the block runs.

    Lines read ``2026-11-25 08:51:26.123 INFO    ctuq.pipeline.phases: message``. The file is created on the
    first record (so a command refused before it starts writes nothing), preceded by a DEBUG record of the
    command line and process id. An exception leaving the block is recorded at its end when the file was opened:
    a user error as its one line (:func:`ctuq.errors.format_user_error`), an interruption as ``interrupted: ...``,
    anything else with its traceback; the exception propagates unchanged (the terminal line is
    :func:`ctuq.cli.main`'s). In a ``torchrun`` launch only rank 0 writes. Yields ``path``.

    ``deferred``: the records are held in memory and written when the block ends without an exception (for a
    command whose output folder must be empty when its own check runs, ``ctuq simulate``: a file written before
    that check would fail it); an exception leaves no file.
    """
    path = Path(path)
    logger = logging.getLogger(ROOT_LOGGER)
    if not _is_root_rank():
        yield path
        return
    level = logger.level
    logger.setLevel(logging.DEBUG)  # the file gets every record, whatever the terminal shows
    start = f"started (pid {os.getpid()}): {_command_line or shlex.join(sys.argv)}"
    head = [logger.makeRecord(_log.name, logging.DEBUG, __file__, 0, start, None, None)]
    handler = _RunFileHandler(path, head, deferred)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(FILE_FORMAT, _FILE_DATEFMT))
    logger.addHandler(handler)
    try:
        yield path
        handler.release()
    except BaseException as exc:
        if handler.opened and handler.held is None:
            handler.handle(_exit_record(logger, exc))
        raise
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def _exit_record(logger: logging.Logger, exc: BaseException) -> logging.LogRecord:
    """The log-file record of the exception ``exc`` that ends a run."""
    if is_user_error(exc):
        msg = format_user_error(exc)
    elif isinstance(exc, KeyboardInterrupt):  # ctuq.interrupt.Interrupted says which signal, where, what was saved
        msg = f"interrupted: {exc}" if str(exc) else "interrupted"
    elif isinstance(exc, Exception):
        msg = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    else:
        msg = f"stopped: {type(exc).__name__} {exc}".rstrip()
    return logger.makeRecord(_log.name, logging.ERROR, __file__, 0, msg, None, None)


def duration(seconds: float) -> str:
    """A time as a person reads it in a log line: ``"40 s"``, ``"3.2 min"`` or ``"5.1 h"``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
