"""The CT model of the linearised DIP: what makes :class:`ctuq.inference.LinearizedPosterior` a CT posterior.

* ``T`` as the output map of the linearised U-Net: ``Ψ₀ = T Φ`` (:func:`ct_features`), ``Φ`` over the
  convolution weights at the DIP weights ``ṽ`` (:class:`~ctuq.linearize.LinearizedNetwork`);
* the DIP's *scale* (data and image × ``scale``, 14 for the walnut): the network and the inference live in scaled
  units;
* the offset ``ỹ = y + T(Φṽ − g(ṽ))`` (the U-Net has no dense last layer, so it does not cancel; one JVP);
* ``σ²`` initialised from the DIP residual ``‖T g(ṽ) − y‖²/c`` unless given (with ``per_ray`` noise, the whitened
  residual ``mean((T g(ṽ) − y)²/d)``: :mod:`ctuq.pipeline.noise`), and by default learned.

:func:`ct_posterior` builds the (not yet set-up) posterior from these; the ``uq`` config section becomes its keyword
arguments through :func:`ctuq.pipeline.uq_settings.posterior_arguments`. The run around it (set-up, fit, streamed
moments, checkpoints) is :class:`ctuq.pipeline.uq.UQRun`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctuq.config import UQConfig
from ctuq.inference import LinearizedFeatures, LinearizedPosterior
from ctuq.linearize import LinearizedNetwork
from ctuq.memory import GIB
from ctuq.pipeline.noise import ResolvedNoise
from ctuq.pipeline.uq_settings import posterior_arguments

__all__ = ["ct_features", "ct_posterior"]


def ct_features(
    model: torch.nn.Module,
    net_input: torch.Tensor,
    op,
    *,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
):
    """``(network, Ψ₀)`` for CT: the linearised U-Net ``Φ`` and the unscaled features ``Ψ₀ = T Φ``.

    ``model`` maps ``net_input`` ``(1, C, *image_shape)`` to ``(1, 1, *image_shape)`` (scaled image units);
    ``op`` is the ray transform (its ``forward_flat``/``adjoint_flat`` are ``T``/``Tᵀ`` on flat images).
    ``memory_budget`` (bytes) bounds one chunk of Jacobian products; when not even one product fits, the first
    product raises :class:`ctuq.linearize.MemoryBudgetError` naming the sizes (default: automatic).
    """
    net = LinearizedNetwork(model, net_input, chunk_size=chunk_size, memory_budget=memory_budget)
    if net.d_out != op.d_x:
        raise ValueError(
            f"ct_features: the network outputs {tuple(net.output_shape)} ({net.d_out} values) but the "
            f"operator expects images of shape {op.image_shape} ({op.d_x} pixels)"
        )
    return net, LinearizedFeatures(net, op.forward_flat, op.adjoint_flat, n_outputs=op.c)


def ct_posterior(
    model: torch.nn.Module,
    net_input: torch.Tensor,
    op,
    y: torch.Tensor,
    *,
    scale: float = 1.0,
    settings: UQConfig | None = None,
    seed: int = 0,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    shard=None,
    noise: ResolvedNoise,
):
    """The (not yet set-up) posterior of a fitted DIP: ``(posterior, network, info)``.

    ``noise`` is the run's resolved noise model (:func:`resolve_noise`): it builds the likelihood, and with
    ``per_ray`` its relative variances ``d`` whiten the DIP residual that gives ``σ²₀``. ``info`` holds ``g0`` (the
    DIP output ``g(ṽ)``, flat ``(d_x,)``, scaled units), ``dip_residual_sigma2`` (``‖T g(ṽ) − y‖²/c``, scaled
    units), ``initial_sigma2`` and ``noise`` (the model; for ``per_ray`` also ``variance_mean``, the mean of the
    measurement variances in data units², and the range of ``d``). ``y`` (``op.measurement_shape``) is in data units
    (mm, not scaled).
    """
    settings = settings or UQConfig()
    rel = noise.relative
    budget = None if settings.memory_budget_gb is None else int(settings.memory_budget_gb * GIB)
    net, base = ct_features(model, net_input, op, chunk_size=settings.chunk_size, memory_budget=budget)
    y_s = (y.to(device=op.device, dtype=net.dtype) * scale).reshape(-1)
    with torch.no_grad():
        g0 = net.output()
        phi_v = net.jvp(net.params()[None])[0]
        delta = op.forward_flat((phi_v - g0)[None].to(op.dtype))[0].to(net.dtype)
        residual = op.forward_flat(g0[None].to(op.dtype))[0].to(net.dtype) - y_s
    dip_noise = float(residual.double().pow(2).mean())
    info: dict = {"noise": str(noise.model)}
    if rel is None:
        white_noise = dip_noise
    else:
        white_noise = float((residual.double().cpu().pow(2) / rel).mean())
        info.update(
            {
                "variance_mean": float(noise.measurement_variances.double().mean()),
                "relative_variance_min": float(rel.min()),
                "relative_variance_max": float(rel.max()),
                "whitened_residual_sigma2": white_noise,
            }
        )
    sigma2_0 = settings.noise_variance if settings.noise_variance is not None else white_noise
    if not sigma2_0 > 0:
        raise FloatingPointError(
            "the DIP fits the data exactly (zero residual); set uq.noise_variance to a positive value"
        )
    likelihood = noise.likelihood(sigma2_0, settings.learn_noise)
    args = posterior_arguments(settings)
    posterior = LinearizedPosterior(
        base,
        y_s + delta,
        likelihood=likelihood,
        seed=seed,
        progress=progress,
        log=log,
        shard=shard,
        **args,
    )
    # the prior completes its options from the reconstruction, in images of op.image_shape (TV-PredCP: its rate is
    # uq.tv_predcp.scale per TV of the reconstruction)
    posterior.weight_prior.prepare(output=g0, output_shape=tuple(op.image_shape))
    info.update({"g0": g0, "dip_residual_sigma2": dip_noise, "initial_sigma2": float(sigma2_0)})
    return posterior, net, info
