"""Ellipsoid phantoms: exact line integrals, pixel-averaged rasterisation, and a synthetic walnut.

A phantom is a sum of ellipsoids, each with an *additive* attenuation value (mm⁻¹): the attenuation at a point
is the sum of the values of the ellipsoids that contain it. Negative values carve material away again (the
air inside a walnut shell is an inner ellipsoid with the negated shell value); such carving ellipsoids must lie
fully inside what they carve, or the attenuation would become negative (:func:`walnut_phantom` guarantees it).

Coordinates are world coordinates ``(x, y, z)`` in mm (``ctuq.geometry``'s convention). An ellipsoid is
``{c + R (a ⊙ s) : |s| ≤ 1}`` with centre ``c``, semi-axes ``a`` and a rotation ``R`` whose columns are the
ellipsoid's principal axes in world coordinates.

Line integrals are exact: a ray ``p + t·d`` meets an ellipsoid where ``|M(p − c) + t·M d|² ≤ 1`` with
``M = diag(1/a) Rᵀ``, a quadratic in ``t``; the chord length is the length of that ``t`` interval (clipped to
the ray or segment) times ``|d|``. 2D use needs no separate code: rays in the plane ``z = const`` meet the
ellipse in which that plane cuts each ellipsoid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import astra
import numpy as np

from ctuq.options import PhantomKind
from ctuq.utils import progress as _progress

__all__ = [
    "Ellipsoid",
    "EllipsoidPhantom",
    "TexturedPhantom",
    "make_phantom",
    "rotation_from_euler",
    "textured_phantom",
    "walnut_phantom",
]

# Elements of a (rays × ellipsoids) work array per chunk: 0.5 MB per float64 temporary (cache-sized; measured
# fastest on a 2-core CPU among 2^16 … 2^22).
_PAIR_CHUNK = 1 << 16


def rotation_from_euler(z: float = 0.0, y: float = 0.0, x: float = 0.0) -> np.ndarray:
    """Rotation matrix ``Rz(z) @ Ry(y) @ Rx(x)`` (angles in radians): ``(3, 3)`` float64, det +1."""
    cz, sz = math.cos(z), math.sin(z)
    cy, sy = math.cos(y), math.sin(y)
    cx, sx = math.cos(x), math.sin(x)
    rz = np.array([[cz, -sz, 0.0], [sz, cz, 0.0], [0.0, 0.0, 1.0]])
    ry = np.array([[cy, 0.0, sy], [0.0, 1.0, 0.0], [-sy, 0.0, cy]])
    rx = np.array([[1.0, 0.0, 0.0], [0.0, cx, -sx], [0.0, sx, cx]])
    return rz @ ry @ rx


@dataclasses.dataclass(frozen=True, eq=False)
class Ellipsoid:
    """One ellipsoid of a phantom.

    Parameters
    ----------
    center : (3,) float
        Centre ``(x, y, z)`` in mm.
    semi_axes : (3,) float
        Semi-axis lengths (mm) along the columns of ``rotation``; all positive.
    value : float
        Additive attenuation (mm⁻¹); negative values carve.
    rotation : (3, 3) array, optional
        Orthonormal matrix with determinant +1 whose columns are the principal axes in world coordinates
        (default: identity, i.e. semi-axes along x, y, z).
    name : str
        Free-form label (e.g. ``"shell"``), kept in the simulation sidecar.
    """

    center: tuple[float, float, float]
    semi_axes: tuple[float, float, float]
    value: float
    rotation: Any = None
    name: str = ""

    def __post_init__(self):
        c = np.asarray(self.center, dtype=np.float64).reshape(-1)
        a = np.asarray(self.semi_axes, dtype=np.float64).reshape(-1)
        if c.shape != (3,) or a.shape != (3,):
            raise ValueError(f"Ellipsoid {self.name!r}: center and semi_axes need 3 entries, got {c.shape}, {a.shape}")
        if not (np.all(np.isfinite(c)) and np.all(np.isfinite(a)) and np.all(a > 0)):
            raise ValueError(f"Ellipsoid {self.name!r}: semi_axes must be positive and finite, got {a.tolist()}")
        if not math.isfinite(float(self.value)):
            raise ValueError(f"Ellipsoid {self.name!r}: value must be finite, got {self.value}")
        r = np.eye(3) if self.rotation is None else np.asarray(self.rotation, dtype=np.float64)
        if r.shape != (3, 3) or not np.allclose(r.T @ r, np.eye(3), atol=1e-9) or np.linalg.det(r) < 0:
            raise ValueError(f"Ellipsoid {self.name!r}: rotation must be a 3×3 rotation matrix (orthonormal, det +1)")
        object.__setattr__(self, "center", tuple(float(v) for v in c))
        object.__setattr__(self, "semi_axes", tuple(float(v) for v in a))
        object.__setattr__(self, "value", float(self.value))
        r = r.copy()
        r.flags.writeable = False
        object.__setattr__(self, "rotation", r)

    @property
    def matrix(self) -> np.ndarray:
        """``M = diag(1/a) Rᵀ`` ``(3, 3)``: maps ``x − c`` to the unit-sphere frame."""
        return np.asarray(self.rotation).T / np.asarray(self.semi_axes)[:, None]

    @property
    def volume(self) -> float:
        """Volume (mm³)."""
        a = self.semi_axes
        return 4.0 / 3.0 * math.pi * a[0] * a[1] * a[2]

    def half_extent(self) -> np.ndarray:
        """Half-widths ``(3,)`` (mm) of the axis-aligned bounding box along x, y, z."""
        ra = np.asarray(self.rotation) * np.asarray(self.semi_axes)[None, :]
        return np.sqrt((ra**2).sum(axis=1))

    def normalized_radius_sq(self, points: np.ndarray) -> np.ndarray:
        """``|M(p − c)|²`` for points ``(..., 3)`` (mm): ≤ 1 inside the ellipsoid."""
        q = np.einsum("...k,jk->...j", np.asarray(points, dtype=np.float64) - np.asarray(self.center), self.matrix)
        return (q**2).sum(axis=-1)

    def surface_points(self, n: int = 2000) -> np.ndarray:
        """``(n, 3)`` points (mm) on the surface, the images of a Fibonacci lattice on the unit sphere."""
        i = np.arange(n) + 0.5
        polar = np.arccos(1.0 - 2.0 * i / n)
        azim = math.pi * (1.0 + math.sqrt(5.0)) * i
        s = np.stack([np.sin(polar) * np.cos(azim), np.sin(polar) * np.sin(azim), np.cos(polar)], axis=1)
        return np.asarray(self.center) + np.einsum("nk,jk->nj", s * np.asarray(self.semi_axes), self.rotation)

    def transformed(self, rotation: np.ndarray, shift: Sequence[float] = (0.0, 0.0, 0.0)) -> Ellipsoid:
        """The ellipsoid moved rigidly: ``x ↦ rotation @ x + shift`` (rotation about the origin, mm)."""
        rot = np.asarray(rotation, dtype=np.float64)
        return Ellipsoid(
            rot @ np.asarray(self.center) + np.asarray(shift, dtype=np.float64),
            self.semi_axes,
            self.value,
            rot @ np.asarray(self.rotation),
            self.name,
        )

    def to_dict(self) -> dict:
        """JSON-serialisable description (mm, mm⁻¹; rotation as a nested list, columns = principal axes)."""
        return {
            "name": self.name,
            "center": list(self.center),
            "semi_axes": list(self.semi_axes),
            "value": self.value,
            "rotation": np.asarray(self.rotation).tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> Ellipsoid:
        """Inverse of :meth:`to_dict`."""
        missing = {"center", "semi_axes", "value"} - set(d)
        if missing:
            raise ValueError(f"Ellipsoid.from_dict: missing keys {sorted(missing)} in {d}")
        return cls(d["center"], d["semi_axes"], d["value"], d.get("rotation"), d.get("name", ""))


class EllipsoidPhantom:
    """A sum of :class:`Ellipsoid` s with analytic line integrals and supersampled rasterisation.

    Parameters
    ----------
    ellipsoids : iterable of Ellipsoid
        The components; order does not matter (values add).
    """

    def __init__(self, ellipsoids: Iterable[Ellipsoid]):
        self.ellipsoids: tuple[Ellipsoid, ...] = tuple(ellipsoids)
        if not self.ellipsoids:
            raise ValueError("EllipsoidPhantom needs at least one ellipsoid")
        for e in self.ellipsoids:
            if not isinstance(e, Ellipsoid):
                raise TypeError(f"EllipsoidPhantom: expected Ellipsoid, got {type(e).__name__}")
        # Stacked per-ellipsoid data for the vectorised kernels.
        self._m = np.stack([e.matrix for e in self.ellipsoids])  # (E, 3, 3)
        self._c = np.array([e.center for e in self.ellipsoids])  # (E, 3)
        self._v = np.array([e.value for e in self.ellipsoids])  # (E,)
        self._m_flat = self._m.reshape(-1, 3)  # (3E, 3): rows of every M
        self._mc = np.einsum("eij,ej->ei", self._m, self._c).reshape(-1)  # (3E,): M c per ellipsoid
        q = np.einsum("eki,ekj->eij", self._m, self._m)  # Q = MᵀM (E, 3, 3)
        q_sym = np.stack([q[:, 0, 0], q[:, 1, 1], q[:, 2, 2], 2 * q[:, 0, 1], 2 * q[:, 0, 2], 2 * q[:, 1, 2]])
        qc = np.einsum("eij,ej->ei", q, self._c)
        k = np.einsum("ei,ei->e", self._c, qc) - 1.0
        self._q = q
        self._quadric = (q_sym, q.reshape(-1, 9).T.copy(), qc, k)  # (6,E), (9,E), (E,3), (E,)

    def __len__(self) -> int:
        return len(self.ellipsoids)

    def __repr__(self) -> str:
        return f"EllipsoidPhantom({len(self)} ellipsoids)"

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """``{"ellipsoids": [Ellipsoid.to_dict(), ...]}`` (JSON-serialisable)."""
        return {"ellipsoids": [e.to_dict() for e in self.ellipsoids]}

    @classmethod
    def from_dict(cls, d: dict) -> EllipsoidPhantom:
        """Inverse of :meth:`to_dict` (e.g. from a simulation sidecar's ``phantom`` entry)."""
        if "ellipsoids" not in d:
            raise ValueError("EllipsoidPhantom.from_dict: no 'ellipsoids' key")
        return cls(Ellipsoid.from_dict(e) for e in d["ellipsoids"])

    def bounding_box(self) -> np.ndarray:
        """``(3, 2)`` array of ``[min, max]`` per axis x, y, z (mm) over all ellipsoids."""
        lo = np.min([np.asarray(e.center) - e.half_extent() for e in self.ellipsoids], axis=0)
        hi = np.max([np.asarray(e.center) + e.half_extent() for e in self.ellipsoids], axis=0)
        return np.stack([lo, hi], axis=1)

    # ------------------------------------------------------------------ point values
    def values(self, points: np.ndarray) -> np.ndarray:
        """Attenuation (mm⁻¹) at points ``(..., 3)`` (mm): shape ``(...)``, float64."""
        pts = np.asarray(points, dtype=np.float64)
        if pts.shape[-1] != 3:
            raise ValueError(f"EllipsoidPhantom.values: points must have shape (..., 3), got {pts.shape}")
        flat = pts.reshape(-1, 3)
        out = np.empty(flat.shape[0])
        step = max(1, _PAIR_CHUNK // len(self))
        for i in range(0, flat.shape[0], step):
            q = (np.einsum("nk,jk->nj", flat[i : i + step], self._m_flat) - self._mc).reshape(-1, len(self), 3)
            inside = (q**2).sum(axis=2) <= 1.0
            out[i : i + step] = np.einsum("ne,e->n", inside.astype(np.float64), self._v)
        return out.reshape(pts.shape[:-1])

    # ------------------------------------------------------------------ line integrals
    def line_integrals(
        self,
        starts: np.ndarray,
        ends: np.ndarray | None = None,
        *,
        directions: np.ndarray | None = None,
        chunk_size: int | None = None,
    ) -> np.ndarray:
        """Exact line integrals ``∫ μ dl`` (mm⁻¹ · mm = dimensionless) along a batch of rays.

        Give either ``ends`` (segments from ``starts`` to ``ends``) or ``directions`` (half-lines from
        ``starts``; directions need not be normalised). For a source outside the object and an end point on the
        detector both are the full line integral.

        Parameters
        ----------
        starts : (..., 3) array
            Start points (mm).
        ends, directions : (..., 3) array
            Exactly one of them; broadcastable against ``starts``.
        chunk_size : int, optional
            Rays per vectorised chunk (default: about 6.6·10⁴ ray–ellipsoid pairs per chunk, 0.5 MB temporaries).

        Returns
        -------
        (...) float64 array of line integrals.
        """
        if (ends is None) == (directions is None):
            raise ValueError("line_integrals: give exactly one of ends= or directions=")
        p = np.asarray(starts, dtype=np.float64)
        other = np.asarray(ends if ends is not None else directions, dtype=np.float64)
        if p.shape[-1] != 3 or other.shape[-1] != 3:
            raise ValueError(
                f"line_integrals: starts {p.shape} and {'ends' if ends is not None else 'directions'} "
                f"{other.shape} must both end in a length-3 axis (x, y, z in mm)"
            )
        # One start point for every ray (a cone-beam source) makes C a per-ellipsoid constant: a faster path.
        shared = p.reshape(-1, 3)[0] if p.size == 3 else None
        p, other = np.broadcast_arrays(p, other)
        shape = p.shape[:-1]
        p = p.reshape(-1, 3)
        d = other.reshape(-1, 3) - p if ends is not None else other.reshape(-1, 3)
        t_max = 1.0 if ends is not None else np.inf
        n_e = len(self)
        step = int(chunk_size) if chunk_size else max(1, _PAIR_CHUNK // n_e)
        out = np.empty(p.shape[0])
        for i in range(0, p.shape[0], step):
            chords = self._chords(p[i : i + step], d[i : i + step], t_max, shared)
            out[i : i + step] = np.einsum("ne,e->n", chords, self._v)
        out *= np.linalg.norm(d, axis=1)  # ray-parameter lengths → mm
        return out.reshape(shape)

    def _chords(self, p: np.ndarray, d: np.ndarray, t_max: float, shared: np.ndarray | None = None) -> np.ndarray:
        """Chord lengths in ray-parameter units ``(n, E)`` of rays ``p + t d``, ``t ∈ [0, t_max]``.

        The quadratic ``A t² + 2B t + C`` with ``A = dᵀQd``, ``B = (p − c)ᵀQd``, ``C = (p − c)ᵀQ(p − c) − 1``,
        ``Q = MᵀM``, is assembled from a few (n × 6|9) · (6|9 × E) products, several times faster than forming
        ``M(p − c)`` per pair; the expanded form is accurate to ~1e-13 relative in float64. ``shared``: the one
        start point of all rays, if so (then ``B`` is an (n × 3) · (3 × E) product and ``C`` a constant per
        ellipsoid).
        """
        q_sym, q_full, qc, k = self._quadric
        dd = np.stack(
            [
                d[:, 0] * d[:, 0],
                d[:, 1] * d[:, 1],
                d[:, 2] * d[:, 2],
                d[:, 0] * d[:, 1],
                d[:, 0] * d[:, 2],
                d[:, 1] * d[:, 2],
            ],
            axis=1,
        )
        # einsum, not matmul: with inner sizes 3–9, multithreaded BLAS is slower than einsum's single loop,
        # and up to 25× slower when other processes share the cores (measured with OpenBLAS on 2 cores).
        a = np.einsum("nk,ke->ne", dd, q_sym)
        if shared is not None:
            rel = shared[None, :] - self._c  # (E, 3): p − c
            q_rel = np.einsum("eij,ej->ei", self._q, rel)  # Q (p − c)
            b = np.einsum("nk,ek->ne", d, q_rel)
            c = np.einsum("ei,ei->e", rel, q_rel) - 1.0  # (E,)
        else:
            pp = np.stack(
                [
                    p[:, 0] * p[:, 0],
                    p[:, 1] * p[:, 1],
                    p[:, 2] * p[:, 2],
                    p[:, 0] * p[:, 1],
                    p[:, 0] * p[:, 2],
                    p[:, 1] * p[:, 2],
                ],
                axis=1,
            )
            pd = (p[:, :, None] * d[:, None, :]).reshape(-1, 9)
            b = np.einsum("nk,ke->ne", pd, q_full)
            b -= np.einsum("nk,ek->ne", d, qc)
            c = np.einsum("nk,ke->ne", pp, q_sym)
            c -= np.einsum("nk,ek->ne", 2.0 * p, qc)
            c += k
        # disc = b² − a c, clipped at 0: a miss then gives an empty interval below.
        disc = b * b
        disc -= a * c
        np.maximum(disc, 0.0, out=disc)
        np.sqrt(disc, out=disc)
        np.divide(1.0, a, out=a, where=a > 0)  # a = 0 only for a zero-length ray
        b *= -1.0
        t0 = b - disc
        t0 *= a
        np.maximum(t0, 0.0, out=t0)
        b += disc
        b *= a
        np.minimum(b, t_max, out=b)
        b -= t0
        np.maximum(b, 0.0, out=b)
        return b

    # ------------------------------------------------------------------ rasterisation
    def rasterize(
        self,
        volume,
        *,
        supersampling: int = 3,
        z: float | None = None,
        thickness: float | None = None,
        progress: bool = False,
    ) -> np.ndarray:
        """Pixel/voxel averages of the attenuation on a :class:`~ctuq.geometry.VolumeGeometry` (mm⁻¹).

        Each pixel's value is the mean over ``supersampling`` points per axis spread evenly across the pixel
        (``s²`` in 2D, ``s³`` in 3D), so edges get partial-volume values. Arrays follow ctuq's convention:
        index increases with the coordinate (``[i, j]`` ↔ ``(y, x)``, ``[k, i, j]`` ↔ ``(z, y, x)``).

        Parameters
        ----------
        volume : VolumeGeometry
            3D ``(n_z, n_y, n_x)`` grid, or a 2D ``(n_y, n_x)`` grid (then ``z`` is required).
        supersampling : int
            Sample points per axis and pixel (1: pixel centres only).
        z : float, optional
            2D grids: height (mm) of the slice plane.
        thickness : float, optional
            2D grids: average also over ``[z − thickness/2, z + thickness/2]`` (a voxel slab, e.g. one slice of a
            3D volume); ``None`` averages over the plane ``z`` only.
        progress : bool
            Show a progress bar over slices (3D).

        Returns
        -------
        float64 array of ``volume.shape``.
        """
        s = int(supersampling)
        if s < 1:
            raise ValueError(f"rasterize: supersampling must be ≥ 1, got {supersampling}")
        h = volume.voxel_size
        if volume.ndim == 2:
            if z is None:
                raise ValueError("rasterize: a 2D grid needs the slice height z (mm)")
            if thickness is not None and not thickness > 0:
                raise ValueError(f"rasterize: thickness must be positive, got {thickness}")
            zs = [float(z)] if thickness is None else list(float(z) + _offsets(s) * thickness)
            yc, xc = volume.pixel_centers()
            return self._rasterize_slab(yc, xc, h, np.asarray(zs), s)
        if z is not None or thickness is not None:
            raise ValueError("rasterize: z/thickness apply to 2D grids only; a 3D grid gives every slice")
        zc, yc, xc = volume.pixel_centers()
        out = np.empty(volume.shape)
        for k in _progress(range(len(zc)), desc="rasterise", disable=not progress):
            out[k] = self._rasterize_slab(yc, xc, h, zc[k] + _offsets(s) * h, s)
        return out

    def _rasterize_slab(self, yc: np.ndarray, xc: np.ndarray, h: float, zs: np.ndarray, s: int) -> np.ndarray:
        """Mean over the sample heights ``zs`` and ``s × s`` in-plane samples per pixel; ``(n_y, n_x)``."""
        out = np.zeros((len(yc), len(xc)))
        off = _offsets(s) * h
        for e in self.ellipsoids:
            ext = e.half_extent()
            c = np.asarray(e.center)
            zsel = zs[np.abs(zs - c[2]) <= ext[2]]
            if zsel.size == 0:
                continue
            # Only pixels whose area meets the bounding box can hold samples inside the ellipsoid.
            iy = np.nonzero(np.abs(yc - c[1]) <= ext[1] + h / 2)[0]
            ix = np.nonzero(np.abs(xc - c[0]) <= ext[0] + h / 2)[0]
            if iy.size == 0 or ix.size == 0:
                continue
            ys, xs = yc[iy[0] : iy[-1] + 1], xc[ix[0] : ix[-1] + 1]
            m = e.matrix
            count = np.zeros((len(ys), len(xs)))
            for zz in zsel:
                dz = zz - c[2]
                for oy in off:
                    dy = ys + oy - c[1]
                    for ox in off:
                        dx = xs + ox - c[0]
                        r2 = 0.0
                        for row in m:  # |M (p − c)|², separable in the grid axes
                            qi = row[0] * dx[None, :] + row[1] * dy[:, None] + row[2] * dz
                            r2 = r2 + qi * qi
                        count += r2 <= 1.0
            out[iy[0] : iy[-1] + 1, ix[0] : ix[-1] + 1] += e.value * count
        return out / (len(zs) * s * s)


def _offsets(s: int) -> np.ndarray:
    """Sample offsets (in pixel units) of ``s`` evenly spread points across a pixel: ``(k + ½)/s − ½``."""
    return (np.arange(s) + 0.5) / s - 0.5


# ---------------------------------------------------------------------------------------- synthetic walnut
def _inside(child: Ellipsoid, parent: Ellipsoid, margin: float = 0.04, n: int = 1000) -> bool:
    """Whether ``child`` lies inside ``parent`` shrunk by ``margin`` (normalised radius), by dense surface
    sampling; the margin absorbs the sampling error."""
    return bool(np.max(parent.normalized_radius_sq(child.surface_points(n))) <= (1.0 - margin) ** 2)


def _outside_small(child: Ellipsoid, other: Ellipsoid, margin: float = 0.04, n: int = 1000) -> bool:
    """Whether a *small, round* ``child`` misses ``other`` (``other`` grown by ``margin``), by dense sampling of the
    child's surface: if they met, part of the child's surface would lie inside ``other``, and for a small round
    child that part is many samples wide. (Not valid for large thin bodies: use :func:`_separated`.)"""
    return bool(np.min(other.normalized_radius_sq(child.surface_points(n))) >= (1.0 + margin) ** 2)


def _separated(a: Ellipsoid, b: Ellipsoid, gap: float = 0.0) -> bool:
    """Exact sufficient disjointness test: some axis (a principal axis of either ellipsoid, or the line of
    centres) on which the two support intervals are at least ``gap`` mm apart. An ellipsoid's half-width along a
    unit vector ``n`` is ``|diag(a) Rᵀ n|``."""
    ca, cb = np.asarray(a.center), np.asarray(b.center)
    axes = [*np.asarray(a.rotation).T, *np.asarray(b.rotation).T]
    dist = np.linalg.norm(cb - ca)
    if dist > 0:
        axes.append((cb - ca) / dist)
    for n in axes:
        ha = np.linalg.norm(np.asarray(a.semi_axes) * (np.asarray(a.rotation).T @ n))
        hb = np.linalg.norm(np.asarray(b.semi_axes) * (np.asarray(b.rotation).T @ n))
        if abs(float(n @ (cb - ca))) >= ha + hb + gap:
            return True
    return False


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    return rotation_from_euler(rng.uniform(0, 2 * math.pi), math.asin(rng.uniform(-1, 1)), rng.uniform(0, 2 * math.pi))


def _place_carvings(
    rng, parent: Ellipsoid, count: int, make, others: Sequence[Ellipsoid], tries: int = 400
) -> list[Ellipsoid]:
    """Rejection-sample up to ``count`` carving ellipsoids ``make(rng, point)`` inside ``parent``, separated
    (:func:`_separated`, 0.2 mm) from each other and from ``others``."""
    out: list[Ellipsoid] = []
    pc, pr, pa = np.asarray(parent.center), np.asarray(parent.rotation), np.asarray(parent.semi_axes)
    for _ in range(tries):
        if len(out) == count:
            break
        s = rng.normal(size=3)
        s *= rng.uniform(0.0, 0.8) ** (1 / 3) / np.linalg.norm(s)  # uniform in 80 % of the unit ball
        cand = make(rng, pc + pr @ (pa * s))
        if all(_separated(cand, o, 0.2) for o in [*others, *out]) and _inside(cand, parent):
            out.append(cand)
    return out


def walnut_phantom(
    seed: int = 0,
    *,
    size: float = 1.0,
    center: Sequence[float] | None = None,
    shell_value: float | None = None,
    kernel_value: float | None = None,
    septum_value: float | None = None,
    n_folds: int = 14,
    n_pockets: int = 8,
    n_pores: int = 8,
) -> EllipsoidPhantom:
    """A synthetic walnut as an :class:`EllipsoidPhantom` (mm, mm⁻¹), random but reproducible from ``seed``.

    Structure (walnut frame: long axis ``z``, septum in the plane ``x = 0``; the whole nut is then tilted by a
    few degrees, turned about ``z`` and shifted, all seeded):

    * shell: an outer ellipsoid (about 31 × 29 × 34 mm times ``size``, ±4 % per axis) with value
      ``shell_value`` (≈ 0.055 mm⁻¹) minus a concentric inner cavity 1.2–1.8 mm thinner (value −shell) —
      air inside — with a few small pores carved out of the shell wall;
    * septum: a thin plate (≈ 1.2 mm thick) in the plane ``x = 0`` inside the cavity (≈ 0.045 mm⁻¹);
    * kernel: one half on each side of the septum (≈ 0.034 mm⁻¹, ±4 %), leaving air gaps to the shell and the
      septum, each split into two lobes by a deep crease (a thin disc across its middle);
    * up to ``n_folds`` thin folds (flat discs) and ``n_pockets`` small air pockets carved out of each half.

    The shell's outline stays within 18 mm of the rotation axis: the cylinder that the real walnut detector sees
    at every angle has a radius of 18.3 mm, so simulated projections are never truncated.

    Every carving ellipsoid lies inside the ellipsoid it carves (dense surface sampling with a margin; the
    carvings are small or thin against the smooth parent, so the sampling error is far below the margin), and
    carvings of one parent, like the positive parts, are pairwise separated by a plane (an exact test). So the
    attenuation is never negative and never exceeds the largest single value; times 14 it lies in [0, 1] (the
    DIP's scale).

    Parameters
    ----------
    seed : int
        Seeds every random variation (sizes, shapes, orientation, position, folds, pockets, pores).
    size : float
        Overall scale factor (1: ≈ 31–34 mm across).
    center : (3,) float, optional
        Centre (mm); default: a seeded offset of 0.3–1 mm in x and y from the origin.
    shell_value, kernel_value, septum_value : float, optional
        Attenuation values (mm⁻¹); default: seeded around 0.055, 0.034 and 0.045.
    n_folds, n_pockets : int
        Folds and air pockets tried per kernel half (fewer are kept where they do not fit).
    n_pores : int
        Pores tried in the shell wall.
    """
    rng = np.random.default_rng([int(seed), 0x5A1A])
    mu_shell, mu_kernel, mu_septum = _walnut_values(rng, shell_value, kernel_value, septum_value)
    scale = size * rng.uniform(0.95, 1.05)
    outer_axes = np.array([15.5, 14.5, 17.0]) * scale * rng.uniform(0.96, 1.04, size=3)
    thickness = rng.uniform(1.2, 1.8) * size
    cavity_axes = outer_axes - thickness
    outer = Ellipsoid((0, 0, 0), outer_axes, mu_shell, name="shell")
    cavity = Ellipsoid((0, 0, 0), cavity_axes, -mu_shell, name="cavity")
    parts: list[Ellipsoid] = [outer, cavity]
    parts += _shell_pores(rng, outer, cavity, outer_axes, thickness, mu_shell, n_pores)

    septum_half = rng.uniform(0.5, 0.7) * size
    septum = Ellipsoid((0, 0, 0), (septum_half, cavity_axes[1] * 0.93, cavity_axes[2] * 0.93), mu_septum, name="septum")
    if not _inside(septum, cavity, 0.01):  # pragma: no cover - the axes above always fit
        raise RuntimeError("walnut_phantom: septum does not fit into the cavity")
    parts.append(septum)

    halves = _kernel_halves(rng, cavity, cavity_axes, septum, septum_half, mu_kernel, size)
    parts += halves
    for half in halves:
        parts += _kernel_carvings(rng, half, size, n_folds, n_pockets)

    # Pose: a small tilt, a turn about z that avoids the axis-aligned (mirror-symmetric) orientations, a shift.
    turn = rng.uniform(math.radians(12), math.radians(35)) * rng.choice([-1.0, 1.0])
    pose = rotation_from_euler(turn, rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1))
    if center is None:
        # Off-centre, but the shell stays inside the cylinder of radius 18.3 mm that the real detector (768 ×
        # 0.1496 mm at 199 mm, source 66 mm from the axis) sees at every angle: no truncated projections.
        shift = np.array(
            [
                rng.uniform(0.3, 1.0) * rng.choice([-1, 1]),
                rng.uniform(0.3, 1.0) * rng.choice([-1, 1]),
                rng.uniform(-0.5, 0.5),
            ]
        )
    else:
        shift = np.asarray(center, dtype=np.float64).reshape(3)
    return EllipsoidPhantom(e.transformed(pose, shift) for e in parts)


def _walnut_values(rng, shell_value, kernel_value, septum_value) -> tuple[float, float, float]:
    """The shell's, kernel's and septum's attenuation (mm⁻¹): the given ones, else seeded around 0.055, 0.034 and
    0.045 (drawn in that order); ``ValueError`` for one that is not positive."""
    mu_shell = shell_value if shell_value is not None else rng.uniform(0.052, 0.058)
    mu_kernel = kernel_value if kernel_value is not None else rng.uniform(0.031, 0.036)
    mu_septum = septum_value if septum_value is not None else rng.uniform(0.042, 0.048)
    for name, v in (("shell_value", mu_shell), ("kernel_value", mu_kernel), ("septum_value", mu_septum)):
        if not v > 0:
            raise ValueError(f"walnut_phantom: {name} must be positive, got {v}")
    return mu_shell, mu_kernel, mu_septum


def _shell_pores(rng, outer, cavity, outer_axes, thickness: float, mu_shell: float, n_pores: int) -> list[Ellipsoid]:
    """Up to ``n_pores`` pores carved out of the shell wall (``thickness`` mm, value ``mu_shell``): inside the outer
    ellipsoid (semi-axes ``outer_axes``), outside the cavity, pairwise separated (200 tries)."""
    pores: list[Ellipsoid] = []
    for _ in range(200):
        if len(pores) == n_pores:
            break
        s = rng.normal(size=3)
        s /= np.linalg.norm(s)
        p = s * (outer_axes - thickness / 2)
        r = rng.uniform(0.2, 0.4) * thickness
        cand = Ellipsoid(p, (r, r, r * rng.uniform(0.6, 1.0)), -mu_shell, _random_rotation(rng), name="pore")
        if (
            _inside(cand, outer, 0.01)
            and _outside_small(cand, cavity, 0.01)
            and all(_separated(cand, o, 0.2) for o in pores)
        ):
            pores.append(cand)
    return pores


def _kernel_halves(rng, cavity, cavity_axes, septum, septum_half: float, mu_kernel: float, size: float):
    """The two kernel halves (value about ``mu_kernel``), one per side of the septum (half thickness
    ``septum_half``), each shrunk until it fits the cavity (semi-axes ``cavity_axes``) with an air gap."""
    gap = 0.5 * size  # air between kernel and septum / shell
    halves: list[Ellipsoid] = []
    # One kernel half per side of the septum, laid out in the cavity's unit-sphere frame: centred at
    # x = ±(g + α) with semi-axes α, β, γ, about the largest ellipsoid that fits the half-ball with an air gap.
    gx = (septum_half + gap) / cavity_axes[0]
    for side in (-1.0, 1.0):
        alpha = rng.uniform(0.42, 0.46) - gx / 2
        beta, gamma = rng.uniform(0.66, 0.72), rng.uniform(0.66, 0.74)
        centre = np.array([side * (gx + alpha), rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03)]) * cavity_axes
        tilt = rotation_from_euler(rng.uniform(-0.05, 0.05), rng.uniform(-0.03, 0.03), rng.uniform(-0.03, 0.03))
        value = mu_kernel * rng.uniform(0.96, 1.04)
        half = None
        for shrink in np.linspace(1.0, 0.6, 41):  # shrink until it fits the cavity with an air gap
            axes = np.array([alpha, beta, gamma]) * cavity_axes * shrink
            cand = Ellipsoid(centre, axes, value, tilt, name="kernel")
            if _inside(cand, cavity, 0.04) and _separated(cand, septum, 0.3):
                half = cand
                break
        if half is None:  # pragma: no cover - the shrink range always leaves room
            raise RuntimeError("walnut_phantom: a kernel half does not fit into the cavity")
        halves.append(half)
    return halves


def _kernel_carvings(rng, half: Ellipsoid, size: float, n_folds: int, n_pockets: int) -> list[Ellipsoid]:
    """What is carved out of a kernel half: the deep crease that splits it into two lobes, up to ``n_folds``
    folds and ``n_pockets`` air pockets."""
    ha = np.asarray(half.semi_axes)
    # The deep crease that splits each kernel half into two lobes: a thin disc across the middle (y ≈ 0).
    crease = None
    for shrink in np.linspace(0.85, 0.5, 15):
        cand = Ellipsoid(
            half.center,
            (ha[0] * shrink, rng.uniform(0.25, 0.35) * size, ha[2] * shrink),
            -half.value,
            np.asarray(half.rotation) @ rotation_from_euler(rng.uniform(-0.15, 0.15)),
            name="crease",
        )
        if _inside(cand, half, 0.03):
            crease = cand
            break
    carvings = [crease] if crease is not None else []

    def make_fold(rng, point):
        length = rng.uniform(1.2, 2.6) * size
        return Ellipsoid(
            point,
            (rng.uniform(0.15, 0.3) * size, length, length * rng.uniform(1.2, 2.5)),
            -half.value,
            _random_rotation(rng),
            name="fold",
        )

    def make_pocket(rng, point):
        r = rng.uniform(0.25, 0.7) * size
        return Ellipsoid(
            point,
            (r, r * rng.uniform(0.7, 1.0), r * rng.uniform(0.7, 1.0)),
            -half.value,
            _random_rotation(rng),
            name="pocket",
        )

    folds = _place_carvings(rng, half, n_folds, make_fold, carvings)
    pockets = _place_carvings(rng, half, n_pockets, make_pocket, carvings + folds)
    return carvings + folds + pockets


# ---------------------------------------------------------------------------------------- textured phantom
# The textured phantom stays inside this radius (mm), like the walnut: the real detector sees a cylinder of
# 18.3 mm radius at every angle, so no projection is truncated.
_TEXTURED_RADIUS = 17.5


def _overlap_1d(fine_edges: np.ndarray, coarse_edges: np.ndarray) -> np.ndarray:
    """``(n_coarse, n_fine)`` lengths of the overlap of every coarse cell with every fine cell, divided by the
    coarse cell's length: the exact area-averaging matrix of a piecewise-constant profile along one axis."""
    lo = np.maximum(coarse_edges[:-1, None], fine_edges[None, :-1])
    hi = np.minimum(coarse_edges[1:, None], fine_edges[None, 1:])
    return np.clip(hi - lo, 0.0, None) / np.diff(coarse_edges)[:, None]


class TexturedPhantom:
    """A z-invariant (prism) object whose cross-section is a piecewise-constant fine image (mm⁻¹).

    The attenuation at ``(x, y, z)`` is the value of the fine pixel containing ``(x, y)`` for every ``z`` (zero
    outside the image). Line integrals are those of this exact object: ASTRA's CPU ``line_fanflat`` kernel gives
    the intersection lengths of the ray's ``xy`` trace with the fine pixels, times ``|d|/|d_xy|`` for the slope of
    a ray that leaves the plane (a cone-beam row). The ground truth (:meth:`rasterize`) is the exact area average
    of the same fine image over each coarser pixel. The fine grid is several times finer than any reconstruction
    grid, and the projections are averaged over sub-rays by the simulator, so loaded data never share the
    discretisation of a reconstruction operator (no inverse crime) — unlike the ellipsoid walnut, whose line
    integrals are analytic, this phantom's texture has no closed form, hence the voxelised projection.

    Parameters
    ----------
    image : (n, n) array
        Fine image (mm⁻¹), ``[i, j]`` ↔ ``(y, x)`` with index increasing with the coordinate, centred at the origin.
    pixel_size : float
        Fine pixel edge (mm).
    description : dict, optional
        JSON-serialisable record of how the image was made (kind, seed, ...), kept in :meth:`to_dict`.
    """

    def __init__(self, image: np.ndarray, pixel_size: float, description: dict | None = None):
        img = np.asarray(image, dtype=np.float64)
        if img.ndim != 2 or img.shape[0] != img.shape[1] or img.shape[0] < 2:
            raise ValueError(f"TexturedPhantom: image must be a square (n, n) array with n ≥ 2, got {img.shape}")
        if not np.all(np.isfinite(img)) or img.min() < 0:
            raise ValueError("TexturedPhantom: image values must be finite and ≥ 0 (mm⁻¹)")
        if not (math.isfinite(pixel_size) and pixel_size > 0):
            raise ValueError(f"TexturedPhantom: pixel_size must be positive (mm), got {pixel_size}")
        self.image = img
        self.image.flags.writeable = False
        self.pixel_size = float(pixel_size)
        self.description = dict(description or {})
        self.half_width = img.shape[0] * self.pixel_size / 2.0

    def __repr__(self) -> str:
        return f"TexturedPhantom({self.image.shape[0]}² pixels of {self.pixel_size} mm)"

    def to_dict(self) -> dict:
        """JSON record for the simulation sidecar: how the image was made, its grid and a checksum of its values
        (the image itself is regenerated from ``kind``/``seed``/``pixel_size_mm`` with :func:`make_phantom`)."""
        return {
            **self.description,
            "pixel_size_mm": self.pixel_size,
            "shape": list(self.image.shape),
            "value_range": [float(self.image.min()), float(self.image.max())],
            "sha256": hashlib.sha256(np.ascontiguousarray(self.image).tobytes()).hexdigest(),
        }

    def bounding_box(self) -> np.ndarray:
        """``(3, 2)`` ``[min, max]`` per axis x, y, z (mm): the image's square, unbounded in z."""
        w = self.half_width
        return np.array([[-w, w], [-w, w], [-np.inf, np.inf]])

    def values(self, points: np.ndarray) -> np.ndarray:
        """Attenuation (mm⁻¹) at points ``(..., 3)`` (mm): shape ``(...)``, float64 (``z`` is ignored)."""
        pts = np.asarray(points, dtype=np.float64)
        if pts.shape[-1] != 3:
            raise ValueError(f"TexturedPhantom.values: points must have shape (..., 3), got {pts.shape}")
        n = self.image.shape[0]
        j = np.floor((pts[..., 0] + self.half_width) / self.pixel_size).astype(np.int64)
        i = np.floor((pts[..., 1] + self.half_width) / self.pixel_size).astype(np.int64)
        inside = (i >= 0) & (i < n) & (j >= 0) & (j < n)
        out = np.zeros(pts.shape[:-1])
        out[inside] = self.image[i[inside], j[inside]]
        return out

    def line_integrals(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Line integrals ``∫ μ dl`` (dimensionless) along the segments ``starts → ends`` (``(..., 3)`` mm each,
        broadcastable); both end points must lie outside the phantom's cylinder (as source and detector do).

        Rays are grouped into fans: consecutive rays (in C order) with one source whose end points are evenly
        spaced along a line (a detector row, with or without sub-pixel rays) become one ``fanflat_vec`` view, so a
        detector row costs one ASTRA view, not one per ray. Returns a float64 array of the broadcast shape.
        """
        p = np.asarray(starts, dtype=np.float64)
        q = np.asarray(ends, dtype=np.float64)
        if p.shape[-1] != 3 or q.shape[-1] != 3:
            raise ValueError(f"TexturedPhantom.line_integrals: starts {p.shape} and ends {q.shape} must end in 3")
        p, q = np.broadcast_arrays(p, q)
        shape = p.shape[:-1]
        p, q = p.reshape(-1, 3), q.reshape(-1, 3)
        d = q - p
        dxy = np.hypot(d[:, 0], d[:, 1])
        w = self.half_width * math.sqrt(2.0)
        if np.any(dxy <= 1e-9 * np.linalg.norm(d, axis=1)):
            raise ValueError("TexturedPhantom.line_integrals: a ray runs along z (no xy extent)")
        if np.any(np.hypot(p[:, 0], p[:, 1]) <= w) or np.any(np.hypot(q[:, 0], q[:, 1]) <= w):
            raise ValueError(
                f"TexturedPhantom.line_integrals: ray end points must lie outside the phantom's cylinder "
                f"(radius {w:.2f} mm about z)"
            )
        out = np.empty(p.shape[0])
        for lo, hi in _fan_groups(p, q):
            out[lo:hi] = self._fan(p[lo, :2], q[lo:hi, :2])
        out *= np.linalg.norm(d, axis=1) / dxy  # the xy integral of a z-invariant object, stretched by the slope
        return out.reshape(shape)

    def _fan(self, src: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Line integrals from one source ``(2,)`` to evenly spaced collinear points ``(m, 2)`` (mm): ``(m,)``."""
        m = ends.shape[0]
        if m > 1:
            u = (ends[-1] - ends[0]) / (m - 1)
        else:  # one ray: any short detector perpendicular to it
            r = ends[0] - src
            u = np.array([-r[1], r[0]]) / np.linalg.norm(r) * 1e-3
        centre = (ends[0] + ends[-1]) / 2.0
        return self._astra(np.concatenate([src, centre, u])[None, :], m)[0]

    def _astra(self, vectors: np.ndarray, n_det: int) -> np.ndarray:
        """ASTRA ``line_fanflat`` projection of the fine image for ``fanflat_vec`` rows ``(n_views, 6)``."""
        n, w = self.image.shape[0], self.half_width
        vol = astra.create_vol_geom(n, n, -w, w, -w, w)
        proj = astra.create_proj_geom("fanflat_vec", int(n_det), np.ascontiguousarray(vectors, dtype=np.float64))
        pid = astra.create_projector("line_fanflat", proj, vol)
        try:
            # ASTRA's row 0 is its minimum y: ctuq's [i, j] ↔ (y, x) with y increasing is the image flipped.
            sid, sino = astra.create_sino(np.flipud(self.image).astype(np.float32), pid)
            astra.data2d.delete(sid)
        finally:
            astra.projector.delete(pid)
        return np.asarray(sino, dtype=np.float64)

    def rasterize(
        self,
        volume,
        *,
        supersampling: int = 3,
        z: float | None = None,
        thickness: float | None = None,
        progress: bool = False,
    ) -> np.ndarray:
        """Exact pixel (voxel) averages (mm⁻¹) of the fine image on a :class:`~ctuq.geometry.VolumeGeometry`.

        Same signature as :meth:`EllipsoidPhantom.rasterize`; the averages are exact area overlaps (the object is
        piecewise constant), so ``supersampling``, ``thickness`` and ``progress`` have nothing to refine, and
        every slice of a 3D grid is the same (the object does not vary along ``z``). A 2D grid still needs ``z``,
        as for the ellipsoid phantom. Returns a float64 array of ``volume.shape``.
        """
        if int(supersampling) < 1:
            raise ValueError(f"rasterize: supersampling must be ≥ 1, got {supersampling}")
        if volume.ndim == 2 and z is None:
            raise ValueError("rasterize: a 2D grid needs the slice height z (mm)")
        if volume.ndim == 3 and (z is not None or thickness is not None):
            raise ValueError("rasterize: z/thickness apply to 2D grids only; a 3D grid gives every slice")
        h = volume.voxel_size
        n_y, n_x = volume.shape[-2:]
        n = self.image.shape[0]
        fine = (np.arange(n + 1) - n / 2.0) * self.pixel_size
        ay = _overlap_1d(fine, (np.arange(n_y + 1) - n_y / 2.0) * h)
        ax = _overlap_1d(fine, (np.arange(n_x + 1) - n_x / 2.0) * h)
        img = ay @ self.image @ ax.T
        if volume.ndim == 3:
            return np.broadcast_to(img, volume.shape).copy()
        return img


def _fan_groups(p: np.ndarray, q: np.ndarray, rtol: float = 1e-7) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of consecutive rays with the same start and evenly spaced collinear ``xy`` ends."""
    n = p.shape[0]
    if n == 1:
        return [(0, 1)]
    scale = max(float(np.abs(q[:, :2]).max()), 1.0) * rtol
    step = np.diff(q[:, :2], axis=0)  # (n−1, 2)
    same_src = np.all(np.abs(np.diff(p[:, :2], axis=0)) <= scale, axis=1)
    # ray i+1 continues the run of ray i when it has the same source and the same step as the previous pair
    cont = np.zeros(n, dtype=bool)
    cont[1] = same_src[0]
    cont[2:] = same_src[1:] & np.all(np.abs(step[1:] - step[:-1]) <= scale, axis=1)
    groups, lo = [], 0
    for i in np.nonzero(~cont[1:])[0] + 1:
        groups.append((lo, int(i)))
        lo = int(i)
    groups.append((lo, n))
    return groups


def _band_limited_field(rng: np.random.Generator, n: int, pixel_size: float, scale: float) -> np.ndarray:
    """A stationary Gaussian random field ``(n, n)`` with unit variance whose power lies in a band around the
    spatial frequency ``1/scale`` (cycles/mm; a Gaussian annulus of relative width ½): blobs ``scale`` mm apart."""
    k = np.fft.fftfreq(n, d=pixel_size)
    kr = np.hypot(k[:, None], k[None, :])
    k0 = 1.0 / scale
    amp = np.exp(-0.5 * ((kr - k0) / (0.5 * k0)) ** 2)
    amp[0, 0] = 0.0
    f = np.fft.ifft2(np.fft.fft2(rng.standard_normal((n, n))) * amp).real
    return f / max(float(f.std()), 1e-12)


def _superellipse(x, y, cx, cy, a, b, power, angle) -> np.ndarray:
    """Boolean mask of ``|x'/a|^p + |y'/b|^p ≤ 1`` in the frame centred at ``(cx, cy)`` and turned by ``angle``."""
    c, s = math.cos(angle), math.sin(angle)
    xr = (x - cx) * c + (y - cy) * s
    yr = -(x - cx) * s + (y - cy) * c
    return np.abs(xr / a) ** power + np.abs(yr / b) ** power <= 1.0


def textured_phantom(seed: int = 0, *, pixel_size: float = 0.1) -> TexturedPhantom:
    """A random, reproducible textured cross-section (mm⁻¹, values in [0, 0.058], the walnut phantom's range),
    as a z-invariant :class:`TexturedPhantom` within 17.5 mm of the rotation axis.

    Content, all seeded (``seed``), painted in order (later parts replace earlier ones):

    * a smooth body (a rotated superellipse, 22–33 mm across, exponent 2–3) of soft tissue ≈ 0.021 mm⁻¹ modulated
      by band-limited Gaussian random fields at three scales (≈ 3, 1 and 0.35 mm; ±8, ±5, ±4 %), inside a dense
      skin/cortex layer 0.8–1.5 mm thick (≈ 0.05) and a darker fat layer beneath it (≈ 0.014);
    * 3–5 organs (superellipses) of several contrasts — low (±5–20 % of the tissue) and high (0.03–0.045) — each
      with its own texture at a random scale;
    * a bone: a cortical shell (≈ 0.054) around trabecular structure, struts ≈ 0.2–0.4 mm wide where a
      band-pass field (scale ≈ 0.8 mm) crosses zero (≈ 0.045) over marrow (≈ 0.025);
    * air pockets (0) and small dense calcifications (≈ 0.05), 0.3–1 mm across.

    Parameters
    ----------
    seed : int
        Seeds every random choice.
    pixel_size : float
        Fine pixel edge (mm); several times smaller than the reconstruction pixels (the simulator uses
        ``min(0.1, ground-truth voxel / 4)``). The texture is drawn on this grid, so the phantom of one seed
        depends on it.
    """
    if not (math.isfinite(pixel_size) and 0 < pixel_size <= 0.5):
        raise ValueError(f"textured_phantom: pixel_size must lie in (0, 0.5] mm, got {pixel_size}")
    rng = np.random.default_rng([int(seed), 0x7E47])
    n = int(math.ceil(2 * (_TEXTURED_RADIUS + 0.5) / pixel_size))
    n += n % 2
    c = (np.arange(n) + 0.5 - n / 2.0) * pixel_size
    y, x = np.meshgrid(c, c, indexing="ij")

    def field(scale: float) -> np.ndarray:
        return _band_limited_field(rng, n, pixel_size, scale)

    outline, body = _body_outline(rng, x, y)
    cx, cy, a, b, power, angle = outline
    skin = rng.uniform(0.8, 1.5)
    fat = rng.uniform(0.8, 2.0)
    img, mu_soft = _paint_body(rng, x, y, outline, body, skin, fat, field)
    # Organs and the bone centres: inside the core, at distance from each other (rejection sampling).
    place = _placer(rng, outline, skin, fat)
    core_size = min(a, b) - skin - fat
    _paint_bone(rng, img, x, y, place, field, core_size)
    _paint_organs(rng, img, x, y, place, field, core_size, mu_soft)
    _paint_spots(rng, img, x, y, place)
    np.clip(img, 0.0, 0.058, out=img)
    return TexturedPhantom(
        img, pixel_size, {"kind": PhantomKind.TEXTURED.value, "seed": int(seed), "generator": "textured_phantom"}
    )


def _body_outline(rng, x: np.ndarray, y: np.ndarray) -> tuple[tuple, np.ndarray]:
    """The textured body's superellipse ``(cx, cy, a, b, power, angle)`` on the grid ``x``, ``y`` (mm), shrunk
    until it lies within :data:`_TEXTURED_RADIUS` (superellipse corners reach further than the semi-axes), and
    its mask."""
    r = np.hypot(x, y)
    a, b = rng.uniform(12.5, 16.5), rng.uniform(11.0, 15.0)
    power, angle = rng.uniform(2.0, 3.0), rng.uniform(0.0, math.pi)
    cx, cy = rng.uniform(-0.6, 0.6, size=2)
    for _ in range(50):
        body = _superellipse(x, y, cx, cy, a, b, power, angle)
        if r[body].max() <= _TEXTURED_RADIUS:
            break
        a, b = a * 0.97, b * 0.97
    return (cx, cy, a, b, power, angle), body


def _paint_body(rng, x, y, outline, body: np.ndarray, skin: float, fat: float, field) -> tuple[np.ndarray, float]:
    """The image with the body (mask ``body``) painted: a dense skin layer ``skin`` mm thick, a fat layer ``fat``
    mm beneath it, textured soft tissue in the core; and the soft tissue's attenuation (mm⁻¹)."""
    cx, cy, a, b, power, angle = outline
    inner = _superellipse(x, y, cx, cy, a - skin, b - skin, power, angle)
    core = _superellipse(x, y, cx, cy, a - skin - fat, b - skin - fat, power, angle)
    mu_soft = rng.uniform(0.018, 0.024)
    texture = 1.0 + 0.08 * field(3.0) + 0.05 * field(1.0) + 0.04 * field(0.35)
    img = np.zeros(x.shape)
    img[body] = rng.uniform(0.046, 0.052) * (1.0 + 0.03 * field(0.5))[body]
    img[inner] = (rng.uniform(0.012, 0.016) * texture)[inner]
    img[core] = (mu_soft * texture)[core]
    return img, mu_soft


def _placer(rng, outline, skin: float, fat: float):
    """``place(radius, tries=200)``: a centre ``(px, py)`` whose disc of ``radius`` lies inside the body's core
    and keeps 0.5 mm from every disc placed before (rejection sampling), or ``None``."""
    cx, cy, a, b, power, angle = outline
    placed: list[tuple[float, float, float]] = []

    def place(radius: float, tries: int = 200) -> tuple[float, float] | None:
        for _ in range(tries):
            px, py = cx + rng.uniform(-a, a), cy + rng.uniform(-b, b)
            ok = _superellipse(
                np.array(px), np.array(py), cx, cy, a - skin - fat - radius, b - skin - fat - radius, power, angle
            )
            if bool(ok) and all(math.hypot(px - qx, py - qy) > radius + qr + 0.5 for qx, qy, qr in placed):
                placed.append((px, py, radius))
                return px, py
        return None

    return place


def _paint_bone(rng, img: np.ndarray, x, y, place, field, core_size: float) -> None:
    """A bone where one fits: a cortical shell around trabecular struts (where a band-pass field crosses zero)
    over marrow."""
    bone_r = rng.uniform(0.18, 0.28) * core_size
    pos = place(bone_r)
    if pos is not None:
        ba, bb = bone_r, bone_r * rng.uniform(0.65, 1.0)
        bang, bpow = rng.uniform(0, math.pi), rng.uniform(2.0, 2.6)
        shell = _superellipse(x, y, *pos, ba, bb, bpow, bang)
        cortical = rng.uniform(0.5, 1.0)
        marrow = _superellipse(x, y, *pos, ba - cortical, bb - cortical, bpow, bang)
        img[shell] = rng.uniform(0.052, 0.056)
        trab = np.abs(field(0.8)) < rng.uniform(0.25, 0.35)  # thin network along the zero set
        img[marrow] = np.where(trab, rng.uniform(0.042, 0.048), rng.uniform(0.023, 0.028))[marrow]


def _paint_organs(rng, img: np.ndarray, x, y, place, field, core_size: float, mu_soft: float) -> None:
    """3–5 organs of low or high contrast against the soft tissue, each with its own texture."""
    for _ in range(int(rng.integers(3, 6))):
        radius = rng.uniform(0.12, 0.3) * core_size
        pos = place(radius)
        if pos is None:
            continue
        mask = _superellipse(
            x, y, *pos, radius, radius * rng.uniform(0.5, 1.0), rng.uniform(1.6, 3.5), rng.uniform(0, math.pi)
        )
        base = mu_soft * rng.uniform(0.8, 1.2) if rng.uniform() < 0.5 else rng.uniform(0.03, 0.045)
        tex = 1.0 + rng.uniform(0.03, 0.12) * field(rng.uniform(0.4, 2.5))
        img[mask] = (base * tex)[mask]


def _paint_spots(rng, img: np.ndarray, x, y, place) -> None:
    """6–13 air pockets and small dense calcifications, 0.3–1 mm across, anywhere in the core."""
    for _ in range(int(rng.integers(6, 14))):
        radius = rng.uniform(0.15, 0.5)
        pos = place(radius, tries=50)
        if pos is None:
            continue
        mask = _superellipse(x, y, *pos, radius, radius * rng.uniform(0.6, 1.0), 2.0, rng.uniform(0, math.pi))
        img[mask] = 0.0 if rng.uniform() < 0.4 else rng.uniform(0.048, 0.056)


def make_phantom(kind: str, seed: int = 0, *, voxel_size: float = 0.4) -> EllipsoidPhantom | TexturedPhantom:
    """The phantom ``kind`` (:class:`ctuq.options.PhantomKind`) of ``seed``: :func:`walnut_phantom` or
    :func:`textured_phantom` with fine pixels of ``min(0.1, voxel_size / 4)`` mm (``voxel_size``: the ground-truth
    voxel edge, mm). Raises ``ValueError`` naming the valid kinds for an unknown one."""
    kind = PhantomKind.parse(kind, "phantom")
    if kind == PhantomKind.WALNUT:
        return walnut_phantom(seed)
    return textured_phantom(seed, pixel_size=min(0.1, float(voxel_size) / 4.0))
