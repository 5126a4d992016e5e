"""Sub-commands of the ``ctuq`` console script.

Each module defines ``add_parser(subparsers)`` registering its sub-command with ``func=run`` and ``run(args) ->
int``; it parses arguments only, the work is done by :mod:`ctuq.pipeline`, which a command module imports when it
runs (:func:`ctuq.registry.lazy_module`), not to print its ``--help``. :data:`COMMANDS` names each command's module
and its one-line summary, so ``ctuq --help`` lists the commands without importing any of them, and
:mod:`ctuq.cli` imports only the module of the command it runs (a command whose module is missing is left out).
"""

import argparse
from typing import NamedTuple


class Command(NamedTuple):
    """A sub-command: the module that defines it and the summary ``ctuq --help`` shows."""

    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "simulate": Command(
        "ctuq.commands.simulate", "simulate a walnut cone-beam scan (walnut data set layout, with ground truth)"
    ),
    "reconstruct": Command(
        "ctuq.commands.reconstruct", "DIP reconstruction with FBP/TV baselines; writes a run folder"
    ),
    "uq": Command("ctuq.commands.uq", "rerun only the uncertainty phase on a finished reconstruction folder"),
    "pretrain": Command(
        "ctuq.commands.pretrain", "pretrain the U-Net on simulated walnuts (FBP → image) to start the DIP from"
    ),
    "design": Command(
        "ctuq.commands.design", "choose scan angles after a sparse pilot scan (EIG/ESE with the linearised DIP)"
    ),
    "view": Command(
        "ctuq.commands.view", "show a run folder's images in napari at physical scale (needs the 'view' extra)"
    ),
    "fetch": Command(
        "ctuq.commands.fetch",
        "download a walnut of the Der Sarkissian et al. (2019) data set (resumable, md5-checked)",
    ),
}
"""Every sub-command, in the order ``ctuq --help`` lists them."""


def command_parser(subparsers, name: str, doc: str, examples: str, extra: str = "") -> argparse.ArgumentParser:
    """The sub-parser of ``ctuq NAME``: :data:`COMMANDS`' summary as its help, the first paragraph of the command
    module's docstring ``doc`` (then ``extra``) as its description, and ``examples`` (lines as written) as its
    epilog."""
    return subparsers.add_parser(
        name,
        help=COMMANDS[name].summary,
        description=doc.split("\n\n")[0] + extra,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n" + examples,
    )
