"""A scan format: one module that reads and writes one file layout, registered in
:data:`ctuq.registry.DATA_FORMATS` with one line.

A format is a :class:`ScanFormat` subclass (used as a class; formats hold no state) that detects its files, opens
them into a :class:`~ctuq.data.source.ScanSource` (every slice and volume is then cut by the one loader,
:mod:`ctuq.data.loader`) and writes a :class:`ScanContent` (the class docstring lists its attributes and methods).
``ctuq simulate`` writes every layout through these methods, and :class:`ctuq.testing.ScanFormatContract` checks
the write → open round trip of any format bit for bit. A format of your own::

    from ctuq.registry import DATA_FORMATS

    @DATA_FORMATS.register
    class MyFormat(ScanFormat):
        name = "mine"
        ...
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import tifffile

from ctuq.data.astra_geometry import angle_range, circular_vectors
from ctuq.data.source import ScanSource
from ctuq.errors import CTUQError
from ctuq.options import AngleUnit, ScanGeometry
from ctuq.registry import DATA_FORMATS
from ctuq.utils import atomic_path

__all__ = [
    "CircularOrbit",
    "ScanOrbit",
    "ScanContent",
    "ScanWriter",
    "ScanFormat",
    "one_plane_orbit",
    "write_tiff_array",
]


@dataclasses.dataclass(frozen=True)
class CircularOrbit:
    """A circular cone-beam orbit about ``z`` by its parameters (mm, pixels, degrees): what ``ctuq simulate`` scans
    and what parametric formats store (:func:`ctuq.data.astra_geometry.circular_vectors`' arguments).

    Attributes
    ----------
    n_angles : int
        Distinct angles, equally spaced over a full turn: ``θ_k = 360°·k/n_angles``.
    pixel_size, row_pixel_size : float
        Detector column and row pitch (mm).
    source_object, object_detector : float
        Source–rotation-axis and rotation-axis–detector distances (mm).
    cor_offset_px, row_offset_px, tilt_deg : float
        Detector corrections: the rotation axis' column offset from the detector centre, the detector centre's row
        offset along ``+v`` (pixels) and its in-plane tilt (degrees).
    source_z : float
        The source's height (mm); the detector stays centred at ``z = 0``.
    degree_angles : bool
        ``θ_k`` converted from the degrees ``360·k/n`` (:func:`~ctuq.data.astra_geometry.angle_range`: what a
        format that stores degrees gives back bit for bit), else ``2πk/n`` radians.
    """

    n_angles: int
    pixel_size: float
    row_pixel_size: float
    source_object: float
    object_detector: float
    cor_offset_px: float = 0.0
    row_offset_px: float = 0.0
    tilt_deg: float = 0.0
    source_z: float = 0.0
    degree_angles: bool = True

    def angles(self, closing: bool = False) -> np.ndarray:
        """``(n_angles,)`` float64 radians; with ``closing`` one more, equal to the first (``(n_angles + 1,)``)."""
        n = int(self.n_angles)
        if self.degree_angles:
            theta = angle_range(0.0, 360.0, n, AngleUnit.DEGREE)
        else:
            theta = 2.0 * np.pi * np.arange(n) / n
        return np.append(theta, theta[0]) if closing else theta

    def vectors(self, closing: bool = False) -> np.ndarray:
        """ASTRA ``cone_vec`` rows ``(n_angles, 12)`` (mm), one per angle; with ``closing`` the ``(n_angles + 1)``-th
        row repeats the first exactly (the walnut layout's last file)."""
        return circular_vectors(
            ScanGeometry.CONE,
            self.angles(closing),
            pixel_size=self.pixel_size,
            row_pixel_size=self.row_pixel_size,
            source_object=self.source_object,
            object_detector=self.object_detector,
            cor_offset_px=self.cor_offset_px,
            row_offset_px=self.row_offset_px,
            tilt_deg=self.tilt_deg,
            source_z=self.source_z,
        )

    @property
    def corrected(self) -> bool:
        """Whether the detector has a tilt or a row offset (which not every format can store)."""
        return bool(self.tilt_deg) or bool(self.row_offset_px)


@dataclasses.dataclass
class ScanOrbit:
    """One orbit of a scan to write: its geometry and raw frames (counts, e.g. uint16).

    Attributes
    ----------
    geometry : CircularOrbit
    projections : np.ndarray
        ``(n_angles, det_rows, det_cols)``: projection ``k`` at the geometry's angle ``k``; row ``r`` at
        ``d + (r − (n_rows − 1)/2)·v`` (``v`` along ``+z``), column ``c`` along ``u``.
    flats, darks : np.ndarray
        ``(n_flats, det_rows, det_cols)`` and ``(n_darks, det_rows, det_cols)`` (the walnut layout holds 2 and 1).
    closing : np.ndarray or None
        ``(det_rows, det_cols)``: a last projection at angle 0 taken after the orbit (the walnut data set's last
        file); formats that hold distinct angles only drop it, the walnut layout writes projection 0 again without
        it.
    """

    geometry: CircularOrbit
    projections: np.ndarray
    flats: np.ndarray
    darks: np.ndarray
    closing: np.ndarray | None = None

    @property
    def det_shape(self) -> tuple[int, int]:
        """``(det_rows, det_cols)``."""
        return tuple(int(s) for s in self.projections.shape[1:])


@dataclasses.dataclass
class ScanContent:
    """A scan to write (:meth:`ScanFormat.write`): what ``ctuq simulate`` produces.

    Attributes
    ----------
    orbits : dict of int to ScanOrbit
        By orbit number (1, 2, 3: the walnut layout's ``tubeV{n}``); one orbit for most formats.
    ground_truth : np.ndarray or None
        ``gt_shape`` float32 attenuation (mm⁻¹) on the volume grid, slice ``k`` at ``z = (k + ½ − n_z/2)·h``.
    gt_shape : (int, int, int)
        The volume grid ``(n_z, n_y, n_x)`` (``ground_truth.shape`` when given).
    voxel_size : float
        Its voxel edge ``h`` (mm).
    read_noise : float
        Per-frame read-noise sd (counts) the loader's variances use (0 for noise-free counts).
    record : dict or None
        A JSON record of where the scan came from (the simulator's parameters and phantom): formats with a place
        for it store it (the walnut layout as ``ctuq_simulation.json``).
    title : str
        A one-line title (NXtomo's ``title``).
    """

    orbits: dict[int, ScanOrbit]
    ground_truth: np.ndarray | None
    gt_shape: tuple[int, int, int]
    voxel_size: float
    read_noise: float = 0.0
    record: dict | None = None
    title: str = "ctuq scan"

    def __post_init__(self):
        self.gt_shape = tuple(int(s) for s in self.gt_shape)
        if self.ground_truth is not None and tuple(self.ground_truth.shape) != self.gt_shape:
            raise ValueError(
                f"ScanContent: ground truth {tuple(self.ground_truth.shape)} is not gt_shape {self.gt_shape}"
            )
        if not (self.voxel_size > 0 and math.isfinite(self.voxel_size)):
            raise ValueError(f"ScanContent: voxel_size must be positive and finite (mm), got {self.voxel_size}")

    def only_orbit(self, fmt: str) -> ScanOrbit:
        """The one orbit of a format that holds one (``ValueError`` naming ``fmt`` otherwise)."""
        if len(self.orbits) != 1:
            raise ValueError(f"{fmt} holds one orbit; this scan has orbits {sorted(self.orbits)}")
        return next(iter(self.orbits.values()))


def one_plane_orbit(orbits: Mapping[int, CircularOrbit], fmt: str) -> CircularOrbit:
    """The one orbit of a format ``fmt`` that stores one circular orbit with the source in the detector centre's
    plane, its angles in degrees (:meth:`ScanFormat.check_orbits`; ``ValueError`` saying what to change)."""
    if len(orbits) != 1 or next(iter(orbits.values())).source_z != 0:
        raise ValueError(
            f"{fmt} holds one circular orbit with the source in the detector centre's plane; simulate --orbits 2 "
            f"(got orbits {sorted(orbits)})"
        )
    geometry = next(iter(orbits.values()))
    if not geometry.degree_angles:
        raise ValueError(f"{fmt} states the angles in degrees: write an orbit of degree angles")
    return geometry


class ScanWriter(ABC):
    """Writes one scan piece by piece, in the order a simulator produces it (:meth:`ScanFormat.writer`): per orbit
    its geometry with flats and darks (:meth:`orbit`), its projections in geometry order (:meth:`projection`) and
    the closing one (:meth:`closing`); then the ground truth slice by slice (:meth:`ground_truth_slice`);
    :meth:`close` last. Arrays as in :class:`ScanOrbit` and :class:`ScanContent`."""

    @abstractmethod
    def orbit(self, number: int, geometry: CircularOrbit, flats: np.ndarray, darks: np.ndarray) -> None:
        """Start orbit ``number``."""

    @abstractmethod
    def projection(self, number: int, k: int, counts: np.ndarray) -> None:
        """Projection ``k`` (``0 … n_angles − 1``) of orbit ``number``, ``(det_rows, det_cols)``."""

    @abstractmethod
    def closing(self, number: int, counts: np.ndarray) -> None:
        """The closing projection of orbit ``number`` (:attr:`ScanOrbit.closing`)."""

    @abstractmethod
    def ground_truth_slice(self, k: int, image: np.ndarray) -> None:
        """Ground-truth slice ``k`` ``(n_y, n_x)`` (mm⁻¹)."""

    @abstractmethod
    def close(self) -> Path:
        """Finish the scan; returns what :meth:`ScanFormat.open` takes."""


def write_tiff_array(path: Path, array: np.ndarray, compress: bool) -> None:
    """Write ``array`` (an image, or a stack of frames as one page each) atomically to the TIFF ``path``: zlib
    level 9 with the horizontal predictor for integer images when ``compress`` (lossless; no extra package)."""
    kw: dict[str, Any] = {"metadata": None}
    if array.ndim == 3:  # a stack of frames, one page each (3 or 4 frames would otherwise be read as RGB(A))
        kw["photometric"] = "minisblack"
    if compress:
        # zlib is built into tifffile; the horizontal predictor (integer images only; the float predictor
        # needs imagecodecs) roughly halves the size of smooth count images.
        kw["compression"] = "zlib"
        kw["compressionargs"] = {"level": 9}
        if np.issubdtype(array.dtype, np.integer):
            kw["predictor"] = True
    with atomic_path(path) as tmp:
        tifffile.imwrite(tmp, np.ascontiguousarray(array), **kw)


class ScanFormat(ABC):
    """The base class of a scan format (module docstring). Subclasses set the class attributes and implement
    :meth:`detect`, :meth:`open` and :meth:`write`.

    Attributes
    ----------
    name : str
        Registry name (``ctuq.registry.DATA_FORMATS``).
    expects : str
        What a path of this format looks like (messages, ``--help``).
    layouts : mapping of str to dict
        ``ctuq simulate --layout`` names this format writes, each with the options it passes to :meth:`write`
        (default ``{name: {}}``).
    stores_degrees : bool
        The format stores a circular orbit's angles in degrees: a scan written in it round-trips bit for bit only
        with :attr:`CircularOrbit.degree_angles` (the simulator then uses degree angles for every layout it writes,
        so all of them hold one geometry).
    error : type
        The format's error class (a :class:`~ctuq.errors.CTUQError`).
    """

    name: ClassVar[str]
    expects: ClassVar[str]
    layouts: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    stores_degrees: ClassVar[bool] = False
    error: ClassVar[type[CTUQError]] = CTUQError

    @classmethod
    def write_layouts(cls) -> dict[str, dict[str, Any]]:
        """``--layout`` name → write options (:attr:`layouts`, or ``{name: {}}``)."""
        return {k: dict(v) for k, v in cls.layouts.items()} or {cls.name: {}}

    @classmethod
    def folder_lacks(cls) -> str:
        """What a folder without this format lacks, for the message that no format reads it
        (``"no scan.yaml"``); default ``"no <name> scan (<expects>)"``."""
        return f"no {cls.name} scan ({cls.expects})"

    @classmethod
    @abstractmethod
    def detect(cls, path: Path) -> Path | None:
        """The file or folder to :meth:`open` when ``path`` (an existing file or folder) holds this format, else
        ``None``. Cheap: names and signatures, not contents."""

    @classmethod
    @abstractmethod
    def open(cls, path: Path, orbit: int = 2) -> ScanSource:
        """Validate the scan at ``path`` (what :meth:`detect` returned) and return its source: geometry, flats and
        darks, array headers; projections are read on demand. ``orbit`` (1, 2, 3) selects the walnut layout's
        source orbit; formats holding one orbit ignore it. Raises :attr:`error` naming the file and key."""

    @classmethod
    @abstractmethod
    def write(cls, folder: Path, content: ScanContent, *, compress: bool = True, **options) -> Path:
        """Write ``content`` into ``folder`` (created; files replaced atomically); returns what :meth:`open` takes.
        ``compress``: lossless compression where the format has it; ``options``: a layout's (:attr:`layouts`).
        ``ValueError`` for content the format cannot store (:meth:`check_orbits`)."""

    @classmethod
    def check_orbits(cls, orbits: Mapping[int, CircularOrbit]) -> None:
        """Refuse (``ValueError``, one line saying what to change) orbits this format cannot store, before
        anything is simulated. Default: anything goes."""
        return None

    @classmethod
    def writer(cls, folder: Path, content: ScanContent, *, compress: bool = True, **options) -> ScanWriter | None:
        """A :class:`ScanWriter` that writes the scan piece by piece into ``folder`` (``content`` gives the
        scan-level facts: ``gt_shape``, ``voxel_size``, ``read_noise``, ``record``, ``title``; its orbits and
        ground truth arrive through the writer), or ``None`` (default): the format is written whole by
        :meth:`write`."""
        return None

    @classmethod
    def written_files(cls, folder: Path) -> list[Path]:
        """The files a :meth:`write` into ``folder`` leaves there (what ``ctuq simulate --overwrite`` removes
        before writing again). Default: none."""
        return []


DATA_FORMATS.set_base(ScanFormat)
