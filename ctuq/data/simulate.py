"""Cone-beam scan simulator: a phantom scanned along circular orbits, written through the scan formats' registry
(:data:`ctuq.registry.DATA_FORMATS`) in one or several layouts (DESIGN.md §4).

``simulate_scan(out_dir, params, layouts=...)`` writes the scan in each ``--layout`` a registered format offers
(:func:`ctuq.data.formats.write_layouts`): by default the walnut data set's layout (:mod:`ctuq.data.walnut`)::

    out_dir/Projections/tubeV{o}/scan_{k:06}.tif        N raw projections (uint16 counts), k = 0 … N−1
    out_dir/Projections/tubeV{o}/di000000.tif           dark frame
    out_dir/Projections/tubeV{o}/io000000.tif           flat field (before), io000001.tif (after)
    out_dir/Projections/tubeV{o}/scan_geom_corrected.geom   N rows × 12: ASTRA cone_vec (source, detector
                                                            centre, u step, v step; mm)
    out_dir/Reconstructions/full_AGD_50_{k:06}.tiff     ground-truth slices (float32, mm⁻¹), k ↔ z
    out_dir/ctuq_simulation.json                        every parameter, the phantom, the GT voxel size

and also ``yaml-npy`` / ``yaml-tiff`` (:mod:`ctuq.data.scan_file`), ``nxtomo`` (:mod:`ctuq.data.nxtomo`) or a
format of your own. Formats whose files hold one projection each (the walnut layout) are written as the scan is
simulated (:meth:`~ctuq.data.scan_format.ScanFormat.writer`); the others receive the whole
:class:`~ctuq.data.scan_format.ScanContent` at the end (:meth:`~ctuq.data.scan_format.ScanFormat.write`).

Conventions, chosen so that the real data set's loading rules recover the simulated geometry:

* Geometry row ``k`` of an orbit is the source at angle ``θ_k = 2πk/(N−1)`` about ``z`` (ASTRA's ``cone``
  orientation: source ``(D_so sin θ, −D_so cos θ, z_o)``, detector centre on the opposite side at distance
  ``D_sd``, ``u`` along the rows, ``v`` along +z), plus small deterministic per-orbit "corrections" (a detector
  tilt in its plane and a centre offset). Rows ``0`` and ``N−1`` are the same angle: the ``N``-th projection (the
  content's closing projection) repeats the first angle with its own noise. When a layout that stores degrees is
  written (``scan.yaml``, NXtomo), ``θ_k`` are ``360·k/(N−1)`` degrees in every layout, so all hold one geometry.
* Files pair with geometry rows in reverse: file ``N−1−k`` ↔ row ``k``.
* A projection ``P`` (``det_rows × det_cols``, row ``r`` at ``d + (r − (R−1)/2)·v``) is stored as the raw image
  ``flipud(P.T)`` (``det_cols × det_rows``), so the data set's ``transpose(flipud(raw))`` returns ``P``.
* Counts: per detector pixel the transmission is the mean of ``exp(−∫μ)`` over ``s × s`` sub-rays spread across
  the pixel (photons are averaged, not line integrals), times the flat-field counts ``I₀·G`` (a smooth gain
  pattern ``G``), Poisson noise, plus a dark offset (fixed pattern) and Gaussian read noise, rounded to uint16.
  Flats and the dark frame are their own noisy images. ``noise=False`` drops every random term (only the
  rounding to integers remains).
* Ground truth: pixel (voxel) averages of the phantom, ``(n_y, n_x)`` per slice, slice ``k`` at
  ``z = (k + ½ − n_z/2)·h``; the grid is centred at the origin (ctuq's convention: index ↔ coordinate).

* Writing: every file goes through :func:`ctuq.utils.atomic_path` (no half-written file after a crash); the
  sidecar is written first with ``"complete": false`` and rewritten with ``true`` at the very end, and the
  loader refuses an incomplete scan. A non-empty output folder is refused unless ``overwrite`` (then only the
  files of an earlier simulated scan are removed). No dates or timings are written, so the same parameters
  reproduce every file byte for byte.

The phantom is :func:`~ctuq.data.phantom.walnut_phantom` unless another :class:`EllipsoidPhantom` is given; its
line integrals are exact, so loaded data never share the discretisation of a reconstruction operator (no
inverse crime).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

from ctuq import __version__
from ctuq.data.formats import DATA_FORMATS, write_layouts
from ctuq.data.phantom import EllipsoidPhantom, TexturedPhantom, make_phantom, walnut_phantom
from ctuq.data.presets import SCAN_PRESETS
from ctuq.data.scan_format import CircularOrbit, ScanContent, ScanOrbit
from ctuq.data.walnut import DARK_NAME, FLAT_NAMES, PROJECTION_PATTERN, SIDECAR_NAME, WalnutFormat
from ctuq.geometry import VolumeGeometry
from ctuq.utils import atomic_write_json
from ctuq.utils import progress as _progress_bar

__all__ = [
    "SimulationParameters",
    "SCAN_PRESETS",
    "ORBIT_CORRECTIONS",
    "orbit_vectors",
    "simulation_orbit",
    "simulate_scan",
    "projection_file_name",
    "prepare_output_dir",
    "estimate_work",
    "check_layouts",
]

# Deterministic per-orbit "calibration corrections": detector tilt in its own plane (degrees) and detector
# centre offset (in pixels along u and v). Small, like a real corrected geometry, but enough that the vectors
# are not those of an ideal circular scan.
ORBIT_CORRECTIONS = {
    1: {"tilt_deg": 0.12, "offset_u_px": 0.35, "offset_v_px": -0.60},
    2: {"tilt_deg": -0.08, "offset_u_px": -0.45, "offset_v_px": 0.30},
    3: {"tilt_deg": 0.05, "offset_u_px": 0.20, "offset_v_px": 0.50},
}


@dataclasses.dataclass
class SimulationParameters:
    """Everything that sizes a simulated scan (lengths in mm). Defaults are the real data set's sizes.

    Attributes
    ----------
    n_projections : int
        Projection files per orbit, ``N`` (the last one repeats the first angle): 1201 in the real data.
    det_rows, det_cols : int
        Detector size (972 × 768 in the real data).
    pixel_size : float
        Detector column pitch ``|u|`` (mm); 0.1496 in the real data.
    row_pixel_size : float or None
        Detector row pitch ``|v|`` (mm); ``None``: ``pixel_size``.
    source_origin, source_detector : float
        Source–rotation-axis and source–detector distances (mm).
    orbits : tuple of int
        Which of the orbits 1, 2, 3 (``tubeV1..3``) to simulate.
    orbit_height : float
        Source height (mm) of orbit 1 (``+h``) and orbit 3 (``−h``); orbit 2's source lies in ``z = 0``. The
        detector stays centred at ``z = 0``.
    corrections : bool
        Apply :data:`ORBIT_CORRECTIONS` (detector tilt and offset).
    gt_shape : (int, int, int)
        Ground-truth volume ``(n_z, n_y, n_x)``.
    gt_voxel_size : float
        Ground-truth voxel edge (mm).
    supersampling : int
        Sub-rays per detector pixel and axis (``s²`` rays per pixel).
    gt_supersampling : int
        Samples per voxel and axis for the ground truth (``s³`` per voxel).
    flat_counts : float
        Mean flat-field photon counts per pixel ``I₀``.
    dark_counts : float
        Mean dark offset (counts).
    read_noise : float
        Standard deviation (counts) of the Gaussian read noise.
    flat_variation : float
        Relative amplitude of the smooth flat-field gain pattern ``G``.
    noise : bool
        Poisson and read noise on; ``False`` gives exact (only integer-rounded) counts for tests.
    compress : bool
        zlib-compressed TIFFs (lossless; tifffile needs no extra package for them).
    seed : int
        Seeds the phantom (:func:`walnut_phantom`), the detector patterns and the noise.
    noise_seed : int or None
        Seeds only the noise (Poisson counts, read noise of flats, dark and projections) when given: the same
        object, geometry and detector patterns under another noise realisation (to check the per-measurement
        variances of :mod:`ctuq.data.walnut` against repeated scans). ``None``: ``seed``.
    """

    n_projections: int = 1201
    det_rows: int = 972
    det_cols: int = 768
    pixel_size: float = 0.1496
    row_pixel_size: float | None = None
    source_origin: float = 66.0
    source_detector: float = 199.0
    orbits: tuple[int, ...] = (1, 2, 3)
    orbit_height: float = 7.5
    corrections: bool = True
    gt_shape: tuple[int, int, int] = (501, 501, 501)
    gt_voxel_size: float = 0.1
    supersampling: int = 3
    gt_supersampling: int = 3
    flat_counts: float = 2.0e4
    dark_counts: float = 100.0
    read_noise: float = 2.0
    flat_variation: float = 0.05
    noise: bool = True
    compress: bool = True
    seed: int = 0
    noise_seed: int | None = None

    def __post_init__(self):
        self.orbits = tuple(int(o) for o in self.orbits)
        self.gt_shape = tuple(int(s) for s in self.gt_shape)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""

        def need(ok: bool, field: str, what: str) -> None:
            if not ok:
                raise ValueError(f"SimulationParameters.{field} = {getattr(self, field)!r}: {what}")

        need(int(self.n_projections) >= 2, "n_projections", "need at least 2 (the last repeats the first angle)")
        need(int(self.det_rows) >= 2, "det_rows", "need at least 2 detector rows")
        need(int(self.det_cols) >= 1, "det_cols", "need at least 1 detector column")
        need(self.pixel_size > 0, "pixel_size", "must be positive (mm)")
        need(self.row_pixel_size is None or self.row_pixel_size > 0, "row_pixel_size", "must be positive (mm)")
        need(self.source_origin > 0, "source_origin", "must be positive (mm)")
        need(self.source_detector > self.source_origin, "source_detector", "must exceed source_origin (mm)")
        need(
            len(self.orbits) >= 1 and set(self.orbits) <= {1, 2, 3} and len(set(self.orbits)) == len(self.orbits),
            "orbits",
            "must be distinct values among 1, 2, 3",
        )
        need(len(self.gt_shape) == 3 and min(self.gt_shape) >= 1, "gt_shape", "must be 3 positive ints (n_z, n_y, n_x)")
        need(self.gt_voxel_size > 0, "gt_voxel_size", "must be positive (mm)")
        need(int(self.supersampling) >= 1, "supersampling", "must be ≥ 1")
        need(int(self.gt_supersampling) >= 1, "gt_supersampling", "must be ≥ 1")
        need(self.flat_counts > 0, "flat_counts", "must be positive")
        need(self.dark_counts >= 0, "dark_counts", "must be ≥ 0")
        need(self.read_noise >= 0, "read_noise", "must be ≥ 0")
        need(0 <= self.flat_variation < 0.5, "flat_variation", "must lie in [0, 0.5)")
        peak = (
            self.flat_counts * (1 + self.flat_variation)
            + self.dark_counts
            + 6 * (math.sqrt(self.flat_counts * 1.5) + self.read_noise + 3)
        )
        need(peak < 65535, "flat_counts", f"flat + dark counts (up to ≈{peak:.0f}) must fit uint16 (< 65535)")

    @property
    def v_pixel_size(self) -> float:
        """Row pitch ``|v|`` (mm)."""
        return float(self.pixel_size if self.row_pixel_size is None else self.row_pixel_size)

    def to_dict(self) -> dict:
        """JSON-serialisable dict of every field."""
        d = dataclasses.asdict(self)
        if self.noise_seed is None:  # the sidecars of scans written before the field existed stay byte-identical
            del d["noise_seed"]
        d["orbits"] = list(self.orbits)
        d["gt_shape"] = list(self.gt_shape)
        return d

    @classmethod
    def preset(cls, name: str, **overrides) -> SimulationParameters:
        """Parameters of a named preset (:data:`SCAN_PRESETS`) with ``overrides`` applied (``None`` values ignored)."""
        if name not in SCAN_PRESETS:
            raise ValueError(f"unknown simulation preset {name!r}; valid: {sorted(SCAN_PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = set(overrides) - fields
        if bad:
            raise ValueError(f"unknown simulation parameter(s) {sorted(bad)}; valid: {sorted(fields)}")
        kw = dict(SCAN_PRESETS[name]["params"])
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


def projection_file_name(index: int) -> str:
    """``scan_{index:06}.tif``."""
    return PROJECTION_PATTERN.format(int(index))


def simulation_orbit(params: SimulationParameters, orbit: int, *, degree_angles: bool = False) -> CircularOrbit:
    """Orbit ``orbit`` (1, 2, 3) of ``params`` as a :class:`~ctuq.data.scan_format.CircularOrbit`: ``N − 1``
    distinct angles, the source at height ``+h``, ``0``, ``−h``, the per-orbit detector corrections
    (:data:`ORBIT_CORRECTIONS`) when ``params.corrections``."""
    src_z = {1: params.orbit_height, 2: 0.0, 3: -params.orbit_height}[int(orbit)]
    corr = _corrections(params, orbit)
    return CircularOrbit(
        n_angles=int(params.n_projections) - 1,
        pixel_size=params.pixel_size,
        row_pixel_size=params.v_pixel_size,
        source_object=params.source_origin,
        object_detector=params.source_detector - params.source_origin,
        cor_offset_px=-corr["offset_u_px"],
        row_offset_px=corr["offset_v_px"],
        tilt_deg=corr["tilt_deg"],
        source_z=src_z,
        degree_angles=degree_angles,
    )


def orbit_vectors(params: SimulationParameters, orbit: int, *, degree_angles: bool = False) -> np.ndarray:
    """ASTRA ``cone_vec`` rows ``(N, 12)`` (mm) of one orbit: source, detector centre, u step, v step.

    Row ``k`` is angle ``θ_k = 2πk/(N−1)``; row ``N−1`` equals row 0 exactly. With ``degree_angles`` the angles are
    ``360·k/(N−1)`` degrees converted by :func:`ctuq.data.astra_geometry.angle_range` (equal to ``2πk/(N−1)`` up to
    rounding): what a layout storing degrees (NXtomo, ``scan.yaml``) gives back bit for bit. The vectors are
    :func:`ctuq.data.astra_geometry.circular_vectors`' (the formula every format's loader uses;
    :meth:`CircularOrbit.vectors` of :func:`simulation_orbit`).
    """
    return simulation_orbit(params, orbit, degree_angles=degree_angles).vectors(closing=True)


def _corrections(params: SimulationParameters, orbit: int) -> dict:
    if params.corrections:
        return ORBIT_CORRECTIONS[int(orbit)]
    return {"tilt_deg": 0.0, "offset_u_px": 0.0, "offset_v_px": 0.0}


def _detector_patterns(params: SimulationParameters, orbit: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat-field counts ``I₀·G`` (float) and the integer dark fixed pattern, both ``(det_rows, det_cols)``."""
    rng = np.random.default_rng([int(params.seed), int(orbit), 0xF1A7])
    r = (np.arange(params.det_rows) + 0.5) / params.det_rows - 0.5
    c = (np.arange(params.det_cols) + 0.5) / params.det_cols - 0.5
    rr, cc = np.meshgrid(r, c, indexing="ij")
    ph1, ph2 = rng.uniform(0, 2 * np.pi, size=2)
    # A smooth gain: vignetting towards the corners plus two low-frequency ripples.
    gain = (
        1.0
        - 0.6 * (rr**2 + cc**2) / 0.5
        + 0.25 * np.cos(2 * np.pi * 1.3 * cc + ph1)
        + 0.15 * np.cos(2 * np.pi * 0.8 * rr + ph2)
    )
    gain = 1.0 + params.flat_variation * (gain - gain.mean()) / max(np.abs(gain - gain.mean()).max(), 1e-12)
    dark = np.round(params.dark_counts + rng.normal(0.0, 3.0, size=rr.shape)).clip(0, None)
    return params.flat_counts * gain, dark


