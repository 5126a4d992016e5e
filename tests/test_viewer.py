"""ctuq.viewer and ``ctuq view``: the layers of a run folder (names, physical scale, colormaps, contrast limits) built
without napari, added to napari's headless ViewerModel when napari is installed, and the command's one-line errors
(no run folder, damaged images, napari or its Qt binding missing)."""

import json
import sys
import types

import numpy as np
import pytest

from ctuq.cli import main
from ctuq.outputs import write_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.viewer import INSTALL_HINT, ViewerError, add_layers, layer_specs


def _run_folder(path, shape=(6, 8), voxel=0.5, std=True, gt=True):
    """A run folder with the images ``ctuq view`` reads; returns them (reconstruction, std, ground truth)."""
    rng = np.random.default_rng(0)
    rec = rng.uniform(0.0, 0.05, shape).astype(np.float32)
    images = {rf.RECONSTRUCTION_NAME: rec}
    if std:
        images[rf.STD_NAME] = rng.uniform(0.0, 0.01, shape).astype(np.float32)
    if gt:
        images[rf.GROUND_TRUTH_NAME] = rng.uniform(0.0, 0.06, shape).astype(np.float32)
    for name, image in images.items():
        write_tiff(path / name, image, voxel_size=voxel)
    return images


@pytest.mark.parametrize("shape", [(6, 8), (3, 6, 8)])
def test_layer_specs_of_a_run(tmp_path, shape):
    images = _run_folder(tmp_path, shape)
    specs = layer_specs(tmp_path)
    assert [s.name for s in specs] == ["ground truth", "reconstruction", "error", "std"]
    by = {s.name: s for s in specs}
    rec, std, gt = images[rf.RECONSTRUCTION_NAME], images[rf.STD_NAME], images[rf.GROUND_TRUTH_NAME]
    assert np.array_equal(by["reconstruction"].data, rec) and np.array_equal(by["ground truth"].data, gt)
    assert np.array_equal(by["std"].data, std) and np.array_equal(by["error"].data, np.abs(rec - gt))
    for s in specs:
        assert s.scale == pytest.approx((0.5,) * len(shape)) and s.units == "mm"
        assert s.axis_labels == ("z", "y", "x")[-len(shape) :]
    assert by["reconstruction"].colormap == by["ground truth"].colormap == "gray"
    assert by["std"].colormap == by["error"].colormap == "magma"  # one colour, one value in mm⁻¹ in both
    assert by["reconstruction"].contrast_limits == by["ground truth"].contrast_limits == (gt.min(), gt.max())
    top = np.percentile(np.concatenate([std.ravel(), np.abs(rec - gt).ravel()]), 99.5)
    assert by["std"].contrast_limits == by["error"].contrast_limits == pytest.approx((0.0, top))


def test_only_the_images_present_and_the_voxel_size_fallbacks(tmp_path, capsys):
    images = _run_folder(tmp_path, voxel=None, std=False, gt=False)
    (tmp_path / rf.METRICS_NAME).write_text(json.dumps({"data": {"voxel_size_mm": 1.6}}))
    (spec,) = layer_specs(tmp_path)  # no std, no ground truth: the reconstruction alone, its own value range
    rec = images[rf.RECONSTRUCTION_NAME]
    assert spec.name == "reconstruction" and spec.contrast_limits == (rec.min(), rec.max())
    assert spec.scale == (1.6, 1.6) and spec.units == "mm"  # from metrics.json (TIFFs without metadata)
    (tmp_path / rf.METRICS_NAME).unlink()
    (spec,) = layer_specs(tmp_path)
    assert spec.scale == (1.0, 1.0) and spec.units == "pixel"
    write_tiff(tmp_path / rf.RECONSTRUCTION_NAME, np.full((4, 4), 0.02, np.float32))  # constant: a range of 1
    assert layer_specs(tmp_path)[0].contrast_limits == (pytest.approx(0.02), pytest.approx(1.02))


