"""Phantoms for simulated scans (attenuation in mm⁻¹, world coordinates in mm): ellipsoid phantoms with exact line
integrals (:mod:`~ctuq.data.phantom.ellipsoid`), the synthetic walnut built from them
(:mod:`~ctuq.data.phantom.walnut`), the textured prism phantom (:mod:`~ctuq.data.phantom.textured`) and the laminate
(:mod:`~ctuq.data.phantom.laminate`);
:func:`make_phantom` picks one by its kind."""

from __future__ import annotations

from ctuq.data.phantom.ellipsoid import Ellipsoid, EllipsoidPhantom, rotation_from_euler
from ctuq.data.phantom.laminate import laminate_phantom
from ctuq.data.phantom.textured import TexturedPhantom, textured_phantom
from ctuq.data.phantom.walnut import walnut_phantom
from ctuq.options import PhantomKind

__all__ = [
    "Ellipsoid",
    "EllipsoidPhantom",
    "TexturedPhantom",
    "laminate_phantom",
    "make_phantom",
    "rotation_from_euler",
    "textured_phantom",
    "walnut_phantom",
]


def make_phantom(kind: str, seed: int = 0, *, voxel_size: float = 0.4) -> EllipsoidPhantom | TexturedPhantom:
    """The phantom ``kind`` (:class:`ctuq.options.PhantomKind`) of ``seed``: :func:`walnut_phantom`,
    :func:`laminate_phantom`, or :func:`textured_phantom` with fine pixels of ``min(0.1, voxel_size / 4)`` mm
    (``voxel_size``: the ground-truth voxel edge, mm). Raises ``ValueError`` naming the valid kinds for an unknown
    one."""
    kind = PhantomKind.parse(kind, "phantom")
    if kind == PhantomKind.WALNUT:
        return walnut_phantom(seed)
    if kind == PhantomKind.LAMINATE:
        return laminate_phantom(seed)
    return textured_phantom(seed, pixel_size=min(0.1, float(voxel_size) / 4.0))
