"""Ctrl-C and SIGTERM as a clean stop: checkpoint at the next safe point, then say how to resume.

The ``ctuq`` command line runs every command inside :func:`handling`, which installs handlers for SIGINT (Ctrl-C)
and SIGTERM (``kill``, a batch system's time limit). What a signal does depends on where the program is:

* inside a :func:`safe_points` region — the DIP iterations, the EM steps, the prediction's sample chunks, i.e. the
  loops that checkpoint — the signal is only *noted*. The loop polls :func:`requested` at the end of every
  iteration (step, chunk); when a signal is pending it writes its checkpoint as of that point and calls
  :func:`stop`, which raises :class:`Interrupted` naming the checkpoint. A ``--resume`` then continues from exactly
  that point, so it ends bit-identical to a run that was never interrupted (the checkpoints hold the weights,
  the optimizer and the RNG states, resp. the posterior and the running sums of the finished chunks);
* anywhere else (loading, FBP, TV, set-up of the inference, writing), or at a second signal while one is pending,
  :class:`Interrupted` is raised at once, like Python's own ``KeyboardInterrupt``: the files written so far are
  complete (every writer is atomic), and ``--resume`` continues from the last checkpoint.

:class:`Interrupted` is a ``KeyboardInterrupt``, so code that lets Ctrl-C through lets it through too.
``ctuq.cli.main`` turns it into one line naming the exact ``--resume`` command (:func:`resume_command`) and the
exit status ``128 + signal`` (130 for SIGINT, 143 for SIGTERM).

Without :func:`handling` (library use) nothing changes: the regions only count their depth, SIGINT raises
Python's ``KeyboardInterrupt`` wherever the program is, and SIGTERM ends the process.

This module imports nothing from ctuq.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

__all__ = [
    "Interrupted",
    "handling",
    "safe_points",
    "safe_iter",
    "requested",
    "stop",
    "note_run_folder",
    "run_folder",
    "RESUMABLE_COMMANDS",
    "resume_command",
    "message",
]

T = TypeVar("T")

# Commands whose --resume continues from the checkpoints of their output folder, and the option naming it.
RESUMABLE_COMMANDS = {"reconstruct": "--out", "design": "--out", "uq": None}


class Interrupted(KeyboardInterrupt):
    """The run was stopped by signal ``signum`` (SIGINT or SIGTERM).

    ``where`` says at which point (e.g. ``"the DIP fit after iteration 37 of 300"``; empty when the signal stopped
    the program at once) and ``checkpoint`` is the file written there (``None`` when none was written then).
    """

    def __init__(self, signum: int, where: str = "", checkpoint: str | Path | None = None) -> None:
        self.signum = int(signum)
        self.where = where
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        super().__init__(self.describe())

    @property
    def signal_name(self) -> str:
        """``"SIGINT"``, ``"SIGTERM"``, ..."""
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    @property
    def exit_status(self) -> int:
        """The shell's status of a process ended by this signal: ``128 + signum`` (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum

    def describe(self) -> str:
        """``interrupted by SIGTERM during <where> (checkpoint written: <file>)``."""
        text = f"interrupted by {self.signal_name}"
        if self.where:
            text += f" during {self.where}"
        if self.checkpoint is not None:
            text += f" (checkpoint written: {self.checkpoint})"
        return text


class _State:
    """The process's signal state (signal handlers run in the main thread only)."""

    def __init__(self) -> None:
        self.installed = False
        self.depth = 0  # nesting of active safe_points regions
        self.pending: int | None = None  # a signal noted inside a region, not yet acted upon
        self.run_folder: Path | None = None


_STATE = _State()


def _handler(signum: int, _frame) -> None:
    if _STATE.depth > 0 and _STATE.pending is None:
        _STATE.pending = signum  # the loop checkpoints and stops at its next safe point
        return
    _STATE.pending = None
    raise Interrupted(signum)


