"""The held-out check of a CT posterior: its samples projected onto the scan's unused angles, the rows scored.

A run uses every ``data.angular_subsampling``-th angle of its scan; the others are measurements the reconstruction
never saw. The loaded problem carries them (:attr:`ctuq.data.CTData.heldout`: the held-out operator ``T_h`` on the
run's image grid, the held-out sinogram ``y_h`` and their measurement variances), and :func:`run_heldout_check`
compares them with the posterior predictive ``N(T_h x̂, T_h Σ T_hᵀ + σ² I)``: ``x̂`` the DIP reconstruction, ``Σ``
from posterior image samples (the first ``n_samples`` of the run's own prediction samples: same seed), the noise
variance of each held-out row from the posterior's own likelihood
(:meth:`~ctuq.inference.likelihoods.Likelihood.noise_variance_of`: ``σ²``, or ``σ² v_h / mean(v_used)`` with
per-ray noise). Units: the posterior lives in the DIP's scaled units; samples are divided by ``scale`` and the noise
by ``scale²``, so the check is in the units of the sinogram (line integrals).

The per-row arrays (:class:`~ctuq.calibration.rows.HeldoutRows`) are everything the statistics and the calibration
methods need (:meth:`HeldoutRows.score <ctuq.calibration.rows.HeldoutRows.score>`,
:meth:`ctuq.calibration.CalibrationMethod.fit`), so a finished run's saved rows (:mod:`ctuq.calibration.rows`) are
rescored and refitted without rebuilding its posterior. The row weights of the image maps the methods fit on, ``Σ_j
T_ij² f_j`` (the object mask's, ``bias_weight``, and each registered method's image features), are computed here,
where ``T_h`` is at hand (:func:`ctuq.calibration.maps.bias_weight`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ctuq.calibration.maps import bias_weight, object_mask
from ctuq.calibration.rows import HeldoutRows
from ctuq.registry import CALIBRATIONS

__all__ = ["HELDOUT_SAMPLES", "run_heldout_check", "method_features"]

HELDOUT_SAMPLES = 256
"""Posterior samples of the check: enough for ``k`` to ±1 % on the demo (its bootstrap s.e. is larger)."""


def method_features(reconstruction, companions: dict | None = None) -> dict:
    """Every registered calibration method's :meth:`~ctuq.calibration.CalibrationMethod.image_features` of
    ``reconstruction`` (``(H, W)``, mm⁻¹) and its ``companions``, merged (name → float64 map)."""
    x = (
        reconstruction.detach().to("cpu", torch.float64).numpy()
        if isinstance(reconstruction, torch.Tensor)
        else reconstruction
    )
    x = np.asarray(x, np.float64)
    out = {}
    for method in CALIBRATIONS.values():
        out.update(method.image_features(x, companions))
    return out


def run_heldout_check(
    posterior,
    reconstruction: torch.Tensor,
    scale: float,
    held,
    *,
    noise_model: str,
    n_samples: int = HELDOUT_SAMPLES,
    chunk_size: int = 64,
    seed: int = 0,
    n_bootstrap: int = 200,
    command: str | None = None,
    companions: dict | None = None,
) -> HeldoutRows:
    """The held-out check of a fitted CT posterior (module docstring): the scored
    :class:`~ctuq.calibration.rows.HeldoutRows` (bootstrap settings ``n_bootstrap`` and ``seed``).

    Parameters
    ----------
    posterior : LinearizedPosterior
        Fitted; its ``sample_outputs`` yields zero-mean image samples ``(B, d_x)`` in scaled units and its
        ``likelihood`` answers the held-out rows' noise variance (``noise_variance_of``, scaled units²).
    reconstruction : torch.Tensor
        ``held.op.image_shape`` predictive mean ``x̂`` (mm⁻¹).
    scale : float
        The DIP scale.
    held : ctuq.data.HeldoutData
        The scan's held-out rows: ``op`` (``T_h``), ``y`` ``(n_angles, n_cols)``, ``geometry_rows``, ``n_used``,
        ``variances`` (their measurement variances, data units², or ``None``).
    noise_model : str
        The run's resolved ``uq.noise`` (``homoscedastic``/``per_ray``), recorded in the report.
    n_samples, chunk_size, seed : int
        Posterior samples (``seed``: the prediction's own, ``run seed + 1``, so these are the std map's first
        samples; it also seeds the bootstrap and the bias weights' probes).
    n_bootstrap : int
        Block-bootstrap replicates (angles resampled) of the check's statistics and of the methods' fits on the rows.
    command : str, optional
        The command that reproduces the check, recorded in the report.
    companions : dict, optional
        The run's other reconstructions by name (``"fbp"``, ``"tv"``: ``image_shape``, mm⁻¹), for the calibration
        methods whose image features use them (:func:`method_features`).
    """
    t0 = time.perf_counter()
    op = held.op
    with torch.no_grad():
        x = reconstruction.reshape(1, -1).to(op.device, op.dtype)
        mean = op.forward_flat(x)[0].double().cpu()
        sum_sq = torch.zeros(op.c, dtype=torch.float64)
        k = 0
        for _i, images, _ps in posterior.sample_outputs(n_samples, chunk_size=chunk_size, seed=seed):
            proj = op.forward_flat((images / scale).to(op.device, op.dtype)).double().cpu()
            sum_sq += proj.pow(2).sum(0)
            k += proj.shape[0]
    variance = (sum_sq / k).numpy()
    noise = posterior.likelihood.noise_variance_of(held.variances, target_scale=scale)
    noise = noise.numpy() if isinstance(noise, torch.Tensor) else noise
    photon = None
    if held.variances is not None:
        photon = held.variances.detach().to("cpu", torch.float64).reshape(-1).numpy()
    groups = np.repeat(held.geometry_rows, op.c // held.n_angles)
    y = held.y.reshape(-1).double().cpu().numpy()
    weight = bias_weight(op, object_mask(reconstruction.reshape(op.image_shape)), seed=seed)
    meta = {"n_samples": int(k), "n_angles": held.n_angles, "n_used_angles": int(held.n_used)}
    meta["noise_model"] = str(noise_model)
    if command is not None:
        meta["command"] = command
    features = method_features(reconstruction.reshape(op.image_shape), companions)
    weights = {name: bias_weight(op, f, seed=seed) for name, f in features.items()}
    rows = HeldoutRows(
        y - mean.numpy(), variance, noise, groups, photon, weight, meta, {}, features, weights, n_bootstrap, seed
    )
    rows.score()
    rows.report["seconds"] = time.perf_counter() - t0
    return rows
