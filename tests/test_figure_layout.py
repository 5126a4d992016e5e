"""Every figure a run writes is readable without README: no text is clipped (every text artist's box lies inside
the figure), every colour bar and image axis carries its unit, the evaluation region is named, and the calibration
legend sits off the curves. The figures are drawn with the demo's kinds of content and label lengths."""

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from ctuq import figures

UNIT = figures.IMAGE_UNIT


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plotting functions save, drawn, in the order they were saved."""
    saved: list[Figure] = []
    original = figures.save_figure

    def keep(fig, path):
        saved.append(fig)
        return original(fig, path)

    monkeypatch.setattr(figures, "save_figure", keep)
    return saved


def _texts(fig: Figure) -> list[Text]:
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _renderer(fig: Figure):
    """Draw ``fig`` as the PNG writer does (Agg, constrained layout) and return its renderer."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _assert_nothing_clipped(fig: Figure) -> None:
    """Everything drawn (texts, colour bars, legends; ticks outside the axes' limits are not drawn and not counted)
    lies inside the figure, to a pixel."""
    renderer = _renderer(fig)
    drawn_box = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)  # inches → pixels
    box = fig.bbox
    if drawn_box.x0 < box.x0 - 1 or drawn_box.y0 < box.y0 - 1 or drawn_box.x1 > box.x1 + 1 or drawn_box.y1 > box.y1 + 1:
        outside = [
            t.get_text()
            for t in _texts(fig)
            if not box.expanded(1.0, 1.0).contains(*t.get_window_extent(renderer).p0)
            or not box.expanded(1.0, 1.0).contains(*t.get_window_extent(renderer).p1)
        ]
        raise AssertionError(f"drawn box {drawn_box.extents} exceeds the figure {box.extents}; texts: {outside}")


def _images(seed=0, n=64):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:n, :n]
    gt = 0.05 * (((yy - n / 2) ** 2 + (xx - n / 2) ** 2) < (n / 3) ** 2)
    rec = gt + 0.003 * rng.standard_normal((n, n))
    std = 0.002 + 0.004 * (gt > 0) + 0.0005 * rng.random((n, n))
    return gt, rec, std


@pytest.mark.slow
def test_image_figures_have_units_a_named_region_and_nothing_clipped(tmp_path, drawn):
    gt, rec, std = _images()
    roi = (slice(8, 56), slice(8, 56))
    figures.plot_reconstructions(
        tmp_path / "r.png", {"FBP": rec, "TV": rec, "DIP": rec}, ground_truth=gt, psnrs={"FBP": 25.4, "TV": 31.6}
    )
    figures.plot_uq_panels(
        tmp_path / "u.png",
        rec,
        np.abs(rec - gt),
        std,
        ground_truth=gt,
        roi=roi,
        titles=["ground truth", "DIP reconstruction", "|error|", "std.tif: sqrt(std² + τ² M), τ = 0.00214 mm⁻¹"],
    )
    figures.plot_uq_comparison(tmp_path / "c.png", {"linearised": (rec, None, std), "MC dropout": (rec, None, std)},
                               ground_truth=gt, roi=roi)  # fmt: skip
    vol = np.stack([gt] * 8)
    figures.plot_orthogonal_slices(tmp_path / "o.png", vol, None, np.stack([std] * 8), ground_truth=vol)
    for fig in drawn:
        _assert_nothing_clipped(fig)
        labels = [cb.ax.get_ylabel() for cb in _colorbars(fig)]
        assert labels and all(label == UNIT for label in labels), labels
    names = [t.get_text() for t in _texts(drawn[1])]
    assert figures.ROI_LABEL in names  # the dashed square is named
    assert figures.ROI_LABEL not in [t.get_text() for t in _texts(drawn[0])]  # no region, no legend


def _colorbars(fig: Figure):
    return [ax._colorbar for ax in fig.axes if getattr(ax, "_colorbar", None) is not None]


@pytest.mark.slow
def test_curve_figures_have_units_legends_off_the_curves_and_nothing_clipped(tmp_path, drawn):
    gt, rec, std = _images()
    levels = np.round(np.arange(0.05, 1.0, 0.05), 2)
    curves = {
        "linearised DIP, sqrt(std² + τ² M), τ = 0.00214 (held-out)": (levels, np.minimum(1, levels * 1.3)),
        "linearised DIP (uncalibrated)": (levels, np.minimum(1, levels * 1.1)),
        "std × 1.44 (held-out k, not applied)": (levels, np.minimum(1, levels * 1.5)),
    }
    figures.plot_calibration(tmp_path / "cal.png", curves)
    figures.plot_error_vs_std(tmp_path / "e.png", np.abs(rec - gt) + 1e-6, std)
    figures.plot_joint_ll(tmp_path / "j.png", {"linearised DIP": {str(p): 5.0 + 0.01 * p for p in range(1, 11)}})
    figures.plot_heldout_calibration(
        tmp_path / "h.png",
        levels,
        levels,
        np.linspace(-5, 5, 41),
        np.full(40, 0.1),
        recalibrated=(levels, levels, 1.44),
    )
    figures.plot_em_trace(tmp_path / "em.png", [{"a": 1.0, "gamma": 3.0, "w_norm2": 2.0, "sigma2": 0.1}] * 3)
    rmv = np.geomspace(1e-3, 4e-3, 10)
    figures.plot_reliability(
        tmp_path / "r.png",
        {"std.tif (sqrt(std² + τ² M), τ = 0.00214)": (rmv, rmv**0.7 * 0.02), "posterior (uncalibrated)": (rmv, rmv)},
        ence={"posterior (uncalibrated)": 0.0},
    )
    for fig in drawn:
        _assert_nothing_clipped(fig)
    cal_fig, err_fig = drawn[0], drawn[1]
    # the calibration legend is not inside the axes (it would cover the curves)
    (ax,) = [a for a in cal_fig.axes]
    assert ax.get_legend() is None and cal_fig.legends
    renderer = _renderer(cal_fig)
    assert cal_fig.legends[0].get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0 + 1
    axis_labels = [a.get_xlabel() for a in err_fig.axes] + [a.get_ylabel() for a in err_fig.axes]
    assert f"std ({UNIT})" in axis_labels and f"|error| ({UNIT})" in axis_labels
    rel_fig = drawn[-1]
    (ax,) = rel_fig.axes
    assert ax.get_legend() is None and rel_fig.legends and f"RMSE ({UNIT})" == ax.get_ylabel()
    assert "posterior (uncalibrated) (ENCE 0.00)" in [t.get_text() for t in rel_fig.legends[0].get_texts()]
