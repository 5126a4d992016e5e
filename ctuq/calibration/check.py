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

The per-row arrays (:class:`HeldoutRows`) are everything the statistics need (:func:`ctuq.metrics.heldout.
heldout_check`, :meth:`HeldoutRows.score`), so a finished run's saved rows (:mod:`ctuq.calibration.rows`) are
rescored without rebuilding its posterior; the calibration methods fit themselves on the scored rows
(:meth:`ctuq.calibration.CalibrationMethod.fit`). The bias model's per-row weights ``w_i = Σ_j T_ij² M_j`` are
computed here, where ``T_h`` is at hand (:func:`ctuq.calibration.bias.bias_weight`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from ctuq.calibration.bias import bias_weight, object_mask
from ctuq.metrics.heldout import heldout_check
from ctuq.registry import CALIBRATIONS

__all__ = ["HELDOUT_SAMPLES", "HeldoutRows", "run_heldout_check", "add_bias_weights", "method_features", "add_features"]

HELDOUT_SAMPLES = 256
"""Posterior samples of the check: enough for ``k`` to ±1 % on the demo (its bootstrap s.e. is larger)."""


@dataclasses.dataclass
class HeldoutRows:
    """The held-out rows of a check, flat per row (sinogram units), and their scores.

    Attributes
    ----------
    residual : np.ndarray
        ``(m,)`` ``y_h − T_h x̂``.
    variance : np.ndarray
        ``(m,)`` the image part ``v_i`` of the predictive variance (from the projected posterior samples).
    noise_variance : float or np.ndarray
        ``σ²``, or ``(m,)`` per row (per-ray noise).
    groups : np.ndarray
        ``(m,)`` int: the scan's geometry row of each row's angle (the block labels of the bootstrap).
    photon_variance : np.ndarray or None
        ``(m,)`` each row's measurement variance from the scan's photon statistics; ``None`` without counts.
    bias_weight : np.ndarray or None
        ``(m,)`` ``w_i = Σ_j T_ij² M_j`` of the object mask (:func:`ctuq.calibration.bias.bias_weight`); ``None`` for
        rows saved before the bias model.
    meta : dict
        Sizes and provenance: ``n_samples``, ``n_angles``, ``n_used_angles``, ``noise_model``, ``command``.
    features : dict
        Image maps the registered calibration methods fit on (name → ``(H, W)`` float64, ≥ 0:
        :meth:`~ctuq.calibration.CalibrationMethod.image_features`).
    feature_weights : dict
        Their held-out row weights (name → ``(m,)`` float64, mm²: ``Σ_j T_ij² f_j``, as :attr:`bias_weight` is of the
        object mask).
    report : dict
        The scores (:meth:`score`): :func:`ctuq.metrics.heldout.heldout_check`'s dict plus :attr:`meta`; empty until
        scored.
    """

    residual: np.ndarray
    variance: np.ndarray
    noise_variance: float | np.ndarray
    groups: np.ndarray
    photon_variance: np.ndarray | None = None
    bias_weight: np.ndarray | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    report: dict = dataclasses.field(default_factory=dict)
    features: dict = dataclasses.field(default_factory=dict)
    feature_weights: dict = dataclasses.field(default_factory=dict)

    def score(self, *, n_bootstrap: int = 200, seed: int = 0) -> dict:
        """Score the rows (:func:`ctuq.metrics.heldout.heldout_check`, ``n_bootstrap`` block-bootstrap replicates
        seeded by ``seed``) into :attr:`report`, with :attr:`meta` added; returns it."""
        report = heldout_check(
            self.residual,
            np.zeros_like(self.residual),
            variance=self.variance,
            noise_variance=self.noise_variance,
            photon_variance=self.photon_variance,
            bias_weight=self.bias_weight,
            groups=self.groups,
            n_bootstrap=n_bootstrap,
            seed=seed,
        )
        report.update(self.meta)
        self.report = report
        return report

    @property
    def k(self) -> float:
        """The check's recalibration scale of the image std (scored rows)."""
        return float(self.report["scale"]["k"])

    @classmethod
    def concat(cls, parts) -> HeldoutRows:
        """The rows of ``parts`` (a non-empty sequence of :class:`HeldoutRows`) one after another, unscored; the
        optional arrays (photon variances, bias and feature weights) are kept where every part has them."""
        parts = list(parts)
        if not parts:
            raise ValueError("HeldoutRows.concat: no rows to join")

        def joined(get):
            got = [get(p) for p in parts]
            return None if any(g is None for g in got) else np.concatenate([np.asarray(g, np.float64) for g in got])

        sizes = [p.residual.size for p in parts]
        noise = [np.broadcast_to(np.asarray(p.noise_variance, np.float64), (n,)) for p, n in zip(parts, sizes)]
        names = set.intersection(*(set(p.feature_weights) for p in parts))
        return cls(
            residual=np.concatenate([np.asarray(p.residual, np.float64) for p in parts]),
            variance=np.concatenate([np.asarray(p.variance, np.float64) for p in parts]),
            noise_variance=np.concatenate(noise),
            groups=np.concatenate([np.asarray(p.groups) for p in parts]),
            photon_variance=joined(lambda p: p.photon_variance),
            bias_weight=joined(lambda p: p.bias_weight),
            meta=dict(parts[0].meta),
            features=dict(parts[0].features) if names else {},
            feature_weights={k: joined(lambda p, k=k: p.feature_weights[k]) for k in sorted(names)},
        )

    def take(self, index) -> HeldoutRows:
        """The rows ``index`` (integer array or boolean mask over the rows), unscored: a copy."""
        idx = np.asarray(index)

        def pick(a):
            return None if a is None else np.asarray(a)[idx]

        noise = self.noise_variance if np.ndim(self.noise_variance) == 0 else pick(self.noise_variance)
        return dataclasses.replace(
            self,
            residual=pick(self.residual),
            variance=pick(self.variance),
            noise_variance=noise,
            groups=pick(self.groups),
            photon_variance=pick(self.photon_variance),
            bias_weight=pick(self.bias_weight),
            feature_weights={k: pick(v) for k, v in self.feature_weights.items()},
            meta=dict(self.meta),
            report={},
        )


def add_bias_weights(rows: HeldoutRows, op, reconstruction, *, seed: int) -> HeldoutRows:
    """``rows`` with the bias weights of the held-out operator ``op`` (``T_h``) and the object mask of
    ``reconstruction`` (``op.image_shape``, mm⁻¹): a copy, unscored (for rows saved before the bias model).
    ``ValueError`` when ``op`` does not have one row per saved row."""
    if op.c != rows.residual.size:
        raise ValueError(f"{rows.residual.size} saved rows, but the held-out operator has {op.c}")
    weight = bias_weight(op, object_mask(np.asarray(reconstruction).reshape(op.image_shape)), seed=seed)
    return dataclasses.replace(rows, bias_weight=weight, report={})


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


def add_features(rows: HeldoutRows, op, reconstruction, companions: dict | None = None, *, seed: int) -> HeldoutRows:
    """``rows`` with the registered methods' image features (:func:`method_features`) and their row weights through
    the held-out operator ``op`` (``T_h``; :func:`ctuq.calibration.bias.bias_weight`): a copy, unscored, for rows
    saved before a method that needs them. ``ValueError`` when ``op`` does not have one row per saved row."""
    if op.c != rows.residual.size:
        raise ValueError(f"{rows.residual.size} saved rows, but the held-out operator has {op.c}")
    features = method_features(np.asarray(reconstruction).reshape(op.image_shape), companions)
    weights = {name: bias_weight(op, f, seed=seed) for name, f in features.items()}
    return dataclasses.replace(rows, features=features, feature_weights=weights, report={})


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
    """The held-out check of a fitted CT posterior (module docstring): the scored :class:`HeldoutRows`.

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
        Block-bootstrap replicates of ``k`` (angles resampled).
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
    rows = HeldoutRows(y - mean.numpy(), variance, noise, groups, photon, weight, meta, {}, features, weights)
    rows.score(n_bootstrap=n_bootstrap, seed=seed)
    rows.report["seconds"] = time.perf_counter() - t0
    return rows
