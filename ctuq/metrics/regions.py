"""Regions of interest and their tiling into patches.

A region of interest (ROI) is given in any of the forms listed in :mod:`ctuq.metrics` (``None``,
``"inner_square"``, one ``slice`` per image axis, or a boolean mask) and resolved once into a
:class:`_Region`: a unit-step bounding box plus, when the ROI is not the whole box, a mask of the box.
Every reduction over pixels in this package goes through :func:`_select`, and every patch statistic tiles
the bounding box with :func:`_patch_grid` / :func:`_patch_blocks`, so the in-memory estimators and the
streaming accumulator :class:`ctuq.metrics.SampleMoments` see exactly the same pixels and patches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Union

import numpy as np
import torch

__all__ = ["Roi", "inner_square_roi", "roi_mask", "PUBLISHED_GRID", "PUBLISHED_ROI"]

#: Published walnut evaluation region: pixels 72:424 along each axis of the 501² slice (DESIGN.md §7).
PUBLISHED_GRID = 501
PUBLISHED_ROI = (72, 424)

#: Every accepted ROI form: ``None`` (whole image), ``"inner_square"``, a tuple of slices (one per image
#: axis) or a boolean mask (torch tensor or numpy array) of the image's shape.
Roi = Union[None, str, Sequence[slice], torch.Tensor, np.ndarray]  # noqa: UP007 - runtime alias


def inner_square_roi(shape: Sequence[int]) -> tuple[slice, ...]:
    """The published evaluation region, scaled to ``shape``: one ``slice`` per axis.

    For a 501-pixel axis this is exactly ``slice(72, 424)`` (DESIGN.md §7). For an axis of ``n`` pixels
    both ends are scaled proportionally and rounded half up: ``start = round(72·n/501)``,
    ``stop = round(424·n/501)`` (e.g. 128 → ``18:108``, 256 → ``37:217``). Every axis of a 2D ``(H, W)`` or
    3D ``(D, H, W)`` shape is cropped the same way, so a 501³ volume gets the inner cube ``72:424``³.

    Parameters
    ----------
    shape : sequence of 2 or 3 positive ints
        The image shape ``(H, W)`` or ``(D, H, W)`` in pixels.

    Returns
    -------
    tuple of slice
        One unit-step ``slice`` per axis, in pixels.

    Raises
    ------
    ValueError
        For shapes that are not 2 or 3 positive ints, or too small to hold a region.
    """
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError as exc:
        raise ValueError(f"inner_square_roi: shape must be a sequence of ints, got {shape!r}") from exc
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"inner_square_roi: shape must be 2 or 3 positive ints (H, W) / (D, H, W), got {shape}")
    out = []
    for n in shape:
        # integer round-half-up of a·n/501, free of float representation error
        start = (2 * PUBLISHED_ROI[0] * n + PUBLISHED_GRID) // (2 * PUBLISHED_GRID)
        stop = (2 * PUBLISHED_ROI[1] * n + PUBLISHED_GRID) // (2 * PUBLISHED_GRID)
        if stop <= start:
            raise ValueError(f"inner_square_roi: an axis of {n} pixels is too small for the inner region")
        out.append(slice(start, stop))
    return tuple(out)


class _Region(NamedTuple):
    """A resolved ROI: a unit-step bounding box and, when the ROI is not the whole box, a mask of the box."""

    box: tuple[slice, ...]
    mask: torch.Tensor | None  # bool, shape of the box (CPU); None: every pixel of the box
    n: int  # number of ROI pixels


def _resolve_roi(roi: Roi, shape: tuple[int, ...], where: str) -> _Region:
    full = tuple(slice(0, n) for n in shape)
    if roi is None:
        return _Region(full, None, math.prod(shape))
    if isinstance(roi, str):
        if roi != "inner_square":
            raise ValueError(f"{where}: roi string must be 'inner_square', got {roi!r}")
        roi = inner_square_roi(shape)
    if isinstance(roi, (tuple, list)):
        if len(roi) != len(shape) or not all(isinstance(s, slice) for s in roi):
            raise ValueError(
                f"{where}: a roi given as slices needs exactly one slice per image axis ({len(shape)} for "
                f"image shape {shape}), got {roi!r}"
            )
        idx = [s.indices(n) for s, n in zip(roi, shape)]
        if any(len(range(*i)) == 0 for i in idx):
            raise ValueError(f"{where}: roi {roi!r} selects no pixel of an image of shape {shape}")
        if all(step == 1 for _, _, step in idx):
            box = tuple(slice(a, b) for a, b, _ in idx)
            return _Region(box, None, math.prod(b - a for a, b, _ in idx))
        mask = torch.zeros(shape, dtype=torch.bool)
        mask[tuple(slice(*i) for i in idx)] = True
        roi = mask
    if isinstance(roi, np.ndarray):
        roi = torch.from_numpy(np.ascontiguousarray(roi))
    if isinstance(roi, torch.Tensor):
        if roi.dtype != torch.bool:
            raise TypeError(f"{where}: a roi mask must have dtype bool, got {roi.dtype}")
        if tuple(roi.shape) != shape:
            raise ValueError(f"{where}: roi mask has shape {tuple(roi.shape)}, the image has shape {shape}")
        mask = roi.detach().cpu()
        n = int(mask.sum())
        if n == 0:
            raise ValueError(f"{where}: the roi mask selects no pixel")
        box = []
        for axis in range(mask.ndim):
            other = tuple(a for a in range(mask.ndim) if a != axis)
            hit = torch.nonzero(mask.any(dim=other) if other else mask).flatten()
            box.append(slice(int(hit[0]), int(hit[-1]) + 1))
        box = tuple(box)
        sub = mask[box]
        return _Region(box, None if bool(sub.all()) else sub.contiguous(), n)
    raise TypeError(
        f"{where}: roi must be None, 'inner_square', a tuple of slices or a boolean mask, got {type(roi).__name__}"
    )


def roi_mask(roi: Roi, shape: Sequence[int]) -> torch.Tensor:
    """The ROI as a boolean mask.

    Parameters
    ----------
    roi : Roi
        Any accepted ROI form (see :mod:`ctuq.metrics`).
    shape : sequence of int
        Image shape ``(H, W)`` or ``(D, H, W)`` in pixels.

    Returns
    -------
    torch.Tensor
        Bool CPU tensor of ``shape``, True inside the ROI.
    """
    shape = tuple(int(n) for n in shape)
    region = _resolve_roi(roi, shape, "roi_mask")
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[region.box] = True if region.mask is None else region.mask
    return mask


def _select(t: torch.Tensor, region: _Region) -> torch.Tensor:
    """Flat ``(n_roi,)`` values of an image-shaped tensor inside the ROI."""
    sub = t[region.box]
    if region.mask is None:
        return sub.reshape(-1)
    return sub[region.mask.to(sub.device)]


# ================================================================================================ patches
def _check_patch_sizes(patch_sizes, where: str) -> list[int]:
    try:
        given = list(patch_sizes)
        sizes = [int(p) for p in given]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: patch_sizes must be an iterable of positive ints, got {patch_sizes!r}") from exc
    if not sizes or min(sizes) < 1 or any(a != b for a, b in zip(sizes, given)):
        raise ValueError(f"{where}: patch_sizes must be a non-empty iterable of positive ints, got {patch_sizes!r}")
    return list(dict.fromkeys(sizes))


class _PatchGrid(NamedTuple):
    """Non-overlapping ``p×p`` patches tiling a ROI's bounding box, slice by slice.

    The box (``D`` slices of ``h×w`` pixels; ``D = 1`` for a 2D image) is tiled from its top-left corner
    with ``nh × nw`` patches per slice; the incomplete ones at the bottom/right border are dropped.
    ``valid`` (bool, ``(D, nh, nw)``, CPU) marks the patches lying entirely inside a mask ROI, ``None`` when
    every patch counts. Patches are ordered slice, patch row, patch column (row-major).
    """

    D: int
    h: int
    w: int
    nh: int
    nw: int
    valid: torch.Tensor | None

    @property
    def n_patches(self) -> int:
        """Number of patches that count (valid ones)."""
        return self.D * self.nh * self.nw if self.valid is None else int(self.valid.sum())


def _patch_grid(region: _Region, p: int, where: str) -> _PatchGrid:
    """The patches of size ``p`` used by the joint log-likelihood; ``ValueError`` if there is none."""
    dims = tuple(s.stop - s.start for s in region.box)
    mask = region.mask
    if len(dims) == 2:  # a slice is a one-slice volume, so 2D and 3D share one code path
        dims = (1,) + dims
        mask = mask.unsqueeze(0) if mask is not None else None
    D, h, w = dims
    nh, nw = h // p, w // p
    valid = None
    if mask is not None and nh and nw:
        valid = mask[:, : nh * p, : nw * p].reshape(D, nh, p, nw, p).all(dim=4).all(dim=2)
    if nh == 0 or nw == 0 or (valid is not None and not bool(valid.any())):
        raise ValueError(
            f"{where}: the ROI (bounding box {h}×{w} pixels per slice) holds no complete {p}×{p} patch; "
            "use smaller patch sizes or a larger ROI"
        )
    return _PatchGrid(D, h, w, nh, nw, valid)


def _patch_blocks(D: int, nh: int, nw: int, n_max: int):
    """(d, r0, r1, c0, c1) blocks of patch rows/columns holding at most ``n_max`` patches each.

    Each block is a run of consecutive patches in row-major (slice, row, column) order, so the valid
    patches of a block are also consecutive among all valid patches.
    """
    for d in range(D):
        if nw <= n_max:
            rows = max(1, n_max // nw)
            for r0 in range(0, nh, rows):
                yield d, r0, min(r0 + rows, nh), 0, nw
        else:
            for r in range(nh):
                for c0 in range(0, nw, n_max):
                    yield d, r, r + 1, c0, min(c0 + n_max, nw)


def _grid_patches(t: torch.Tensor, grid: _PatchGrid, p: int) -> torch.Tensor:
    """``(n_patches, p²)`` values of a box-shaped tensor in the counted patches of ``grid``, in grid order.

    ``t``: ``(h, w)`` or ``(D, h, w)`` (the ROI's bounding box); each row lists a patch's pixels row-major,
    the same order as the patch covariances.
    """
    if t.ndim == 2:
        t = t.unsqueeze(0)
    D, nh, nw = grid.D, grid.nh, grid.nw
    out = t[:, : nh * p, : nw * p].reshape(D, nh, p, nw, p).permute(0, 1, 3, 2, 4).reshape(D * nh * nw, p * p)
    if grid.valid is not None:
        out = out[grid.valid.reshape(-1).to(out.device)]
    return out
