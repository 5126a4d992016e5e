"""The stop-rule study (``scripts/stop_rule_study.py``): is the predicted error of a scan not yet taken right, and
does the stop rule stop at the right count?

Per simulated scan (walnut and textured phantoms, :func:`ctuq.studies.calibration.prepare_scans`; 1200 angles):

1. ``plan/``: ``ctuq design --plan`` from the pilot: the predicted RMS error inside the object after ``n = pilot …
   pilot + acquire`` angles, designed and equidistant (:mod:`ctuq.design.plan`);
2. ``acquire/``: the design on the scan's measurements, each new angle scored before it is used (predicted from
   the tracked DIP, as with a stop target) and the forecast after every step (the stop rule needs nothing else: a
   target changes where the design stops, not its choices);
3. ``actual/<strategy>_<n>/``: FBP, TV and the DIP (cold start, the ``dip`` section) from the first ``n`` designed
   angles and from ``n`` equidistant ones, their RMS error inside the same object mask against the ground truth.

The report (:func:`report`) compares predicted with actual errors at every count of the grid, and, for two targets
per scan (the actual DIP error interpolated at 40 % and 80 % of the way, in log error, from the pilot to the last
count), the count at which the online forecast first meets the target against the oracle count (the smallest count
whose actual error meets it, linear in log error between grid counts), and the actual error at the stop count.
Everything is resumable: finished design folders and run folders are reused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ctuq.calibration.maps import object_mask
from ctuq.config import load_config
from ctuq.design.candidates import equidistant_indices
from ctuq.outputs import read_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.design import DESIGN_NAME, TRACK_ITERATIONS, reconstruct_angles, rmse_inside, run_design
from ctuq.pipeline.scan import load_scan
from ctuq.registry import CALIBRATIONS
from ctuq.studies.calibration import prepare_scans
from ctuq.studies.common import Log, read_json
from ctuq.utils import atomic_write_json

__all__ = ["DEFAULTS", "TINY", "UPDATES", "run_study", "report"]

UPDATES = ("pooled", "online", "pilot")  # design.calibration_update, compared on every run

DEFAULTS = {
    "walnut_seeds": [0, 1, 2, 3],
    "textured_seeds": [0, 1, 2, 3],
    "config": "demo",
    "set": ["data.image_shape=[64,64]", "data.detector_subsampling=4"],
    "candidates": 120,
    "pilot": 10,
    "acquire": 20,
    "counts": [10, 15, 20, 25, 30],
    "target_fractions": [0.4, 0.8],
    "scan_preset": "bundled",
    "projections": 1201,
    "det_rows": 4,
    "gt_shape": [1, 128, 128],
    "progress": False,
}
TINY = {
    **DEFAULTS,
    "walnut_seeds": [0],
    "textured_seeds": [],
    "set": ["data.image_shape=[32,32]", "data.detector_subsampling=8", "dip.iterations=200"],
    "candidates": 24,
    "pilot": 4,
    "acquire": 4,
    "counts": [4, 6, 8],
    "scan_preset": "tiny",
    "projections": 49,
}


def _config(opts: dict, scan: Path, extra=()):
    return load_config(
        opts["config"],
        [
            "data.angular_subsampling=1",
            "data.min_angles=1",
            *opts["set"],
            f"data.path={scan}",
            f"design.candidates={opts['candidates']}",
            f"design.pilot={opts['pilot']}",
            f"design.acquire={opts['acquire']}",
            f"design.forecast_points={len(opts['counts'])}",
            *extra,
        ],
    )


def run_scan(name: str, scan: Path, opts: dict, out: Path, log: Log) -> dict:
    """Plan, acquisition and actual errors of one scan into ``out/<name>``; returns its record (``result.json``)."""
    sdir = out / name
    done = sdir / "result.json"
    if done.is_file():
        return read_json(done)
    sdir.mkdir(parents=True, exist_ok=True)
    cfg = _config(opts, scan)
    runs = {}
    for part, kwargs in (("plan", {"plan": True}), ("acquire", {})):
        folder = sdir / part
        # the acquisition as a stop rule runs it (its predictions from the tracked DIP); no target: it runs to the cap
        extra = [] if part == "plan" else ["design.reconstruct=false", f"design.track_iterations={TRACK_ITERATIONS}"]
        if (folder / DESIGN_NAME).is_file():
            runs[part] = read_json(folder / DESIGN_NAME)
            continue
        log(f"{name}: {part}")
        runs[part] = run_design(
            _config(opts, scan, extra), folder, resume=folder.is_dir(), progress=opts["progress"], **kwargs
        )
    acq = runs["acquire"]
    device = torch.device("cpu")
    data, _, _ = load_scan(cfg, device, progress=False, heldout=False)
    cand = np.asarray(acq["candidates"]["scan_indices"])
    cand_op = data.op.subset(cand.tolist())
    y_cand = data.y[torch.as_tensor(cand)]
    gt = data.ground_truth.detach().cpu().double().numpy().reshape(cand_op.image_shape)
    pilot_x, _ = read_tiff(sdir / "acquire" / "pilot" / rf.RECONSTRUCTION_NAME)
    mask = object_mask(np.asarray(pilot_x, np.float64)) > 0
    order = acq["pilot"]["candidates"] + [a["candidate"] for a in acq["acquired"]]
    actual: dict = {"designed": {}, "equidistant": {}}
    done_sets: dict[tuple, float] = {}  # the same angles (the pilot: equidistant) are reconstructed once
    for n in opts["counts"]:
        for strategy in ("designed", "equidistant"):
            idx = sorted(order[:n] if strategy == "designed" else equidistant_indices(len(cand), n).tolist())
            if tuple(idx) not in done_sets:
                folder = sdir / "actual" / f"{strategy}_{n:03d}"
                if not rf.is_finished_run(folder):
                    log(f"{name}: DIP from {n} {strategy} angles")
                reconstruct_angles(
                    cfg, folder, cand_op.subset(idx), y_cand[idx], data.ground_truth, device, False, need_model=False
                )
                done_sets[tuple(idx)] = rmse_inside(folder, gt, mask)["dip"]
            actual[strategy][n] = done_sets[tuple(idx)]
    record = {
        "scan": name,
        "counts": opts["counts"],
        "plan": {
            s: {r["count"]: [r["rmse"], *r["rmse_band"]] for r in runs["plan"]["forecast"]["plan"][s]}
            for s in ("designed", "equidistant")
        },
        "online": _online_by_update(acq["forecast"]),
        "online_coverage": {
            mode: [r["cumulative_coverage_90_by_update"][mode] for r in acq["forecast"]["online"]] for mode in UPDATES
        },
        "actual": actual,
        "order": order,
        "plan_s": runs["plan"]["timings"]["total_s"],
    }
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


def run_study(opts: dict, out: Path, log: Log | None = None) -> str:
    """Every scan of ``opts`` (scans simulated into ``out/scans`` or reused), then ``results.md``; returns it."""
    log = log or Log("stop_rule_study")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scans = prepare_scans(opts, out, log)
    records = [run_scan(name, path, opts, out, log) for name, path in scans.items()]
    text = report(records, opts["target_fractions"])
    (out / "results.md").write_text(text)
    log(f"wrote {out / 'results.md'}")
    return text
