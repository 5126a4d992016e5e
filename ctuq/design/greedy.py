"""The greedy sequential design loop (resumable) and the baseline strategies.

Each acquisition step scores every remaining candidate with the criterion, takes the argmax (ties: the lowest
index), conditions the engine on it and records the step (its time, the criterion values of all candidates, the
chosen angle). A prior *updater* may then replace the model — the linearised DIP refreshes its g-prior scales
and ``a`` every few angles, or retrains the network — after which the engine is reset on all chosen angles
(not after the last acquisition unless asked: it would change no choice).

Resuming: after every step the records are written atomically to ``checkpoint`` with a fingerprint of the
problem and settings. A rerun with the same fingerprint replays the recorded acquisitions through the engine
(the same seeded noise streams, the updater restoring rather than recomputing anything expensive it stored) and
continues with the next step, so a killed design ends with the same angles as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ctuq.design.candidates import DesignError, equidistant_indices, golden_indices, random_indices, spread_mask
from ctuq.errors import CheckpointMismatch
from ctuq.options import Baseline, Criterion
from ctuq.options import values as option_values
from ctuq.utils import atomic_torch_save, check_fingerprint, json_digest
from ctuq.utils import progress as _progress_bar

__all__ = ["DesignResult", "greedy_design", "baseline_design", "STRATEGIES", "CHECKPOINT_VERSION"]

_log = logging.getLogger(__name__)

STRATEGIES = (*option_values(Criterion), *option_values(Baseline))
"""Design strategies (``design.criterion``, ``ctuq design --criterion``): a criterion (greedy) or a baseline."""
CHECKPOINT_VERSION = 1


@dataclasses.dataclass
class DesignResult:
    """A finished design.

    Attributes
    ----------
    strategy : str
        ``eig``, ``ese``, ``diag_eig``, ``equidistant``, ``golden`` or ``random``.
    pilot, acquired : list of int
        Candidate indices of the pilot and of the acquired angles, in acquisition order.
    steps : list of dict
        Per acquisition: ``step`` (1-based), ``candidate``, ``angle_deg``, ``criterion`` (value of the chosen),
        ``values`` (all candidates; ``None`` for chosen ones), ``jitter`` (``η``), ``time_s`` (scoring and
        conditioning), ``update_s`` (a prior update after the step, 0 if none), ``n_chosen``.
    timings : dict
        ``setup_s`` (reset on the pilot), ``steps_s``, ``updates_s``, ``total_s``.
    resumed_steps : int
        Steps replayed from a checkpoint.
    stopped_at : int or None
        The step after which ``after_step`` stopped the design (a stop rule); ``None``: it ran its ``n_acquire``.
    """

    strategy: str
    pilot: list[int]
    acquired: list[int]
    steps: list[dict]
    timings: dict
    resumed_steps: int = 0
    stopped_at: int | None = None

    @property
    def chosen(self) -> list[int]:
        """Pilot then acquired candidate indices, in acquisition order."""
        return list(self.pilot) + list(self.acquired)


def _digest(fingerprint: dict, steps: list[dict]) -> str:
    # What the checkpoint records of its own content: a file edited by hand (or damaged) does not match it.
    return json_digest({"fingerprint": fingerprint, "steps": steps})


def _load(path: Path, fingerprint: dict, n_candidates: int) -> dict:
    """The design checkpoint at ``path``: readable, of this version, its content matching its digest, its steps
    consecutive acquisitions of distinct candidates below ``n_candidates``, its fingerprint ``fingerprint``
    (:class:`CheckpointMismatch` naming the file otherwise)."""
    hint = "delete it to start the design afresh"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged file: re-raised with the file named
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointMismatch(
            f"{path}: not a readable design checkpoint ({type(exc).__name__}: {reason}); {hint}"
        ) from exc
    version = state.get("version") if isinstance(state, dict) else None
    if version != CHECKPOINT_VERSION:
        raise CheckpointMismatch(
            f"{path}: a design checkpoint of version {version!r}, this ctuq reads version {CHECKPOINT_VERSION}; {hint}"
        )
    steps = state.get("steps")
    if not isinstance(steps, list) or not isinstance(state.get("fingerprint", {}), dict):
        raise CheckpointMismatch(f"{path}: a damaged design checkpoint (no list of steps); {hint}")
    if state.get("digest") != _digest(state.get("fingerprint", {}), steps):
        raise CheckpointMismatch(f"{path}: its content does not match its digest (edited or damaged); {hint}")
    seen: set[int] = set()
    for k, rec in enumerate(steps, start=1):
        cand = rec.get("candidate") if isinstance(rec, dict) else None
        if (
            not isinstance(rec, dict)
            or rec.get("step") != k
            or not isinstance(cand, int)
            or not 0 <= cand < n_candidates
            or cand in seen
        ):
            raise CheckpointMismatch(
                f"{path}: step record {k} is damaged (not acquisition {k} of a distinct candidate in "
                f"[0, {n_candidates})); {hint}"
            )
        seen.add(cand)
    check_fingerprint(
        state.get("fingerprint", {}),
        fingerprint,
        what=f"{path}: cannot resume the design",
        error=CheckpointMismatch,
        hint="delete it to start afresh, or use the same settings",
    )
    return state


def greedy_design(
    engine,
    pilot,
    n_acquire: int,
    *,
    criterion: str,
    angles_deg,
    jitter: float,
    updater: Callable | None = None,
    checkpoint: str | Path | None = None,
    fingerprint: dict | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    on_setup: Callable | None = None,
    update_last: bool = False,
    before_acquire: Callable | None = None,
    after_step: Callable | None = None,
    desc: str | None = None,
    spread: float = 0.0,
) -> DesignResult:
    """Greedy design: ``n_acquire`` steps of argmax ``criterion`` after the ``pilot`` (candidate indices).

    Parameters
    ----------
    engine : DesignEngine
        Holds the model; reset here on the pilot.
    criterion : {"eig", "ese", "diag_eig"}
    angles_deg : array-like
        Candidate angles in degrees (for the records).
    jitter : float
        Relative jitter of the criteria (:mod:`ctuq.design.criteria`).
    updater : callable, optional
        ``updater(engine, n_acquired, chosen, replay) -> DesignModel | None`` after every step; a model returned
        resets the engine on all chosen angles. ``replay`` is true while a resumed design replays its steps.
    checkpoint : path, optional
        Written after every step; resumed from when it exists (fingerprint checked).
    fingerprint : dict
        What identifies this design (problem, settings).
    on_setup : callable, optional
        ``on_setup(engine)`` right after the engine was conditioned on the pilot (before any replay), e.g. to
        take the std map after the pilot without a second reset.
    update_last : bool
        Also call ``updater`` after the last acquisition. It changes no choice of this design (a g-prior refresh
        after 35 angles is the dearest: its measurement covariance has the most rows), so it is skipped unless
        the caller uses the engine afterwards (the std map after the design). A resumed longer design replays it.
    before_acquire : callable, optional
        ``before_acquire(engine, step, beta, replay)`` after ``beta`` was chosen and before it is conditioned on
        (its measurement still unseen: the prequential check of :mod:`ctuq.design.forecast`); also on replay.
    after_step : callable, optional
        ``after_step(engine, step, replay) -> bool`` after the step (and its prior update); ``True`` stops the
        design there (a stop rule). Called on replay too, so a resumed design that had stopped stops again.
    desc : str, optional
        The progress bar's label (default ``design (<criterion>)``).
    spread : float
        The spread constraint ``design.spread`` in [0, 1]: each step takes the argmax only among the candidates in
        gaps at least ``spread`` times as wide as the widest gap of the angles chosen so far
        (:func:`~ctuq.design.candidates.spread_mask`); 0 (default): among all.
    """
    if criterion not in option_values(Criterion):
        raise DesignError(f"design.criterion must be one of {list(option_values(Criterion))}, got {criterion!r}")
    say = log or _log.info
    angles_deg = np.asarray(angles_deg, dtype=np.float64)
    pilot = [int(b) for b in pilot]
    # n_acquire is not part of it: a greedy design of N steps begins with the design of fewer steps.
    fingerprint = dict(fingerprint or {}, criterion=criterion, pilot=pilot)
    spread_mask([], len(angles_deg), spread)  # the range check, before any work
    if spread:  # only then: checkpoints of plain designs keep their fingerprint
        fingerprint["spread"] = float(spread)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    saved = _load(ckpt, fingerprint, len(angles_deg)) if ckpt is not None and ckpt.is_file() else {"steps": []}
    steps: list[dict] = [dict(s) for s in saved["steps"]][:n_acquire]
    hooks = _Hooks(n_acquire, updater, update_last, before_acquire, after_step, float(spread))
    t_start = time.perf_counter()
    engine.reset(pilot)
    engine.prepare()  # the set-up's samples are timed as set-up, not as the first step
    timings = {"setup_s": time.perf_counter() - t_start, "steps_s": 0.0, "updates_s": 0.0}
    if on_setup is not None:
        on_setup(engine)
    if steps:
        say(f"resuming the design: replaying {len(steps)} recorded acquisitions")
    stopped_at = _replay(engine, steps, hooks)
    steps = steps[: stopped_at or len(steps)]
    resumed = len(steps)
    bar = _progress_bar(
        total=n_acquire, initial=resumed, desc=desc or f"design ({criterion})", disable=None if progress else True
    )
    try:
        for step in range(resumed + 1, n_acquire + 1):
            if stopped_at is not None:
                break
            rec, stop = _acquire(engine, step, criterion, jitter, angles_deg, hooks)
            if stop:
                stopped_at = step
            steps.append(rec)
            timings["steps_s"] += rec["time_s"]
            timings["updates_s"] += rec["update_s"]
            if ckpt is not None:
                state = {"version": CHECKPOINT_VERSION, "fingerprint": fingerprint, "steps": steps}
                atomic_torch_save(ckpt, {**state, "digest": _digest(fingerprint, steps)})
            bar.update(1)
            bar.set_postfix({"angle": f"{rec['angle_deg']:.1f}°", "s/step": f"{rec['time_s']:.2f}"}, refresh=False)
    finally:
        bar.close()
    timings["total_s"] = time.perf_counter() - t_start
    return DesignResult(criterion, pilot, [s["candidate"] for s in steps], steps, timings, resumed, stopped_at)


@dataclasses.dataclass
class _Hooks:
    """The caller's callbacks around each acquisition of :func:`greedy_design` (its parameters of these names)."""

    n_acquire: int
    updater: Callable | None
    update_last: bool
    before_acquire: Callable | None
    after_step: Callable | None
    spread: float = 0.0

    def before(self, engine, step: int, beta: int, replay: bool) -> None:
        if self.before_acquire is not None:
            self.before_acquire(engine, step, beta, replay)

    def update(self, engine, step: int, replay: bool) -> bool:
        """The prior update after ``step`` (not after the last unless ``update_last``): whether it replaced the
        model (the engine is then reset on all chosen angles)."""
        if self.updater is None or not (step < self.n_acquire or self.update_last):
            return False
        new = self.updater(engine, step, engine.chosen, replay)
        if new is None:
            return False
        engine.reset(engine.chosen, model=new)
        return True

    def stop(self, engine, step: int, replay: bool) -> bool:
        return self.after_step is not None and bool(self.after_step(engine, step, replay))


