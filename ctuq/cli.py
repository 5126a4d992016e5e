"""The ``ctuq`` console script: ``ctuq simulate``, ``reconstruct``, ``uq``, ``pretrain``, ``design``.

Error contract (one place for every command): a user error (:mod:`ctuq.errors`: bad config or option, damaged
scan, unusable ``--out``, missing CUDA, diverged fit, ...) prints one line ``ctuq <command>: <file or option>:
<problem>`` on stderr and exits with status 2. ``ctuq --debug ...`` (also accepted after the command) or
``CTUQ_DEBUG=1`` re-raises it so the traceback shows. Programming errors always keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ctuq import __version__
from ctuq.commands import COMMANDS
from ctuq.errors import debug_requested, format_user_error, is_user_error
from ctuq.utils import tune_malloc

_DEBUG_HELP = "show the Python traceback of errors (also: environment variable CTUQ_DEBUG=1)"


def build_parser() -> argparse.ArgumentParser:
    """The ``ctuq`` parser with one sub-parser per available command (and ``--debug`` on each)."""
    parser = argparse.ArgumentParser(
        prog="ctuq",
        description="Computed-tomography uncertainty: deep-image-prior reconstruction with error bars.",
    )
    parser.add_argument("--version", action="version", version=f"ctuq {__version__}")
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for _name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:  # sub-command not built yet
                continue
            raise
        p = mod.add_parser(sub)
        # SUPPRESS: without the flag the sub-parser must not reset a --debug given before the command.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``ctuq`` command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (0, 2 for a
    user error, 130 when interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    tune_malloc()  # keep freed host memory for reuse (glibc): fewer page faults in long runs
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("ctuq: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug_requested(args.debug) or not is_user_error(exc):
            raise
        print(f"ctuq {args.command}: {format_user_error(exc)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
