"""Ellipsoid phantom: exact chord lengths, pixel-averaged rasterisation, the synthetic walnut."""

import math

import numpy as np
import pytest

from ctuq.data.phantom import Ellipsoid, EllipsoidPhantom, rotation_from_euler, walnut_phantom
from ctuq.geometry import VolumeGeometry


def test_sphere_chords_are_exact_for_lines_half_lines_and_segments():
    ph = EllipsoidPhantom([Ellipsoid((1.0, 2.0, 3.0), (5.0, 5.0, 5.0), 0.5)])
    dist = np.array([0.0, 1.0, 3.0, 4.9, 5.0, 7.0])
    starts = np.stack([np.full_like(dist, -100.0), 2.0 + dist, np.full_like(dist, 3.0)], axis=1)
    ends = starts + np.array([200.0, 0.0, 0.0])
    expected = 0.5 * 2 * np.sqrt(np.clip(25.0 - dist**2, 0, None))
    np.testing.assert_allclose(ph.line_integrals(starts, ends), expected, rtol=1e-12, atol=1e-12)
    # half-lines: the same with unnormalised directions; a start inside the sphere counts only the forward part
    np.testing.assert_allclose(ph.line_integrals(starts, directions=3.0 * (ends - starts)), expected, atol=1e-12)
    inside = ph.line_integrals(np.array([1.0, 2.0, 3.0]), directions=np.array([0.0, 0.0, -2.0]))
    assert inside == pytest.approx(0.5 * 5.0, abs=1e-12)
    # segments stop at their end point; pointing away from the sphere sees nothing
    seg = ph.line_integrals(np.array([[-100.0, 2.0, 3.0]]), np.array([[1.0, 2.0, 3.0]]))
    assert seg[0] == pytest.approx(0.5 * 5.0, abs=1e-12)
    away = ph.line_integrals(np.array([-100.0, 2.0, 3.0]), directions=np.array([-1.0, 0.0, 0.0]))
    assert away == 0.0


def test_rotated_ellipsoid_chord_along_each_principal_axis():
    rot = rotation_from_euler(0.3, -0.7, 1.1)
    axes = np.array([6.0, 3.0, 1.5])
    c = np.array([0.5, -1.0, 2.0])
    ph = EllipsoidPhantom([Ellipsoid(c, axes, 1.0, rot)])
    for i in range(3):
        direction = rot[:, i]
        got = ph.line_integrals(c - 50 * direction, c + 50 * direction)
        assert got == pytest.approx(2 * axes[i], rel=1e-12)


def test_walnut_line_integrals_match_brute_force_integration():
    ph = walnut_phantom(0)
    rng = np.random.default_rng(1)
    box = ph.bounding_box()
    n_samples = 100_000
    for _ in range(5):
        # rays from a source 66 mm out through random points of the nut, 132 mm long
        theta = rng.uniform(0, 2 * np.pi)
        start = np.array([66 * np.cos(theta), 66 * np.sin(theta), rng.uniform(-3, 3)])
        target = rng.uniform(-8, 8, size=3)
        end = start + 2 * (target - start)
        exact = ph.line_integrals(start, end)
        # integrate numerically over the part of the segment inside the bounding box (slab clipping)
        d = end - start
        with np.errstate(divide="ignore"):
            t_lo, t_hi = (box[:, 0] - start) / d, (box[:, 1] - start) / d
        t0, t1 = max(0.0, np.minimum(t_lo, t_hi).max()), min(1.0, np.maximum(t_lo, t_hi).min())
        t = t0 + (np.arange(n_samples) + 0.5) / n_samples * (t1 - t0)
        length = (t1 - t0) * np.linalg.norm(d)
        brute = ph.values(start + t[:, None] * d).sum() * length / n_samples
        # Midpoint rule on a piecewise-constant integrand: each ellipsoid boundary (≤ 2 per ellipsoid) costs at
        # most one step × |value|; here ≈ 2e-3 against line integrals of 0.2–2.
        bound = 2 * np.abs([e.value for e in ph.ellipsoids]).sum() * length / n_samples
        assert exact > 0.2  # the ray really crosses the nut
        assert abs(exact - brute) <= bound, (exact, brute, bound)


def test_shared_start_fast_path_equals_general_path():
    ph = walnut_phantom(0)
    rng = np.random.default_rng(2)
    src = np.array([40.0, -52.0, 1.5])
    ends = rng.uniform(-30, 30, size=(500, 3)) - src
    shared = ph.line_integrals(src, ends)  # one start point: fast path
    general = ph.line_integrals(np.repeat(src[None], 500, axis=0), ends)  # per-ray starts: general path
    np.testing.assert_allclose(shared, general, rtol=1e-11, atol=1e-12)
    assert (shared > 0).mean() > 0.3


def test_rasterised_mean_matches_analytic_volume_and_area():
    e = Ellipsoid((0.3, -0.4, 0.2), (6.0, 4.0, 3.0), 0.05, rotation_from_euler(0.4, 0.3, -0.2))
    ph = EllipsoidPhantom([e])
    vol = VolumeGeometry((20, 32, 32), 0.5)  # 16 × 16 × 10 mm box around the ellipsoid
    img = ph.rasterize(vol, supersampling=3)
    mass = img.sum() * 0.5**3
    # Supersampled voxel averages: the volume error is a boundary effect of (h/s)-sized cells, well below 1 %.
    assert mass == pytest.approx(e.value * e.volume, rel=5e-3)
    assert img.min() >= 0 and img.max() == pytest.approx(0.05)
    # 2D: axis-aligned ellipsoid cut at height z is an ellipse of area π a b (1 − z²/c²)
    e2 = Ellipsoid((0.0, 0.0, 0.0), (8.0, 5.0, 4.0), 1.0)
    grid = VolumeGeometry((64, 64), 0.3)
    z = 1.5
    area = EllipsoidPhantom([e2]).rasterize(grid, z=z, supersampling=4).sum() * 0.3**2
    assert area == pytest.approx(math.pi * 8 * 5 * (1 - z**2 / 16), rel=5e-3)