def _replay(engine, steps: list[dict], hooks: _Hooks) -> int | None:
    """Condition ``engine`` on the recorded ``steps`` again (same conditioning, same noise streams, the updater
    restoring its stored prior updates); the step at which the stop rule stopped the design, else ``None``."""
    for rec in steps:
        hooks.before(engine, rec["step"], rec["candidate"], True)
        engine.acquire(rec["candidate"], rec["step"])
        hooks.update(engine, rec["step"], True)
        if hooks.stop(engine, rec["step"], True):
            return rec["step"]
    return None


def _acquire(engine, step: int, criterion: str, jitter: float, angles_deg: np.ndarray, hooks: _Hooks):
    """One acquisition: score every candidate, condition on the argmax, update the prior; ``(record, stop)`` with
    the step's record (:class:`DesignResult` ``steps``) and whether the stop rule ends the design here."""
    t0 = time.perf_counter()
    values, eta = engine.criteria(criterion, jitter)
    allowed = None
    if hooks.spread:
        allowed = spread_mask(engine.chosen, len(angles_deg), hooks.spread)
        keep = torch.as_tensor(allowed, device=values.device)
        beta = int(torch.argmax(torch.where(keep, values, torch.full_like(values, -math.inf))))
    else:
        beta = int(torch.argmax(values))
    hooks.before(engine, step, beta, False)
    engine.acquire(beta, step)
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    if hooks.update(engine, step, False) and step < hooks.n_acquire:
        engine.prepare()  # timed with the update; after the last step nothing is scored
    du = time.perf_counter() - t1
    stop = hooks.stop(engine, step, False)
    rec = {
        "step": step,
        "candidate": beta,
        "angle_deg": float(angles_deg[beta]),
        "criterion": float(values[beta]),
        "jitter": eta,
        "time_s": dt,
        "update_s": du,
        "n_chosen": len(engine.chosen),
        "values": [None if not math.isfinite(v) else float(v) for v in values.tolist()],
    }
    if allowed is not None:
        rec["allowed"] = int(allowed.sum())  # candidates the spread constraint left to choose from
    return rec, stop


