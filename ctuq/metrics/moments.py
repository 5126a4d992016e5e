"""Second moments of image samples: pixelwise variances/stds, in memory or streamed.

* :func:`pixelwise_variance`, :func:`pixelwise_std`, :func:`pixelwise_std_about` — from all ``k`` samples
  held at once (any centering, see :mod:`ctuq.metrics`);
* :class:`SampleMoments` — a running-sum accumulator fed with chunks of zero-mean samples, holding
  everything :func:`ctuq.metrics.uq_summary_from_moments` needs (pixel sums of squares and per-patch
  second-moment matrices) in memory independent of ``k``.

Images are in image units (mm⁻¹ for attenuation images), variances in image units² (mm⁻²).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ctuq.options import Centering

from ._common import DEFAULT_CHUNK_BYTES, _as_tensor, _check_centering, _check_image, _check_samples, _chunk_count
from .regions import Roi, _check_patch_sizes, _patch_blocks, _patch_grid, _PatchGrid, _resolve_roi

__all__ = ["pixelwise_variance", "pixelwise_std", "pixelwise_std_about", "SampleMoments"]


# ============================================================================== in-memory pixel variances
class _Moments(NamedTuple):
    """Second moments of the samples over a box: what every estimator here needs."""

    var: torch.Tensor  # float64, box shape: (scale2 / k) Σ_j (s_j − offset)²
    offset: torch.Tensor | None  # float64, box shape, subtracted from each sample (None: zero)
    scale2: float  # k / (k − 1) for empirical centering, else 1


def _moments(
    samples: torch.Tensor,
    box: tuple[slice, ...],
    centering: str,
    about: torch.Tensor | None,
    chunk_bytes: int,
    where: str,
) -> _Moments:
    k = samples.shape[0]
    view = samples[(slice(None),) + box]
    step = _chunk_count(8 * view[0].numel(), chunk_bytes)
    offset = None
    scale2 = 1.0
    if centering == Centering.MEAN:
        offset = about[box]
    elif centering == Centering.EMPIRICAL:
        # two passes (mean, then deviations) rather than E[s²] − E[s]²: MC-dropout passes have a mean
        # far larger than their spread, and the one-pass formula would cancel away the variance.
        acc = torch.zeros(view.shape[1:], dtype=torch.float64, device=view.device)
        for i in range(0, k, step):
            acc += view[i : i + step].to(torch.float64).sum(0)
        offset = acc / k
        scale2 = k / (k - 1)
    acc = torch.zeros(view.shape[1:], dtype=torch.float64, device=view.device)
    for i in range(0, k, step):
        c = view[i : i + step].to(torch.float64)
        if offset is not None:
            c = c - offset
        acc += (c * c).sum(0)
    var = acc * (scale2 / k)
    if not bool(torch.isfinite(var).all()):
        raise ValueError(f"{where}: samples contain NaN or Inf")
    return _Moments(var, offset, scale2)


def pixelwise_variance(
    samples, jitter: float = 0.0, *, centering: str = Centering.NONE, mean=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> torch.Tensor:
    """Pixelwise predictive variance ``(1/k) Σ_j x_j² + jitter`` of ``k`` samples.

    Parameters
    ----------
    samples : ``(k, H, W)`` or ``(k, D, H, W)`` tensor or array
        Image units (mm⁻¹).
    jitter : float
        Added to every pixel (image units², mm⁻²), e.g. the σ²-free image-space noise term of DESIGN.md §1;
        ≥ 0.
    centering : ``"none"`` | ``"empirical"`` | ``"mean"``
        How the samples become deviations (see :mod:`ctuq.metrics`); ``"mean"`` needs ``mean``.
    mean : ``(H, W)`` / ``(D, H, W)``, only for ``centering="mean"``.
    chunk_bytes : int
        Bytes of float64 sample data handled at once.

    Returns
    -------
    torch.Tensor
        Image-shaped variance (image units², mm⁻²) in ``samples.dtype`` on ``samples.device``, accumulated
        in float64.
    """
    where = "pixelwise_variance"
    samples = _check_samples(samples, where)
    shape = tuple(samples.shape[1:])
    _check_centering(centering, mean is not None, samples.shape[0], where)
    if not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"{where}: jitter must be finite and ≥ 0, got {jitter}")
    about = _check_image(mean, "mean", shape, where, samples.device) if centering == Centering.MEAN else None
    full = tuple(slice(0, n) for n in shape)
    m = _moments(samples, full, centering, about, chunk_bytes, where)
    return (m.var + jitter).to(samples.dtype)


def pixelwise_std(samples, jitter: float = 0.0) -> torch.Tensor:
    """Pixelwise standard deviation ``sqrt((1/k) Σ_j x_j² + jitter)`` of **zero-mean** samples ``x_j``.

    Parameters
    ----------
    samples : ``(k, H, W)`` or ``(k, D, H, W)``
        Zero-mean deviations, image units (mm⁻¹).
    jitter : float
        Image units² (mm⁻²), ≥ 0.

    Returns
    -------
    torch.Tensor
        Image-shaped std (image units, mm⁻¹) in ``samples.dtype`` on ``samples.device``. For samples that
        are not zero-mean (MC dropout) use :func:`pixelwise_std_about`.
    """
    return pixelwise_variance(samples, jitter).sqrt()


def pixelwise_std_about(samples, mean=None, jitter: float = 0.0) -> torch.Tensor:
    """Pixelwise standard deviation of samples that are **not** zero-mean (e.g. MC-dropout forward passes).

    Parameters
    ----------
    samples : ``(k, H, W)`` or ``(k, D, H, W)``
        Raw samples, image units (mm⁻¹).
    mean : image-shaped or None
        ``None``: the spread about the samples' own average, ``sqrt(Σ_j (s_j − s̄)² / (k − 1) + jitter)``
        (unbiased; needs k ≥ 2). Given (e.g. the predictive mean): the spread about it,
        ``sqrt(Σ_j (s_j − mean)² / k + jitter)``.
    jitter : float
        Image units² (mm⁻²), ≥ 0.

    Returns
    -------
    torch.Tensor
        Image-shaped std (image units, mm⁻¹) in ``samples.dtype`` on ``samples.device``.
    """
    centering = Centering.EMPIRICAL if mean is None else Centering.MEAN
    return pixelwise_variance(samples, jitter, centering=centering, mean=mean).sqrt()


# ================================================================================== streaming accumulator
_STATE_VERSION = 1
_STATE_KIND = "ctuq.metrics.SampleMoments"
_DTYPES = {"float64": torch.float64, "float32": torch.float32}


class SampleMoments:
    """Running sums of zero-mean image samples, enough for every metric of :func:`ctuq.metrics.uq_summary`.

    Feed the deviations ``x_j`` (predictive samples minus the predictive mean; DESIGN.md §1) chunk by chunk
    with :meth:`update`; the accumulator keeps

    * ``k``, the number of samples seen;
    * the pixelwise sum of squares ``Σ_j x_j²`` over the whole image (for the std map);
    * for every patch size ``p``, the second-moment sums ``Σ_j x_{j,P} x_{j,P}ᵀ`` (``p² × p²``) of exactly the
      patches that :func:`ctuq.metrics.patch_joint_log_likelihood` scores: the ROI's bounding box tiled
      slice by slice with non-overlapping ``p×p`` patches from its top-left corner, incomplete border patches
      dropped, and, for a mask ROI, only the patches lying entirely inside the mask.

    Memory is ``Π image_shape + Σ_p n_p·p⁴ ≤ image pixels + box pixels · Σ_p p²`` elements of ``dtype``
    (``n_p`` patches of size ``p``, ``box pixels`` the size of the ROI's bounding box), whatever the number of
    samples: about 0.38 GB in float64 for the published 352² region of a 501² slice and ``p = 1…10``. A 3D
    volume is tiled with 2D ``p×p`` patches in each ``(H, W)`` slice, as the in-memory estimator does, which costs
    ``D`` times a slice.

    Only ``centering="none"`` (second moments about zero, divided by ``k``) can be streamed:

    * ``"mean"`` (deviations about a known mean) is the same estimator applied to ``samples − mean``, so
      subtract the mean from each chunk before :meth:`update`;
    * ``"empirical"`` (MC dropout) subtracts the samples' own average before squaring, which is only known
      after the last sample; the in-memory code makes two passes precisely to avoid the cancellation of a
      one-pass ``E[s²] − E[s]²``. Keep all samples and call :func:`ctuq.metrics.uq_summary`.

    Parameters
    ----------
    image_shape : ``(H, W)`` or ``(D, H, W)``
        Shape of one sample, in pixels.
    roi : Roi
        Region of interest of the likelihoods and calibration (see :mod:`ctuq.metrics`); default the whole
        image. The pixel sums of squares always cover the whole image.
    patch_sizes : iterable of positive ints
        Patch sizes ``p`` of the joint log-likelihood (default 1…10, the published sizes); duplicates are
        dropped, the order is kept.
    dtype : ``torch.float64`` (default) or ``torch.float32``
        Dtype of the running sums; chunks are converted to it before any arithmetic. ``float32`` halves the
        memory but loses the ≤ 1e-9 agreement with :func:`ctuq.metrics.uq_summary` (≈ 1e-6 relative).
    device : torch.device or str
        Where the sums live and the work runs; chunks on other devices are copied here.
    centering : str
        Must be ``"none"``; the other values raise ``ValueError`` with the reason above.
    chunk_bytes : int
        Bytes of reordered patch data handled at once within :meth:`update`; bounds its temporaries.

    Raises
    ------
    ValueError
        For a shape that is not 2 or 3 positive ints, bad patch sizes, a ROI holding no complete patch of
        some size, an unsupported centering or dtype.

    Examples
    --------
    >>> acc = SampleMoments((128, 128), roi="inner_square")
    >>> for chunk in sampler:              # (B, 128, 128) zero-mean deviations   # doctest: +SKIP
    ...     acc.update(chunk)
    >>> summary = uq_summary_from_moments(x_true, mean, acc)                      # doctest: +SKIP
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        roi: Roi = None,
        patch_sizes: Iterable[int] = range(1, 11),
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        *,
        centering: str = Centering.NONE,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        where = "SampleMoments"
        try:
            shape = tuple(int(n) for n in image_shape)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: image_shape must be a sequence of ints, got {image_shape!r}") from exc
        if len(shape) not in (2, 3) or min(shape) < 1:
            raise ValueError(f"{where}: image_shape must be (H, W) or (D, H, W) with positive sizes, got {shape}")
        if centering == Centering.MEAN:
            raise ValueError(
                f"{where}: centering='mean' is not streamed; subtract the predictive mean from each chunk and "
                "use centering='none' (the same estimator)"
            )
        if centering == Centering.EMPIRICAL:
            raise ValueError(
                f"{where}: centering='empirical' needs the samples' own average before any square is summed "
                "(a one-pass E[s²] − E[s]² cancels catastrophically for MC dropout), so it cannot be streamed; "
                "keep all samples and use ctuq.metrics.uq_summary"
            )
        if centering != "none":
            raise ValueError(f"{where}: centering must be 'none', got {centering!r}")
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"{where}: dtype must be torch.float64 or torch.float32, got {dtype}")
        _chunk_count(1, chunk_bytes)  # validates chunk_bytes
        self._shape = shape
        self._region = _resolve_roi(roi, shape, where)
        self._sizes = tuple(_check_patch_sizes(patch_sizes, where))
        self._grids: dict[int, _PatchGrid] = {p: _patch_grid(self._region, p, where) for p in self._sizes}
        self._dtype = dtype
        self._device = torch.device(device)
        self._chunk_bytes = int(chunk_bytes)
        self._valid = {p: (g.valid.to(self._device) if g.valid is not None else None) for p, g in self._grids.items()}
        self._k = 0
        self._sum_sq = torch.zeros(shape, dtype=dtype, device=self._device)
        self._patch_sums = {
            p: torch.zeros((g.n_patches, p * p, p * p), dtype=dtype, device=self._device)
            for p, g in self._grids.items()
        }

    @staticmethod
    def memory_bytes(
        image_shape: Sequence[int],
        roi: Roi = None,
        patch_sizes: Iterable[int] = range(1, 11),
        dtype: torch.dtype = torch.float64,
    ) -> int:
        """Bytes of the running sums an accumulator with these arguments holds, without allocating them: the
        pixel sums of squares (``prod(image_shape)``) plus, per patch size ``p``, ``n_patches(p) · p⁴`` patch sums
        (the same ROI and patch tiling as the constructor; its errors for a bad shape, ROI or patch size)."""
        where = "SampleMoments"
        shape = tuple(int(n) for n in image_shape)
        region = _resolve_roi(roi, shape, where)
        sizes = _check_patch_sizes(patch_sizes, where)
        numel = math.prod(shape) + sum(_patch_grid(region, p, where).n_patches * p**4 for p in sizes)
        return torch.empty((), dtype=dtype).element_size() * numel

    # ----------------------------------------------------------------------------------------- properties
    @property
    def image_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``(H, W)`` or ``(D, H, W)`` (pixels)."""
        return self._shape

    @property
    def patch_sizes(self) -> tuple[int, ...]:
        """Patch sizes ``p`` whose per-patch sums are kept, in the order given."""
        return self._sizes

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the running sums."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Device of the running sums."""
        return self._device

    @property
    def n_samples(self) -> int:
        """Number ``k`` of samples accumulated so far."""
        return self._k

    @property
    def n_pixels(self) -> int:
        """Number of ROI pixels (what the marginal likelihood and calibration average over)."""
        return self._region.n

    @property
    def buffer_numel(self) -> int:
        """Total number of elements of the running-sum buffers (independent of :attr:`n_samples`)."""
        return self._sum_sq.numel() + sum(s.numel() for s in self._patch_sums.values())

    def n_patches(self, p: int) -> int:
        """Number of ``p×p`` patches scored by the joint log-likelihood for patch size ``p``."""
        return self._grids[int(p)].n_patches

    def roi_mask(self) -> torch.Tensor:
        """The ROI as a bool CPU tensor of :attr:`image_shape`."""
        mask = torch.zeros(self._shape, dtype=torch.bool)
        mask[self._region.box] = True if self._region.mask is None else self._region.mask
        return mask

    def __repr__(self) -> str:
        return (
            f"SampleMoments(image_shape={self._shape}, n_samples={self._k}, n_roi_pixels={self._region.n}, "
            f"patch_sizes={list(self._sizes)}, dtype={self._dtype}, device='{self._device}')"
        )

    # ------------------------------------------------------------------------------------------ streaming
    def update(self, chunk) -> SampleMoments:
        """Add a chunk of zero-mean samples to the running sums.

        Parameters
        ----------
        chunk : ``(B, *image_shape)`` float tensor or numpy array
            ``B ≥ 0`` deviations ``x_j`` in image units (mm⁻¹), any dtype and device (copied to
            :attr:`device` and converted to :attr:`dtype` piecewise). ``B = 0`` changes nothing.

        Returns
        -------
        SampleMoments
            ``self``, so that updates can be chained.

        Raises
        ------
        ValueError
            If the chunk has the wrong shape or contains NaN/Inf (the sums are left untouched).
        TypeError
            If the chunk is not floating point.
        """
        where = "SampleMoments.update"
        chunk = _as_tensor(chunk, "chunk", where)
        if tuple(chunk.shape[1:]) != self._shape or chunk.ndim != len(self._shape) + 1:
            raise ValueError(
                f"{where}: chunk must have shape (B, {', '.join(map(str, self._shape))}), got {tuple(chunk.shape)}"
            )
        if not chunk.is_floating_point():
            raise TypeError(f"{where}: chunk must be floating point, got {chunk.dtype}")
        B = chunk.shape[0]
        if B == 0:
            return self
        # checked before anything is added, so a bad chunk cannot poison sums that took hours to collect
        if not bool(torch.isfinite(chunk).all()):
            raise ValueError(f"{where}: chunk contains NaN or Inf")
        chunk = chunk.to(self._device)
        dt = self._dtype
        elem = torch.finfo(dt).bits // 8
        step = _chunk_count(elem * math.prod(self._shape), self._chunk_bytes)
        for i in range(0, B, step):
            c = chunk[i : i + step].to(dt)
            self._sum_sq += (c * c).sum(0)
            del c
        view = chunk[(slice(None),) + self._region.box]
        if view.ndim == 3:  # a slice is a one-slice volume, as in the in-memory estimator
            view = view.unsqueeze(1)
        for p, grid in self._grids.items():
            q = p * p
            sums, valid = self._patch_sums[p], self._valid[p]
            n_max = _chunk_count(elem * (2 * B * q + q * q), self._chunk_bytes)
            pos = 0
            for d, r0, r1, c0, c1 in _patch_blocks(grid.D, grid.nh, grid.nw, n_max):
                nr, nc = r1 - r0, c1 - c0
                rows, cols = slice(r0 * p, r1 * p), slice(c0 * p, c1 * p)
                # one copy that converts and reorders to (patch row, patch col, sample, p, p), the layout
                # of the in-memory estimator, so both see each patch's pixels in the same order
                x = torch.empty((nr, nc, B, p, p), dtype=dt, device=self._device)
                x.copy_(view[:, d, rows, cols].reshape(B, nr, p, nc, p).permute(1, 3, 0, 2, 4))
                x = x.reshape(nr * nc, B, q)
                if valid is not None:
                    x = x[valid[d, r0:r1, c0:c1].reshape(-1)]
                n = x.shape[0]
                if n:
                    # blocks are runs of consecutive patches, so their valid patches are consecutive too;
                    # in place, so no second buffer of the sums' size is ever allocated
                    sums[pos : pos + n].baddbmm_(x.transpose(1, 2), x)
                pos += n
                del x
            assert pos == sums.shape[0], (pos, sums.shape)
        self._k += B
        return self

    def merge(self, other: SampleMoments) -> SampleMoments:
        """Add another accumulator's sums to this one (e.g. shards sampled on different machines).

        Parameters
        ----------
        other : SampleMoments
            Same image shape, ROI, patch sizes and dtype; may live on another device. Left unchanged.

        Returns
        -------
        SampleMoments
            ``self``, now holding ``n_samples + other.n_samples`` samples.

        Raises
        ------
        ValueError
            Naming the first configuration mismatch.
        """
        if not isinstance(other, SampleMoments):
            raise TypeError(f"SampleMoments.merge: expected a SampleMoments, got {type(other).__name__}")
        self._check_config(other._config(), "SampleMoments.merge")
        self._sum_sq += other._sum_sq.to(self._device)
        for p in self._sizes:
            self._patch_sums[p] += other._patch_sums[p].to(self._device)
        self._k += other._k
        return self

    def reduce_(self, shard) -> SampleMoments:
        """Sum the running sums of every process onto rank 0, in place (a sharded prediction; see
        :mod:`ctuq.inference.distributed`).

        Parameters
        ----------
        shard : ctuq.inference.Shard
            Anything with ``reduce_sum_(tensor)`` (sum onto rank 0 in place), ``all_reduce_sum(tensor)`` and
            ``is_root``. Every process must call this with accumulators of the same configuration.

        Returns
        -------
        SampleMoments
            ``self``: on rank 0 it holds every process's samples (the same sums as one process accumulating all
            chunks, up to the order of float64 additions); on the other ranks its sums are unspecified and
            :attr:`n_samples` is the total.
        """
        shard.reduce_sum_(self._sum_sq)
        for p in self._sizes:
            shard.reduce_sum_(self._patch_sums[p])
        self._k = int(shard.all_reduce_sum(torch.tensor([self._k], dtype=torch.float64))[0])
        return self

    # ----------------------------------------------------------------------------------------- estimates
    def variance(self) -> torch.Tensor:
        """Pixelwise variance ``(1/k) Σ_j x_j²`` over the whole image.

        Returns
        -------
        torch.Tensor
            ``image_shape``, float64 on :attr:`device`, image units² (mm⁻²); equals
            :func:`pixelwise_variance` of the same samples (in float64) up to summation order.

        Raises
        ------
        ValueError
            If no sample has been accumulated.
        """
        if self._k < 1:
            raise ValueError("SampleMoments.variance: no sample has been accumulated yet")
        return self._sum_sq.to(torch.float64) * (1.0 / self._k)

    def std(self, jitter: float = 0.0) -> torch.Tensor:
        """Pixelwise standard deviation ``sqrt((1/k) Σ_j x_j² + jitter)`` over the whole image.

        Parameters
        ----------
        jitter : float
            Added to the variance, image units² (mm⁻²), ≥ 0.

        Returns
        -------
        torch.Tensor
            ``image_shape``, float64 on :attr:`device`, image units (mm⁻¹).
        """
        if not (math.isfinite(jitter) and jitter >= 0):
            raise ValueError(f"SampleMoments.std: jitter must be finite and ≥ 0, got {jitter}")
        return (self.variance() + jitter).sqrt()

    # ------------------------------------------------------------------------------------ checkpointing
    def _config(self) -> dict:
        box = [[s.start, s.stop] for s in self._region.box]
        return {
            "image_shape": list(self._shape),
            "roi_box": box,
            "roi_mask": self._region.mask,
            "patch_sizes": list(self._sizes),
            "dtype": str(self._dtype).removeprefix("torch."),
        }

    def _check_config(self, cfg: dict, where: str) -> None:
        mine = self._config()
        for key, label in (
            ("image_shape", "image shape"),
            ("roi_box", "ROI bounding box"),
            ("patch_sizes", "patch sizes"),
            ("dtype", "dtype"),
        ):
            if cfg[key] != mine[key]:
                raise ValueError(
                    f"{where}: {label} mismatch: this accumulator has {mine[key]}, the other has {cfg[key]}"
                )
        a, b = mine["roi_mask"], cfg["roi_mask"]
        if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or not torch.equal(a, b.cpu()))):
            raise ValueError(f"{where}: ROI mismatch: the ROI masks differ (same bounding box {mine['roi_box']})")

    def state_dict(self) -> dict:
        """The running sums and their configuration, for ``torch.save``.

        Holds only tensors and plain Python values, so it loads with ``torch.load(..., weights_only=True)``.
        The tensors share storage with the accumulator (no copy: they can be large); save or clone them
        before the next :meth:`update`.

        Returns
        -------
        dict
            ``version`` (int), ``kind``, ``image_shape``, ``roi_box`` (``[[start, stop], …]``), ``roi_mask``
            (bool tensor of the box, or ``None``), ``patch_sizes``, ``dtype`` (str), ``n_samples``,
            ``sum_sq`` (image-shaped, image units² × samples) and ``patch_sums``
            (``{str(p): (n_patches, p², p²)}``).
        """
        state = self._config()
        state.update(
            {
                "version": _STATE_VERSION,
                "kind": _STATE_KIND,
                "n_samples": self._k,
                "sum_sq": self._sum_sq,
                "patch_sums": {str(p): s for p, s in self._patch_sums.items()},
            }
        )
        return state

    def load_state_dict(self, state: dict) -> SampleMoments:
        """Replace the running sums by those of :meth:`state_dict` (the configuration must match).

        Parameters
        ----------
        state : dict
            As returned by :meth:`state_dict`, possibly after ``torch.save``/``torch.load``; its tensors may
            be on any device.

        Returns
        -------
        SampleMoments
            ``self``.

        Raises
        ------
        ValueError
            For another version, or a state for another image shape, ROI, patch sizes or dtype (the message
            names the mismatch), or malformed buffers. Nothing is changed when it raises.
        """
        where = "SampleMoments.load_state_dict"
        if not isinstance(state, dict):
            raise ValueError(f"{where}: state must be a dict, got {type(state).__name__}")
        if state.get("kind") != _STATE_KIND or state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"{where}: not a SampleMoments state of version {_STATE_VERSION} "
                f"(kind {state.get('kind')!r}, version {state.get('version')!r})"
            )
        missing = [
            key
            for key in (
                "image_shape",
                "roi_box",
                "roi_mask",
                "patch_sizes",
                "dtype",
                "n_samples",
                "sum_sq",
                "patch_sums",
            )
            if key not in state
        ]
        if missing:
            raise ValueError(f"{where}: state lacks {missing}")
        self._check_config(state, where)
        k = state["n_samples"]
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"{where}: n_samples must be an int ≥ 0, got {k!r}")
        sum_sq, sums = state["sum_sq"], state["patch_sums"]
        if not isinstance(sum_sq, torch.Tensor) or sum_sq.shape != self._sum_sq.shape or sum_sq.dtype != self._dtype:
            raise ValueError(f"{where}: sum_sq must be a {self._dtype} tensor of shape {self._shape}")
        if not isinstance(sums, dict) or set(sums) != {str(p) for p in self._sizes}:
            raise ValueError(f"{where}: patch_sums must hold the patch sizes {list(self._sizes)}")
        for p in self._sizes:
            t = sums[str(p)]
            if not isinstance(t, torch.Tensor) or t.shape != self._patch_sums[p].shape or t.dtype != self._dtype:
                raise ValueError(
                    f"{where}: patch_sums['{p}'] must be a {self._dtype} tensor of shape "
                    f"{tuple(self._patch_sums[p].shape)}"
                )
        self._sum_sq.copy_(sum_sq)
        for p in self._sizes:
            self._patch_sums[p].copy_(sums[str(p)])
        self._k = k
        return self
