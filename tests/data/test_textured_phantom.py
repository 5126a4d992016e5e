"""The textured phantom (``ctuq simulate --phantom textured``): reproducibility, value range, its line integrals
against an analytic object, exact ground-truth averages, a simulated scan that the walnut loader reads, and the
one-line error for an unknown ``--phantom``."""

import json

import numpy as np
import pytest

from ctuq.cli import main
from ctuq.data import WalnutScan, read_slice
from ctuq.data.phantom import (
    Ellipsoid,
    EllipsoidPhantom,
    TexturedPhantom,
    make_phantom,
    textured_phantom,
    walnut_phantom,
)
from ctuq.data.simulate import SimulationParameters, simulate_scan
from ctuq.geometry import VolumeGeometry


def test_seeded_reproducible_and_different_per_seed():
    a, b, c = textured_phantom(4), textured_phantom(4), textured_phantom(5)
    np.testing.assert_array_equal(a.image, b.image)
    assert a.to_dict() == b.to_dict() and a.to_dict()["sha256"] != c.to_dict()["sha256"]
    assert np.mean(a.image != c.image) > 0.2


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_values_in_the_walnut_range_with_texture_at_several_scales(seed):
    p = textured_phantom(seed)
    assert p.image.min() == 0.0 and 0.045 < p.image.max() <= 0.058  # mm⁻¹, the walnut phantom's range
    yy, xx = np.indices(p.image.shape)
    r = np.hypot(xx + 0.5 - p.image.shape[1] / 2, yy + 0.5 - p.image.shape[0] / 2) * p.pixel_size
    assert np.all(p.image[r > 17.5 + p.pixel_size] == 0)  # inside the detector's field of view
    inside = p.image[(p.image > 0.01) & (p.image < 0.03)]  # soft tissue
    assert inside.size > 10_000 and inside.std() / inside.mean() > 0.04  # textured, not piecewise flat
    # fine-scale texture: neighbouring-pixel differences inside the tissue are not all zero
    d = np.abs(np.diff(p.image, axis=1))[(p.image[:, 1:] > 0.01) & (p.image[:, 1:] < 0.03)]
    assert np.median(d) > 1e-5


def test_line_integrals_match_an_analytic_ellipse():
    """A fine rasterised ellipse (0.1 mm pixels) projected through the textured phantom's path against the
    analytic chord lengths: agreement to the pixel-edge discretisation (tolerance 0.03 of a 0.4 max, and a mean
    error below 1 %), for cone-beam rays that leave the plane (the |d|/|d_xy| stretch)."""
    e = EllipsoidPhantom([Ellipsoid((6.0, -3.0, 0.0), (4.0, 2.0, 1e4), 0.05)])
    h, n = 0.1, 360
    tp = TexturedPhantom(e.rasterize(VolumeGeometry((n, n), h), z=0.0, supersampling=4), h)
    rng = np.random.default_rng(0)
    th = rng.uniform(0, 2 * np.pi, (20, 1))
    off = np.linspace(-15, 15, 48)[None, :]
    src = np.stack([66 * np.sin(th), -66 * np.cos(th), np.zeros_like(th)], -1)
    det = np.stack(
        [-133 * np.sin(th) + off * np.cos(th), 133 * np.cos(th) + off * np.sin(th), 0 * th + 0 * off + 6], -1
    )
    got = tp.line_integrals(src, det)
    want = e.line_integrals(src, det)
    assert got.shape == (20, 48)
    assert np.abs(got - want).max() < 0.03 and np.abs(got - want).mean() < 0.01 * want.max()
    # single rays (no fan structure) take the one-ray path and give the same numbers
    np.testing.assert_allclose(tp.line_integrals(src[3, 0], det[3, 5]), got[3, 5], rtol=1e-5)


def test_line_integrals_refuse_rays_that_start_inside():
    p = textured_phantom(0)
    with pytest.raises(ValueError, match="outside the phantom's cylinder"):
        p.line_integrals(np.zeros(3), np.array([100.0, 0.0, 0.0]))


def test_ground_truth_is_the_exact_area_average():
    p = textured_phantom(1)
    fine = p.image.shape[0]
    coarse = p.rasterize(VolumeGeometry((fine // 4, fine // 4), 4 * p.pixel_size), z=0.0)
    np.testing.assert_allclose(coarse, p.image.reshape(fine // 4, 4, fine // 4, 4).mean(axis=(1, 3)), atol=1e-15)
    big = p.rasterize(VolumeGeometry((128, 128), 0.4), z=0.0)
    # the same attenuation mass (mm⁻¹ · mm²) on both grids
    assert abs(big.sum() * 0.4**2 - p.image.sum() * p.pixel_size**2) < 1e-9 * p.image.sum()


def test_make_phantom_kinds_and_a_bad_kind():
    assert isinstance(make_phantom("walnut", 2), EllipsoidPhantom)
    assert make_phantom("walnut", 2).to_dict() == walnut_phantom(2).to_dict()
    t = make_phantom("textured", 2, voxel_size=0.2)
    assert isinstance(t, TexturedPhantom) and t.pixel_size == 0.05
    with pytest.raises(ValueError, match="phantom must be one of"):
        make_phantom("cow", 0)


@pytest.fixture(scope="module")
def textured_scan(tmp_path_factory):
    out = tmp_path_factory.mktemp("tex") / "Walnut1"
    params = SimulationParameters.preset("tiny", seed=3)
    sidecar = simulate_scan(out, params, phantom="textured", preset="tiny", progress=False)
    return out, params, sidecar


def test_loader_reads_the_textured_scan(textured_scan):
    out, params, sidecar = textured_scan
    assert sidecar["phantom"]["kind"] == "textured" and sidecar["phantom"]["seed"] == 3
    assert json.loads((out / "ctuq_simulation.json").read_text())["complete"] is True
    d = read_slice(WalnutScan(out), angular_subsampling=1, detector_subsampling=1, progress=False)
    gt = d.ground_truth.numpy()
    want = make_phantom("textured", 3, voxel_size=params.gt_voxel_size).rasterize(
        VolumeGeometry((128, 128), params.gt_voxel_size), z=0.0
    )
    np.testing.assert_allclose(gt, want, atol=1e-7)  # float32 ground truth
    y = d.y.numpy()
    assert y.shape[0] == params.n_projections - 1 and np.all(np.isfinite(y))
    # the measured line integrals are those of the phantom: about 0.05 mm⁻¹ × 30 mm through the middle
    assert 0.5 < y.max() < 2.5 and y.min() > -0.1


def test_cli_phantom_textured_and_a_bad_value(tmp_path, capsys):
    assert (
        main(
            [
                "simulate",
                "--preset",
                "tiny",
                "--phantom",
                "textured",
                "--projections",
                "5",
                "--no-progress",
                "--out",
                str(tmp_path / "t"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "t" / "ctuq_simulation.json").read_text())["phantom"]["kind"] == "textured"
    capsys.readouterr()
    assert main(["simulate", "--phantom", "cow", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ctuq simulate: --phantom 'cow': unknown phantom; valid: walnut, textured, laminate"
    assert not (tmp_path / "c").exists()
