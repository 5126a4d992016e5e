"""Sub-commands of the ``ctuq`` console script.

Each module defines ``add_parser(subparsers)`` registering its sub-command with ``func=run``
and ``run(args) -> int``; it parses arguments only, the work is done by :mod:`ctuq.pipeline`. ``cli.py`` imports
them by name from :data:`COMMANDS` (a command whose module is missing is left out).
"""

COMMANDS = {
    "simulate": "ctuq.commands.simulate",
    "reconstruct": "ctuq.commands.reconstruct",
    "uq": "ctuq.commands.uq",
    "pretrain": "ctuq.commands.pretrain",
    "design": "ctuq.commands.design",
    "view": "ctuq.commands.view",
    "fetch": "ctuq.commands.fetch",
}
