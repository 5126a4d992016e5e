"""Loading the scan a config names (:func:`ctuq.pipeline.scan.load_scan`): the scan is read once, and a 2D slice
comes with the rows of the angles the run does not use — the same operator, sinogram and variances as reading every
angle and keeping the others — or with the one-line reason why there are none."""

import collections

import numpy as np
import torch

from ctuq.config import load_config
from ctuq.data import WalnutScan, read_data
from ctuq.data.problem import HELDOUT_NO_UNUSED_ANGLES, HELDOUT_NOT_READ
from ctuq.geometry import ProjectionGeometry
from ctuq.operators import make_ray_transform
from ctuq.pipeline.scan import load_scan

SETTING = ["data.image_shape=[32, 32]", "data.angular_subsampling=2", "data.detector_subsampling=3"]


def _cfg(scan, *extra):
    return load_config(None, [f"data.path={scan}", *SETTING, *extra])


def test_the_heldout_rows_come_with_the_loaded_slice(tiny_scan):
    d, path, warnings = load_scan(_cfg(tiny_scan), torch.device("cpu"), progress=False)
    held = d.heldout
    assert path == tiny_scan and warnings == [] and d.heldout_reason == ""
    every = read_data(tiny_scan, angular_subsampling=1, detector_subsampling=3, image_shape=(32, 32), progress=False)
    rows = np.asarray(every.meta["geometry_rows"])
    used = np.isin(rows, d.meta["geometry_rows"])
    assert held.n_used == d.y.shape[0] == used.sum() == 16 and held.n_angles == (~used).sum() == 16
    assert np.array_equal(held.geometry_rows, rows[~used])
    assert torch.equal(held.y, every.y[torch.from_numpy(~used)]) and held.y.device == d.y.device
    assert torch.equal(held.variances, every.variances[torch.from_numpy(~used)])
    # T_h as the held-out check built it by reading the scan a second time: the fan geometry's held-out rows
    fan = every.geometry
    want = make_ray_transform(every.volume, ProjectionGeometry(fan.kind, fan.det_shape, vectors=fan.vectors[~used]))
    assert (held.op.matrix != want.matrix).nnz == 0 and np.array_equal(held.op.matrix.indices, want.matrix.indices)
    # the used rows are those of a load without held-out rows, bit for bit
    alone, _, _ = load_scan(_cfg(tiny_scan), torch.device("cpu"), progress=False, heldout=False)
    assert alone.heldout is None and alone.heldout_reason == HELDOUT_NOT_READ
    assert torch.equal(alone.y, d.y) and torch.equal(alone.variances, d.variances) and alone.meta == d.meta
    assert (alone.op.matrix != d.op.matrix).nnz == 0


def test_every_projection_file_is_read_once(tiny_scan, monkeypatch):
    reads = collections.Counter()
    read_image = WalnutScan.read_image

    def counting(self, name):
        reads[name] += 1
        return read_image(self, name)

    monkeypatch.setattr(WalnutScan, "read_image", counting)
    d, _, _ = load_scan(_cfg(tiny_scan), torch.device("cpu"), progress=False)
    projections = {k: v for k, v in reads.items() if k.startswith("scan_")}
    assert len(projections) == d.heldout.n_used + d.heldout.n_angles == 32  # files 1 … 32: file 0 repeats row 0
    assert set(projections.values()) == {1} and reads["di000000.tif"] == 1


def test_without_unused_angles_the_reason_is_stated(tiny_scan):
    d, _, _ = load_scan(_cfg(tiny_scan, "data.angular_subsampling=1"), torch.device("cpu"), progress=False)
    assert d.heldout is None and d.heldout_reason == HELDOUT_NO_UNUSED_ANGLES
    assert d.heldout_reason == (
        "the scan has no unused angles (data.angular_subsampling = 1); a K-fold over the used angles is not done: "
        "it needs one DIP refit per fold"
    )
