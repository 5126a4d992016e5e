"""The stop-rule study (``scripts/stop_rule_study.py``): is the predicted error of a scan not yet taken right, and
does the stop rule stop at the right count?

Per simulated scan (walnut and textured phantoms, :func:`ctuq.studies.calibration.prepare_scans`; 1200 angles), in
``OUT/<scan>/``, everything through the public API:

1. ``plan/``: ``ctuq design --plan`` from the pilot (:func:`ctuq.design_angles` with ``plan=True``): the predicted
   RMS error inside the object after ``n = pilot … pilot + acquire`` angles, designed and equidistant
   (:mod:`ctuq.design.plan`);
2. ``acquire/``: the design on the scan's measurements (:func:`ctuq.design_angles`), each new angle scored before it
   is used (predicted from the tracked DIP, as with a stop target) and the forecast after every step (the stop rule
   needs nothing else: a target changes where the design stops, not its choices);
3. ``actual/<strategy>_<n>/``: FBP, TV and the DIP (cold start, the ``dip`` section) from the first ``n`` designed
   angles and from ``n`` equidistant ones (:func:`ctuq.reconstruct` of the scan's :meth:`~ctuq.scan.Scan.subset`
   with ``uq=False``), their RMS error inside the same object mask against the ground truth;
4. ``result.json``: the scan's record, derived from those folders.

The report (:func:`report`) compares predicted with actual errors at every count of the grid, and, for two targets
per scan (the actual DIP error interpolated at 40 % and 80 % of the way, in log error, from the pilot to the last
count), the count at which the online forecast first meets the target against the oracle count (the smallest count
whose actual error meets it, linear in log error between grid counts), and the actual error at the stop count.
A rerun of the same command resumes: every design and run is asked of the API on its folder with ``resume=True,
reuse=True`` (a finished one is loaded, an interrupted one continues from its checkpoints). The options are one frozen
dataclass, :class:`StopRuleOptions` (:data:`DEFAULTS`, :data:`TINY`), recorded in ``OUT/study.json``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ctuq.calibration.maps import object_mask
from ctuq.config import ConfigError, load_config
from ctuq.pipeline.design import TRACK_ITERATIONS
from ctuq.registry import CALIBRATIONS

# the public API (ctuq.design_angles, ctuq.load_scan), imported from its home modules
from ctuq.run import design_angles
from ctuq.scan import load_scan
from ctuq.studies.calibration import prepare_scans
from ctuq.studies.common import (
    NEUTRAL_OPTIONS,
    Log,
    StudyError,
    check_study_folder,
    read_json,
    reconstruct_protocols,
    study_fingerprint,
)
from ctuq.studies.study_options import freeze, option, plain
from ctuq.utils import atomic_write_json

__all__ = ["StopRuleOptions", "DEFAULTS", "TINY", "UPDATES", "run_study", "run_scan", "report", "stop_counts"]

UPDATES = ("pooled", "online", "pilot")  # design.calibration_update, compared on every run


@dataclasses.dataclass(frozen=True)
class StopRuleOptions:
    """The options of one stop-rule study (``scripts/stop_rule_study.py`` builds them from its flags). All but
    ``progress`` and ``tiny`` change numbers, so ``study.json`` records them and a rerun in the same folder must keep
    them (the seeds may grow)."""

    walnut_seeds: tuple[int, ...] = option((0, 1, 2, 3), help="seeds of the simulated walnut scans")
    textured_seeds: tuple[int, ...] = option((0, 1, 2, 3), help="seeds of the simulated textured scans")
    config: str = option("demo", help="base config of every design and reconstruction")
    set: tuple[str, ...] = option(
        ("data.image_shape=[64,64]", "data.detector_subsampling=4"),
        help="config overrides of every design and reconstruction (KEY=VALUE)",
    )
    candidates: int = option(120, help="candidate angles of the designs (design.candidates)")
    pilot: int = option(10, help="equidistant pilot angles (design.pilot)")
    acquire: int = option(20, help="angles each design acquires (design.acquire)")
    counts: tuple[int, ...] = option((10, 15, 20, 25, 30), help="angle counts where predicted and actual errors meet")
    target_fractions: tuple[float, ...] = option(
        (0.4, 0.8), help="stop targets: fractions of the way (log error) from the pilot's error to the last count's"
    )
    scan_preset: str = option("bundled", help="ctuq simulate preset of the scans (bundled, tiny, walnut)")
    projections: int = option(1201, help="projection files per scan (the last repeats the first angle)")
    det_rows: int = option(4, help="detector rows of the simulated scans")
    gt_shape: tuple[int, int, int] = option((1, 128, 128), help="ground-truth grid of the simulated scans")
    progress: bool = option(False, help="progress bars of the designs and runs")
    tiny: bool = option(False, help="the test size (TINY)")

    def __post_init__(self) -> None:
        freeze(self)

    def validate(self) -> None:
        """One-line :class:`StudyError` for an invalid option (named as its command-line flag)."""
        if not self.walnut_seeds and not self.textured_seeds:
            raise StudyError("--walnut-seeds/--textured-seeds: the study needs at least one scan")
        if not self.counts or list(self.counts) != sorted(set(self.counts)) or self.counts[0] != self.pilot:
            raise StudyError(f"counts {list(self.counts)}: increasing angle counts from the pilot ({self.pilot})")
        if self.counts[-1] > self.pilot + self.acquire:
            raise StudyError(
                f"counts {list(self.counts)}: the last count exceeds pilot + acquire = {self.pilot + self.acquire}"
            )
        try:
            load_config(self.config, list(self.set))
        except ConfigError as exc:
            raise StudyError(f"--set: {exc}") from None


DEFAULTS = StopRuleOptions()
# seconds-long runs of the machinery (tests)
TINY = StopRuleOptions(
    walnut_seeds=(0,),
    textured_seeds=(),
    set=(
        "data.image_shape=[32,32]",
        "data.detector_subsampling=8",
        "dip.iterations=200",
        "dip.warm_start_iterations=30",
        "tv.path_iterations=10",
        "tv.per_decade=2",
    ),
    candidates=24,
    pilot=4,
    acquire=4,
    counts=(4, 6, 8),
    scan_preset="tiny",
    projections=49,
    tiny=True,
)


def _sets(options: StopRuleOptions) -> list[str]:
    """The config overrides of every design and reconstruction of a scan."""
    return ["data.min_angles=1", *options.set, f"design.forecast_points={len(options.counts)}"]


def run_scan(name: str, scan: Path, options: StopRuleOptions, out: Path, log: Log) -> dict:
    """Plan, acquisition and actual errors of one scan into ``out/<name>``; returns its record (``result.json``,
    derived from the design and run folders there)."""
    sdir = out / name
    design = dict(
        config=options.config,
        candidates=options.candidates,
        pilot=options.pilot,
        acquire=options.acquire,
        resume=True,
        reuse=True,
        progress=options.progress,
    )
    plan = design_angles(scan, set=_sets(options), plan=True, out=sdir / "plan", **design)
    log(f"{name}: plan {'loaded' if plan.reused else 'done'}")
    # the acquisition as a stop rule runs it (its predictions from the tracked DIP); no target: it runs to the cap
    extra = ["design.reconstruct=false", f"design.track_iterations={TRACK_ITERATIONS}"]
    acq = design_angles(scan, set=[*_sets(options), *extra], out=sdir / "acquire", **design)
    log(f"{name}: acquisition {'loaded' if acq.reused else 'done'}")
    cand = np.asarray(acq.record["candidates"]["scan_indices"])
    mask = object_mask(np.asarray(acq.pilot_images["dip"], np.float64)) > 0
    order = acq.record["pilot"]["candidates"] + [a["candidate"] for a in acq.record["acquired"]]
    by_count = reconstruct_protocols(
        load_scan(scan), cand, {"designed": order, "equidistant": None}, options.counts, sets=_sets(options),
        options=options, out=sdir / "actual", mask=mask, log=log, name=name,
    )  # fmt: skip
    actual = {s: {n: rec["rmse"]["dip"] for n, rec in runs.items()} for s, runs in by_count.items()}
    record = {
        "scan": name,
        "counts": list(options.counts),
        "plan": {
            s: {r["count"]: [r["rmse"], *r["rmse_band"]] for r in plan.record["forecast"]["plan"][s]}
            for s in ("designed", "equidistant")
        },
        "online": _online_by_update(acq.forecast),
        "online_coverage": {
            mode: [r["cumulative_coverage_90_by_update"][mode] for r in acq.forecast["online"]] for mode in UPDATES
        },
        "actual": actual,
        "order": order,
        "plan_s": plan.record["timings"]["total_s"],
    }
    done = sdir / "result.json"
    atomic_write_json(done, record)
    return read_json(done)


def _online_by_update(fc: dict) -> dict:
    """The forecast after every step under each ``design.calibration_update`` (mode → count → RMS error, mm⁻¹):
    the run's own fit, and the other modes' fits recorded beside it, applied to the same posterior (``rms_std``) by
    the design's calibration method (:meth:`~ctuq.calibration.CalibrationMethod.predicted_rms`)."""
    method = CALIBRATIONS[fc["calibration"]]
    at_pilot, first = fc["calibration_at_pilot"], fc["after_step"][0]["count"]
    out: dict = {}
    for after in fc["after_step"]:
        n = after["count"]
        if n == first:
            fits = dict.fromkeys(UPDATES, at_pilot)
        else:
            rec = fc["online"][n - first - 1]
            fits = {"pilot": at_pilot, **{k: v for k, v in rec["alternatives"].items() if v}}
            fits[fc["update"]] = rec["calibration"]
        for mode, fit in fits.items():
            out.setdefault(mode, {})[str(n)] = method.predicted_rms(fit, after["rms_std"])
    return out


