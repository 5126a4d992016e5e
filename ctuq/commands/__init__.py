"""Sub-commands of the ``ctuq`` console script.

Each module defines ``add_parser(subparsers)`` registering its sub-command with ``func=run``
and ``run(args) -> int``. ``cli.py`` imports them lazily so ``ctuq --help`` stays fast.
"""

COMMANDS = {
    "simulate": "ctuq.commands.simulate",
    "reconstruct": "ctuq.commands.reconstruct",
    "uq": "ctuq.commands.uq",
    "pretrain": "ctuq.commands.pretrain",
    "design": "ctuq.commands.design",
}
