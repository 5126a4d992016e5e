"""How many angles: the predicted error of a scan not yet taken, its online calibration, and the stop rule.

Notation (``docs/experimental_design.md`` §7). After the chosen angles ``τ`` the design engine's posterior gives the
pixel variance ``v_τ(x)`` of the image (``DesignEngine.posterior_variance``, sampled) and, for every candidate row,
its predictive mean ``μ = T̄x̂ + T̄ K T^τᵀ C_τ⁻¹ (y_τ − T^τ x̂)`` around the pilot reconstruction ``x̂`` and the image
part ``v_i`` of its predictive variance. A calibration method of :data:`ctuq.registry.CALIBRATIONS`
(``design.calibration``: any registered one, e.g. ``heldout``: the scale ``k``; ``bias``: a bias ``τ`` inside the
object mask ``M``; ``none``) is fitted on rows whose measurements the posterior has not seen, as ``ctuq uq`` fits it
on the scan's unused angles (the rows carry the bias weights of ``M`` and the row weights of the method's image
features, :meth:`~ctuq.calibration.CalibrationMethod.image_features`):

* **at the pilot**: the candidates not in the pilot (the scan measured them; a plan made before any further
  scanning has only those);
* **online**: before an acquired angle is conditioned on, its rows are unseen: their residuals ``y_β − μ_β`` are
  scored against the calibration fitted on the earlier ones (its
  :meth:`~ctuq.calibration.CalibrationMethod.row_variance`: a prequential check of coverage, ``z²``, log-likelihood)
  and then join the fit.

The **predicted RMS error** after ``τ`` is the calibrated std map's root mean square inside the object mask ``M``
of the pilot reconstruction (the bias model's mask), ``sqrt(mean_M(c(√v_τ)²))``, ``c`` the fitted method's
:meth:`~ctuq.calibration.CalibrationMethod.apply_std` (mm⁻¹); its 95 % band comes from refitting the method on
block-bootstrap resamples of the rows (angles drawn with replacement; each refit is the method's
:meth:`~ctuq.calibration.CalibrationMethod.fit` on the resampled rows, a point fit without a bootstrap of its own).
The predicted PSNR uses the whole image and
an intensity range (the ground truth's, else ``design.intensity_range``).

A :class:`StopRule` reads targets with units (``0.002/mm``, ``30dB``, ``1%``) and says after each acquisition
whether the calibrated prediction meets them.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import torch

from ctuq.calibration.maps import bias_weight, object_mask
from ctuq.calibration.rows import HeldoutRows
from ctuq.design.candidates import DesignError
from ctuq.metrics.image import psnr_from_mse
from ctuq.options import ForecastUpdate, values
from ctuq.registry import CALIBRATIONS

__all__ = [
    "Target",
    "parse_target",
    "StopRule",
    "RowPredictor",
    "ErrorForecaster",
    "OnlineCalibration",
    "forecast_counts",
]

_Z90 = 1.6448536269514722  # Φ⁻¹(0.95): the central 90 % interval
_MIN_ONLINE_ANGLES = 3  # below this the online fit adds the pilot's rows: 1-2 angles are too few rows in blocks


# ---------------------------------------------------------------------------------------------- targets
@dataclasses.dataclass(frozen=True)
class Target:
    """A stop target. ``kind``: ``rmse`` (value in mm⁻¹), ``psnr`` (dB) or ``min_gain`` (mm⁻¹, or a fraction of the
    current predicted error when ``relative``); ``text`` as the user wrote it."""

    kind: str
    value: float
    relative: bool = False
    text: str = ""

    def describe(self) -> str:
        if self.kind == "rmse":
            return f"predicted RMS error ≤ {self.value:.4g} mm⁻¹"
        if self.kind == "psnr":
            return f"predicted PSNR ≥ {self.value:.4g} dB"
        gain = f"{100 * self.value:.3g} %" if self.relative else f"{self.value:.4g} mm⁻¹"
        return f"the last angle improved the predicted RMS error by less than {gain}"


_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_PER_MM = r"(?:/mm|1/mm|mm\^-1|mm-1|mm⁻¹)"
_UNITS = {
    "rmse": (re.compile(rf"^{_NUMBER}\s*{_PER_MM}$"), "mm⁻¹, e.g. 0.002/mm"),
    "psnr": (re.compile(rf"^{_NUMBER}\s*dB$", re.IGNORECASE), "dB, e.g. 30dB"),
    "min_gain": (re.compile(rf"^{_NUMBER}\s*({_PER_MM}|%)$"), "mm⁻¹ or %, e.g. 0.0001/mm or 1%"),
}
_OPTION = {"rmse": "--target-rmse", "psnr": "--target-psnr", "min_gain": "--min-gain"}


def parse_target(kind: str, text) -> Target:
    """The :class:`Target` of ``kind`` (``rmse``, ``psnr``, ``min_gain``) written as ``text`` with its unit.

    :class:`DesignError` naming the option for a value without a unit, with another unit, not positive or not
    finite (a bare ``0.002`` is refused: in mm⁻¹ or in a scan's own units it means two different scans)."""
    option = _OPTION[kind]
    pattern, units = _UNITS[kind]
    raw = str(text).strip()
    got = pattern.match(raw)
    if got is None:
        try:
            float(raw)
            why = "has no unit"
        except ValueError:
            why = "is not a number with a unit"
        raise DesignError(f"{option}: {raw!r} {why}; give it in {units}")
    value = float(got.group(1))
    relative = kind == "min_gain" and got.group(2) == "%"
    if not (math.isfinite(value) and value > 0):
        raise DesignError(f"{option}: {raw!r} must be positive and finite")
    return Target(kind, value / 100.0 if relative else value, relative, raw)


class StopRule:
    """Stop when the calibrated prediction meets a :class:`Target` (or never, without one).

    :meth:`met` takes the forecast records of the counts so far (``rmse``, ``psnr``; the last is the current one).
    """

    def __init__(self, target: Target | None):
        self.target = target

    @classmethod
    def from_settings(cls, target_rmse=None, target_psnr=None, min_gain=None) -> StopRule:
        """The rule of at most one given target (``design.target_rmse`` …); :class:`DesignError` for two."""
        given = {k: v for k, v in (("rmse", target_rmse), ("psnr", target_psnr), ("min_gain", min_gain)) if v}
        if len(given) > 1:
            raise DesignError(f"{' / '.join(_OPTION[k] for k in given)}: give one stop target, not {len(given)}")
        if not given:
            return cls(None)
        ((kind, text),) = given.items()
        return cls(parse_target(kind, text))

    def __bool__(self) -> bool:
        return self.target is not None

    def met(self, history: list[dict]) -> bool:
        """Whether the last record of ``history`` meets the target (``min_gain``: its drop from the one before)."""
        t, now = self.target, history[-1]
        if t is None:
            return False
        if t.kind == "rmse":
            return now["rmse"] <= t.value
        if t.kind == "psnr":
            return now.get("psnr") is not None and now["psnr"] >= t.value
        if len(history) < 2:
            return False
        gain = history[-2]["rmse"] - now["rmse"]
        return gain < (t.value * now["rmse"] if t.relative else t.value)

    def reachable(self, best: dict) -> str | None:
        """``None`` when the forecast ``best`` (the lowest predicted error the candidates and the step budget allow,
        with its band) can meet the target; else the one-line reason."""
        t = self.target
        if t is None or t.kind == "min_gain":
            return None
        if t.kind == "rmse" and best["rmse_band"][0] > t.value:
            return (
                f"--target-rmse: {t.text} is below the predicted RMS error after {best['count']} angles, the most "
                f"the candidates and --acquire allow ({best['rmse']:.4g} mm⁻¹, 95 % band "
                f"{best['rmse_band'][0]:.4g}–{best['rmse_band'][1]:.4g}); raise the target or --acquire"
            )
        if t.kind == "psnr":
            if best.get("psnr") is None:
                return "--target-psnr: the scan has no ground truth; give its intensity range (design.intensity_range)"
            if best["psnr_band"][1] < t.value:
                return (
                    f"--target-psnr: {t.text} is above the predicted PSNR after {best['count']} angles, the most the "
                    f"candidates and --acquire allow ({best['psnr']:.2f} dB, 95 % band {best['psnr_band'][0]:.2f}–"
                    f"{best['psnr_band'][1]:.2f}); lower the target or raise --acquire"
                )
        return None


def forecast_counts(first: int, last: int, points: int) -> list[int]:
    """About ``points`` angle counts from ``first`` to ``last`` (both included), evenly spaced, distinct."""
    if last <= first:
        return [int(first)]
    return sorted({int(round(c)) for c in np.linspace(first, last, max(2, int(points)))})


# ---------------------------------------------------------------------------------------------- rows
class RowPredictor:
    """The rows of candidate angles as held-out rows under the engine's current posterior.

    Parameters
    ----------
    center : torch.Tensor
        ``x̂`` ``(d_x,)`` mm⁻¹: the reconstruction the Gaussian is centred on (the pilot DIP; :meth:`recenter` after
        a retraining).
    y : torch.Tensor
        ``(n_candidates, k)`` measurements (data units); only the chosen angles' rows and those predicted are read.
    model : DesignModel
        For the operator, ``image_scale`` and the bias weights of its rows.
    mask : np.ndarray
        The object mask ``M`` (image shape, 0/1) of the bias model's row weights ``Σ_j T_ij² M_j``.
    features : dict, optional
        Image maps (name → image shape, ≥ 0) whose row weights ``Σ_j T_ij² f_j`` the rows carry (the forecast's
        calibration method's :meth:`~ctuq.calibration.CalibrationMethod.image_features`: :attr:`ErrorForecaster.
        features`).
    seed : int
        Seeds the probes of the row weights on an operator without an assembled matrix.
    """

    def __init__(self, center: torch.Tensor, y: torch.Tensor, model, mask: np.ndarray, *, seed: int = 0, features=None):
        self.op = model.op
        self.k, self.n = model.k, model.n_candidates
        self.y = y.detach().double().cpu().reshape(self.n, self.k)
        self.center = None
        self.recenter(center)
        self.bias = bias_weight(self.op, mask, seed=seed).reshape(self.n, self.k)
        self.features = dict(features or {})
        self.feature_weights = {
            name: bias_weight(self.op, f, seed=seed).reshape(self.n, self.k) for name, f in self.features.items()
        }

    def recenter(self, center: torch.Tensor) -> None:
        """Centre the predictions on ``center`` ``(d_x,)`` (mm⁻¹): a retrained reconstruction. A no-op for the
        tensor already in use."""
        if center is self.center:
            return
        op = self.op
        with torch.no_grad():
            proj = op.forward_flat(center.reshape(1, -1).to(op.device, op.dtype))[0]
        self.center = center
        self.center_proj = proj.double().cpu().reshape(self.n, self.k)  # data units

    def rows(self, engine, blocks) -> HeldoutRows:
        """The rows of candidate ``blocks`` given the engine's chosen angles (data units): residuals ``y − μ``, the
        image part of their predictive variance, ``σ²``, the angle as group, the bias and feature weights; no
        bootstrap of their own (the forecaster resamples them itself)."""
        blocks = [int(b) for b in blocks]
        mdl = engine.model
        s = float(mdl.image_scale)
        mu = engine.conditional_mean(s * self.center_proj, s * self.y[engine.chosen], blocks) / s
        var = engine.predictive_variance(blocks) / s**2
        return HeldoutRows(
            residual=(self.y[blocks] - mu).reshape(-1).numpy(),
            variance=var.reshape(-1).numpy(),
            noise_variance=float(mdl.sigma2) / s**2,
            groups=np.repeat(np.asarray(blocks), self.k),
            bias_weight=self.bias[blocks].reshape(-1).copy(),
            meta={"n_angles": len(blocks), "n_used_angles": len(engine.chosen)},
            features=self.features,
            feature_weights={name: w[blocks].reshape(-1).copy() for name, w in self.feature_weights.items()},
            n_bootstrap=0,
        )


# ---------------------------------------------------------------------------------------------- forecast
class ErrorForecaster:
    """A calibration method fitted on rows, applied to posterior variance maps: the predicted error with its band.

    Parameters
    ----------
    method : str
        A name of :data:`ctuq.registry.CALIBRATIONS` (``design.calibration``).
    reconstruction : array-like
        The pilot reconstruction ``x̂`` (image shape, mm⁻¹): its object mask ``M``
        (:func:`ctuq.calibration.maps.object_mask`) is where the RMS error is predicted, and the method's image
        features (:attr:`features`) are its.
    companions : dict, optional
        The pilot's other reconstructions by name (``"fbp"``, ``"tv"``), for methods whose features use them.
    data_range : float, optional
        The intensity range (mm⁻¹) of the predicted PSNR; ``None``: no PSNR.
    n_bootstrap : int
        Block-bootstrap refits of the method for the band (angles resampled with replacement).
    seed : int
        Seeds the bootstrap.
    """

    def __init__(
        self,
        method: str,
        reconstruction,
        *,
        companions: dict | None = None,
        data_range=None,
        n_bootstrap: int = 50,
        seed: int = 0,
    ):
        if method not in CALIBRATIONS:
            raise DesignError(f"design.calibration must be one of {list(CALIBRATIONS.names())}, got {method!r}")
        x = reconstruction.detach().cpu().numpy() if isinstance(reconstruction, torch.Tensor) else reconstruction
        self.reconstruction = np.asarray(x, np.float64)
        self.name, self.mask = method, object_mask(self.reconstruction)
        if not self.mask.any():
            raise DesignError("the pilot reconstruction has no object (its object mask is empty): nothing to forecast")
        self.cls = CALIBRATIONS[method]
        #: the image maps the method fits on (name → image shape, float64): their row weights come with the rows
        self.features = self.cls.image_features(self.reconstruction, companions)
        self.data_range = None if data_range is None else float(data_range)
        self.n_bootstrap, self.seed = int(n_bootstrap), int(seed)
        self.method = None
        self.replicates: list = []
        self.n_rows = 0

    def fit_once(self, rows: HeldoutRows):
        """The method fitted on ``rows`` alone (a point fit: no bootstrap of the method's own), or ``None`` when it
        cannot be fitted on them."""
        return self.cls.fit(dataclasses.replace(rows, n_bootstrap=0, report={}), self.reconstruction)

    def fit(self, rows: HeldoutRows) -> ErrorForecaster:
        """Fit the method on ``rows`` and on ``n_bootstrap`` block-bootstrap resamples of them (:meth:`fit_once`
        each: nothing else is scored); returns self."""
        self.method = self.fit_once(rows)
        self.n_rows = int(rows.residual.size)
        groups = np.asarray(rows.groups)
        labels, inverse = np.unique(groups, return_inverse=True)
        members = [np.flatnonzero(inverse == j) for j in range(len(labels))]
        gen = np.random.default_rng(self.seed)
        self.replicates = []
        for _ in range(self.n_bootstrap if len(labels) > 1 else 0):
            pick = gen.integers(0, len(labels), len(labels))
            self.replicates.append(self.fit_once(rows.take(np.concatenate([members[j] for j in pick]))))
        return self

    def report(self) -> dict:
        """The fitted method (its :meth:`report`) and the rows it was fitted on."""
        return {"method": self.name, **(self.method.report() if self.method else {}), "n_rows": self.n_rows}

    def _errors(self, method, var: np.ndarray) -> tuple[float, float]:
        cal = np.asarray(method.apply_std(np.sqrt(var)), np.float64) ** 2
        return math.sqrt(float(cal[self.mask > 0].mean())), float(cal.mean())

    def predict(self, variance, count: int) -> dict:
        """The forecast of a posterior pixel variance map ``variance`` (image shape or flat, mm⁻²) after ``count``
        angles: ``rmse`` (mm⁻¹, inside ``M``) with ``rmse_band`` (95 %), ``rms_std`` (the posterior's own RMS std
        inside ``M``, uncalibrated), ``std_mean`` (the posterior's own mean std
        inside ``M``, uncalibrated), ``psnr`` and ``psnr_band`` (dB, when a range is known)."""
        var = np.asarray(variance.cpu() if isinstance(variance, torch.Tensor) else variance, np.float64)
        var = np.clip(var.reshape(self.mask.shape), 0.0, None)
        rmse, mse = self._errors(self.method, var)
        reps = [self._errors(m, var) for m in self.replicates if m is not None]
        lo, hi = np.quantile([r[0] for r in reps], [0.025, 0.975]).tolist() if reps else [rmse, rmse]
        out = {
            "count": int(count),
            "rmse": rmse,
            "rms_std": math.sqrt(float(var[self.mask > 0].mean())),
            "rmse_band": [min(lo, rmse), max(hi, rmse)],
            "std_mean": float(np.sqrt(var)[self.mask > 0].mean()),
            "psnr": None,
            "psnr_band": None,
        }
        if self.data_range is not None:
            psnr = psnr_from_mse(mse, self.data_range)
            ps = [psnr_from_mse(r[1], self.data_range) for r in reps] or [psnr]
            out["psnr"] = psnr
            out["psnr_band"] = [min(float(np.quantile(ps, 0.025)), psnr), max(float(np.quantile(ps, 0.975)), psnr)]
        return out


# ---------------------------------------------------------------------------------------------- online
class OnlineCalibration:
    """Prequential scoring of acquired angles and the calibration refitted on them.

    Each acquired angle's rows are scored with the forecaster as fitted *before* they were seen (:meth:`score`),
    then the forecaster is refitted as ``update`` says (``design.calibration_update``): ``online`` (default) on the
    acquired angles' rows alone (with the pilot's until :data:`_MIN_ONLINE_ANGLES` are in), ``pooled`` on the
    pilot's held-out rows and every acquired angle's, ``pilot`` never (the angles are scored, the pilot's fit is
    kept). The other two fits are recorded beside (``alternatives``), so a study compares them on one run.

    ``records`` has one entry per acquisition: ``step``, ``angle_deg``, ``coverage_90`` (its rows inside their
    calibrated 90 % interval), ``coverage_90_raw`` (under the posterior alone), ``mean_z2``, ``ll`` (mean Gaussian
    log-likelihood per row, nats), ``cumulative_coverage_90`` (all acquired rows so far), the same for every mode
    (``cumulative_coverage_90_by_update``), ``calibration`` (the forecaster's fit after the angle) and
    ``alternatives`` (the other modes' fits).
    """

    def __init__(self, forecaster: ErrorForecaster, pilot_rows: HeldoutRows | None, update: str = "online"):
        if update not in values(ForecastUpdate):
            raise DesignError(f"design.calibration_update must be one of {values(ForecastUpdate)}, got {update!r}")
        self.forecaster, self.pilot_rows, self.update = forecaster, pilot_rows, update
        self.parts: list[HeldoutRows] = []
        self.records: list[dict] = []
        # every update mode's current fit (all start from the pilot's) and its prequential counts (inside, total)
        self.fits = dict.fromkeys(values(ForecastUpdate), forecaster.method)
        self.counts = {mode: [0, 0] for mode in self.fits}

    def _rows_for(self, update: str) -> HeldoutRows | None:
        if update == ForecastUpdate.PILOT:
            return None
        pilot = [] if self.pilot_rows is None else [self.pilot_rows]
        if update == ForecastUpdate.ONLINE and len(self.parts) >= _MIN_ONLINE_ANGLES:
            pilot = []
        return HeldoutRows.concat([*pilot, *self.parts])

    def score(self, rows: HeldoutRows, step: int, angle_deg: float) -> dict:
        """Score the rows of the angle about to be acquired under every mode's fit so far, then refit (the
        forecaster as ``update`` says, the other modes beside it); returns the record."""
        r = np.asarray(rows.residual, np.float64)
        raw_var = np.asarray(rows.variance, np.float64) + np.asarray(rows.noise_variance, np.float64)
        coverage = {}
        for mode, fit in self.fits.items():
            var = fit.row_variance(rows) if fit is not None else raw_var
            inside = np.abs(r) <= _Z90 * np.sqrt(var)
            self.counts[mode][0] += int(inside.sum())
            self.counts[mode][1] += int(r.size)
            coverage[mode] = float(inside.mean())
            if mode == self.update:
                z, pred_var = r / np.sqrt(var), var
        self.parts.append(rows)
        mine = self._rows_for(self.update)
        if mine is not None:
            self.forecaster.fit(mine)
        self.fits[self.update] = self.forecaster.method
        alternatives = {}
        for other in values(ForecastUpdate):
            got = self._rows_for(other) if other != self.update else None
            if got is not None:
                self.fits[other] = self.forecaster.fit_once(got)
            if other != self.update:
                fit = self.fits[other]
                alternatives[other] = fit.report() if fit is not None else None
        rec = {
            "step": int(step),
            "angle_deg": float(angle_deg),
            "coverage_90": coverage[self.update],
            "coverage_90_raw": float((np.abs(r / np.sqrt(raw_var)) <= _Z90).mean()),
            "mean_z2": float(np.mean(z**2)),
            "ll": float(np.mean(-0.5 * (np.log(2 * math.pi * pred_var) + z**2))),
            "cumulative_coverage_90": self.counts[self.update][0] / self.counts[self.update][1],
            "cumulative_coverage_90_by_update": {m: c[0] / c[1] for m, c in self.counts.items()},
            "calibration": self.forecaster.report(),
            "alternatives": alternatives,
        }
        self.records.append(rec)
        return rec
