"""The predicted error curve before acquiring (``ctuq design --plan``) and the hooks of a design with a stop rule.

:func:`plan_curves` forecasts the error after ``n = pilot … pilot + acquire`` angles for two strategies, without any
new measurement (:mod:`ctuq.design.forecast` for the quantities):

* **designed**: the greedy design run ahead on the covariance alone. Its choices need no data; the linearised
  DIP's refreshed ``a`` (the energy rule) does, so the angles not measured yet enter it as the pilot
  reconstruction's projections, its best guess of them;
* **equidistant**: ``n`` evenly spaced candidates, the prior's g-prior and ``a`` refitted on them as a design that
  had chosen them would.

:class:`AcquisitionHooks` are the ``before_acquire`` / ``after_step`` of :func:`ctuq.design.greedy.greedy_design`
for a design on measured data: each new angle scored before it is used (:class:`~ctuq.design.forecast.
OnlineCalibration`), the error forecast after every step, and the :class:`~ctuq.design.forecast.StopRule`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from ctuq.design.candidates import equidistant_indices
from ctuq.design.engine import DesignEngine
from ctuq.design.forecast import ErrorForecaster, OnlineCalibration, RowPredictor, StopRule
from ctuq.design.greedy import greedy_design

__all__ = [
    "plan_curves",
    "recommend",
    "RECOMMEND_MARGIN",
    "TRUSTED_PER_SIDE",
    "designed_ahead",
    "trusted_count",
    "recommends_designed",
    "pilot_rows",
    "AcquisitionHooks",
    "refresh_updater",
]


def _variance(engine: DesignEngine, n: int, seed: int):
    """The posterior pixel variance after the engine's chosen angles, in the scan's image units² (mm⁻²)."""
    return engine.posterior_variance(n, seed=seed) / float(engine.model.image_scale) ** 2


def refresh_updater(prior, every: int) -> Callable | None:
    """A greedy-design updater that refits the weight prior's scales and ``a`` of ``prior`` (a :class:`DIPPrior`) on
    the chosen angles every ``every`` acquisitions, and never retrains (``None`` without a prior or refresh)."""
    if prior is None or not every:
        return None

    def update(engine, n_acquired: int, chosen, replay: bool):
        return prior.model_for(chosen) if n_acquired % every == 0 else None

    return update


def pilot_rows(engine: DesignEngine, predictor: RowPredictor, pilot, max_angles: int):
    """The held-out rows at the pilot: up to ``max_angles`` candidates outside the pilot (at least one: a design
    leaves candidates to acquire), evenly spread (the engine conditioned on the pilot)."""
    rest = np.setdiff1d(np.arange(engine.model.n_candidates), np.asarray(pilot))
    take = rest[equidistant_indices(rest.size, min(int(max_angles), rest.size))]
    return predictor.rows(engine, take.tolist())


def plan_curves(
    model,
    prior,
    pilot,
    counts,
    forecaster: ErrorForecaster,
    *,
    criterion: str,
    jitter: float,
    angles_deg,
    route: str,
    n_samples: int,
    refresh_every: int,
    std_samples: int,
    seed: int,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    spread: float = 0.0,
) -> dict:
    """The predicted error after each of ``counts`` angles for the designed and the equidistant strategy.

    Parameters
    ----------
    model : DesignModel
        The design model after the pilot (its prior's data: the pilot's measurements and, for the DIP, the pilot
        reconstruction's projections elsewhere).
    prior : DIPPrior or None
        Refits the g-prior and ``a`` (designed: every ``refresh_every`` angles; equidistant: on each set); ``None``
        for a fixed prior (isotropic, Matérn).
    pilot : list of int
        Pilot candidate indices.
    counts : list of int
        Angle counts (pilot included), ascending, from ``len(pilot)``.
    forecaster : ErrorForecaster
        Fitted at the pilot.
    criterion, jitter, angles_deg, route, n_samples, spread : as for :func:`greedy_design` /
        :class:`DesignEngine`.
    std_samples : int
        Core-sampler draws per variance map.
    seed : int
        Seeds the engines and the variance maps.

    Returns
    -------
    dict
        ``counts``; ``designed`` and ``equidistant``: lists of :meth:`ErrorForecaster.predict` records per count;
        ``designed_order``: the planned acquisitions (candidate indices); ``time_s``.
    """
    t0 = time.perf_counter()
    say = log or (lambda _m: None)
    counts = [int(c) for c in counts]
    designed, order = _designed_curve(
        DesignEngine(model, route=route, n_samples=n_samples, seed=seed),
        prior,
        pilot,
        counts,
        forecaster,
        refresh_every=refresh_every,
        std_samples=std_samples,
        seed=seed,
        criterion=criterion,
        angles_deg=angles_deg,
        jitter=jitter,
        spread=spread,
        progress=progress,
        log=say,
    )
    equidistant = []
    eq = DesignEngine(model, route="sampled", n_samples=2, seed=seed)
    for n in counts:  # each set as a design that had chosen it would: the prior refitted on it
        chosen = equidistant_indices(model.n_candidates, n).tolist()
        eq.reset(chosen, model=prior.model_for(chosen) if prior is not None else model)
        equidistant.append(forecaster.predict(_variance(eq, std_samples, seed + 17), n))
    out = {
        "counts": counts,
        "designed": designed,
        "equidistant": equidistant,
        "designed_order": order,
        "time_s": time.perf_counter() - t0,
    }
    say(
        "predicted RMS error (mm⁻¹) after "
        + ", ".join(f"{n}: {d['rmse']:.3g}" for n, d in zip(counts, out["designed"]))
        + " angles (designed)"
    )
    return out


def _count_meeting(counts, records, target) -> float | None:
    """The angle count at which the predicted curve ``records`` (per count) first meets ``target`` (linear in log
    error, or in PSNR, between the plan's counts); ``None`` when it never does within them."""
    if target.kind == "psnr":
        vals = [r.get("psnr") for r in records]
        if any(v is None for v in vals):
            return None
        ok = [v >= target.value for v in vals]
        curve, goal = np.asarray(vals, float), target.value
    else:
        vals = [r["rmse"] for r in records]
        ok = [v <= target.value for v in vals]
        curve, goal = -np.log(vals), -math.log(target.value)  # rising, like the PSNR
    if not any(ok):
        return None
    j = ok.index(True)
    if j == 0:
        return float(counts[0])
    lo, hi = curve[j - 1], curve[j]
    return float(counts[j - 1] + (counts[j] - counts[j - 1]) * (goal - lo) / (hi - lo))


RECOMMEND_MARGIN = 0.02
"""The plan recommends designed angles only where it predicts them at least this fraction below equidistant ones in
RMS error: the protocol study (docs/experimental_design.md §9) found designs ahead by 1.1–2.1 dB where the plan
predicted 2.2–5 % less error, and the DIP's differences at predicted gains below 1.5 % inside its run-to-run spread,
with designs as often behind as ahead (a threshold read off those three scans)."""


def designed_ahead(designed: float, equidistant: float, margin: float = RECOMMEND_MARGIN) -> bool:
    """Whether a predicted RMS error of designed angles (mm⁻¹) is at least ``margin`` (a fraction) below the
    equidistant one at the same count: the first rule by which :func:`recommend` picks designed angles."""
    return designed / equidistant <= 1.0 - margin


TRUSTED_PER_SIDE = 1.0 / 3.0
"""The plan recommends designed angles only up to this fraction of the image side (pixels) in angles
(:func:`trusted_count`: 21 at 64², 42 at 128²). In the protocol study at 64² (docs/experimental_design.md §9: three
sets of three scans) the designs were ahead of as many equidistant angles at 20 angles, and from 40 angles their DIP
was as often behind as ahead, by up to 1.6 dB where the plan predicted them 5–6 % ahead; with TV's weight chosen on
the truth the same designed angles were ahead there: above this count the 64² runs' held-out tuning, not the angles'
information, decided (it picks a weight further from the best one for designed angles, whose rows the coarse grid
fits worse). The limit was read off two of the sets and held on the third. At 128² the designs were ahead on the
mean of three scans at every count up to 80, so there it is conservative."""


def trusted_count(image_shape) -> int:
    """The largest angle count at which :func:`recommend` may pick designed angles: :data:`TRUSTED_PER_SIDE` times
    the image's larger in-plane side (pixels; ``image_shape`` ``(ny, nx)`` or ``(nz, ny, nx)``), at least 1."""
    side = max(int(n) for n in tuple(image_shape)[-2:])
    return max(1, int(side * TRUSTED_PER_SIDE))


def recommends_designed(
    designed: float, equidistant: float, count: float, *, max_designed: int | None, margin: float = RECOMMEND_MARGIN
) -> bool:
    """The rule of :func:`recommend` at one count: designed angles when their predicted RMS error is at least
    ``margin`` below the equidistant one's (:func:`designed_ahead`) and the count, rounded up to whole angles, is at
    most ``max_designed`` (:func:`trusted_count`; ``None``: no limit)."""
    within = max_designed is None or math.ceil(count) <= max_designed
    return within and designed_ahead(designed, equidistant, margin)


def _rmse_at(counts, records, n: float) -> float:
    """A predicted curve's RMS error at count ``n`` (linear in log error between the plan's counts)."""
    return float(np.exp(np.interp(n, counts, np.log([r["rmse"] for r in records]))))


def recommend(planned: dict, target=None, margin: float = RECOMMEND_MARGIN, max_designed: int | None = None) -> dict:
    """The protocol the plan recommends: designed or equidistant angles.

    Designed angles are recommended only where the plan predicts them at least ``margin`` (a fraction,
    :data:`RECOMMEND_MARGIN`) below equidistant ones in RMS error, and only up to ``max_designed`` angles
    (:func:`trusted_count` of the image; ``None``: no limit); otherwise the equidistant scan, which needs no design
    (:func:`recommends_designed`). With a stop ``target`` (:class:`~ctuq.design.forecast.Target`, an RMS error or a
    PSNR): the predicted count at which each strategy meets it (linear in log error between the plan's counts;
    ``None`` beyond them); the designed scan is recommended when it meets the target with fewer whole angles and
    the rule holds at that count. Without one (or a ``min_gain`` target): at the plan's last count.

    Returns
    -------
    dict
        ``recommended`` (``"designed"`` or ``"equidistant"``), ``margin``, ``max_designed``, ``target`` (its text or
        ``None``), ``counts`` (strategy → predicted count or ``None``, with a target), ``rmse_last`` (strategy →
        predicted RMS error at the last count, mm⁻¹), ``ahead`` (strategy → the plan's counts where its predicted
        error is lower), and ``reason`` (one line).
    """
    counts = [int(c) for c in planned["counts"]]
    des, eq = planned["designed"], planned["equidistant"]
    last = {"designed": des[-1]["rmse"], "equidistant": eq[-1]["rmse"]}
    ahead = {
        "designed": [n for n, d, e in zip(counts, des, eq) if d["rmse"] < e["rmse"]],
        "equidistant": [n for n, d, e in zip(counts, des, eq) if e["rmse"] < d["rmse"]],
    }
    limit = None if max_designed is None else int(max_designed)
    out = {"margin": float(margin), "max_designed": limit, "target": None, "counts": None}
    out.update(rmse_last=last, ahead=ahead)
    beyond = f"designed angles are recommended up to {limit} angles at this image size"
    if target is not None and target.kind in ("rmse", "psnr"):
        need = {"designed": _count_meeting(counts, des, target), "equidistant": _count_meeting(counts, eq, target)}
        d, e = need["designed"], need["equidistant"]
        fewer = d is not None and (e is None or math.ceil(d) < math.ceil(e))
        rates = (_rmse_at(counts, des, d), _rmse_at(counts, eq, d)) if fewer else None
        clear = fewer and recommends_designed(*rates, d, max_designed=limit, margin=margin)
        best = "designed" if clear else "equidistant"
        if d is None and e is None:
            why = f"neither is predicted to meet {target.text} within {counts[-1]} angles"
        else:
            shown = {k: "not within the plan" if v is None else f"{math.ceil(v)} angles" for k, v in need.items()}
            why = f"{target.text}: designed {shown['designed']}, equidistant {shown['equidistant']}"
            if fewer and not clear:
                gain_ok = designed_ahead(*rates, margin)
                why += f" ({beyond})" if gain_ok else f" (the design's predicted gain is below the {margin:.0%} margin)"
        out.update(target=target.text, counts=need, recommended=best, reason=why)
        return out
    ratio = last["designed"] / last["equidistant"]
    clear = recommends_designed(last["designed"], last["equidistant"], counts[-1], max_designed=limit, margin=margin)
    why = f"predicted RMS error after {counts[-1]} angles: designed {ratio:.3f} × equidistant (margin {margin:.0%})"
    if not clear and designed_ahead(last["designed"], last["equidistant"], margin):
        why += f"; {beyond}"
    out.update(recommended="designed" if clear else "equidistant", reason=why)
    return out


def _designed_curve(engine, prior, pilot, counts, forecaster, *, refresh_every, std_samples, seed, **greedy):
    """The designed strategy of :func:`plan_curves`: ``(forecast per count, planned acquisitions)``, the greedy
    design (``greedy``: its keyword arguments) run ahead on the covariance of ``engine`` with a forecast at each
    count."""
    n0 = len(pilot)
    designed: dict[int, dict] = {}

    def record(eng, step, replay=False):
        n = n0 + step
        if n in counts:
            designed[n] = forecaster.predict(_variance(eng, std_samples, seed + 17), n)
        return False

    if max(counts) <= n0:
        engine.reset(pilot)
        record(engine, 0)
        return [designed[n] for n in counts], []
    result = greedy_design(
        engine,
        pilot,
        max(counts) - n0,
        updater=refresh_updater(prior, refresh_every),
        on_setup=lambda eng: record(eng, 0),
        after_step=record,
        desc=f"plan ({greedy['criterion']})",
        **greedy,
    )
    return [designed[n] for n in counts], list(result.acquired)


class AcquisitionHooks:
    """``before_acquire`` / ``after_step`` of a design on measured data (module docstring).

    ``online`` scores each new angle (its rows predicted from ``center()``, the current reconstruction, when
    given: the retrained DIP of ``design.retrain_every``); ``forecasts`` holds the forecast after the pilot and after
    every step (count, ``rmse``, band, ``psnr``, and the calibration it used); :attr:`stopped` tells whether the
    rule stopped.
    """

    def __init__(
        self,
        predictor: RowPredictor,
        online: OnlineCalibration,
        rule: StopRule,
        *,
        n_pilot: int,
        angles_deg,
        std_samples: int,
        seed: int,
        center: Callable | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.predictor, self.online, self.rule = predictor, online, rule
        self.center = center
        self.n_pilot, self.angles_deg = int(n_pilot), np.asarray(angles_deg, np.float64)
        self.std_samples, self.seed = int(std_samples), int(seed)
        self.say = log or (lambda _m: None)
        self.forecasts: list[dict] = []
        self.stopped = False
        self.time_s = 0.0

    def at_pilot(self, engine) -> dict:
        """The forecast after the pilot (the forecaster fitted on the pilot's rows)."""
        rec = self.online.forecaster.predict(_variance(engine, self.std_samples, self.seed + 17), self.n_pilot)
        self.forecasts = [rec]
        return rec

    def before_acquire(self, engine, step: int, beta: int, replay: bool) -> None:
        t0 = time.perf_counter()
        if self.center is not None:  # a retrained DIP: predict from it
            self.predictor.recenter(self.center(engine.chosen))
        self.online.score(self.predictor.rows(engine, [beta]), step, float(self.angles_deg[beta]))
        self.time_s += time.perf_counter() - t0

    def after_step(self, engine, step: int, replay: bool) -> bool:
        t0 = time.perf_counter()
        rec = self.online.forecaster.predict(_variance(engine, self.std_samples, self.seed + 17), len(engine.chosen))
        rec["calibration"] = self.online.forecaster.report()
        self.forecasts.append(rec)
        self.time_s += time.perf_counter() - t0
        on = self.online.records[-1]
        if not replay:
            self.say(
                f"step {step}: angle {on['angle_deg']:.1f}° scored before use: coverage@0.9 {on['coverage_90']:.2f} "
                f"(all acquired {on['cumulative_coverage_90']:.2f}); predicted RMS error {rec['rmse']:.4g} mm⁻¹ "
                f"[{rec['rmse_band'][0]:.4g}, {rec['rmse_band'][1]:.4g}]"
            )
        self.stopped = self.rule.met(self.forecasts)
        if self.stopped and not replay:
            self.say(f"stop rule met after {len(engine.chosen)} angles: {self.rule.target.describe()}")
        return self.stopped
