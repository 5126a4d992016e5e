"""The streaming image statistics of a run (:class:`ctuq.metrics.SampleMoments`): the region they are kept in
(``uq.roi``) and the memory they need, checked against the host's before any sample is drawn
(:data:`ctuq.memory.Budget.STATISTICS`).

Pixelwise and p×p patch second moments (``uq.patch_sizes``) are running sums over sample chunks, float64: their size
depends on the image and these settings only, not on the number of samples.
"""

from __future__ import annotations

from ctuq.config import UQConfig
from ctuq.errors import CTUQError
from ctuq.memory import GIB, Budget, free_memory_bytes, memory_budget
from ctuq.metrics import SampleMoments, inner_square_roi

__all__ = ["statistics_roi", "moments_bytes", "check_moments_memory"]


def statistics_roi(settings: UQConfig, image_shape):
    """The region the statistics are kept in: the inner square of ``image_shape`` (``uq.roi = inner_square``) or
    ``None`` (the whole image)."""
    return inner_square_roi(image_shape) if settings.roi == "inner_square" else None


def moments_bytes(image_shape, settings: UQConfig) -> int:
    """Bytes of the streaming statistics (:class:`ctuq.metrics.SampleMoments`, float64) of ``image_shape`` with
    ``settings``' ROI and patch sizes: the pixel sums of squares plus, per patch size ``p``, ``n_p · p⁴`` patch sums
    (:meth:`ctuq.metrics.SampleMoments.memory_bytes`)."""
    shape = tuple(int(n) for n in image_shape)
    return SampleMoments.memory_bytes(shape, roi=statistics_roi(settings, shape), patch_sizes=settings.patch_sizes)


def check_moments_memory(settings: UQConfig, image_shape) -> None:
    """Refuse statistics that exceed the host's statistics budget (:data:`ctuq.memory.Budget.STATISTICS`), naming
    the sizes and the settings that set them (:class:`~ctuq.errors.CTUQError`)."""
    need = moments_bytes(image_shape, settings)
    budget = memory_budget(Budget.STATISTICS, "cpu")
    if budget is not None and need > budget:
        avail = free_memory_bytes("cpu") or 0
        raise CTUQError(
            f"uq.patch_sizes {list(settings.patch_sizes)}: the streaming statistics of a "
            f"{'×'.join(map(str, image_shape))} image (uq.roi {settings.roi!r}) need {need / GIB:.1f} GiB (pixel sums "
            f"plus p×p patch covariances, {sum(p * p for p in settings.patch_sizes)} per ROI pixel per slice) but "
            f"{avail / GIB:.1f} GiB of host memory are available; use fewer or smaller patch sizes (e.g. "
            f"uq.patch_sizes=[1,2,4]) or a smaller image"
        )