def _loglin(counts, values, at: float) -> float:
    """``values`` (errors) interpolated linearly in log error at count ``at``."""
    return float(np.exp(np.interp(at, counts, np.log(values))))


def stop_counts(rec: dict, fractions, mode: str = "pooled") -> list[dict]:
    """Per target: the target (mm⁻¹), the stop count of the forecast during acquisition (calibration update
    ``mode``), the oracle count (designed), and the actual error at the stop count (interpolated in log error
    between grid counts)."""
    counts = [int(c) for c in rec["counts"]]
    act = [rec["actual"]["designed"][str(c)] for c in counts]
    online = {int(k): v for k, v in rec["online"][mode].items()}
    out = []
    for f in fractions:
        target = _loglin([0.0, 1.0], [act[0], act[-1]], f)
        stop = next((n for n in sorted(online) if n > counts[0] and online[n] <= target), None)
        dense = np.arange(counts[0], counts[-1] + 1)
        curve = [_loglin(counts, act, n) for n in dense]
        oracle = next((int(n) for n, e in zip(dense, curve) if e <= target), int(counts[-1]))
        out.append(
            {
                "fraction": f,
                "target": target,
                "stop": stop,
                "oracle": oracle,
                "actual_at_stop": None if stop is None else _loglin(counts, act, stop),
            }
        )
    return out