@contextlib.contextmanager
def handling(signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Within the block, ``signals`` raise :class:`Interrupted` (deferred to the next safe point inside
    :func:`safe_points` regions); the previous handlers come back afterwards. Outside the main thread (where Python
    cannot install handlers) and when already active, it changes nothing."""
    if _STATE.installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    _STATE.installed, _STATE.depth, _STATE.pending, _STATE.run_folder = True, 0, None, None
    try:
        for s in signals:
            signal.signal(s, _handler)
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _STATE.installed, _STATE.depth, _STATE.pending = False, 0, None


@contextlib.contextmanager
def safe_points(enabled: bool = True) -> Iterator[None]:
    """A region whose loop polls :func:`requested` at every safe point and calls :func:`stop` after checkpointing.

    A signal that arrived after the region's last poll is acted upon when the region ends normally
    (:class:`Interrupted` without a new checkpoint: the last one written stands). ``enabled=False`` (a loop that
    cannot checkpoint, a sharded run whose ranks must stop together) leaves signals immediate.
    """
    if not enabled:
        yield
        return
    _STATE.depth += 1
    try:
        yield
    except BaseException:
        if _STATE.depth == 1:
            _STATE.pending = None  # the run ends through this exception anyway
        raise
    finally:
        _STATE.depth -= 1
    if _STATE.depth == 0 and _STATE.pending is not None:
        signum, _STATE.pending = _STATE.pending, None
        raise Interrupted(signum)


def safe_iter(iterable: Iterable[T], enabled: bool = True) -> Iterator[T]:
    """The items of ``iterable``, produced inside a :func:`safe_points` region (for a ``for`` loop that polls
    :func:`requested` in its body)."""
    with safe_points(enabled):
        yield from iterable


def requested() -> int | None:
    """The signal waiting to stop the run at this safe point, or ``None``."""
    return _STATE.pending


def stop(where: str, checkpoint: str | Path | None = None) -> None:
    """Raise :class:`Interrupted` for the pending signal (SIGINT if none), after the caller wrote ``checkpoint``;
    ``where`` names the point, e.g. ``"the EM after step 3 of 5"``."""
    signum = _STATE.pending if _STATE.pending is not None else int(signal.SIGINT)
    _STATE.pending = None
    raise Interrupted(signum, where, checkpoint)


def note_run_folder(folder: str | Path) -> None:
    """Record the output folder of the running command, for :func:`resume_command` (a run folder chosen by ctuq,
    e.g. ``runs/<timestamp>``, is not on the command line)."""
    _STATE.run_folder = Path(folder)


def run_folder() -> Path | None:
    """The folder of :func:`note_run_folder` (``None`` before one was noted)."""
    return _STATE.run_folder


def resume_command(command: str, argv: Sequence[str], folder: str | Path | None = None) -> str | None:
    """The exact command line that resumes ``ctuq <argv>`` (``argv`` as given to ``ctuq``, beginning with the
    command), or ``None`` when ``command`` has no ``--resume`` (or the run never got an output folder).

    ``--resume`` is added when missing, and ``--out <folder>`` when the output folder was not on the command line.
    """
    if command not in RESUMABLE_COMMANDS or "--check" in argv:
        return None
    args = list(argv)
    option = RESUMABLE_COMMANDS[command]
    if option is not None and not any(a == option or a.startswith(option + "=") for a in args):
        if folder is None:
            return None
        args += [option, str(folder)]
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["ctuq", *args])


def message(exc: KeyboardInterrupt, command: str, argv: Sequence[str]) -> str:
    """The one line for a run of ``ctuq <argv>`` stopped by ``exc``: what stopped it, where, the checkpoint, and the
    command that resumes it."""
    text = exc.describe() if isinstance(exc, Interrupted) else "interrupted by SIGINT"
    again = resume_command(command, argv, run_folder())
    return f"{text}; resume with: {again}" if again else text
