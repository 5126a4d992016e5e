"""The TV-PredCP hyperprior on a block's lengthscale (``docs/tv_predcp.md``).

Its complexity measure is the expected total variation of the prior image samples of block ``b`` alone,

    κ_b(θ) = E[TV(Φ v_b)],   v_b ~ N(0, a⁻¹ σ²_b (I ⊗ K(ℓ_b)))  (other blocks' weights zero),

with an exponential prior of rate ``λ`` on ``κ_b`` mapped to ``t_b = log ℓ_b`` by the change of variables::

    log p(t_b) = log λ − λ κ_b + log |∂κ_b / ∂t_b|.

``κ_b`` is a sum of Gaussian absolute values: with the anisotropic TV ``TV(x) = Σ_i |(D x)_i|`` (``D``: forward
differences along every image axis) and ``x`` Gaussian, ``E|(Dx)_i| = √(2/π) √V_i`` exactly, ``V_i = Var (Dx)_i``.
Because the prior acts on every filter through the same ``9 × 9`` matrix, ``V_i = σ²_b/a · tr(K(ℓ_b) G_{b,i})`` with
the *tap Gram matrix* ``G_{b,i} = Σ_f g_{i,f} g_{i,f}ᵀ`` (``g_{i,f}``: the gradient of difference ``i`` with respect to
the nine taps of filter ``f``), which does not depend on the hyperparameters. :func:`tap_grams` estimates it once,
without bias, from ``9 n`` JVPs per block (one normal number per filter, placed at each tap in turn), and
:func:`expected_tv` makes ``κ_b`` a smooth closed form of ``(ℓ_b, σ²_b)``: ``∂κ_b/∂t_b``, the hyperprior and its
gradient come from autograd at no Jacobian cost in every step (:func:`tv_predcp_terms`). (Reparametrised samples
``x = Φ L(θ) ξ`` instead give derivatives of ``κ`` whose variance, tried first, was ~100 % per step at 8 samples; the
sign-pattern surrogate of ``TV`` misses the curvature of ``|·|`` in the second derivative.) The variances have flat
priors: the hyperprior is a density on the lengthscales, which depends on ``σ_b`` through ``κ_b ∝ σ_b``, and the MAP
objective includes that dependence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ctuq.inference.priors.tv_predcp.blocks import JITTER, anisotropic_tv, tap_distances

if TYPE_CHECKING:
    from ctuq.inference.priors.tv_predcp.model import TVPredCPModel

__all__ = ["tap_grams", "expected_tv", "tv_predcp_terms"]


def tap_grams(
    prior: TVPredCPModel,
    image_map: Callable[[torch.Tensor], torch.Tensor],
    *,
    n_samples: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    chunk: int = 8,
) -> list[torch.Tensor]:
    """Per Matérn block ``b`` the tap Gram matrices ``Ĝ_b`` ``(m, 9, 9)`` float64 of the TV differences (module
    docstring of :func:`expected_tv`): unbiased estimates of ``G_{b,i} = Σ_f g_{i,f} g_{i,f}ᵀ``, where
    ``g_{i,f} ∈ R⁹`` is the gradient of difference ``i`` of the output with respect to the taps of filter ``f``.

    With one standard normal ``η_f`` per filter, ``z_p = D Φ (η placed at tap p of every filter)`` (9 JVPs) has
    ``E[z_p z_q] = G_pq``; ``Ĝ`` averages ``z zᵀ`` over ``n_samples`` draws of ``η`` (``9 n`` rows through
    ``image_map`` per block, ``9 chunk`` rows per call, drawn from ``generator`` (CPU) in float64). ``Ĝ`` does not
    depend on the hyperparameters, so a fit computes it once.
    """
    grams = []
    for i in prior.matern:
        b = prior.blocks[i]
        n_filters = b.n_weights // 9
        G = None
        for start in range(0, n_samples, chunk):
            k = min(chunk, n_samples - start)
            eta = torch.randn((k, n_filters), generator=generator, dtype=torch.float64)
            rows = torch.zeros((k, 9, prior.d), dtype=torch.float64)
            pos = 0
            for lo, hi in b.segments:
                nf = (hi - lo) // 9
                view = rows[:, :, lo:hi].view(k, 9, nf, 9)
                for p in range(9):
                    view[:, p, :, p] = eta[:, pos : pos + nf]
                pos += nf
            with torch.no_grad():
                X = image_map(rows.reshape(k * 9, prior.d).to(device=device, dtype=dtype)).double().cpu()
            Z = anisotropic_tv(X, prior.image_shape).reshape(k, 9, -1)  # (k, 9 taps, m)
            part = torch.einsum("kpi,kqi->ipq", Z, Z)
            G = part if G is None else G + part
        grams.append(G / n_samples)
    return grams


def expected_tv(
    gram: torch.Tensor, log_lengthscale: torch.Tensor, log_variance: torch.Tensor, a: float
) -> torch.Tensor:
    """``κ = E[TV(Φ v)] = √(2/π) Σ_i √V_i`` for one Matérn block's weights ``v ~ N(0, a⁻¹ σ² (I ⊗ K(ℓ)))`` and
    the anisotropic TV, with ``V_i = σ²/a · tr(K(ℓ) G_i)`` from the tap Gram matrices ``gram`` ``(m, 9, 9)``
    (:func:`tap_grams`); differentiable (any order) in the 0-dim ``log_lengthscale`` and ``log_variance``.

    Exact for the exact ``G`` (``E|N(0, V)| = √(2V/π)``); with :func:`tap_grams`' estimate the only bias is
    Jensen's in the square root, of relative order ``1/n``.
    """
    K = torch.exp(-tap_distances(3) / log_lengthscale.exp()) + JITTER * torch.eye(9, dtype=torch.float64)
    V = log_variance.exp() / a * torch.einsum("pq,ipq->i", K, gram)
    V = V[V > 1e-300]
    return math.sqrt(2.0 / math.pi) * V.sqrt().sum()


def tv_predcp_terms(
    prior: TVPredCPModel, grams: list[torch.Tensor], *, a: float
) -> tuple[float, torch.Tensor, list[dict]]:
    """The TV-PredCP log hyperprior ``Σ_b [log λ − λ κ_b + log |∂κ_b/∂t_b|]`` at the prior's current
    hyperparameters, its gradient in ``θ`` (:meth:`TVPredCPPrior.theta` order, ``(n_hyper,)`` float64; it depends on
    ``t_b = log ℓ_b`` and, through ``κ_b ∝ σ_b``, on ``log σ²_b``), and per Matérn block ``κ_b`` and
    ``∂κ_b/∂t_b``. ``grams``: :func:`tap_grams` of the prior; ``a``: the global prior precision (samples have
    covariance ``a⁻¹ L Lᵀ``). No Jacobian products: ``κ_b`` is a closed form of ``Ĝ_b``.
    """
    lam = prior.rate
    theta = prior.theta().requires_grad_(True)
    log_ell, log_var = prior.split(theta)
    total = torch.zeros((), dtype=torch.float64)
    details = []
    for j, i in enumerate(prior.matern):
        kappa = expected_tv(grams[j], log_ell[j], log_var[i], a)
        (k1,) = torch.autograd.grad(kappa, theta, create_graph=True)
        dk = k1[j]
        kv, dv = float(kappa.detach()), float(dk.detach())
        if not (kv > 0 and dv != 0 and math.isfinite(dv)):
            raise FloatingPointError(
                f"TV-PredCP: block {prior.blocks[i].name!r} has expected TV {kv:.3g} with derivative {dv:.3g} in "
                f"log ℓ; the hyperprior is undefined (does the block influence the output?)"
            )
        total = total + math.log(lam) - lam * kappa + dk.abs().log()
        details.append({"block": prior.blocks[i].name, "kappa": kv, "dkappa_dlog_ell": dv})
    (grad,) = torch.autograd.grad(total, theta)
    return float(total.detach()), grad.detach(), details
