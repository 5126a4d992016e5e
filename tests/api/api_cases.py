"""What the tests of the public API (``tests/api/``) share: a phantom no ctuq phantom draws, ASTRA's own CPU
projection of it, the geometry dicts of every ASTRA kind, and the short settings of their runs.

Imported as ``from api_cases import ...`` (pytest puts ``tests/api/`` on the path, as ``tests/`` for ``tiny``)."""

from __future__ import annotations

import math

import astra
import numpy as np

N = 32  # the image grid: N × N pixels (3D: N_Z × N × N)
N_Z = 5  # slices of a 3D volume (odd: the central slice lies in the source plane z = 0)
N_DET = 48  # detector columns
N_ROWS = 5  # detector rows of a 3D geometry (odd: the central row lies in the plane z = 0)
N_ANGLES = 40
SOURCE_ORIGIN, ORIGIN_DET = 100.0, 50.0  # fan and cone beams (ASTRA length units)
FAN_PIXEL = 1.5  # fan and cone beams: the detector pitch (magnification 1.5: the 48 columns see the whole grid)
SHIFT = 0.37  # _vec kinds: the detector shifted along a row by this many pixels (a centre-of-rotation offset)

#: ``tiny`` shortened further: a run with uncertainty in ~8 s of one CPU core on the 32² fan-beam scan.
SET = {"dip.iterations": 30, "uq.samples": 32, "uq.em_steps": 2, "output.figure": False}


def set_args(settings: dict = SET) -> list[str]:
    """``settings`` as ``ctuq reconstruct`` options: ``["--set", "KEY=VALUE", ...]`` (lists as YAML flow)."""
    out = []
    for key, value in settings.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        out += ["--set", f"{key}={text}"]
    return out