def test_bad_run_folders_are_one_line_errors(tmp_path, capsys):
    def one_line(folder):
        assert main(["view", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("ctuq view: ") and "Traceback" not in err
        return err

    assert one_line(tmp_path / "none") == f"ctuq view: RUN {tmp_path / 'none'}: no such folder\n"
    assert "reconstruction.tif: does not exist" in one_line(tmp_path)
    _run_folder(tmp_path)
    (tmp_path / rf.STD_NAME).write_bytes(b"not a tiff")
    assert f"{tmp_path / rf.STD_NAME}: not a readable TIFF" in one_line(tmp_path)
    write_tiff(tmp_path / rf.STD_NAME, np.zeros((5, 5), np.float32))
    assert "std.tif: shape (5, 5) differs from reconstruction.tif's (6, 8)" in one_line(tmp_path)
    with pytest.raises(ViewerError, match="expected"):
        write_tiff(tmp_path / rf.RECONSTRUCTION_NAME, np.zeros((2, 2, 2, 2), np.float32))
        layer_specs(tmp_path)


class _FakeViewer:
    """What add_layers uses of a napari ViewerModel: add_image, canvas.grid, canvas.overlays.scale_bar."""

    def __init__(self, title=""):
        self.title, self.added = title, []
        self.canvas = types.SimpleNamespace(
            grid=types.SimpleNamespace(enabled=False),
            overlays=types.SimpleNamespace(scale_bar=types.SimpleNamespace(visible=False)),
        )

    def add_image(self, data, **kw):
        self.added.append((data, kw))
        return kw["name"]


def test_view_command_adds_the_layers_to_napari_s_window(tmp_path, monkeypatch):
    _run_folder(tmp_path)
    opened = []

    def viewer(title):
        opened.append(_FakeViewer(title))
        return opened[-1]

    fake = types.SimpleNamespace(Viewer=viewer, run=lambda: opened.append("event loop"))
    monkeypatch.setitem(sys.modules, "napari", fake)
    assert main(["view", str(tmp_path)]) == 0
    window, loop = opened
    assert loop == "event loop" and window.title == f"ctuq view {tmp_path}"
    assert [kw["name"] for _, kw in window.added] == ["ground truth", "reconstruction", "error", "std"]
    assert all(kw["scale"] == (0.5, 0.5) and kw["units"] == ("mm", "mm") for _, kw in window.added)
    assert window.canvas.grid.enabled and window.canvas.overlays.scale_bar.visible
    opened.clear()
    assert main(["view", str(tmp_path), "--overlay"]) == 0 and not opened[0].canvas.grid.enabled


def test_missing_napari_or_qt_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    _run_folder(tmp_path)
    monkeypatch.setitem(sys.modules, "napari", None)  # `import napari` raises ImportError
    assert main(["view", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"ctuq view: ctuq view needs napari, which is not installed: {INSTALL_HINT}\n"

    def no_qt(title):
        raise ImportError("No Qt bindings could be found")

    monkeypatch.setitem(sys.modules, "napari", types.SimpleNamespace(Viewer=no_qt, run=None))
    assert main(["view", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"ctuq view: napari cannot open a window (No Qt bindings could be found): {INSTALL_HINT}\n"


def test_layers_on_napari_s_headless_viewer_model(tmp_path):
    components = pytest.importorskip("napari.components")  # the `view` extra; no window, no Qt
    _run_folder(tmp_path, (3, 6, 8))
    specs = layer_specs(tmp_path)
    viewer = components.ViewerModel()
    layers = add_layers(viewer, specs)
    assert [layer.name for layer in viewer.layers] == [s.name for s in specs] == [layer.name for layer in layers]
    for layer, spec in zip(viewer.layers, specs):
        assert np.array_equal(layer.data, spec.data) and tuple(layer.scale) == pytest.approx((0.5, 0.5, 0.5))
        assert [str(u) for u in layer.units] == ["millimeter"] * 3 and tuple(layer.axis_labels) == ("z", "y", "x")
        assert layer.colormap.name == spec.colormap
        assert tuple(layer.contrast_limits) == pytest.approx(spec.contrast_limits)
    assert viewer.canvas.grid.enabled and viewer.canvas.overlays.scale_bar.visible
