"""The one loader (:mod:`ctuq.data.loader`): slice plans are computed row by row, so the plans of the used and the
held-out angles are bit for bit the rows of the all-angle plan — the fan geometry of the sparse operators and the
one-row cone geometry of the exact cone-beam slice (``astra_cuda``) alike — for a tilted detector and off the source
plane too; a volume has no held-out rows and says why."""

import numpy as np
import pytest

from ctuq.data import WalnutScan, read_volume
from ctuq.data.loader import plan_slice
from ctuq.data.problem import HELDOUT_NOT_READ
from ctuq.data.simulate import simulate_scan


@pytest.fixture(scope="module")
def orbits(tmp_path_factory):
    """The tiny preset with its detector corrections (a tilted, offset detector)."""
    path = tmp_path_factory.mktemp("loader") / "Walnut1"
    simulate_scan(path, preset="tiny", progress=False)
    return path


@pytest.mark.parametrize("slice_index", [2, 1])
@pytest.mark.parametrize("binning", [False, True])
def test_used_and_heldout_plans_are_rows_of_the_all_angle_plan(orbits, slice_index, binning):
    scan = WalnutScan(orbits)
    z = scan.slice_z(slice_index)
    every = plan_slice(scan, z, *scan.angle_plan(1), 3, binning)
    for rows, files in (scan.angle_plan(4), scan.heldout_plan(4)):
        part = plan_slice(scan, z, rows, files, 3, binning)
        pick = np.isin(every.rows, rows)
        assert np.array_equal(part.files, every.files[pick])
        assert part.fan.vectors.tobytes() == every.fan.vectors[pick].tobytes()
        assert part.cone.vectors.tobytes() == every.cone.vectors[pick].tobytes()
        assert part.frac_rows.tobytes() == every.frac_rows[pick].tobytes()
    used, held = scan.angle_plan(4)[0], scan.heldout_plan(4)[0]
    assert np.array_equal(np.sort(np.concatenate([used, held])), every.rows) and not np.isin(held, used).any()


def test_a_volume_read_says_it_has_no_heldout_rows(orbits):
    d = read_volume(WalnutScan(orbits), angular_subsampling=4, detector_subsampling=2, progress=False)
    assert d.heldout is None and d.heldout_reason == HELDOUT_NOT_READ
