"""Image-space helpers the calibration methods share: the object mask, the held-out row weights of an image map, and
the streamed sample moments of a recalibrated posterior (scaled, or with a pixel variance added).

Generic: none of these knows a calibration method. :func:`object_mask` and :func:`bias_weight` are what the
held-out check (:mod:`ctuq.calibration.check`) and the design's forecast (:mod:`ctuq.design.forecast`) compute the
row weights ``Σ_j T_ij² f_j`` of an image map ``f`` with; :func:`scaled_moments`, :func:`biased_moments` and
:func:`moments_with_sums` are what a method's
:meth:`~ctuq.calibration.CalibrationMethod.apply_moments` is built from.
"""

from __future__ import annotations

import copy

import numpy as np
import scipy.sparse as sp
import torch
from scipy import ndimage

from ctuq.metrics import SampleMoments

__all__ = ["object_mask", "bias_weight", "moments_with_sums", "scaled_moments", "biased_moments"]

# the object of the bias model (docs/calibration.md, "τ alone"): x̂ smoothed by 1 px above 10 % of its maximum;
# measured with these values on 24 runs, not tuned
_MASK_FRACTION = 0.1
_MASK_SMOOTH_PX = 1.0
_BIAS_PROBES = 64  # Rademacher probes of diag(T M Tᵀ) for operators without an assembled matrix


def object_mask(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """The object of the bias model: ``image`` ``(H, W)`` (mm⁻¹) smoothed by a Gaussian of 1 px, above 10 % of its
    maximum. Returns ``(H, W)`` float64 0/1."""
    x = image.detach().to("cpu", torch.float64).numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    smooth = ndimage.gaussian_filter(np.asarray(x, np.float64), _MASK_SMOOTH_PX)
    return (smooth > _MASK_FRACTION * smooth.max()).astype(np.float64)


def bias_weight(op, mask: np.ndarray, *, seed: int = 0) -> np.ndarray:
    """``w_i = Σ_j T_ij² M_j`` ``(op.c,)`` float64 (mm²): the variance of held-out row ``i`` per unit ``τ²`` of a
    bias independent from pixel to pixel with variance map ``mask`` (``op.image_shape``; 0/1 for the object mask,
    any map ≥ 0 for an image feature). Exact from the assembled matrix of the sparse backend; otherwise the mean of
    ``(T(√M ⊙ ξ))²`` over 64 Rademacher probes ``ξ`` (unbiased)."""
    m = torch.as_tensor(np.asarray(mask, np.float64).reshape(-1))
    csr = getattr(op, "csr", None)
    if isinstance(csr, torch.Tensor):
        squared = sp.csr_matrix(
            (
                csr.values().detach().to("cpu", torch.float64).pow(2).numpy(),
                csr.col_indices().cpu().numpy(),
                csr.crow_indices().cpu().numpy(),
            ),
            shape=tuple(csr.shape),
        )
        return np.asarray(squared @ m.numpy(), np.float64)
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(op.c, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(_BIAS_PROBES):
            xi = (torch.randint(0, 2, m.shape, generator=gen) * 2 - 1).to(torch.float64) * m.sqrt()
            total += op.forward_flat(xi.reshape(1, -1).to(op.device, op.dtype))[0].double().cpu().pow(2)
    return (total / _BIAS_PROBES).numpy()


def moments_with_sums(moments: SampleMoments, new, **state) -> SampleMoments:
    """A copy of ``moments`` whose second-moment sums are ``new(sum, key)`` (``key``: ``"sum_sq"`` or a patch size;
    the recalibrated posterior's), with the other ``state`` entries replaced; ``moments`` is left unchanged."""
    sd = moments.state_dict()
    sums = {"sum_sq": new(sd["sum_sq"], "sum_sq"), "patch_sums": {p: new(t, p) for p, t in sd["patch_sums"].items()}}
    return copy.deepcopy(moments).load_state_dict({**sd, **state, **sums})


def scaled_moments(moments: SampleMoments, k: float) -> SampleMoments:
    """A copy of ``moments`` whose samples are ``k ×`` those fed to it (covariances × ``k²``): the statistics of the
    recalibrated posterior."""
    return moments_with_sums(moments, lambda t, _key: t * (k * k))


def biased_moments(moments: SampleMoments, variance: torch.Tensor) -> SampleMoments:
    """A copy of ``moments`` whose covariance has ``diag(variance)`` added (``variance``: ``image_shape``, mm⁻²,
    e.g. the bias model's ``τ² M``): pixel variances and every patch covariance of the joint LL gain it on their
    diagonal, as if the samples had an independent pixel noise of that variance. ``moments`` is left unchanged.

    The sums are exact, not sampled: fed through :meth:`SampleMoments.update` as ``P²`` deterministic images
    (``P`` the largest patch size) that each carry ``sqrt(k · variance)`` on one residue class of (row, column)
    modulo ``P``; two pixels of one patch never share a class, so no cross term appears."""
    k = moments.n_samples
    var = torch.as_tensor(variance, dtype=torch.float64)
    if tuple(var.shape) != moments.image_shape or not bool(torch.isfinite(var).all()) or bool((var < 0).any()):
        raise ValueError(
            f"biased_moments: variance must be finite, ≥ 0 and of shape {moments.image_shape}, got {tuple(var.shape)}"
        )
    extra = moments_with_sums(moments, lambda t, _key: torch.zeros_like(t), n_samples=0)
    period = max(moments.patch_sizes)
    amp = (var * k).sqrt()
    rows = torch.arange(amp.shape[-2]) % period
    cols = torch.arange(amp.shape[-1]) % period
    for a in range(period):
        on_row = (rows == a).to(torch.float64)[:, None]
        extra.update(torch.stack([amp * (on_row * (cols == b).to(torch.float64)[None, :]) for b in range(period)]))
    ed = extra.state_dict()
    return moments_with_sums(moments, lambda t, key: t + (ed["sum_sq"] if key == "sum_sq" else ed["patch_sums"][key]))
