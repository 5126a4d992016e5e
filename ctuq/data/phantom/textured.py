"""The textured phantom: a z-invariant object whose cross-section is a piecewise-constant fine image with
band-limited texture, bone, organs and spots (:func:`textured_phantom`), for scans beyond ellipse phantoms."""

from __future__ import annotations

import hashlib
import math

import astra
import numpy as np

from ctuq.options import PhantomKind

__all__ = ["TexturedPhantom", "textured_phantom"]

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
