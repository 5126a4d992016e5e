"""The ``ctuq`` console script: ``ctuq simulate``, ``ctuq reconstruct``, ``ctuq uq``."""

from __future__ import annotations

import argparse
import importlib
import sys

from ctuq import __version__
from ctuq.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ctuq",
        description="Computed-tomography uncertainty: deep-image-prior reconstruction with error bars.",
    )
    parser.add_argument("--version", action="version", version=f"ctuq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:  # sub-command not built yet
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("ctuq: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