def _ratio_row(name: str, r) -> str:
    r = np.asarray(r)
    inside = np.mean((r >= 0.8) & (r <= 1.25))
    within2 = np.mean((r >= 0.5) & (r <= 2.0))
    return (
        f"| {name} | {r.size} | {100 * inside:.0f} % | {100 * within2:.0f} % | {np.median(r):.2f} | "
        f"{r.min():.2f}–{r.max():.2f} |"
    )


def report(records: list[dict], fractions) -> str:
    """The study's tables (markdown) and gate numbers."""
    lines = ["# Stop-rule study", "", "## Predicted / actual RMS error inside the object (DIP)", ""]
    lines.append(
        "Actual: the DIP (cold start) from the first n designed angles / n equidistant ones; predicted: the plan from "
        "the pilot, and the forecast during acquisition with the calibration refitted `pooled` / `online` (ratio to "
        "actual in brackets)."
    )
    lines += [
        "",
        "| scan | n | actual designed | plan designed | pooled | online | actual equidistant | plan equidistant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[str, list] = {}
    for rec in records:
        kind = rec["scan"].split("_")[0]
        for c in rec["counts"]:
            key = str(c)
            ad, ae = rec["actual"]["designed"][key], rec["actual"]["equidistant"][key]
            got = {
                "plan, designed": (rec["plan"]["designed"][key][0], ad),
                "pooled, designed": (rec["online"]["pooled"][key], ad),
                "online, designed": (rec["online"]["online"][key], ad),
                "pilot fit kept, designed": (rec["online"]["pilot"][key], ad),
                "plan, equidistant": (rec["plan"]["equidistant"][key][0], ae),
            }
            for name, (p, a) in got.items():
                ratios.setdefault(name, []).append(p / a)
                ratios.setdefault(f"{name} ({kind})", []).append(p / a)
            cell = {k: f"{p:.4g} ({p / a:.2f})" for k, (p, a) in got.items()}
            lines.append(
                f"| {rec['scan']} | {c} | {ad:.4g} | {cell['plan, designed']} | {cell['pooled, designed']} | "
                f"{cell['online, designed']} | {ae:.4g} | {cell['plan, equidistant']} |"
            )
    lines += ["", "## Gate 1: predicted / actual in [0.8, 1.25] on ≥ 80 % of (scan, count) pairs, never off by 2×", ""]
    lines += [
        "| forecast | pairs | in [0.8, 1.25] | within 2× | median ratio | range |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_ratio_row(name, r) for name, r in sorted(ratios.items())]
    lines += ["", "## Gate 2: the stop rule (≥ 80 % meet actual ≤ 1.1 × target; count ≤ 1.25 × oracle)", ""]
    lines += [
        "Targets per scan: the actual DIP error at "
        + " and ".join(f"{100 * f:.0f} %" for f in fractions)
        + " of the way (in log error) from the pilot to the last count. A rule that never meets its target stops at "
        "the last count (the step budget).",
        "",
        "| calibration update | runs | target met | mean stop / oracle count | stop counts (oracle) |",
        "|---|---|---|---|---|",
    ]
    for mode in UPDATES:
        met, ratio_counts, cells = [], [], []
        for rec in records:
            act = [rec["actual"]["designed"][str(c)] for c in rec["counts"]]
            for st in stop_counts(rec, fractions, mode):
                n = st["stop"] if st["stop"] is not None else int(rec["counts"][-1])
                actual = st["actual_at_stop"] if st["stop"] is not None else act[-1]
                met.append(actual <= 1.1 * st["target"])
                ratio_counts.append(n / st["oracle"])
                cells.append(f"{n} ({st['oracle']})")
        lines.append(
            f"| {mode} | {len(met)} | {100 * np.mean(met):.0f} % | {np.mean(ratio_counts):.2f} | {', '.join(cells)} |"
        )
    lines += [
        "",
        "Equidistant acquisition stopped by the plan's curve (the first count, interpolated in log error between the "
        "plan's counts, whose predicted error meets the target), against the oracle count of equidistant angles:",
        "",
        "| strategy | runs | target met | mean stop / oracle count | stop counts (oracle) |",
        "|---|---|---|---|---|",
    ]
    met, ratio_counts, cells = [], [], []
    for rec in records:
        counts = [int(c) for c in rec["counts"]]
        act = [rec["actual"]["equidistant"][str(c)] for c in counts]
        plan = [rec["plan"]["equidistant"][str(c)][0] for c in counts]
        dense = np.arange(counts[0], counts[-1] + 1)
        for st in stop_counts(rec, fractions):
            t = st["target"]
            stop = next((int(n) for n in dense if _loglin(counts, plan, n) <= t), int(counts[-1]))
            oracle = next((int(n) for n in dense if _loglin(counts, act, n) <= t), int(counts[-1]))
            met.append(_loglin(counts, act, stop) <= 1.1 * t)
            ratio_counts.append(stop / oracle)
            cells.append(f"{stop} ({oracle})")
    lines.append(
        f"| equidistant, plan | {len(met)} | {100 * np.mean(met):.0f} % | {np.mean(ratio_counts):.2f} | "
        f"{', '.join(cells)} |"
    )
    lines += [
        "",
        "## Gate 3: online coverage@0.9 of the acquired angles' rows after 10 acquisitions (in [0.85, 0.95])",
        "",
        "Each angle's rows scored with the calibration fitted before it was seen, pooled over the first 10.",
        "",
        "| calibration update | per scan | mean |",
        "|---|---|---|",
    ]
    for mode in UPDATES:
        cov = [rec["online_coverage"][mode][9] for rec in records if len(rec["online_coverage"][mode]) >= 10]
        if cov:
            lines.append(f"| {mode} | {', '.join(f'{c:.3f}' for c in cov)} | {np.mean(cov):.3f} |")
    plan_s = [rec["plan_s"] for rec in records]
    lines += ["", f"`--plan` wall time per scan: median {np.median(plan_s):.1f} s (max {max(plan_s):.1f} s)."]
    return "\n".join(lines) + "\n"


def run_study(options: StopRuleOptions, out: Path, log: Log | None = None) -> str:
    """Every scan of ``options`` (scans simulated into ``out/scans`` or reused), then ``results.md``; returns it.
    ``out/study.json`` must hold the same options (the seeds may grow); :class:`StudyError` otherwise."""
    log = log or Log("stop_rule_study")
    out = Path(out)
    options.validate()
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = study_fingerprint(plain(options), "simulated", NEUTRAL_OPTIONS)
    check_study_folder(out, fingerprint, log, growable=("walnut_seeds", "textured_seeds"))
    scans = prepare_scans(options, out, log)
    records = [run_scan(name, path, options, out, log) for name, path in scans.items()]
    text = report(records, options.target_fractions)
    (out / "results.md").write_text(text)
    log(f"wrote {out / 'results.md'}")
    return text
