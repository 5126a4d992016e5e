"""The calibration study's tables, gates and figure (:mod:`ctuq.studies.calibration` runs the study): records
aggregated to mean ± s.e. over scans per (angle count, combination) and content type (:func:`aggregate`), the
user's targets checked against them (:func:`parse_target`, :func:`gate_report`), ``results.md``
(:func:`markdown_table`) and ``calibration.png`` (:func:`calibration_figure`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from ctuq.registry import CALIBRATIONS
from ctuq.studies.common import StudyError
from ctuq.utils import atomic_path

__all__ = [
    "LEVELS",
    "STATISTICS",
    "TARGET_METRICS",
    "aggregate",
    "calibration_figure",
    "gate_report",
    "markdown_table",
    "parse_target",
]

# Nominal levels of the calibration curve (central credible intervals).
LEVELS = tuple(float(v) for v in np.round(np.concatenate([np.arange(0.05, 0.951, 0.05), [0.99]]), 2))


def _side_scored() -> list:
    """The registered calibration methods with a side score, in registration order."""
    return [method for method in CALIBRATIONS.values() if method.side_score is not None]


def _uncalibrated(record: dict) -> bool:
    """A study record of the posterior's own map: its ``uq.calibration`` leaves the map alone (``none``)."""
    return not CALIBRATIONS[record["settings"]["uq.calibration"]].changes_std


def _mean_se(xs: list[float]) -> tuple[float, float]:
    a = np.asarray([x for x in xs if x is not None], dtype=np.float64)
    if a.size == 0:
        return math.nan, math.nan
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else math.nan
    return float(a.mean()), se


_SCALARS = ("coverage_0.5", "coverage_0.9", "coverage_0.95", "right_scale", "marginal_ll", "oracle_ll",
            "joint_ll_10", "oracle_joint_ll_10", "spearman", "spearman_inside", "auc_top10", "decile_coverage_min",
            "decile_coverage_max", "ence", "power_ence", "power_gamma", "spearman_reference", "spearman_ratio", "rmse",
            "mean_std")  # fmt: skip


