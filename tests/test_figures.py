"""Figures (ctuq.figures): PNGs of the promised pixel size, shared colour scales, atomic writes, clear errors."""

import os

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch

from ctuq import figures as F
from ctuq import metrics as M

DPI = 40


def _maps(n=32, seed=0, depth=None):
    g = torch.Generator().manual_seed(seed)
    shape = (n, n) if depth is None else (depth, n, n)
    gt = torch.rand(shape, generator=g)
    rec = gt + 0.05 * torch.randn(shape, generator=g)
    std = 0.03 + 0.02 * torch.rand(shape, generator=g)
    return rec, (rec - gt).abs(), std, gt


def _png_shape(path):
    assert path.is_file() and path.stat().st_size > 0
    return mpimg.imread(path).shape[:2]


@pytest.fixture
def captured(monkeypatch):
    """The Figure objects the plotting functions save (to inspect colour limits)."""
    figs = []
    save = F.save_figure

    def spy(fig, path):
        figs.append(fig)
        return save(fig, path)

    monkeypatch.setattr(F, "save_figure", spy)
    return figs


def test_uq_panels_png_size_and_shared_error_std_scale(tmp_path, captured):
    rec, err, std, gt = _maps()
    std[0, 0] = 10.0  # one hot pixel must not dictate the scale (99.9th percentile), but both maps share it
    out = F.plot_uq_panels(tmp_path / "uq.png", rec, err, std, gt, roi="inner_square", dpi=DPI, figsize=(8, 2))
    assert out == tmp_path / "uq.png"
    assert _png_shape(out) == (2 * DPI, 8 * DPI)
    axes = [ax for ax in captured[0].axes if ax.get_images()]
    assert [ax.get_title() for ax in axes] == ["ground truth", "reconstruction", "|error|", "std"]
    clim_err, clim_std = (ax.get_images()[0].get_clim() for ax in axes[2:])
    assert clim_err == clim_std and clim_err[0] == 0.0 and clim_err[1] < 10.0
    assert len(axes[3].patches) == 1  # the ROI rectangle
    # default size: 3 panels × 3.2 in by 3.3 in (the region's legend under them)
    assert _png_shape(F.plot_uq_panels(tmp_path / "d.png", rec, err, std, dpi=DPI)) == (
        round(3.3 * DPI),
        round(9.6 * DPI),
    )


def test_uq_panels_of_a_volume_show_the_central_slice_and_compute_the_error(tmp_path, captured):
    rec, _, std, gt = _maps(depth=5)
    F.plot_uq_panels(tmp_path / "v.png", rec, None, std, gt, titles=["a", "b", "c", "d"], dpi=DPI)
    image_axes = [ax for ax in captured[0].axes if ax.get_images()]
    assert [ax.get_title() for ax in image_axes] == ["a", "b", "c", "d"]
    err_img = image_axes[2].get_images()[0].get_array()
    np.testing.assert_allclose(np.asarray(err_img), (rec[2] - gt[2]).abs().numpy(), rtol=1e-6)


def test_uq_comparison_has_one_row_per_method_on_common_scales(tmp_path, captured):
    a, b = _maps(seed=1), _maps(seed=2)
    methods = {"linearised": a[:3], "exact": a[:3], "MC dropout": (b[0], b[1], 3 * b[2])}
    out = F.plot_uq_comparison(tmp_path / "cmp.png", methods, roi=(slice(4, 28), slice(4, 28)), dpi=DPI, figsize=(6, 6))
    assert _png_shape(out) == (6 * DPI, 6 * DPI)
    image_axes = [ax for ax in captured[0].axes if ax.get_images()]
    assert len(image_axes) == 9
    assert [image_axes[3 * i].get_ylabel() for i in range(3)] == list(methods)
    clims = {ax.get_images()[0].get_clim() for i, ax in enumerate(image_axes) if i % 3}
    assert len(clims) == 1  # every |error| and std panel of every method on one scale


