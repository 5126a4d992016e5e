"""``uq.calibration: spatial``: a bias variance with a spatial shape, fitted on the held-out rows (issue 37).

The bias model (:mod:`ctuq.calibration.bias`) adds one constant variance inside the object: it fixes the std map's
scale but not where it is bright. This method adds a non-negative combination of image maps ``f_k`` that say where a
reconstruction tends to be wrong, and widens the posterior's own variance by a factor:

    std_spatial² = (1 + w_post) · std² + Σ_k w_k f_k,        w ≥ 0,

with the maps (each scaled to mean 1 inside the object mask ``M``, so every ``w_k`` is a variance in mm⁻²):

* ``object``: ``M`` itself (the bias model's term);
* ``edges``: the gradient energy ``|∇x̂|²`` of the reconstruction (errors sit on edges and fine structure);
* ``disagreement``: ``(x̂ − x_alt)²`` smoothed by 1 px, ``x_alt`` the run's TV reconstruction, else its FBP (two
  reconstructions of the same data disagree where the data leave the image open).

The held-out rows see each term through the squared held-out operator, ``W_ik = Σ_j T_ij² f_kj`` (computed by the
check: :attr:`~ctuq.calibration.HeldoutRows.feature_weights`), so the weights are the maximum-likelihood solution of

    r_i ~ N(0, s_i),   s_i = (1 + w_post) v_i + σ²_i + Σ_k w_k W_ik,

the shared fit of :mod:`ctuq.calibration.likelihood` with ``base = v + σ²`` and the columns ``[v, W_1, …]``
(L-BFGS-B on the scaled weights, bounds ``w ≥ 0``). A term the held-out rows cannot see gets weight 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy import ndimage

from ctuq.calibration.base import CalibrationMethod
from ctuq.calibration.likelihood import fit_linear_variance
from ctuq.calibration.maps import biased_moments, object_mask, scaled_moments
from ctuq.metrics import SampleMoments
from ctuq.registry import CALIBRATIONS

__all__ = ["SpatialBias", "FEATURES"]

#: The image maps of the method, in the order of its weights (the feature names the check stores: ``spatial_<name>``).
FEATURES = ("object", "edges", "disagreement")
_PREFIX = "spatial_"
_DISAGREEMENT_SMOOTH_PX = 1.0


def _unit_inside(image: np.ndarray, mask: np.ndarray) -> np.ndarray | None:
    """``image`` scaled to mean 1 inside ``mask`` (``None`` when it is zero there)."""
    mean = float(image[mask > 0].mean()) if mask.any() else 0.0
    return image / mean if mean > 0 and np.isfinite(mean) else None


@CALIBRATIONS.register
class SpatialBias(CalibrationMethod):
    """The spatial bias model (module docstring).

    Parameters
    ----------
    w_posterior : float
        ``w_post ≥ 0``: the posterior variance is widened by ``1 + w_post``.
    weights : dict
        ``{feature: w_k ≥ 0}`` (mm⁻²) for the features of ``maps``.
    maps : dict
        ``{feature: (H, W) float64 map}``, each of mean 1 inside the object.
    """

    name = "spatial"
    summary = (
        "sqrt((1 + w) std² + Σ w_k f_k): the posterior widened and a bias shaped by the object, the reconstruction's "
        "edges and its disagreement with TV/FBP, fitted on the held-out rows"
    )
    report_keys = ("k", "w_posterior", "w_object", "w_edges", "w_disagreement")
    summary_fields = ("w_posterior", "w_object", "w_edges", "w_disagreement")
    parameters = ("w_posterior", "w_object", "w_edges", "w_disagreement")
    # an option, not a default (docs/calibration.md, "Where the errors are"): the study scores it when asked
    study_default = False

    def __init__(self, w_posterior: float, weights: dict, maps: dict):
        w_posterior = float(w_posterior)
        bad = {k: v for k, v in {"posterior": w_posterior, **weights}.items() if not (v >= 0 and np.isfinite(v))}
        if bad:
            raise ValueError(f"SpatialBias: weights must be finite and ≥ 0, got {bad}")
        unknown = sorted(set(weights) - set(FEATURES)) + sorted(set(weights) - set(maps))
        if unknown:
            raise ValueError(f"SpatialBias: weights without a known feature or a map: {unknown}")
        self.w_posterior = w_posterior
        self.weights = {k: float(weights[k]) for k in FEATURES if k in weights}
        self.maps = {k: np.asarray(maps[k], np.float64) for k in self.weights}
        shape = next(iter(self.maps.values())).shape if self.maps else None
        # Σ_k w_k f_k (mm⁻²): the pixel variance the bias terms add, float64
        self.variance = sum((w * self.maps[k] for k, w in self.weights.items()), np.zeros(shape or (0,)))

    # ------------------------------------------------------------------------------------------ features
    @classmethod
    def image_features(cls, reconstruction, companions: dict | None = None) -> dict:
        """``spatial_object``, ``spatial_edges`` and (with a TV or FBP companion) ``spatial_disagreement`` of
        ``reconstruction`` (module docstring); each of mean 1 inside the object mask."""
        x = np.asarray(reconstruction, np.float64)
        if x.ndim != 2:  # volumes: not built (the held-out check is 2D only)
            return {}
        mask = object_mask(x)
        gy, gx = np.gradient(x)
        maps = {"object": mask, "edges": gy**2 + gx**2}
        alt = next((companions[k] for k in ("tv", "fbp") if companions and companions.get(k) is not None), None)
        if alt is not None:
            alt = alt.detach().to("cpu", torch.float64).numpy() if isinstance(alt, torch.Tensor) else alt
            alt = np.asarray(alt, np.float64).reshape(x.shape)
            maps["disagreement"] = ndimage.gaussian_filter((x - alt) ** 2, _DISAGREEMENT_SMOOTH_PX)
        out = {}
        for name, image in maps.items():
            unit = _unit_inside(image, mask)
            if unit is not None:
                out[_PREFIX + name] = unit
        return out

    # ------------------------------------------------------------------------------------------ fitting
    @classmethod
    def fit(cls, rows, reconstruction=None) -> SpatialBias | None:
        """The maximum-likelihood weights on the held-out ``rows`` (module docstring); ``None`` without rows or
        without the object feature's row weights."""
        if rows is None or _PREFIX + "object" not in rows.feature_weights:
            return None
        names = [k for k in FEATURES if _PREFIX + k in rows.feature_weights]
        r = np.asarray(rows.residual, np.float64)
        v = np.asarray(rows.variance, np.float64)
        n = np.broadcast_to(np.asarray(rows.noise_variance, np.float64), r.shape)
        W = np.stack([np.asarray(rows.feature_weights[_PREFIX + k], np.float64) for k in names], axis=1)
        w, _ = fit_linear_variance(r, v + n, np.concatenate([v[:, None], W], axis=1))
        return cls(w[0], dict(zip(names, w[1:])), {k: rows.features[_PREFIX + k] for k in names})

    def row_variance(self, rows) -> np.ndarray:
        """``(1 + w_post) v_i + Σ_k w_k (T² f_k)_i + σ²_i`` (``ValueError`` for rows without the features' weights)."""
        missing = [k for k in self.weights if _PREFIX + k not in rows.feature_weights]
        if missing:
            raise ValueError(f"SpatialBias.row_variance: the rows carry no weights of the features {missing}")
        out = (1.0 + self.w_posterior) * np.asarray(rows.variance, np.float64)
        out = out + np.asarray(rows.noise_variance, np.float64)
        for k, w in self.weights.items():
            out = out + w * np.asarray(rows.feature_weights[_PREFIX + k], np.float64)
        return out

    @classmethod
    def from_state(cls, state: dict) -> SpatialBias:
        weights = {k: state[f"w_{k}"] for k in FEATURES if state.get(f"w_{k}") is not None}
        return cls(state["w_posterior"], weights, {k: state[f"map_{k}"] for k in weights})

    # ------------------------------------------------------------------------------------------ applying
    def apply_std(self, std):
        """``sqrt((1 + w_post) std² + Σ w_k f_k)`` in float64 (numpy's arithmetic for torch and numpy input alike),
        returned in ``std``'s type, dtype (and device)."""
        if isinstance(std, torch.Tensor):
            out = self.apply_std(std.detach().to("cpu", torch.float64).numpy())
            return torch.from_numpy(out).to(device=std.device, dtype=std.dtype)
        std = np.asarray(std)
        var = std.astype(np.float64) ** 2 * (1.0 + self.w_posterior) + self.variance
        return np.sqrt(var).astype(std.dtype, copy=False)

    def apply_moments(self, moments: SampleMoments) -> SampleMoments:
        """The moments scaled by ``sqrt(1 + w_post)`` (:func:`~ctuq.calibration.maps.scaled_moments`), with
        ``Σ w_k f_k`` on every diagonal (:func:`~ctuq.calibration.maps.biased_moments`)."""
        out = scaled_moments(moments, (1.0 + self.w_posterior) ** 0.5) if self.w_posterior > 0 else moments
        return biased_moments(out, torch.from_numpy(self.variance)) if self.variance.any() else out

    # ------------------------------------------------------------------------------------------ reporting
    def report(self) -> dict:
        """``k`` (``None``), ``w_posterior`` and ``w_<feature>`` (mm⁻²; ``None`` for a feature the rows lacked)."""
        return {
            "k": None,
            "w_posterior": self.w_posterior,
            **{f"w_{k}": self.weights.get(k) for k in FEATURES},
        }

    def describe(self) -> str:
        terms = ", ".join(f"{k} {w:.2g}" for k, w in self.weights.items() if w > 0) or "no bias term"
        return f"sqrt({1 + self.w_posterior:.3g} std² + Σ w_k f_k), w: {terms} mm⁻²"

    @classmethod
    def predicted_rms(cls, report: dict, rms_std: float) -> float:
        """``sqrt((1 + w_post) rms_std² + Σ_k w_k)``: each map has mean 1 inside the object mask, when the mask is
        that of the reconstruction the maps were made from (as the design's forecast has it)."""
        extra = sum(report[f"w_{k}"] for k in FEATURES if report.get(f"w_{k}") is not None)
        return math.sqrt((1.0 + report["w_posterior"]) * rms_std**2 + extra)

    def state_dict(self) -> dict:
        """The report plus the feature maps (float64 arrays, ``map_<feature>``)."""
        return {**super().state_dict(), **{f"map_{k}": m.copy() for k, m in self.maps.items()}}
