"""The ``ctuq`` console script: ``simulate``, ``reconstruct``, ``uq``, ``pretrain``, ``design``, ``view``, ``fetch``.

Error contract (one place for every command): a user error (:mod:`ctuq.errors`: bad config or option, damaged
scan, unusable ``--out``, missing CUDA, diverged fit, ...) prints one line ``ctuq <command>: <file or option>:
<problem>`` on stderr and exits with status 2. ``ctuq --debug ...`` (also accepted after the command) or
``CTUQ_DEBUG=1`` re-raises it so the traceback shows. Programming errors always keep their traceback. Ctrl-C
(SIGINT) and SIGTERM stop a run at its next checkpoint (:mod:`ctuq.interrupt`) with one line naming the command that
resumes it, and exit with status 130 / 143.

Terminal output goes through :mod:`ctuq.log`: ``--quiet`` (``-q``) leaves warnings and errors only (and no
progress bars), ``--verbose`` (``-v``) adds debug lines; a command with an output folder also writes every
message, timestamped, to its ``ctuq.log``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import shlex
import sys

from ctuq import __version__, interrupt
from ctuq.commands import COMMANDS
from ctuq.errors import debug_requested, format_user_error, is_user_error
from ctuq.log import configure_logging
from ctuq.registry import lazy_module

utils = lazy_module("ctuq.utils")  # torch: imported when a command runs, not to print --help

_DEBUG_HELP = "show the Python traceback of errors (also: environment variable CTUQ_DEBUG=1)"
_QUIET_HELP = "only warnings and errors on the terminal, no progress bars (the run's ctuq.log still gets everything)"
_VERBOSE_HELP = "also debug messages on the terminal"
_log = logging.getLogger(__name__)


def _add_verbosity(parser: argparse.ArgumentParser, default) -> None:
    # --quiet/--verbose set one verbosity (-1/+1); the last one given wins, before or after the command.
    parser.add_argument(
        "-q", "--quiet", dest="verbosity", action="store_const", const=-1, default=default, help=_QUIET_HELP
    )
    parser.add_argument(
        "-v", "--verbose", dest="verbosity", action="store_const", const=1, default=default, help=_VERBOSE_HELP
    )


_ROLE = re.compile(r":[a-z]+:`~?([^`<]+?)(?: <[^>]+>)?`")


def plain(text: str) -> str:
    """Docstring markup as a terminal shows it: ``:func:`~a.b.c``` → ``c``, ````x```` → ``x``."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), text)
    return text.replace("``", "")


class _PlainSubparsers(argparse._SubParsersAction):
    """Sub-parsers whose descriptions, help and epilogs lose their docstring markup (:func:`plain`)."""

    def add_parser(self, name, **kwargs):
        for key in ("description", "help", "epilog"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = plain(kwargs[key])
        return super().add_parser(name, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``ctuq`` parser: every command of :data:`~ctuq.commands.COMMANDS` listed with its summary, and the full
    sub-parser (with ``--debug``, ``-q``, ``-v``) of ``command`` only, or of every command when ``command`` is
    ``None`` (its module imported to build it: the modules are light, their work is imported when they run)."""
    parser = argparse.ArgumentParser(
        prog="ctuq",
        description="Computed-tomography uncertainty: deep-image-prior reconstruction with error bars.",
        epilog="`ctuq COMMAND --help` describes a command's options; README.md has examples.",
    )
    parser.add_argument("--version", action="version", version=f"ctuq {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    _add_verbosity(parser, 0)
    parser.register("action", "parsers", _PlainSubparsers)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=summary, add_help=False)  # listed in `ctuq --help`, never run from here
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:  # sub-command not built yet
                continue
            raise
        p = mod.add_parser(sub)
        # SUPPRESS: without the flag the sub-parser must not reset a --debug given before the command.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        _add_verbosity(p, argparse.SUPPRESS)
    return parser


def _command_in(argv: list[str]) -> str:
    """The command ``argv`` runs (its first word that names one), or ``""`` (top-level options, ``--help``)."""
    return next((a for a in argv if a in COMMANDS), "")


def main(argv: list[str] | None = None) -> int:
    """Run the ``ctuq`` command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (0, 2 for a
    user error, 130/143 when stopped by SIGINT/SIGTERM: :mod:`ctuq.interrupt`)."""
    words = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_in(words))
    args = parser.parse_args(words)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    command_line = "ctuq " + shlex.join(sys.argv[1:] if argv is None else argv)
    configure_logging(args.verbosity, args.command, command_line)
    _log.debug(f"ctuq {__version__}, Python {sys.version.split()[0]}: {command_line}")
    if args.verbosity < 0 and hasattr(args, "no_progress"):
        args.no_progress = True
    utils.tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    try:
        with interrupt.handling():  # SIGINT/SIGTERM: checkpoint at the next safe point, then Interrupted
            return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:
        # one line: the signal, the checkpoint written and the exact command that resumes the run
        _log.error(interrupt.message(exc, args.command, sys.argv[1:] if argv is None else argv))
        return exc.exit_status if isinstance(exc, interrupt.Interrupted) else 130
    except Exception as exc:
        if debug_requested(args.debug) or not is_user_error(exc):
            raise
        _log.error(format_user_error(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