@pytest.mark.slow
def test_calibration_joint_ll_error_vs_std_and_em_trace_write_pngs(tmp_path):
    rec, err, std, gt = _maps()
    lv, cov = M.coverage(gt, rec, std)
    assert _png_shape(
        F.plot_calibration(
            tmp_path / "cal.png", {"a": (lv, cov), "b": (torch.tensor(lv), cov**2)}, dpi=DPI, figsize=(4, 4)
        )
    ) == (4 * DPI, 4 * DPI)
    rmv = np.geomspace(1e-3, 3e-3, 10)
    assert _png_shape(
        F.plot_reliability(tmp_path / "rel.png", {"a": (rmv, rmv), "b": (rmv, 2 * rmv)}, dpi=DPI, figsize=(4, 4))
    ) == (4 * DPI, 4 * DPI)
    curves = {"a": {str(p): -1.0 - 0.1 * p for p in range(1, 11)}, "b": {1: -2.0, 2: None, 3: -2.5}}
    assert _png_shape(F.plot_joint_ll(tmp_path / "jll.png", curves, dpi=DPI, figsize=(5, 3))) == (3 * DPI, 5 * DPI)
    assert _png_shape(F.plot_error_vs_std(tmp_path / "h1.png", err, std, "inner_square", dpi=DPI, figsize=(4, 3))) == (
        3 * DPI,
        4 * DPI,
    )
    assert _png_shape(
        F.plot_error_vs_std(tmp_path / "h2.png", {"a": (err, std), "b": (err, 2 * std)}, bins=20, log=False, dpi=DPI)
    ) == (round(3.8 * DPI), round(8.4 * DPI))
    trace = [
        {"a": 1e-2 * 3**i, "gamma": 100.0 + i, "w_norm2": torch.tensor(5.0 - i), "log_evidence": None} for i in range(4)
    ]
    trace[1]["log_evidence"] = -100.0
    # a, γ̂, ‖w*‖², log evidence (σ² never recorded → no panel): 4 panels × 3.2 in
    assert _png_shape(F.plot_em_trace(tmp_path / "em.png", trace, dpi=DPI)) == (3 * DPI, round(12.8 * DPI))
    assert _png_shape(F.plot_em_trace(tmp_path / "em2.png", [{"a": 1.0}], dpi=DPI)) == (3 * DPI, round(9.6 * DPI))


def test_a_failing_plot_leaves_no_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    rec, err, std, _ = _maps()
    target = tmp_path / "uq.png"
    target.write_bytes(b"old figure")

    def broken_savefig(self, fname, **kw):
        with open(fname, "wb") as fh:
            fh.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="disk full"):
        F.plot_uq_panels(target, rec, err, std, dpi=DPI)
    with pytest.raises(OSError, match="disk full"):
        F.plot_em_trace(tmp_path / "new.png", [{"a": 1.0}], dpi=DPI)
    assert target.read_bytes() == b"old figure"
    assert sorted(os.listdir(tmp_path)) == ["uq.png"]


def test_bad_input_raises_clear_errors(tmp_path):
    rec, err, std, gt = _maps()
    with pytest.raises(ValueError, match=r"images must share one shape"):
        F.plot_uq_panels(tmp_path / "x.png", rec, err[:, :10], std)
    with pytest.raises(ValueError, match="abs_error is None and no ground_truth"):
        F.plot_uq_panels(tmp_path / "x.png", rec, None, std)
    with pytest.raises(ValueError, match=r"must end in \.png"):
        F.plot_uq_panels(tmp_path / "x.pdf", rec, err, std)
    with pytest.raises(ValueError, match="4 panels need 4 titles"):
        F.plot_uq_panels(tmp_path / "x.png", rec, err, std, gt, titles=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"methods\['m'\] must be \(reconstruction, abs_error, std\)"):
        F.plot_uq_comparison(tmp_path / "x.png", {"m": (rec, err)})
    with pytest.raises(ValueError, match=r"curves\['r'\] RMV and RMSE must be finite and > 0"):
        F.plot_reliability(tmp_path / "x.png", {"r": ([1e-3, 2e-3], [1e-3, 0.0])})
    with pytest.raises(ValueError, match=r"curves\['r'\] has 2 RMV values but 1 RMSE values"):
        F.plot_reliability(tmp_path / "x.png", {"r": ([1e-3, 2e-3], [1e-3])})
    with pytest.raises(ValueError, match=r"curves\['c'\] has 3 levels but 2 coverage values"):
        F.plot_calibration(tmp_path / "x.png", {"c": ([0, 0.5, 1], [0, 1])})
    with pytest.raises(ValueError, match="give std inside the dict"):
        F.plot_error_vs_std(tmp_path / "x.png", {"a": (err, std)}, std)
    with pytest.raises(ValueError, match=r"trace\[1\]\['a'\] = -1.0 must be finite and > 0"):
        F.plot_em_trace(tmp_path / "x.png", [{"a": 1.0}, {"a": -1.0}])
    with pytest.raises(TypeError, match=r"trace\[0\] must be a dict"):
        F.plot_em_trace(tmp_path / "x.png", [3.0])
    with pytest.raises(ValueError, match="non-empty list"):
        F.plot_em_trace(tmp_path / "x.png", [])
    assert not any(tmp_path.iterdir())
