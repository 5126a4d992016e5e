"""``ctuq view RUN``: open a run folder's reconstruction, std, error and ground truth in napari at physical scale.

The layers (names, voxel size in mm as scale, colormaps, contrast limits) are built by :mod:`ctuq.viewer`, which
also documents them; this module only parses arguments and opens the window. napari is an optional extra:
``pip install 'ctuq[view]'``.
"""

from __future__ import annotations

import argparse

from ctuq.commands import command_parser
from ctuq.registry import lazy_module

viewer = lazy_module("ctuq.viewer")  # napari and the images: imported when a window opens, not for --help

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``ctuq view`` with ``subparsers``; returns its parser."""
    p = command_parser(
        subparsers,
        "view",
        __doc__,
        "  ctuq view runs/demo                 # side by side: ground truth, reconstruction, |error|, std\n"
        "  ctuq view runs/demo --overlay       # stacked layers instead (toggle them in the layer list)\n",
    )
    p.add_argument("run_dir", metavar="RUN", help="folder written by `ctuq reconstruct` (or `ctuq uq`)")
    p.add_argument("--overlay", action="store_true", help="stack the layers instead of napari's grid view")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``ctuq view`` for parsed ``args`` (returns when the window is closed); user errors propagate to
    :func:`ctuq.cli.main`."""
    viewer.view_run(args.run_dir, grid=not args.overlay)
    return 0
