"""The scan formats ``--data`` reads and ``ctuq simulate --layout`` writes: :data:`DATA_FORMATS`, the registry of
:class:`~ctuq.data.scan_format.ScanFormat` classes, and the thin readers over it.

This module is the registry's provider: importing it registers the built-in formats, in detection order (the
first format whose ``detect`` accepts a path reads it): the walnut folder (:mod:`ctuq.data.walnut`), a
``scan.yaml`` (:mod:`ctuq.data.scan_file`), an NXtomo file (:mod:`ctuq.data.nxtomo`). A format of your own is one
module with a :class:`~ctuq.data.scan_format.ScanFormat` subclass and one line, ``DATA_FORMATS.register(MyFormat)``
(formats registered later are tried after these).

* :func:`detect_format` / :func:`open_scan`: the format of a path and its opened
  :class:`~ctuq.data.source.ScanSource`;
* :func:`load_data` / :func:`read_data`: open and load a slice or a volume (:mod:`ctuq.data.loader`);
* :func:`write_layouts`: every ``--layout`` name with its format and write options.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ctuq.data import loader
from ctuq.data.nxtomo import NXtomoFormat
from ctuq.data.problem import CTData
from ctuq.data.projections import ScanFormatError
from ctuq.data.scan_file import ScanYamlFormat
from ctuq.data.scan_format import ScanFormat
from ctuq.data.source import ScanSource
from ctuq.data.walnut import WalnutFormat
from ctuq.registry import DATA_FORMATS

__all__ = [
    "DATA_FORMATS",
    "UnknownFormatError",
    "detect_format",
    "open_scan",
    "load_data",
    "read_data",
    "write_layouts",
]

# the built-in formats, one line each, in detection order
DATA_FORMATS.register(WalnutFormat)
DATA_FORMATS.register(ScanYamlFormat)
DATA_FORMATS.register(NXtomoFormat)


class UnknownFormatError(ScanFormatError):
    """``--data`` names a file or folder that no registered format reads; the message lists what each expects."""


def detect_format(path: str | os.PathLike) -> tuple[type[ScanFormat], Path]:
    """The format of ``path`` and the file or folder to open. Raises ``FileNotFoundError`` for a missing path and
    :class:`UnknownFormatError` (listing what each format expects) for one no format reads."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such scan file or folder")
    for fmt in DATA_FORMATS.values():
        target = fmt.detect(path)
        if target is not None:
            return fmt, target
    if path.is_dir():
        lacks = [f.folder_lacks() for f in DATA_FORMATS.values()]
        listed = lacks[0] if len(lacks) == 1 else f"{', '.join(lacks[:-1])} and {lacks[-1]}"
        raise UnknownFormatError(f"{path}: not a scan ctuq reads: the folder has {listed}")
    expects = "; ".join(f"{f.name}: {f.expects}" for f in DATA_FORMATS.values())
    raise UnknownFormatError(f"{path}: not a scan ctuq reads (expected {expects})")


def open_scan(path: str | os.PathLike, orbit: int = 2) -> tuple[type[ScanFormat], ScanSource]:
    """Detect and open the scan at ``path``: ``(format, source)``. ``orbit`` (1, 2, 3) applies to the walnut layout
    only; the other formats hold one circular orbit."""
    fmt, target = detect_format(path)
    return fmt, fmt.open(target, orbit)


def load_data(path: str | os.PathLike, *, ndim: int = 2, orbit: int = 2, **options) -> CTData:
    """Open the scan at ``path`` (any registered format) and load a slice (``ndim=2``,
    :func:`ctuq.data.loader.load_slice`) or a volume (``ndim=3``, :func:`~ctuq.data.loader.load_volume`) with the
    loader ``options`` (``angular_subsampling``, ``detector_subsampling``, ``backend``, ``device``, ``heldout``, …;
    subsampling defaults to 1: every angle and column)."""
    _fmt, scan = open_scan(path, orbit)
    return (loader.load_slice if ndim == 2 else loader.load_volume)(scan, **options)


def read_data(path: str | os.PathLike, *, ndim: int = 2, orbit: int = 2, **options) -> CTData:
    """:func:`load_data` without the operator (``op=None``; CPU; no held-out rows)."""
    _fmt, scan = open_scan(path, orbit)
    return (loader.read_slice if ndim == 2 else loader.read_volume)(scan, **options)


def write_layouts() -> dict[str, tuple[type[ScanFormat], dict[str, Any]]]:
    """Every ``ctuq simulate --layout`` name → ``(format, write options)``, in registry order."""
    out: dict[str, tuple[type[ScanFormat], dict[str, Any]]] = {}
    for fmt in DATA_FORMATS.values():
        for layout, options in fmt.write_layouts().items():
            if layout in out:
                raise ValueError(f"--layout {layout!r} is written by both {out[layout][0].name} and {fmt.name}")
            out[layout] = (fmt, options)
    return out