def _to_uint16(counts: np.ndarray, what: str) -> np.ndarray:
    out = np.round(counts)
    if out.min() < 0 or out.max() > 65535:
        raise ValueError(
            f"simulate: {what} counts outside the uint16 range ({out.min()}..{out.max()}); lower flat_counts"
        )
    return out.astype(np.uint16)


def _transmission(phantom: EllipsoidPhantom, vec: np.ndarray, rows: int, cols: int, s: int) -> np.ndarray:
    """Mean of ``exp(−∫μ)`` over ``s × s`` sub-rays per detector pixel: ``(rows, cols)`` for one cone_vec row."""
    src, det, u, v = vec[0:3], vec[3:6], vec[6:9], vec[9:12]
    off = (np.arange(s) + 0.5) / s - 0.5
    kc = (np.arange(cols) - (cols - 1) / 2.0)[:, None] + off[None, :]  # (cols, s) fractional column
    out = np.empty((rows, cols))
    block = max(1, (1 << 18) // (cols * s * s))
    for r0 in range(0, rows, block):
        kr = (np.arange(r0, min(rows, r0 + block)) - (rows - 1) / 2.0)[:, None] + off[None, :]  # (b, s)
        # (b, s_v, cols, s_u, 3) sub-pixel points on the detector
        pts = det + kr[:, :, None, None, None] * v + kc[None, None, :, :, None] * u
        ell = phantom.line_integrals(src, pts)
        out[r0 : r0 + kr.shape[0]] = np.exp(-ell).mean(axis=(1, 3))
    return out


def _layout_files(out_dir: Path) -> list[Path]:
    """Files of a scan layout under ``out_dir`` (and its per-layout sub-folders) that a new simulation would
    replace: what every registered format's :meth:`~ctuq.data.scan_format.ScanFormat.written_files` lists, and the
    sidecars."""
    found: dict[Path, None] = {}
    for root in [out_dir] + [out_dir / name for name in write_layouts()]:
        for fmt in DATA_FORMATS.values():
            found.update(dict.fromkeys(fmt.written_files(root)))
        sidecar = root / SIDECAR_NAME
        if sidecar.is_file():
            found[sidecar] = None
    return list(found)


def prepare_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Create ``out_dir``; refuse a non-empty one unless ``overwrite``, which removes (only) the files of an earlier
    simulated scan there, so no stale projection can survive. A folder without a ``ctuq_simulation.json`` may be
    real data and is never cleared."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"simulate: output path {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"simulate: output folder {out_dir} is not empty; choose an empty or new folder, "
                f"or pass --overwrite (overwrite=True) to replace the simulated scan there"
            )
        if not (out_dir / SIDECAR_NAME).is_file():
            raise FileExistsError(
                f"simulate: {out_dir} is not empty and holds no {SIDECAR_NAME}, so it is not a "
                f"scan written by ctuq simulate (it may be real data); refusing to overwrite it"
            )
        for p in _layout_files(out_dir):
            p.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def check_layouts(layouts, params: SimulationParameters) -> tuple[str, ...]:
    """Validate ``layouts`` (``--layout`` names: :func:`ctuq.data.formats.write_layouts`) for ``params``; returns
    them as a tuple.

    Raises ``ValueError`` naming the option: an unknown or repeated layout, or orbits a layout's format cannot store
    (:meth:`~ctuq.data.scan_format.ScanFormat.check_orbits`: ``scan.yaml`` and NXtomo hold one circular orbit in the
    detector centre's plane, ``--orbits 2``; NXtomo has no field for the per-orbit detector tilt and row offset,
    ``--no-corrections``).
    """
    available = write_layouts()
    layouts = tuple(str(x) for x in ([layouts] if isinstance(layouts, str) else layouts))
    bad = [x for x in layouts if x not in available]
    if not layouts or bad or len(set(layouts)) != len(layouts):
        raise ValueError(
            f"--layout {' '.join(layouts) or '(none)'}: give distinct layouts among {', '.join(available)}"
        )
    degrees = _degree_angles(layouts)
    orbits = {o: simulation_orbit(params, o, degree_angles=degrees) for o in params.orbits}
    for layout in layouts:
        try:
            available[layout][0].check_orbits(orbits)
        except ValueError as exc:
            raise ValueError(f"--layout {layout}: {exc}") from None
    return layouts


def _degree_angles(layouts: tuple[str, ...]) -> bool:
    """Degree angles in every layout when one of them stores degrees (so all hold one geometry)."""
    available = write_layouts()
    return any(available[x][0].stores_degrees for x in layouts)


def _layout_dirs(out_dir: Path, layouts: tuple[str, ...]) -> dict[str, Path]:
    if len(layouts) == 1:
        return {layouts[0]: out_dir}
    return {x: out_dir / x for x in layouts}


def simulate_scan(
    out_dir: str | Path,
    params: SimulationParameters | None = None,
    *,
    phantom: EllipsoidPhantom | TexturedPhantom | str | None = None,
    preset: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    layouts: tuple[str, ...] | str = (WalnutFormat.name,),
) -> dict:
    """Simulate a scan and write it to ``out_dir`` in the walnut layout (module docstring), or in other layouts.

    Parameters
    ----------
    out_dir : path
        Target ``Walnut{id}``-like folder; must be empty or new unless ``overwrite``.
    params : SimulationParameters, optional
        Sizes, noise and seed; default: those of ``preset``.
    phantom : EllipsoidPhantom, TexturedPhantom or str, optional
        Object to scan (mm, mm⁻¹); default ``walnut_phantom(params.seed)``. A name of
        :class:`ctuq.options.PhantomKind` (``"walnut"``, ``"textured"``) makes that phantom of ``params.seed``
        (:func:`ctuq.data.phantom.make_phantom`; ``ValueError`` naming the valid kinds for another string).
    preset : str, optional
        Name recorded in the sidecar; gives ``params`` when those are not given (default then ``"bundled"``).
    overwrite : bool
        Replace an earlier simulated scan in ``out_dir`` (see :func:`prepare_output_dir`).
    progress : bool
        Progress bars on stderr.
    layouts : str or tuple of str
        ``--layout`` names of registered formats (:func:`check_layouts`): ``walnut`` (default), ``yaml-npy``
        (``scan.yaml`` + ``.npy`` arrays), ``yaml-tiff`` (``scan.yaml`` + TIFF stacks), ``nxtomo`` (``scan.nxs``),
        or a format of your own. One layout is written into ``out_dir``; several into ``out_dir/<layout>/``, each
        with the sidecar. Every layout holds the same uint16 counts (yaml/NXtomo: the ``N−1`` distinct angles in
        geometry-row order, ``(angle, row, column)``; flats ``(2, row, column)`` before and after, one dark) and
        ground truth; when a layout that stores degrees is written the angles are ``360·k/(N−1)`` degrees
        (:func:`orbit_vectors`), so each layout's geometry is bit-identical.

    Returns
    -------
    dict
        The sidecar content (also written to ``out_dir/ctuq_simulation.json``).
    """
    if params is None:
        preset = preset or "bundled"
        params = SimulationParameters.preset(preset)
    params.validate()
    layouts = check_layouts(layouts, params)
    out_dir = Path(out_dir)
    if isinstance(phantom, str):  # checked before the folder is touched
        phantom = make_phantom(phantom, params.seed, voxel_size=params.gt_voxel_size)
    prepare_output_dir(out_dir, overwrite)
    if phantom is None:
        phantom = walnut_phantom(params.seed)
    dirs = _layout_dirs(out_dir, layouts)
    available = write_layouts()
    degree_angles = _degree_angles(layouts)
    sidecar = _sidecar(params, preset, phantom, out_dir, dirs, degree_angles)

    def write_sidecars() -> None:
        for d in {out_dir, *dirs.values()}:
            atomic_write_json(d / SIDECAR_NAME, sidecar)

    write_sidecars()

    content = _scan_content(params, preset, sidecar)
    streams = _stream_writers(layouts, available, dirs, content, params.compress)
    whole = [x for x in layouts if x not in streams]
    for orbit in params.orbits:
        geometry = simulation_orbit(params, orbit, degree_angles=degree_angles)
        _simulate_orbit(params, orbit, geometry, phantom, list(streams.values()), content if whole else None, progress)
        sidecar["orbits"][str(orbit)] = {
            "folder": f"Projections/tubeV{orbit}",
            "source_z_mm": float(geometry.vectors(closing=True)[0, 2]),
            "corrections": ORBIT_CORRECTIONS[orbit] if params.corrections else None,
        }
    gt_max = _simulate_ground_truth(params, phantom, list(streams.values()), content if whole else None, progress)

    for x in whole:
        fmt, options = available[x]
        fmt.write(dirs[x], content, compress=params.compress, **options)
    for writer in streams.values():
        writer.close()

    sidecar["complete"] = True
    sidecar["ground_truth_max"] = gt_max
    # no timings or dates in the sidecar: re-running the same command reproduces every file byte for byte
    write_sidecars()
    return sidecar


def _scan_content(params: SimulationParameters, preset: str | None, sidecar: dict) -> ScanContent:
    """The scan-level facts every writer gets; its orbits and ground truth are filled for the formats written
    whole."""
    read_noise = float(params.read_noise) if params.noise else 0.0  # the walnut loader's reading of the sidecar
    return ScanContent(
        orbits={},
        ground_truth=None,
        gt_shape=params.gt_shape,
        voxel_size=float(params.gt_voxel_size),
        read_noise=read_noise,
        record=sidecar,
        title=f"ctuq simulated scan ({preset})",
    )


def _stream_writers(layouts, available: dict, dirs: dict[str, Path], content: ScanContent, compress: bool) -> dict:
    """The piece-by-piece writers (layout → :class:`~ctuq.data.scan_format.ScanWriter`) of the ``layouts`` whose
    format has one (:meth:`~ctuq.data.scan_format.ScanFormat.writer`); the others are written whole at the end."""
    streams = {}
    for x in layouts:
        fmt, options = available[x]
        writer = fmt.writer(dirs[x], content, compress=compress, **options)
        if writer is not None:
            streams[x] = writer
    return streams


def _sidecar(params, preset, phantom, out_dir: Path, dirs: dict[str, Path], degree_angles: bool) -> dict[str, Any]:
    """The sidecar ``ctuq_simulation.json`` of a simulation starting (``complete`` false, no orbits yet): the
    parameters, the conventions of the layouts written into ``dirs``, the phantom."""
    others = [x for x in dirs if x != WalnutFormat.name]
    sidecar: dict[str, Any] = {
        "format": "ctuq simulated walnut scan",
        "ctuq_version": __version__,
        "complete": False,
        "preset": preset,
        "parameters": params.to_dict(),
        "gt_voxel_size_mm": float(params.gt_voxel_size),
        "gt_shape": list(params.gt_shape),
        "orbits": {},
        "conventions": {
            "geometry_rows": "cone_vec: source xyz, detector centre xyz, u step xyz, v step xyz (mm); "
            "row k at angle 2*pi*k/(N-1); rows 0 and N-1 identical",
            "file_pairing": "scan_{N-1-k:06}.tif <-> geometry row k",
            "raw_image": "raw = flipud(P.T), P = (det_rows, det_cols); transpose(flipud(raw)) gives P",
            "counts": "uint16: Poisson(I0*G*mean(exp(-line integral))) + dark pattern + read noise",
            "ground_truth": "full_AGD_50_{k:06}.tiff: voxel averages (mm^-1), (n_y, n_x), slice k at "
            "z = (k + 1/2 - n_z/2) * h, grid centred at the origin",
        },
        "phantom": phantom.to_dict(),
    }
    if others:  # a walnut-only sidecar stays byte-identical to the one written before layouts existed
        sidecar["layouts"] = {x: str(d.relative_to(out_dir)) if d != out_dir else "." for x, d in dirs.items()}
    if degree_angles:
        sidecar["conventions"]["geometry_rows"] = (
            "cone_vec: source xyz, detector centre xyz, u step xyz, v step xyz (mm); row k at angle "
            "radians(360*k/(N-1) degrees); rows 0 and N-1 identical"
        )
    if others:
        sidecar["conventions"]["other_layouts"] = (
            "scan.yaml / scan.nxs: the N-1 distinct angles in geometry-row order, (angle, row, column) uint16 counts "
            "P (not flipped); flats (2, row, column), darks (1, row, column); ground truth (n_z, n_y, n_x)"
        )
    return sidecar


def _flats_and_dark(params: SimulationParameters, orbit: int, flat_true, dark_true, noise_seed: int):
    """The orbit's two raw flats ``(2, det_rows, det_cols)`` and dark ``(1, det_rows, det_cols)`` (uint16): the
    flat-field counts with Poisson noise plus the dark pattern, and read noise on each frame."""
    rng = np.random.default_rng([noise_seed, int(orbit), 0xDA4C])
    frames = {DARK_NAME: dark_true.copy()}
    for name in FLAT_NAMES:
        frames[name] = (rng.poisson(flat_true).astype(np.float64) if params.noise else flat_true) + dark_true
    raw = {}
    for name, frame in frames.items():
        if params.noise:
            frame = frame + rng.normal(0.0, params.read_noise, size=frame.shape)
        raw[name] = _to_uint16(frame, f"tubeV{orbit}/{name}")
    return np.stack([raw[name] for name in FLAT_NAMES]), raw[DARK_NAME][None]


def _projection_counts(params: SimulationParameters, orbit: int, k: int, trans, flat_true, dark_true, noise_seed):
    """Projection ``k`` of the orbit as uint16 counts ``(det_rows, det_cols)`` from its mean transmission."""
    n = int(params.n_projections)
    mean = flat_true * trans
    if params.noise:
        # One generator per file: the noise of a file does not depend on which files were written before.
        prng = np.random.default_rng([noise_seed, int(orbit), k, 0x9E37])
        counts = prng.poisson(mean) + dark_true + prng.normal(0.0, params.read_noise, size=mean.shape)
    else:
        counts = mean + dark_true
    return _to_uint16(counts, f"tubeV{orbit}/{projection_file_name(n - 1 - k)}")


def _simulate_orbit(params, orbit: int, geometry: CircularOrbit, phantom, streams, content, progress: bool) -> None:
    """Scan ``phantom`` along ``orbit``: its flats, dark and ``N`` projections (the last, the closing one, at angle 0
    again with its own noise) go to every writer of ``streams`` as they are made, and into ``content.orbits``
    (``content`` ``None``: no format is written whole)."""
    n = int(params.n_projections)
    rows, cols, s = int(params.det_rows), int(params.det_cols), int(params.supersampling)
    vec = geometry.vectors(closing=True)
    flat_true, dark_true = _detector_patterns(params, orbit)
    noise_seed = int(params.seed if params.noise_seed is None else params.noise_seed)
    flats, darks = _flats_and_dark(params, orbit, flat_true, dark_true, noise_seed)
    for writer in streams:
        writer.orbit(orbit, geometry, flats, darks)
    stack = None
    if content is not None:
        stack = np.empty((n - 1, rows, cols), dtype=np.uint16)
        content.orbits[orbit] = ScanOrbit(geometry, stack, flats, darks)

    first = None
    # the bar counts the distinct angles; the closing projection (angle 0 again, walnut layout) is not one
    bar = _progress_bar(total=n - 1, desc=f"simulate tubeV{orbit}", disable=not progress)
    for k in range(n):
        if k == n - 1 and first is not None:
            trans = first  # same angle as row 0 (bit-identical vectors)
        else:
            trans = _transmission(phantom, vec[k], rows, cols, s)
            if k == 0:
                first = trans
        counts16 = _projection_counts(params, orbit, k, trans, flat_true, dark_true, noise_seed)
        if k < n - 1:
            for writer in streams:
                writer.projection(orbit, k, counts16)
            if stack is not None:
                stack[k] = counts16
            bar.update(1)
        else:  # the closing projection: angle 0 again, its own noise
            for writer in streams:
                writer.closing(orbit, counts16)
            if stack is not None:
                content.orbits[orbit].closing = counts16
    bar.close()


def _simulate_ground_truth(params: SimulationParameters, phantom, streams, content, progress: bool) -> float:
    """Rasterise the ground truth slice by slice (float32, mm⁻¹) to every writer of ``streams`` and into
    ``content.ground_truth`` (``content`` ``None``: no format is written whole); returns its maximum."""
    nz, ny, nx = params.gt_shape
    h = float(params.gt_voxel_size)
    slice_grid = VolumeGeometry((ny, nx), h)
    gt_max = 0.0
    gt_volume = np.empty((nz, ny, nx), dtype=np.float32) if content is not None else None
    for k in _progress_bar(range(nz), total=nz, desc="ground truth", disable=not progress):
        z = (k + 0.5 - nz / 2.0) * h
        img = phantom.rasterize(slice_grid, z=z, thickness=h, supersampling=params.gt_supersampling)
        gt_max = max(gt_max, float(img.max()))
        img32 = img.astype(np.float32)
        for writer in streams:
            writer.ground_truth_slice(k, img32)
        if gt_volume is not None:
            gt_volume[k] = img32
    if content is not None:
        content.ground_truth = gt_volume
    return gt_max


def estimate_work(params: SimulationParameters, n_ellipsoids: int = 60) -> dict:
    """Rough size of a simulation: ray–ellipsoid pairs, voxels, and bytes on disk (uncompressed)."""
    rays = len(params.orbits) * (params.n_projections - 1) * params.det_rows * params.det_cols * params.supersampling**2
    voxels = math.prod(params.gt_shape)
    size = len(params.orbits) * (params.n_projections + 3) * params.det_rows * params.det_cols * 2 + voxels * 4
    return {"rays": rays, "ray_ellipsoid_pairs": rays * n_ellipsoids, "gt_voxels": voxels, "bytes_uncompressed": size}