def ellipses(seed: int = 43, n: int = N, count: int = 6) -> np.ndarray:
    """``(n, n)`` float32: ``count`` random ellipses (centres, axes, rotations and attenuations from a seeded numpy
    generator) inside the inscribed disc, each adding 0.01 … 0.03 per pixel length; asymmetric under every flip and
    rotation by 90°, so a mirrored or rotated geometry cannot pass for the right one."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[-1 : 1 : n * 1j, -1 : 1 : n * 1j]
    img = np.zeros((n, n))
    for _ in range(count):
        cx, cy = rng.uniform(-0.45, 0.45, size=2)
        a, b = rng.uniform(0.08, 0.35, size=2)
        th = rng.uniform(0.0, math.pi)
        u = (x - cx) * math.cos(th) + (y - cy) * math.sin(th)
        v = -(x - cx) * math.sin(th) + (y - cy) * math.cos(th)
        img[(u / a) ** 2 + (v / b) ** 2 <= 1.0] += rng.uniform(0.01, 0.03)
    return img.astype(np.float32)


def angles(n: int = N_ANGLES) -> np.ndarray:
    """``n`` angles over a full turn (radians), not equispaced (a fixed jitter of up to a third of the step), so that
    ``Scan.angles`` has to carry each one."""
    step = 2 * math.pi / n
    jitter = np.random.default_rng(7).uniform(-step / 3, step / 3, size=n)
    return np.arange(n) * step + jitter + step / 2


def geometry_2d(kind: str, vol_geom: dict | None = None) -> tuple[dict, dict]:
    """``(proj_geom, vol_geom)`` of the 2D ASTRA kind ``kind`` over the ``N × N`` grid of 1-unit pixels (or
    ``vol_geom``): ``parallel`` (unit detector pitch), ``fanflat`` (:data:`FAN_PIXEL`, :data:`SOURCE_ORIGIN`,
    :data:`ORIGIN_DET`), and their ``_vec`` forms with the detector moved by :data:`SHIFT` pixels along its row."""
    vg = vol_geom if vol_geom is not None else astra.create_vol_geom(N, N)
    th = angles()
    base = kind.removesuffix("_vec")
    if base == "parallel":
        pg = astra.create_proj_geom("parallel", 1.0, N_DET, th)
    else:
        pg = astra.create_proj_geom("fanflat", FAN_PIXEL, N_DET, th, SOURCE_ORIGIN, ORIGIN_DET)
    if kind.endswith("_vec"):
        pg = astra.geom_2vec(pg)
        vec = pg["Vectors"]
        vec[:, 2:4] += SHIFT * vec[:, 4:6]
    return pg, vg


def geometry_3d(kind: str) -> tuple[dict, dict]:
    """``(proj_geom, vol_geom)`` of the 3D ASTRA kind ``kind`` over the ``N_Z × N × N`` grid of 1-unit voxels: its
    rays in the central plane ``z = 0`` are those of :func:`geometry_2d` of the 2D kind (``parallel3d`` ↔
    ``parallel``, ``cone`` ↔ ``fanflat``, ``_vec`` shifted alike)."""
    vg = astra.create_vol_geom(N, N, N_Z)
    th = angles()
    base = kind.removesuffix("_vec")
    if base == "parallel3d":
        pg = astra.create_proj_geom("parallel3d", 1.0, 1.0, N_ROWS, N_DET, th)
    else:
        pg = astra.create_proj_geom("cone", FAN_PIXEL, FAN_PIXEL, N_ROWS, N_DET, th, SOURCE_ORIGIN, ORIGIN_DET)
    if kind.endswith("_vec"):
        pg = astra.geom_2vec(pg)
        vec = pg["Vectors"]
        vec[:, 3:6] += SHIFT * vec[:, 6:9]
    return pg, vg


def central_plane_2d(proj_geom_3d: dict) -> dict:
    """The 2D ASTRA ``_vec`` geometry of the rays of a 3D geometry that lie in the plane ``z = 0`` (its central
    detector row): the same x and y vector components (ASTRA's 2D and 3D geometries share their axes)."""
    vec = astra.geom_2vec(proj_geom_3d)["Vectors"] if "Vectors" not in proj_geom_3d else proj_geom_3d["Vectors"]
    kind = "parallel_vec" if proj_geom_3d["type"].startswith("parallel") else "fanflat_vec"
    return astra.create_proj_geom(kind, N_DET, vec[:, [0, 1, 3, 4, 6, 7]])


def astra_sino(image: np.ndarray, proj_geom: dict, vol_geom: dict) -> np.ndarray:
    """ASTRA's CPU projection ``(n_angles, n_det)`` float32 of the 2D ``image`` (ASTRA's array order: row 0 at the
    top, ``y`` largest) with the kernel ctuq's sparse operator uses (``linear`` for parallel beams,
    ``line_fanflat`` for fan beams)."""
    kernel = "linear" if proj_geom["type"].startswith("parallel") else "line_fanflat"
    pid = astra.create_projector(kernel, proj_geom, vol_geom)
    try:
        sid, sino = astra.create_sino(np.ascontiguousarray(image, dtype=np.float32), pid)
        astra.data2d.delete(sid)
    finally:
        astra.projector.delete(pid)
    return np.asarray(sino, dtype=np.float32)


def slab(image: np.ndarray, n_z: int = N_Z) -> np.ndarray:
    """The 3D volume ``(n_z, N, N)`` (ASTRA's ``data3d`` order, ``y`` growing with the row index) whose every slice
    is the 2D ASTRA ``image`` (row 0 at the top): ``flipud(image)`` repeated along ``z``."""
    return np.repeat(np.flipud(image)[None], n_z, axis=0).copy()


def slab_projections(sino_2d: np.ndarray, n_rows: int = N_ROWS) -> np.ndarray:
    """3D projections in ASTRA's ``(rows, angles, columns)`` order whose every detector row is ``sino_2d`` (what a
    slab phantom gives on its central row; ctuq's 2D slice reads that row only)."""
    return np.repeat(sino_2d[None], n_rows, axis=0).copy()


def relative_error(a, b) -> float:
    """``max |a − b| / max |b|``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def one_line(exc: BaseException) -> str:
    """The exception's message, asserted to be one line."""
    text = str(exc)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text
