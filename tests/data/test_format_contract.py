"""The scan-format contract (:class:`ctuq.testing.ScanFormatContract`) over every registered format and every
``--layout`` it writes, with each built-in format's own malformed files."""

import json

import numpy as np
import pytest

from ctuq.data.formats import DATA_FORMATS, write_layouts
from ctuq.testing import Damage, ScanFormatCase, ScanFormatContract

LAYOUTS = write_layouts()


def _edit_text(name: str, old: str, new: str, expect: str):
    """Replace ``old`` by ``new`` in the file ``name`` beside (or under) the opened path; expect ``expect``."""

    def apply(path):
        folder = path if path.is_dir() else path.parent
        target = next(p for p in folder.rglob(name) if p.is_file())
        text = target.read_text()
        assert old in text, f"{target} holds no {old!r}"
        target.write_text(text.replace(old, new, 1))
        return expect

    return apply


def _delete(name: str):
    def apply(path):
        folder = path if path.is_dir() else path.parent
        target = next(p for p in folder.rglob(name) if p.is_file())
        target.unlink()
        return target.name

    return apply


def _nan_geometry(path):
    geom = next(path.rglob("scan_geom_corrected.geom"))
    lines = geom.read_text().splitlines()
    lines[2] = " ".join(["nan"] * 12)
    geom.write_text("\n".join(lines) + "\n")
    return "scan_geom_corrected.geom: 1 geometry rows contain NaN or Inf"


def _incomplete_sidecar(path):
    side = path / "ctuq_simulation.json"
    record = json.loads(side.read_text())
    record["complete"] = False
    side.write_text(json.dumps(record))
    return "ctuq_simulation.json: the simulation that wrote this scan did not finish"


def _nan_npy(path):
    target = path.parent / "ground_truth.npy"
    a = np.load(target)
    a[1, 2, 3] = np.nan
    np.save(target, a)
    return "ground_truth.npy: 1 values of ground-truth slice 1 are NaN or Inf"


EXTRA = {
    "walnut": [
        Damage("a projection missing", _delete("scan_000003.tif")),
        Damage("NaN in the geometry", _nan_geometry),
        Damage("an unfinished simulation", _incomplete_sidecar),
    ],
    "yaml-npy": [
        Damage("an unknown key", _edit_text("scan.yaml", "units: mm", "unit: mm", "scan.yaml: unit: unknown key")),
        Damage("NaN in the ground truth", _nan_npy),
        Damage("the darks missing", _delete("darks.npy")),
    ],
    "yaml-tiff": [
        Damage("more angles", _edit_text("scan.yaml", "count: 6", "count: 7", "projections.tif: 6 projections")),
    ],
}


class TestRegisteredFormats(ScanFormatContract):
    """Every ``--layout`` of every format in the registry at collection time (the format with that layout's write
    options), with the layout's :data:`EXTRA` damages."""

    @pytest.fixture(scope="class", params=list(LAYOUTS))
    @classmethod
    def case(cls, request):
        fmt, options = LAYOUTS[request.param]
        return ScanFormatCase(fmt, options, EXTRA.get(request.param, []))


def test_every_builtin_format_and_layout_is_covered():
    assert {"walnut", "scan_yaml", "nxtomo"} <= set(DATA_FORMATS)
    assert {"walnut", "yaml-npy", "yaml-tiff", "nxtomo"} <= set(LAYOUTS)
