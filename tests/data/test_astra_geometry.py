"""Geometry export: a loaded scan's geometry to ASTRA dicts and back is the identity; the vectors of a described
circular scan are ASTRA's own conversion of its angle-based geometry; vectors survive a text round trip."""

import astra
import numpy as np
import pytest
import torch

from ctuq.data.astra_geometry import (
    AstraGeometryError,
    angle_range,
    circular_vectors,
    from_astra,
    load_astra_vectors,
    save_astra_vectors,
    to_astra,
)
from ctuq.data.loader import read_slice, read_volume
from ctuq.data.walnut import WalnutScan
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.operators import make_ray_transform


def _round_trip(volume, geometry):
    vol_geom, proj_geom = to_astra(volume, geometry)
    v2, g2 = from_astra(vol_geom, proj_geom)
    assert v2.shape == volume.shape and np.isclose(v2.voxel_size, volume.voxel_size)
    assert np.allclose(v2.center, volume.center, atol=1e-12)
    assert g2.kind == geometry.to_vectors().kind and g2.det_shape == geometry.det_shape
    assert np.array_equal(g2.vectors, geometry.to_vectors().vectors)  # mirroring twice is exact
    return v2, g2


def test_loaded_slice_and_volume_round_trip_through_astra(tiny_scan):
    d = read_slice(
        WalnutScan(tiny_scan), angular_subsampling=4, detector_subsampling=3, image_shape=(32, 32), progress=False
    )
    v2, g2 = _round_trip(d.volume, d.geometry)
    # the round-tripped geometry builds the same operator (same matrix)
    a = make_ray_transform(d.volume, d.geometry).matrix
    b = make_ray_transform(v2, g2).matrix
    assert (a != b).nnz == 0
    # ctuq's 2D arrays go to ASTRA unchanged: ASTRA's forward projection of the dicts equals ctuq's operator
    vol_geom, proj_geom = to_astra(d)
    x = torch.rand(d.volume.shape, generator=torch.Generator().manual_seed(1))
    pid = astra.create_projector("line_fanflat", proj_geom, vol_geom)
    try:
        sid, sino = astra.create_sino(x.numpy().astype(np.float32), pid)
        astra.data2d.delete(sid)
    finally:
        astra.projector.delete(pid)
    ours = make_ray_transform(d.volume, d.geometry)(x).numpy()
    assert np.allclose(sino, ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())
    v = read_volume(WalnutScan(tiny_scan), angular_subsampling=8, detector_subsampling=4, progress=False)
    _round_trip(v.volume, v.geometry)


def test_angle_based_astra_geometries_are_read_as_vectors():
    vol = VolumeGeometry((4, 16, 16), 0.5)
    vol_geom = vol.to_astra()
    angles = np.linspace(0, np.pi, 7, endpoint=False)
    cone = astra.create_proj_geom("cone", 0.7, 0.8, 4, 16, angles, 50.0, 30.0)
    v2, g = from_astra(vol_geom, cone)
    assert v2.shape == vol.shape and g.kind == "cone_vec" and g.det_shape == (4, 16)
    assert np.allclose(g.vectors, astra.geom_2vec(cone)["Vectors"])
    with pytest.raises(AstraGeometryError, match=r"proj_geom\['type'\] = 'sparse_matrix'"):
        from_astra(vol_geom, {"type": "sparse_matrix"})


@pytest.mark.parametrize("kind", ["cone", "parallel"])
def test_circular_vectors_are_astras_conversion(kind):
    """ctuq's parametric description (no offsets) gives ASTRA's own vectors of the same angle-based geometry."""
    angles = angle_range(0.0, 360.0, 9, "degree")
    vec = circular_vectors(kind, angles, pixel_size=0.7, row_pixel_size=0.8, source_object=50.0, object_detector=30.0)
    if kind == "cone":
        ref = astra.create_proj_geom("cone", 0.7, 0.8, 4, 16, angles, 50.0, 30.0)
    else:
        ref = astra.create_proj_geom("parallel3d", 0.7, 0.8, 4, 16, angles)
    assert np.allclose(vec, astra.geom_2vec(ref)["Vectors"], atol=1e-12)
    # a centre-of-rotation offset of +1 column moves the detector centre by −u
    shifted = circular_vectors(kind, angles, pixel_size=0.7, source_object=50.0, object_detector=30.0, cor_offset_px=1)
    assert np.allclose(shifted[:, 3:6], vec[:, 3:6] - vec[:, 6:9])


def test_vectors_text_round_trip(tmp_path):
    g = ProjectionGeometry(
        "cone", (4, 16), angles=np.linspace(0, 2, 5), det_spacing=0.3, source_origin=40, origin_det=9
    )
    path = save_astra_vectors(tmp_path / "geometry.txt", g)
    assert np.array_equal(load_astra_vectors(path), g.to_vectors().vectors)
    (tmp_path / "bad.txt").write_text("1 2 3\n")
    with pytest.raises(AstraGeometryError, match=r"bad\.txt: shape \(1, 3\), expected \(n_angles, 12\)"):
        load_astra_vectors(tmp_path / "bad.txt")