def aggregate(records: list[dict], targets: dict | None = None) -> list[dict]:
    """Mean ± s.e. over scans of every scalar score, per (angles, combination, content), where content is
    ``all`` and each phantom kind. ``records``: ``{"scan", "kind", "angles", "combination", "scores"}``;
    ``targets`` (metric → ``[low, high]``): a ``right_scale`` target is also counted per scan in the bias
    model's summary."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        for content in ("all", r["kind"]):
            groups.setdefault((r["angles"], r["combination"], content), []).append(r)
    rows = []
    for (angles, combo, content), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "all")):
        row = {"angles": angles, "combination": combo, "content": content, "n_scans": len(rs)}
        for key in _SCALARS:
            row[key] = _mean_se([r["scores"].get(key) for r in rs])
        row["ll_above_oracle_every_scan"] = all(r["scores"]["marginal_ll"] > r["scores"]["oracle_ll"] for r in rs)
        row["min_ll_margin"] = min(r["scores"]["marginal_ll"] - r["scores"]["oracle_ll"] for r in rs)
        row["calibration"] = [float(np.mean([r["scores"]["calibration"][i] for r in rs])) for i in range(len(LEVELS))]
        row["statistics"] = _statistics(rs)
        for side_cls in _side_scored():
            row[side_cls.side_score.key] = _side_summary(rs, side_cls, (targets or {}).get("right_scale"))
        rows.append(row)
    return rows


# The held-out statistics compared in the study: key in the score's ``heldout`` headline → what it is.
STATISTICS = {
    "k": "σ² fixed, all rows (uq.calibration = heldout)",
    "k_image_rows": "σ² fixed, the image-dominated quarter of the rows",
    "k_photon": "photon-statistics noise variance instead of σ²",
    "k_joint": "k and a noise factor fitted jointly",
}


def _statistics(rs: list[dict]) -> dict:
    """Per held-out statistic of :data:`STATISTICS`: the image-space right scale after rescaling the posterior std by
    its ``k`` (``right_scale / k``; 1 is right) as mean ± s.e. over the scans, and the number of scans where it lies
    within 10 % of 1. Only the records of uncalibrated std maps (:func:`_uncalibrated`) enter."""
    out = {}
    for key in STATISTICS:
        vals = [
            r["scores"]["right_scale"] / r["scores"]["heldout"][key]
            for r in rs
            if _uncalibrated(r) and (r["scores"].get("heldout") or {}).get(key)
        ]
        if vals:
            m, se = _mean_se(vals)
            out[key] = {"after": [m, se], "within_10pc": int(sum(abs(x - 1) <= 0.1 for x in vals)), "n": len(vals)}
    return out


def _side_summary(rs: list[dict], method, right_scale_target=None) -> dict | None:
    """The side score of ``method`` (a calibration method class with a ``side_score``: the bias model, τ alone with
    the posterior kept) over the uncalibrated records that have it: mean ± s.e. over scans of its parameters (τ),
    its right scale, coverage and marginal LL, how many scans have each parameter > 0 (``n_tau_positive``) and keep
    the posterior's LL, and with a ``right_scale_target`` ``[low, high]`` how many land inside it; ``None`` when no
    run has it."""
    key, params = method.side_score.key, tuple(method.side_score.columns)
    have = [r["scores"] for r in rs if r["scores"].get(key)]
    if not have:
        return None
    out = {p: _mean_se([s[key][p] for s in have]) for p in params}
    out.update({m: _mean_se([s[key][m] for s in have]) for m in ("right_scale", "coverage_0.9", "coverage_0.95",
                "marginal_ll")})  # fmt: skip
    out["n"] = len(have)
    for p in params:
        out[f"n_{p}_positive"] = int(sum(s[key][p] > 0 for s in have))
    if right_scale_target is not None:
        out["n_right_scale_in_target"] = int(sum(_inside(s[key]["right_scale"], right_scale_target) for s in have))
    out["n_ll_at_least_posterior"] = int(sum(s[key]["marginal_ll"] >= s["marginal_ll"] - 1e-12 for s in have))
    return out


# What a target may bound: the mean over scans of a scalar score, or the smallest per-scan margin of the marginal
# LL over the oracle's (``min_ll_margin``; a target ``0:`` asks for ctuq above the oracle on every scan).
TARGET_METRICS = (*_SCALARS, "min_ll_margin")


def _inside(value: float, bounds) -> bool:
    lo, hi = bounds
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def parse_target(text: str) -> tuple[str, list[float | None]]:
    """``METRIC=LOW:HIGH`` (either bound may be left empty: unbounded) → ``(metric, [low, high])``;
    :class:`StudyError` naming the text for a malformed one or a metric not in :data:`TARGET_METRICS`."""
    metric, sep, bounds = str(text).partition("=")
    lo_text, colon, hi_text = bounds.partition(":")
    try:
        if not sep or not colon:
            raise ValueError
        lo = float(lo_text) if lo_text.strip() else None
        hi = float(hi_text) if hi_text.strip() else None
    except ValueError:
        raise StudyError(
            f"--target {text}: expected METRIC=LOW:HIGH (a bound may be empty), e.g. right_scale=0.85:1.15"
        ) from None
    metric = metric.strip()
    if metric not in TARGET_METRICS:
        raise StudyError(f"--target {text}: the metric must be one of {', '.join(TARGET_METRICS)}")
    if (lo is None and hi is None) or (lo is not None and hi is not None and lo > hi):
        raise StudyError(f"--target {text}: give at least one bound, low ≤ high")
    return metric, [lo, hi]


def gate_report(
    rows: list[dict], targets: dict | None = None, failures: dict[str, list[str]] | None = None
) -> list[dict]:
    """Each combination's margins against the user's ``targets`` (metric of :data:`TARGET_METRICS` → ``[low,
    high]``, ``None`` unbounded), on the ``all`` rows of every angle count: per target the worst margin over the
    angle counts (positive: inside) and pass/fail; ``[]`` without targets. A combination with runs in ``failures``
    (combination → failed runs) fails as a whole (``failed_runs`` > 0): its rows average over fewer scans than the
    others'."""
    failures = failures or {}
    if not targets:
        return []
    out = []
    for combo in sorted({r["combination"] for r in rows}):
        rs = [r for r in rows if r["combination"] == combo and r["content"] == "all"]
        gates = {}
        for key, (lo, hi) in targets.items():
            margins = []
            for r in rs:
                m = r[key] if key == "min_ll_margin" else r[key][0]
                margins.append(min(m - lo if lo is not None else math.inf, hi - m if hi is not None else math.inf))
            worst = min(margins)
            gates[key] = {"pass": bool(worst >= 0), "margin": float(worst)}
        failed = len(failures.get(combo.rsplit("-", 1)[0], []))  # rows are "<inference combination>-<calibration>"
        out.append({"combination": combo, "angles": sorted(r["angles"] for r in rs), "gates": gates,
                    "failed_runs": failed, "pass": failed == 0 and all(g["pass"] for g in gates.values())})  # fmt: skip
    return out


