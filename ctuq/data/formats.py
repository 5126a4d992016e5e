"""The scan formats ``--data`` reads, by name: the one place that maps a path to its reader.

:data:`DATA_FORMATS` maps each format name (:class:`ctuq.options.DataFormat`) to a :class:`ScanFormat`: a detector
(does this file or folder hold the format? which file to open?), an opener (headers, geometry and checks, no
pixel data) and the slice and volume loaders that give a :class:`~ctuq.data.walnut.CTData`. The walnut layout
keeps its own loader (:func:`ctuq.data.walnut.load_walnut_slice`, unchanged numbers); the others open into a
:class:`~ctuq.data.projections.ProjectionScan` and share :func:`ctuq.data.projections.load_slice` /
:func:`~ctuq.data.projections.load_volume`.

Adding a format is one file, ``ctuq/data/<format>.py`` with an ``open_<format>(path)`` returning a
``ProjectionScan`` (or its own loaders), plus one entry in :data:`DATA_FORMATS` and its name in
:class:`ctuq.options.DataFormat`. The first format whose detector accepts a path reads it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctuq.data import projections
from ctuq.data.nxtomo import NXTOMO_SUFFIXES, is_nxtomo, open_nxtomo
from ctuq.data.projections import ScanFormatError
from ctuq.data.scan_file import is_scan_file, open_scan_file
from ctuq.data.walnut import (
    CTData,
    WalnutScan,
    load_walnut_slice,
    load_walnut_volume,
    read_walnut_slice,
    read_walnut_volume,
)
from ctuq.options import DataFormat

__all__ = ["ScanFormat", "DATA_FORMATS", "UnknownFormatError", "detect_format", "open_scan", "load_data", "read_data"]


class UnknownFormatError(ScanFormatError):
    """``--data`` names a file or folder that no registered format reads; the message lists what each expects."""


@dataclasses.dataclass(frozen=True)
class ScanFormat:
    """One data format.

    Attributes
    ----------
    name : str
        :class:`ctuq.options.DataFormat` value.
    expects : str
        What a path of this format looks like (for messages and ``--help``).
    detect : callable
        ``detect(path) -> Path | None``: the file or folder to open when ``path`` holds this format.
    open : callable
        ``open(path, orbit) -> scan``: validated headers and geometry; the scan has
        :class:`~ctuq.data.walnut.WalnutScan`'s checking interface (``det_shape``, ``gt_shape``, ``angle_plan`` …).
    load_slice, load_volume, read_slice, read_volume : callable
        ``f(scan, **options) -> CTData``: the options of :func:`ctuq.data.walnut.load_walnut_slice` (minus
        ``path``/``orbit``); ``read_*`` without ``backend``/``device`` (no operator).
    """

    name: str
    expects: str
    detect: Callable[[Path], Path | None]
    open: Callable[[Path, int], Any]
    load_slice: Callable[..., CTData]
    load_volume: Callable[..., CTData]
    read_slice: Callable[..., CTData]
    read_volume: Callable[..., CTData]


def _detect_walnut(path: Path) -> Path | None:
    return path if path.is_dir() and (path / "Projections").is_dir() else None


def _detect_yaml(path: Path) -> Path | None:
    if is_scan_file(path):
        return path
    if path.is_dir() and is_scan_file(path / "scan.yaml"):
        return path / "scan.yaml"
    return None


def _detect_nxtomo(path: Path) -> Path | None:
    if is_nxtomo(path):
        return path
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() in NXTOMO_SUFFIXES and is_nxtomo(p))
        if len(found) == 1:
            return found[0]
    return None


def _walnut(fn: Callable[..., CTData]) -> Callable[..., CTData]:
    def load(scan: WalnutScan, **options) -> CTData:
        return fn(scan.path, orbit=scan.orbit, **options)

    load.__doc__ = f"``{fn.__name__}(scan.path, orbit=scan.orbit, **options)``."
    return load


#: Every data format by name, in detection order (one entry per format).
DATA_FORMATS: dict[str, ScanFormat] = {
    DataFormat.WALNUT.value: ScanFormat(
        DataFormat.WALNUT.value,
        "a walnut folder (Projections/tubeV*/ with scan_NNNNNN.tif, flats, dark and the .geom file)",
        _detect_walnut,
        lambda path, orbit: WalnutScan(path, orbit),
        _walnut(load_walnut_slice),
        _walnut(load_walnut_volume),
        _walnut(read_walnut_slice),
        _walnut(read_walnut_volume),
    ),
    DataFormat.SCAN_YAML.value: ScanFormat(
        DataFormat.SCAN_YAML.value,
        "a scan description *.yaml (or a folder holding scan.yaml)",
        _detect_yaml,
        lambda path, orbit: open_scan_file(path),
        projections.load_slice,
        projections.load_volume,
        projections.read_slice,
        projections.read_volume,
    ),
    DataFormat.NXTOMO.value: ScanFormat(
        DataFormat.NXTOMO.value,
        "an NXtomo file (*.nxs, *.h5; or a folder holding exactly one)",
        _detect_nxtomo,
        lambda path, orbit: open_nxtomo(path),
        projections.load_slice,
        projections.load_volume,
        projections.read_slice,
        projections.read_volume,
    ),
}


def detect_format(path: str | os.PathLike) -> tuple[ScanFormat, Path]:
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
        raise UnknownFormatError(
            f"{path}: not a scan ctuq reads: the folder has no Projections/tubeV* folder (walnut layout), no "
            f"scan.yaml and no single NXtomo file (*.nxs, *.h5)"
        )
    expects = "; ".join(f"{f.name}: {f.expects}" for f in DATA_FORMATS.values())
    raise UnknownFormatError(f"{path}: not a scan ctuq reads (expected {expects})")


def open_scan(path: str | os.PathLike, orbit: int = 2) -> tuple[ScanFormat, Any]:
    """Detect and open the scan at ``path``: ``(format, scan)``. ``orbit`` (1, 2, 3) applies to the walnut layout
    only; the other formats hold one circular orbit."""
    fmt, target = detect_format(path)
    return fmt, fmt.open(target, orbit)


def load_data(path: str | os.PathLike, *, ndim: int = 2, orbit: int = 2, **options) -> CTData:
    """Open the scan at ``path`` (any registered format) and load a slice (``ndim=2``) or volume (``ndim=3``) with
    the loader ``options`` of :func:`ctuq.data.walnut.load_walnut_slice` / ``load_walnut_volume``."""
    fmt, scan = open_scan(path, orbit)
    return (fmt.load_slice if ndim == 2 else fmt.load_volume)(scan, **options)


def read_data(path: str | os.PathLike, *, ndim: int = 2, orbit: int = 2, **options) -> CTData:
    """:func:`load_data` without the operator (``op=None``; CPU)."""
    fmt, scan = open_scan(path, orbit)
    return (fmt.read_slice if ndim == 2 else fmt.read_volume)(scan, **options)
