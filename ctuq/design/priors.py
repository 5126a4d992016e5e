"""Building the design priors: isotropic, Matérn-½ (lengthscale by exact evidence) and the prior scale ``a``.

The hyperparameters are found on the pilot with the inference core's :class:`ctuq.inference.LinearizedPosterior`
on the pilot rows (``solver="exact_dual"``: the ``c_p × c_p`` kernel is eigendecomposed once, after which the
MacKay/EM updates of ``a`` and the log evidence are exact and cost nothing more):

* ``a`` by ``"em"``: the exact EM fixed point (maximum evidence) on the pilot, or by ``"energy"``: the prior
  predictive energy matches the measured one, ``tr(T K̄ Tᵀ)/a = ‖ỹ‖² − c σ²`` (the authors' g-prior scale:
  for unit-norm g-prior columns ``tr = d``);
* Matérn-½ lengthscale ``ℓ``: the grid value with the largest exact log evidence ``log N(y_p; 0, T_p K T_pᵀ + σ²I)``
  after fitting ``a`` at that ``ℓ`` by EM.

The linearised DIP is built in :mod:`ctuq.design.dip_prior`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ctuq.design.factors import IdentityFactor, MaternFactor
from ctuq.design.model import DesignModel
from ctuq.inference import DenseFeatures, GaussianLikelihood, LinearizedPosterior
from ctuq.options import DesignPriorKind, DesignPriorScale

__all__ = ["fit_precision", "energy_precision", "isotropic_model", "matern_model", "default_lengthscales"]


def _pilot_posterior(model: DesignModel, blocks, targets: torch.Tensor, learn_noise: bool) -> LinearizedPosterior:
    """The core posterior given the rows of ``blocks``, on features ``Ψ' = Q Λ^(1/2)`` with ``K̄ = Q Λ Qᵀ`` the
    kernel of those rows.

    The evidence, the EM updates of ``a`` (and ``σ²``) and everything else the dual solver computes depend on the
    features only through ``K̄ = ΨΨᵀ``; ``Ψ'`` has the same kernel with ``c_B`` instead of ``d`` columns, so the
    pilot's ``c_B × c_B`` kernel (:meth:`DesignModel.block_kernel`: sparse products, FFTs or a GEMM) is all the
    posterior needs — no ``c_B × d`` assembly of ``T L`` (``d = 4·d_x`` for Matérn).
    """
    K = model.block_kernel(blocks, blocks) * model.a  # T_B L diag(s)² Lᵀ T_Bᵀ, independent of a
    lam, Q = torch.linalg.eigh(0.5 * (K + K.T))
    features = DenseFeatures((Q * lam.clamp_min(0.0).sqrt()).to(torch.float64))
    return LinearizedPosterior(
        features,
        targets.reshape(-1).to(torch.float64),
        prior="isotropic",
        likelihood=GaussianLikelihood(model.sigma2, learn_noise),
        a=model.a,
        solver="exact_dual",
    ).setup()


def fit_precision(
    model: DesignModel,
    blocks: Sequence[int],
    targets: torch.Tensor,
    *,
    learn_noise: bool = False,
    max_steps: int = 200,
    tol: float = 1e-6,
) -> tuple[float, float, float]:
    """``(a, σ², log evidence)`` at the exact EM fixed point on the rows of ``blocks`` (targets ``(c_B,)``).

    Uses the core posterior with its exact dual solver on the kernel of those rows (:func:`_pilot_posterior`).
    """
    post = _pilot_posterior(model, blocks, targets, learn_noise)
    post.fit(max_steps=max_steps, tol=tol)
    return float(post.a), float(post.sigma2), float(post.log_evidence())


def energy_precision(trace: float, targets: torch.Tensor, sigma2: float) -> tuple[float, bool]:
    """``a = tr / (‖ỹ‖² − c σ²)`` (``tr`` = trace of the unscaled-precision prior kernel ``T K̄ Tᵀ`` on those rows).

    Returns ``(a, clipped)``; when the measured energy does not exceed the noise energy the denominator is
    floored at 1 % of ``‖ỹ‖²`` and ``clipped`` is true.
    """
    y = targets.double().reshape(-1)
    energy = float(y @ y)
    signal = energy - y.numel() * float(sigma2)
    clipped = signal <= 0.01 * energy
    return float(trace) / max(signal, 0.01 * energy, 1e-300), bool(clipped)


def _set_precision(model: DesignModel, blocks, targets, method: str, learn_noise: bool) -> DesignModel:
    """``model`` with ``a`` (and ``σ²`` when learned) set by ``method`` (``"em"`` or ``"energy"``) on the rows of
    ``blocks``, the method and its evidence or clipping recorded in ``info``."""
    if method == DesignPriorScale.EM:
        a, s2, ev = fit_precision(model, blocks, targets, learn_noise=learn_noise)
        return model.with_updates(
            a=a, sigma2=s2, info={**model.info, "prior_scale": DesignPriorScale.EM.value, "log_evidence": ev}
        )
    trace = float(model.block_kernel(blocks, blocks).diagonal().sum()) * model.a
    a, clipped = energy_precision(trace, targets, model.sigma2)
    return model.with_updates(
        a=a, info={**model.info, "prior_scale": DesignPriorScale.ENERGY.value, "energy_clipped": clipped}
    )


def isotropic_model(
    op,
    pilot: Sequence[int],
    y_pilot: torch.Tensor,
    sigma2: float,
    *,
    prior_scale: str = "em",
    learn_noise: bool = False,
) -> DesignModel:
    """``K = I/a`` over the pixels of ``op``'s image; ``a`` from the pilot measurements ``y_pilot`` (data units)."""
    factor = IdentityFactor(op.image_shape, dtype=op.dtype, device=op.device)
    model = DesignModel(
        op,
        factor,
        torch.ones(factor.d, dtype=op.dtype),
        a=1.0,
        sigma2=float(sigma2),
        image_prior=DesignPriorKind.ISOTROPIC.value,
    )
    method = DesignPriorScale.EM if prior_scale == DesignPriorScale.AUTO else prior_scale
    return _set_precision(model, pilot, y_pilot, method, learn_noise)


