"""The loaded problem (:class:`ctuq.data.CTData`) and its held-out rows (:class:`ctuq.data.HeldoutData`): shapes are
checked with one clear message each, and a problem without held-out rows always says why."""

import numpy as np
import pytest
import torch

from ctuq.data import CTData, HeldoutData
from ctuq.data.problem import HELDOUT_GIVEN_IN_CODE, HELDOUT_NO_UNUSED_ANGLES, heldout_every_angle_used
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import make_ray_transform


@pytest.fixture(scope="module")
def op():
    angles = np.linspace(0.0, np.pi, 5, endpoint=False)
    return make_ray_transform(
        VolumeGeometry((8, 8), 1.0), ProjectionGeometry("parallel", (12,), angles=angles, det_spacing=1.0)
    )


def _data(op, **kw):
    return CTData(op=op, y=torch.zeros(5, 12), ground_truth=None, volume=op.volume, geometry=op.geometry, meta={}, **kw)


def test_a_problem_given_in_code_says_why_it_has_no_heldout_rows(op):
    d = _data(op)
    assert d.heldout is None and d.heldout_reason == HELDOUT_GIVEN_IN_CODE
    assert _data(op, heldout_reason=HELDOUT_NO_UNUSED_ANGLES).heldout_reason == HELDOUT_NO_UNUSED_ANGLES
    assert heldout_every_angle_used("/scan") == "/scan: every angle of the scan is used by the run"


def test_heldout_rows_and_a_reason_exclude_each_other(op):
    held = HeldoutData(op=op, y=torch.ones(5, 12), geometry_rows=np.arange(5), n_used=5)
    d = _data(op, heldout=held)
    assert d.heldout is held and d.heldout_reason == "" and held.n_angles == 5
    assert held.geometry_rows.dtype == np.int64
    with pytest.raises(ValueError, match="held-out rows are given, so heldout_reason must be empty"):
        _data(op, heldout=held, heldout_reason="why")


def test_variances_must_match_the_sinogram(op):
    with pytest.raises(ValueError, match=r"CTData: variances must have the sinogram's shape \(5, 12\), got \(5, 11\)"):
        _data(op, variances=torch.ones(5, 11))
    bad = torch.ones(5, 12)
    bad[2, 3] = 0.0
    with pytest.raises(ValueError, match=r"CTData: variances must be finite and positive; 1 are not \(first at"):
        _data(op, variances=bad)


def test_heldout_shapes_are_checked(op):
    with pytest.raises(ValueError, match=r"HeldoutData: y must be \(n_angles, n_cols\) with one row per held-out"):
        HeldoutData(op=op, y=torch.ones(4, 12), geometry_rows=np.arange(5), n_used=5)
    with pytest.raises(ValueError, match=r"differs from the operator's measurement shape \(5, 12\)"):
        HeldoutData(op=op, y=torch.ones(5, 11), geometry_rows=np.arange(5), n_used=5)
    with pytest.raises(ValueError, match=r"HeldoutData: variances must have the sinogram's shape"):
        HeldoutData(op=op, y=torch.ones(5, 12), geometry_rows=np.arange(5), n_used=5, variances=torch.ones(12))
    with pytest.raises(ValueError, match=r"HeldoutData: variances must be finite and positive"):
        HeldoutData(
            op=op, y=torch.ones(5, 12), geometry_rows=np.arange(5), n_used=5, variances=torch.full((5, 12), -1.0)
        )