def baseline_design(
    strategy: str, n_candidates: int, pilot, n_acquire: int, *, angles_deg, seed: int = 0
) -> DesignResult:
    """Pilot plus ``n_acquire`` baseline angles (candidate indices).

    ``equidistant``: the ``n_acquire`` candidates evenly spaced over the grid that are farthest from the pilot (the
    equidistant set of that size among the shifts of the grid whose nearest distance to a pilot angle is largest), so
    pilot + acquired approximate a denser even spread. ``golden``: the golden-angle sequence
    (:func:`~ctuq.design.candidates.golden_indices`) without the pilot's candidates, in its order. ``random``: uniform
    without replacement among the non-pilot candidates (seeded). For an equidistant set of the *total* count regardless
    of the pilot, use :func:`ctuq.design.candidates.equidistant_indices`.
    """
    if strategy not in option_values(Baseline):
        raise DesignError(f"baseline strategy must be one of {list(option_values(Baseline))}, got {strategy!r}")
    t0 = time.perf_counter()
    pilot = [int(b) for b in pilot]
    if strategy == Baseline.RANDOM:
        picks = random_indices(n_candidates, n_acquire, exclude=pilot, seed=seed)
    elif strategy == Baseline.GOLDEN:
        taken = set(pilot)
        picks = [b for b in golden_indices(n_candidates, n_candidates).tolist() if b not in taken][:n_acquire]
    else:
        best, best_gap = None, -1.0
        for off in range(max(1, n_candidates // n_acquire)):
            idx = equidistant_indices(n_candidates, n_acquire, offset=off)
            if set(idx.tolist()) & set(pilot):
                continue
            gaps = np.abs(
                (idx[:, None] - np.asarray(pilot)[None, :] + n_candidates / 2) % n_candidates - n_candidates / 2
            ).min(1)
            if gaps.min() > best_gap:
                best, best_gap = idx, float(gaps.min())
        if best is None:
            left = np.setdiff1d(np.arange(n_candidates), pilot)
            best = left[equidistant_indices(len(left), n_acquire)]
        picks = best
    angles_deg = np.asarray(angles_deg, dtype=np.float64)
    steps = [
        {
            "step": i + 1,
            "candidate": int(b),
            "angle_deg": float(angles_deg[b]),
            "criterion": None,
            "values": None,
            "jitter": None,
            "time_s": 0.0,
            "update_s": 0.0,
            "n_chosen": len(pilot) + i + 1,
        }
        for i, b in enumerate(picks)
    ]
    return DesignResult(
        strategy,
        pilot,
        [int(b) for b in picks],
        steps,
        {"setup_s": 0.0, "steps_s": 0.0, "updates_s": 0.0, "total_s": time.perf_counter() - t0},
    )