def default_lengthscales(image_shape) -> list[float]:
    """Grid of Matérn lengthscales (pixels): 9 values from 1 pixel to the image side, geometrically spaced."""
    return [float(v) for v in np.geomspace(1.0, float(max(image_shape)), 9)]


def matern_model(
    op,
    pilot: Sequence[int],
    y_pilot: torch.Tensor,
    sigma2: float,
    *,
    lengthscales: Sequence[float] | None = None,
    prior_scale: str = "em",
    learn_noise: bool = False,
    log: Callable[[str], None] | None = None,
) -> DesignModel:
    """Matérn-½ prior with the lengthscale of largest exact pilot evidence (grid search; ``a`` by EM at each ℓ).

    ``info`` records the grid, each ℓ's log evidence and ``a``, and the chosen ℓ. With ``prior_scale="energy"``
    the lengthscale is still chosen by evidence and ``a`` is then reset by the energy rule.
    """
    say = log or (lambda _m: None)
    grid = list(lengthscales) if lengthscales else default_lengthscales(op.image_shape)
    best, table = None, []
    for ell in grid:
        factor = MaternFactor(op.image_shape, ell, dtype=op.dtype, device=op.device)
        model = DesignModel(
            op,
            factor,
            torch.ones(factor.d, dtype=op.dtype),
            a=1.0,
            sigma2=float(sigma2),
            image_prior=DesignPriorKind.MATERN.value,
            info={"lengthscale": float(ell), "embedding_clipped": factor.clipped},
        )
        fitted = _set_precision(model, pilot, y_pilot, DesignPriorScale.EM, learn_noise)
        ev = fitted.info["log_evidence"]
        table.append({"lengthscale": float(ell), "log_evidence": ev, "a": fitted.a, "sigma2": fitted.sigma2})
        say(f"Matérn ℓ = {ell:.3g} px: log evidence {ev:.6g}, a = {fitted.a:.4g}")
        if best is None or ev > best.info["log_evidence"]:
            best = fitted
    if not math.isfinite(best.info["log_evidence"]):
        raise FloatingPointError("matern prior: the pilot evidence is not finite for any lengthscale")
    best.info["evidence_grid"] = table
    if prior_scale == DesignPriorScale.ENERGY:
        best = _set_precision(best, pilot, y_pilot, DesignPriorScale.ENERGY, learn_noise)
    return best