def test_rasterisation_follows_ctuq_index_convention():
    # A small ball at (x, y, z) = (+6, −4, +2) must land at [k, i, j] with index increasing with coordinate.
    ph = EllipsoidPhantom([Ellipsoid((6.0, -4.0, 2.0), (1.0, 1.0, 1.0), 1.0)])
    vol = VolumeGeometry((20, 20, 20), 1.0)
    img = ph.rasterize(vol, supersampling=2)
    k, i, j = np.unravel_index(np.argmax(img), img.shape)
    zc, yc, xc = vol.pixel_centers()
    assert abs(xc[j] - 6.0) <= 0.5 and abs(yc[i] + 4.0) <= 0.5 and abs(zc[k] - 2.0) <= 0.5
    # the 2D slice at that height is slice k of the volume up to the in-plane vs in-voxel averaging
    sl = ph.rasterize(VolumeGeometry((20, 20), 1.0), z=zc[k], thickness=1.0, supersampling=2)
    np.testing.assert_allclose(sl, img[k], atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_walnut_is_never_negative_and_walnut_sized(seed):
    ph = walnut_phantom(seed)
    # Dense point samples over the bounding box (seeded): additive carvings must never go below zero, and no
    # two positive parts overlap, so nothing exceeds the largest single value.
    rng = np.random.default_rng(seed)
    box = ph.bounding_box()
    pts = box[:, 0] + rng.random((200_000, 3)) * (box[:, 1] - box[:, 0])
    vals = ph.values(pts)
    max_single = max(e.value for e in ph.ellipsoids)
    assert vals.min() >= 0.0
    assert vals.max() <= max_single + 1e-12
    # a slice through the middle at 0.1 mm (point values) as well
    sl = ph.rasterize(VolumeGeometry((500, 500), 0.1), z=float(ph.ellipsoids[0].center[2]), supersampling=1)
    assert sl.min() >= 0.0 and sl.max() <= max_single + 1e-12
    # walnut-sized, inside the 50 mm field of view, values for the DIP's ×14 scale in [0, 1]
    extent = box[:, 1] - box[:, 0]
    assert 27 <= extent[:2].min() and extent.max() <= 40
    assert np.all(np.abs(box) < 24.5)
    # the real detector sees a cylinder of radius 18.3 mm about the axis at every angle: never truncated
    shell = ph.ellipsoids[0].surface_points(20_000)
    assert np.hypot(shell[:, 0], shell[:, 1]).max() < 18.0
    assert 0.03 <= min(e.value for e in ph.ellipsoids if e.value > 0) and 14 * max_single <= 1.0
    names = {e.name for e in ph.ellipsoids}
    assert {"shell", "cavity", "septum", "kernel", "crease", "fold", "pocket", "pore"} <= names
    # the nut has air inside and material in it
    assert (vals == 0).mean() > 0.2 and (vals > 0).mean() > 0.2


def test_walnut_mass_is_the_sum_of_its_ellipsoids():
    ph = walnut_phantom(0)
    img = ph.rasterize(VolumeGeometry((50, 50, 50), 0.8), supersampling=3)
    analytic = sum(e.value * e.volume for e in ph.ellipsoids)
    # Thin folds and pores (0.3 mm against 0.27 mm sample spacing) make this coarser than a single ellipsoid.
    assert img.sum() * 0.8**3 == pytest.approx(analytic, rel=2e-2)


def test_walnut_is_seeded():
    a, b, c = walnut_phantom(0), walnut_phantom(0), walnut_phantom(1)
    assert a.to_dict() == b.to_dict()
    assert a.to_dict() != c.to_dict()
    starts = np.array([[-60.0, 1.0, 0.5], [0.3, -60.0, -1.0]])
    ends = -starts
    np.testing.assert_array_equal(a.line_integrals(starts, ends), b.line_integrals(starts, ends))
    # the dict round trip (sidecar) reproduces the phantom exactly
    d = EllipsoidPhantom.from_dict(a.to_dict())
    np.testing.assert_array_equal(d.line_integrals(starts, ends), a.line_integrals(starts, ends))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="semi_axes must be positive"):
        Ellipsoid((0, 0, 0), (1.0, -1.0, 1.0), 0.1)
    with pytest.raises(ValueError, match="rotation matrix"):
        Ellipsoid((0, 0, 0), (1.0, 1.0, 1.0), 0.1, rotation=np.diag([1.0, 1.0, -1.0]))
    ph = EllipsoidPhantom([Ellipsoid((0, 0, 0), (1.0, 1.0, 1.0), 0.1)])
    with pytest.raises(ValueError, match="exactly one of ends= or directions="):
        ph.line_integrals(np.zeros(3))
    with pytest.raises(ValueError, match="length-3 axis"):
        ph.line_integrals(np.zeros((4, 2)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="needs the slice height z"):
        ph.rasterize(VolumeGeometry((4, 4), 1.0))