def _bounds_text(bounds) -> str:
    lo, hi = bounds
    if lo is not None and hi is not None:
        return f"∈ [{lo:g}, {hi:g}]"
    return f"≥ {lo:g}" if lo is not None else f"≤ {hi:g}"


def _fmt(ms: tuple[float, float], digits: int = 3) -> str:
    m, s = ms
    if m is None or not math.isfinite(m):
        return "—"
    return f"{m:.{digits}f}" if not math.isfinite(s) else f"{m:.{digits}f} ± {s:.{digits}f}"


def markdown_table(
    rows: list[dict],
    gates: list[dict],
    unavailable: dict[str, str],
    command: str,
    failures: dict[str, list[str]] | None = None,
    targets: dict | None = None,
) -> str:
    """``results.md``: the scores table (mean ± s.e. over scans), the margins against the user's ``targets`` (only
    when there are: ``gates`` from :func:`gate_report`), the unavailable combinations and the runs that failed
    (``failures``: combination → ``"scan, angles: error"``)."""
    targets = targets or {}
    lines = [
        "# Calibration study",
        "",
        f"Command: `{command}`",
        "",
        "Inner square; mean ± s.e. over scans. right scale = sqrt(mean((err/std)²)) (1 is right, > 1: std too "
        "small); oracle = a constant std equal to the RMS error (knows the ground truth); LL in nats/pixel. Inside the "
        "object (truth > 20 % of its maximum): ENCE over the std deciles, beside it the ENCE and γ of the best "
        "c·std^γ of the posterior's map fitted on the truth (a reference, never seen by a method); Spearman ratio = "
        "Spearman inside / the Spearman a calibrated map with the same std gets (1 right, > 1 too flat), the latter "
        "in brackets.",
        "",
        "| angles | combination | content | scans | cov 0.5 | cov 0.9 | cov 0.95 | right scale | marginal LL "
        "| oracle LL | joint LL 10×10 | Spearman | Spearman inside | AUC top 10 % | cov 0.9 per std decile (min–max) "
        "| ENCE (best c·std^γ on the truth, γ) | Spearman ratio (calibrated reference) | LL > oracle on every scan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['angles']} | {r['combination']} | {r['content']} | {r['n_scans']} | {_fmt(r['coverage_0.5'])} "
            f"| {_fmt(r['coverage_0.9'])} | {_fmt(r['coverage_0.95'])} | {_fmt(r['right_scale'], 2)} "
            f"| {_fmt(r['marginal_ll'], 2)} | {_fmt(r['oracle_ll'], 2)} | {_fmt(r['joint_ll_10'], 2)} "
            f"| {_fmt(r['spearman'], 2)} | {_fmt(r['spearman_inside'], 2)} | {_fmt(r['auc_top10'], 2)} "
            f"| {_fmt(r['decile_coverage_min'], 2)} – {_fmt(r['decile_coverage_max'], 2)} "
            f"| {_fmt(r['ence'], 2)} ({_fmt(r['power_ence'], 2)}, {_fmt(r['power_gamma'], 2)}) "
            f"| {_fmt(r['spearman_ratio'], 2)} ({_fmt(r['spearman_reference'], 2)}) "
            f"| {'yes' if r['ll_above_oracle_every_scan'] else 'no'} "
            f"(min {r['min_ll_margin']:+.2f}) |"
        )
    if gates:
        lines += ["", "## Targets (worst margin over the angle counts, positive = inside)", ""]
        heads = [f"{key} {_bounds_text(bounds)}" for key, bounds in targets.items()]
        lines += [f"| combination | {' | '.join(heads)} | all |", "|---|" + "---|" * (len(heads) + 1)]
    for g in gates:
        cells = [f"{'pass' if v['pass'] else 'FAIL'} ({v['margin']:+.3f})" for v in g["gates"].values()]
        verdict = "pass" if g["pass"] else "FAIL"
        if g.get("failed_runs"):
            verdict += f" ({g['failed_runs']} run{'s' if g['failed_runs'] > 1 else ''} failed)"
        lines.append(f"| {g['combination']} | {' | '.join(cells)} | {verdict} |")
    stat_rows = [r for r in rows if r["content"] == "all" and r.get("statistics")]
    if stat_rows:
        lines += ["", "## Held-out statistics against the image-space right scale (uncalibrated runs)", ""]
        lines += [
            "right scale of std × k (1 is right): mean ± s.e. over scans; in brackets the scans within 10 % of 1",
            "",
        ]
        lines += ["| angles | combination | " + " | ".join(f"`{k}`: {v}" for k, v in STATISTICS.items()) + " |"]
        lines += ["|---|---|" + "---|" * len(STATISTICS)]
        for r in stat_rows:
            st = r["statistics"]
            cells = [
                f"{_fmt(tuple(st[k]['after']), 2)} ({st[k]['within_10pc']}/{st[k]['n']})" if k in st else "—"
                for k in STATISTICS
            ]
            lines.append(f"| {r['angles']} | {r['combination']} | " + " | ".join(cells) + " |")
    for side_cls in _side_scored():
        lines += _side_table(rows, side_cls.side_score, targets.get("right_scale"))
    if unavailable:
        lines += ["", "## Combinations not run", ""]
        lines += [f"- `{name}`: {why}" for name, why in unavailable.items()]
    if failures:
        lines += ["", "## Runs that failed (their combination's rows average over the other scans)", ""]
        lines += [f"- `{name}` on {run}" for name, runs in failures.items() for run in runs]
    return "\n".join(lines) + "\n"


