"""The ray-transform contract (:class:`ctuq.testing.RayTransformContract`) over every registered backend, skipped where
its availability flag is false here (``astra_cuda`` without a CUDA device ASTRA can use), and over every geometry
kind each backend declares (ODL's ``impl`` fixture pattern); plus the agreement of each backend with ODL's
``RayTransform`` (ASTRA CPU projectors) on the same 2D parallel and fan geometries.

Each check builds its operator through :func:`ctuq.operators.make_ray_transform`, so a new backend gets the whole
contract from its registry line.
"""

import math

import numpy as np
import odl
import pytest
import torch
from odl.applications import tomo

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import RAY_TRANSFORMS, make_ray_transform
from ctuq.testing import RayTransformContract


class TestRegisteredBackends(RayTransformContract):
    """Every backend in the registry at collection time (``impl``), over every geometry kind it declares."""


def _device(name: str) -> str:
    return "cpu" if "cpu" in RAY_TRANSFORMS[name].devices else "cuda"


def pytest_generate_tests(metafunc):
    """``impl`` and ``beam`` for the module's own test: every registered backend (skipped by its flag) and the ODL
    comparisons its geometry kinds allow. The contract class parametrises its own tests."""
    if metafunc.cls is not None or "impl" not in metafunc.fixturenames:
        return
    params = []
    for name, cls in RAY_TRANSFORMS.items():
        mark = pytest.mark.skipif(not cls.available(), reason=f"backend {name!r} is not available on this machine")
        params += [
            pytest.param(name, beam, id=f"{name}-{beam}", marks=mark)
            for beam, kind in (("parallel", "parallel_vec"), ("fan", "fanflat_vec"))
            if kind in cls.geometry_kinds
        ]
    metafunc.parametrize("impl,beam", params)


# ---------------------------------------------------------------------------------------------- ODL
def _odl_to_ours(g) -> ProjectionGeometry:
    """ODL geometry → ctuq vector geometry, through ODL's own per-angle source/detector/axis positions (world
    coordinates (x0, x1) = (x, y); the detector index increases along ``det_axis``)."""
    cell = float(g.det_partition.cell_sides[0])
    rows = []
    for t in g.angles:
        first = g.src_position(t) if isinstance(g, tomo.FanBeamGeometry) else -g.det_to_src(t, 0.0)
        rows.append(np.concatenate([first, g.det_refpoint(t), g.det_axis(t) * cell]))
    kind = "fanflat_vec" if isinstance(g, tomo.FanBeamGeometry) else "parallel_vec"
    return ProjectionGeometry(kind, (g.det_partition.shape[0],), vectors=np.array(rows))


# The sparse backend uses the same ASTRA CPU projector (linear / line_fanflat) on the same rays as ODL's
# ``astra_cpu``: equal up to float32 rounding, on any image. Other backends interpolate differently (ASTRA CUDA's
# texture-interpolated rays): a few per cent on a smooth image (the default entry).
ODL_REFERENCE = {"sparse": ("random", 1e-4)}


def test_matches_odl_ray_transform(impl, beam):
    n, half = 32, 6.4
    space = odl.uniform_discr([-half, -half], [half, half], (n, n), dtype="float32")
    if beam == "parallel":
        g = tomo.Parallel2dGeometry(odl.uniform_partition(0, math.pi, 15), odl.uniform_partition(-9, 9, 45))
    else:
        g = tomo.FanBeamGeometry(
            odl.uniform_partition(0, 2 * math.pi, 20),
            odl.uniform_partition(-20, 20, 50),
            src_radius=30.0,
            det_radius=40.0,
        )
    odl_op = tomo.RayTransform(space, g, impl="astra_cpu")
    ours = make_ray_transform(VolumeGeometry((n, n), 2 * half / n), _odl_to_ours(g), backend=impl, device=_device(impl))
    image, tolerance = ODL_REFERENCE.get(impl, ("smooth", 0.03))
    # ODL arrays are indexed (x0, x1) = (x, y); ours (row, col) = (y, x): ours = odl.T.
    if image == "random":
        x = np.random.default_rng(0).random((n, n)).astype(np.float32)
    else:
        yy, xx = np.meshgrid(*ours.volume.pixel_centers(), indexing="ij")
        blobs = [(-2.0, 1.5, 1.5, 0.02), (2.5, -1.0, 1.0, 0.01)]
        x = sum(a * np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * w * w)) for cx, cy, w, a in blobs).T
        x = x.astype(np.float32)
    x[: n // 4, :] = 0.0  # asymmetric in x0 so that a transposition error shows
    y_odl = odl_op(space.element(x)).data
    y_ours = ours(torch.from_numpy(np.ascontiguousarray(x.T)).to(ours.device)).cpu().numpy()
    assert np.linalg.norm(y_odl - y_ours) <= tolerance * np.linalg.norm(y_odl)
