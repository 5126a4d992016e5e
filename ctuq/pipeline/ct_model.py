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

import numpy as np
import torch

from ctuq.config import UQConfig
from ctuq.inference import LinearizedFeatures, LinearizedPosterior
from ctuq.linearize import LinearizedNetwork
from ctuq.memory import GIB
from ctuq.metrics import SampleMoments, uq_summary_from_moments
from ctuq.pipeline.noise import ResolvedNoise
from ctuq.pipeline.uq_settings import posterior_arguments

__all__ = ["ct_features", "ct_posterior", "CTPosterior"]


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


def _network(features) -> LinearizedNetwork:
    """The linearised network behind the features of a CT posterior: a :class:`LinearizedFeatures`, or one under
    the row subsets, row scalings and stacked blocks that ``restrict``, per-ray variances and ``extend`` put on it
    (every block of a stack shares the network)."""
    while not isinstance(features, LinearizedFeatures):
        features = features.blocks[0] if hasattr(features, "blocks") else features.base
    return features.network


class CTPosterior:
    """A fitted CT posterior in image units (``Run.posterior``): the linearised DIP's Gaussian posterior, whose
    samples are images in mm⁻¹ about the reconstruction ``x̂``.

    Parameters
    ----------
    posterior : LinearizedPosterior
        Set up and fitted, on the features ``Ψ₀ = T Φ`` of :func:`ct_features` (scaled units).
    mean : torch.Tensor
        ``image_shape`` reconstruction ``x̂`` (mm⁻¹).
    scale : float
        The DIP's data/image scale.
    """

    def __init__(self, posterior: LinearizedPosterior, mean: torch.Tensor, scale: float):
        self.linearized = posterior
        self.mean = mean.detach().cpu()
        self.scale = float(scale)

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.mean.shape)

    @property
    def n_measurements(self) -> int:
        """``c``: the measurements the posterior is conditioned on."""
        return int(self.linearized.n_outputs)

    def deviations(self, n: int, *, seed: int = 0, chunk_size: int = 64):
        """Zero-mean image samples ``x_j`` (mm⁻¹) in chunks ``(B, *image_shape)`` float32, ``n`` in all; chunk ``i``
        draws from its own generator ``(seed, i)``."""
        for _i, images, _ps in self.linearized.sample_outputs(n, chunk_size=chunk_size, seed=seed):
            yield (images / self.scale).detach().cpu().float().reshape(-1, *self.image_shape)

    def sample(self, n: int, *, seed: int = 0, chunk_size: int = 64) -> np.ndarray:
        """``n`` posterior image samples ``x̂ + x_j`` ``(n, *image_shape)`` float32 (mm⁻¹)."""
        dev = torch.cat(list(self.deviations(n, seed=seed, chunk_size=chunk_size)))
        return (self.mean.float()[None] + dev).numpy()

    def std(self, n_samples: int = 1024, *, seed: int = 0, chunk_size: int = 64) -> np.ndarray:
        """The pixelwise posterior std ``sqrt(mean_j x_j²)`` ``image_shape`` float32 (mm⁻¹) from ``n_samples``
        samples (uncalibrated: the run's ``std`` may add its held-out calibration)."""
        total = torch.zeros(self.image_shape, dtype=torch.float64)
        for chunk in self.deviations(n_samples, seed=seed, chunk_size=chunk_size):
            total += chunk.double().pow(2).sum(0)
        return (total / n_samples).sqrt().float().numpy()

    def log_likelihood(
        self, truth, *, n_samples: int = 1024, patch_sizes=range(1, 11), roi=None, seed: int = 0
    ) -> dict[str, float]:
        """The test log-likelihood of the image ``truth`` (``image_shape``, mm⁻¹) per pixel (nats): the marginal one
        and the joint one of non-overlapping ``p × p`` patches for each of ``patch_sizes`` (keys ``"marginal"``,
        ``"joint_<p>"``), from ``n_samples`` samples with the stabilised patch covariance of DESIGN.md §1; ``roi``
        a region as for :class:`ctuq.metrics.SampleMoments` (default the whole image)."""
        moments = SampleMoments(self.image_shape, roi=roi, patch_sizes=patch_sizes)
        for chunk in self.deviations(n_samples, seed=seed):
            moments.update(chunk)
        # a copy: torch takes no array of negative strides (np.flipud of an image)
        x = torch.as_tensor(np.array(truth, dtype=np.float64)).reshape(self.image_shape)
        summary = uq_summary_from_moments(x, self.mean.double(), moments)
        return {"marginal": float(summary["marginal_ll"]), **{f"joint_{p}": v for p, v in summary["joint_ll"].items()}}

    def restrict(self, angles, n_columns: int) -> CTPosterior:
        """The posterior given only the measured angles ``angles`` (indices into the run's angles; ``n_columns``
        detector columns each): same prior scales, ``a`` and ``σ²``, the solver set up anew."""
        idx = torch.as_tensor(np.asarray(angles, dtype=np.int64))
        rows = (idx[:, None] * n_columns + torch.arange(n_columns)[None]).reshape(-1)
        return CTPosterior(self.linearized.restrict(rows).setup(), self.mean, self.scale)

    def extend(self, op, y: torch.Tensor, variances: torch.Tensor | None = None) -> CTPosterior:
        """The posterior given also the measurements ``y`` (``op.measurement_shape``, data units) of the ray
        transform ``op`` (e.g. a scan's held-out angles: ``Scan.load().heldout``), with their per-ray
        ``variances`` where the likelihood whitens by them."""
        net = _network(self.linearized.base)
        features = LinearizedFeatures(net, op.forward_flat, op.adjoint_flat, n_outputs=op.c)
        with torch.no_grad():
            g0 = net.output()
            phi_v = net.jvp(net.params()[None])[0]
            delta = op.forward_flat((phi_v - g0)[None].to(op.dtype))[0].to(net.dtype)
        targets = (y.to(device=op.device, dtype=net.dtype) * self.scale).reshape(-1) + delta
        v = None if variances is None else variances.reshape(-1)
        return CTPosterior(self.linearized.extend(features, targets, v).setup(), self.mean, self.scale)

    def __repr__(self) -> str:
        return (
            f"CTPosterior(image {self.image_shape}, {self.n_measurements} measurements, prior "
            f"{self.linearized.prior}, a = {self.linearized.a:.4g}, σ² = {self.linearized.sigma2:.4g})"
        )