def _side_table(rows: list[dict], side, scale_target) -> list[str]:
    """The ``results.md`` lines of one side score (``side``: a method's
    :class:`~ctuq.calibration.SideScore`) over the ``all`` rows that have it, with a column counting the scans whose
    right scale lies inside ``scale_target`` when one is given; none without such rows."""
    have = [r for r in rows if r["content"] == "all" and r.get(side.key)]
    if not have:
        return []
    inside = f" right scale {_bounds_text(scale_target)} |" if scale_target is not None else ""
    heads = "".join(f" {sym} > 0 | {sym} ({unit}) |" for sym, unit in side.columns.values())
    lines = ["", f"## {side.title}", ""]
    lines += [
        side.note,
        "",
        f"| angles | combination | scans |{heads} right scale |{inside} cov 0.9 | cov 0.95 | marginal LL "
        "| LL ≥ posterior's |",
        "|---|---|---|" + "---|---|" * len(side.columns) + "---|" + ("---|" if inside else "") + "---|---|---|---|",
    ]
    for r in have:
        b = r[side.key]
        count = f" {b['n_right_scale_in_target']} |" if "n_right_scale_in_target" in b else ""
        params = "".join(f" {b[f'n_{p}_positive']} | {_fmt(b[p], 5)} |" for p in side.columns)
        lines.append(
            f"| {r['angles']} | {r['combination']} | {b['n']} |{params} {_fmt(b['right_scale'], 2)} |{count} "
            f"{_fmt(b['coverage_0.9'])} | {_fmt(b['coverage_0.95'])} | {_fmt(b['marginal_ll'], 2)} "
            f"| {b['n_ll_at_least_posterior']} |"
        )
    return lines


def calibration_figure(rows: list[dict], path: Path) -> None:
    """Coverage against nominal level (0.05…0.99), one curve per combination, one panel per angle count
    (all scans), written atomically to ``path`` (PNG)."""
    angles = sorted({r["angles"] for r in rows})
    fig = Figure(figsize=(4.5 * len(angles), 4.2), layout="constrained")
    axes = fig.subplots(1, len(angles), squeeze=False)
    for ax, n in zip(axes[0], angles):
        ax.plot([0, 1], [0, 1], "k:", lw=1, label="ideal")
        for r in rows:
            if r["angles"] == n and r["content"] == "all":
                ax.plot(LEVELS, r["calibration"], marker="o", ms=3, label=r["combination"])
        ax.set(xlabel="nominal level", ylabel="empirical coverage", title=f"{n} angles", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
