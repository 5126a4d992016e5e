"""Calibration study (issue 26): is the std map's scale right on scans ctuq never saw, for which combination of
prior × noise model × recalibration?

Over simulated scans of two content types (the ellipsoid walnut and the textured phantom,
:func:`ctuq.data.phantom.make_phantom`, several seeds each), every scan simulated once with 1200 angles so that
every angle count of the study is a subset and the other angles stay unused (held out), the study

1. fits the DIP once per scan × angle count with the ``ctuq reconstruct`` pipeline (:func:`ctuq.pipeline.runner
   .reconstruct`, ``--no-uq``; the run folder ``OUT/<scan>/angles_<N>/dip`` is resumed when interrupted);
2. per combination of the grid (``uq.prior`` × ``uq.noise`` × ``uq.calibration``), copies that run folder and runs
   the inference on it as ``ctuq uq RUN --set uq.prior=… --set uq.noise=… --set uq.calibration=…`` would
   (:func:`ctuq.pipeline.runner.rerun_uq`), so every combination shares the DIP and differs only in the settings;
3. scores the run's ``std.tif`` against its reconstruction and ground truth in the inner square
   (:func:`score_run`): coverage at 0.5/0.9/0.95 and over 0.05…0.99, the right-scale factor
   ``sqrt(mean((err/std)²))``, the marginal log-likelihood against the best constant std (the oracle: a constant
   std equal to the RMS error, which knows the ground truth), the 10×10 joint log-likelihood (``metrics.json``)
   against the same oracle, Spearman(std, |err|), and the held-out check when the run made one;
4. aggregates mean ± s.e. over scans per (angle count, combination), also per content type, and checks the
   issue's acceptance gates (:data:`GATES`).

A combination whose settings the config does not know yet (``uq.noise``/``uq.calibration`` before they exist) is
reported as unavailable before any work starts (:func:`check_combinations`); a combination's baseline values
(``homoscedastic``, ``none``) are simply left out when the key does not exist, since they are what the code does
without it. Options are one plain dict ``opts`` (:data:`DEFAULTS`); the script is ``scripts/calibration_study.py``.
"""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
from matplotlib.figure import Figure
from scipy.special import ndtri
from scipy.stats import spearmanr

from ctuq.config import Config, ConfigError, load_config
from ctuq.data.simulate import SIDECAR_NAME
from ctuq.metrics import inner_square_roi
from ctuq.options import PhantomKind
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.runner import reconstruct, rerun_uq
from ctuq.pipeline.simulate import simulate
from ctuq.studies.common import Log, StudyError, check_study_folder, read_json, study_fingerprint
from ctuq.utils import atomic_path, atomic_write_json

__all__ = [
    "AXES",
    "DEFAULTS",
    "TINY",
    "GATES",
    "LEVELS",
    "Combination",
    "combinations",
    "check_combinations",
    "scan_names",
    "prepare_scans",
    "score_run",
    "aggregate",
    "gate_report",
    "markdown_table",
    "calibration_figure",
    "run_study",
    "validate_options",
]

# The combination grid: config key → values; the first value of each axis is what ctuq does without the key.
AXES: dict[str, tuple[str, ...]] = {
    "uq.prior": ("gprior", "tv_predcp"),
    "uq.noise": ("homoscedastic", "per_ray"),
    "uq.calibration": ("none", "heldout"),
}

# Nominal levels of the calibration curve (central credible intervals).
LEVELS = tuple(float(v) for v in np.round(np.concatenate([np.arange(0.05, 0.951, 0.05), [0.99]]), 2))
HEADLINE = (0.5, 0.9, 0.95)
JOINT_PATCH = "10"

# Acceptance gates of issue 26 on the means over scans: (metric, low, high); None = unbounded.
GATES = {
    "right_scale": (0.85, 1.15),
    "coverage_0.9": (0.86, 0.94),
    "coverage_0.95": (0.92, None),
}

DEFAULTS: dict[str, Any] = {
    "walnut_seeds": [0, 1, 2, 3, 4],
    "textured_seeds": [0, 1, 2, 3, 4],
    "settings": [60, 300],
    "priors": ["gprior", "tv_predcp"],
    "noises": ["homoscedastic", "per_ray"],
    "calibrations": ["none", "heldout"],
    "config": "demo",
    "set": [],
    # Scan: the bundled preset's detector and ground-truth pixels, 1200 angles, 4 detector rows (the central slice
    # lies between the middle two), one ground-truth slice.
    "scan_preset": "bundled",
    "projections": 1201,
    "det_rows": 4,
    "gt_shape": [1, 128, 128],
    "progress": False,
}

# --tiny: seconds per combination (for tests); tiny scans, 32 angles, a short DIP and few samples.
TINY: dict[str, Any] = {
    "walnut_seeds": [0],
    "textured_seeds": [0],
    "settings": [8],
    "scan_preset": "tiny",
    "projections": 33,
    "det_rows": 4,
    "gt_shape": [1, 128, 128],
    "set": [
        "data.detector_subsampling=1",
        "data.image_shape=[32, 32]",
        "data.min_angles=2",
        "dip.iterations=20",
        "dip.checkpoint_every=10",
        "tv.enabled=false",
        "uq.samples=32",
        "uq.em_steps=3",
        "output.figure=false",
    ],
}


class Combination:
    """One point of the grid: ``settings`` (config key → value) and the ``--set`` strings that realise it (the
    baseline values of keys the config does not have are left out). ``error``: why it cannot run, or ``None``."""

    def __init__(self, settings: dict[str, str]):
        self.settings = dict(settings)
        self.overrides: list[str] = []
        self.error: str | None = None

    @property
    def name(self) -> str:
        """Folder-safe name, e.g. ``gprior-homoscedastic-none``."""
        return "-".join(self.settings.values())

    def __repr__(self) -> str:
        return f"Combination({self.name})"


def combinations(opts: dict) -> list[Combination]:
    """The grid ``priors × noises × calibrations`` of ``opts`` as :class:`Combination` s (unchecked)."""
    grid = itertools.product(opts["priors"], opts["noises"], opts["calibrations"])
    return [Combination(dict(zip(AXES, combo))) for combo in grid]


def _base_overrides(opts: dict, scan: Path | None, n_angles: int | None) -> list[str]:
    out = list(opts["set"])
    if scan is not None:
        out.append(f"data.path={scan}")
    if n_angles is not None:
        out.append(f"data.angular_subsampling={(opts['projections'] - 1) // n_angles}")
    return out


def check_combinations(opts: dict, combos: list[Combination]) -> list[Combination]:
    """Resolve each combination's ``--set`` strings against the config, up front: a setting the config rejects
    (an unknown key, or a value not in its choices) makes the combination unavailable, with the config's own
    one-line message in ``error``; a baseline value of an unknown key is dropped (the code's behaviour without
    it). Returns ``combos`` (updated in place)."""
    for combo in combos:
        combo.overrides, combo.error = [], None
        for key, value in combo.settings.items():
            text = f"{key}={value}"
            try:
                load_config(opts["config"], [*opts["set"], text])
            except ConfigError as exc:
                unknown = "unknown config key" in str(exc)
                if unknown and value == AXES[key][0]:
                    continue
                combo.error = f"{text}: not available yet ({exc})" if unknown else str(exc)
                break
            combo.overrides.append(text)
        if combo.error is None:
            try:
                load_config(opts["config"], [*opts["set"], *combo.overrides])
            except ConfigError as exc:  # a pair of settings that is invalid together
                combo.error = str(exc)
    return combos


def scan_names(opts: dict) -> list[tuple[str, str, int]]:
    """``(name, kind, seed)`` of every scan: ``walnut_<seed>`` and ``textured_<seed>``."""
    out = [(f"walnut_{s}", PhantomKind.WALNUT.value, int(s)) for s in opts["walnut_seeds"]]
    return out + [(f"textured_{s}", PhantomKind.TEXTURED.value, int(s)) for s in opts["textured_seeds"]]


def prepare_scans(opts: dict, out: Path, log: Log) -> dict[str, Path]:
    """Simulate every scan into ``out/scans/<name>`` (:func:`ctuq.pipeline.simulate.simulate`), reusing complete
    ones. Returns name → folder."""
    paths = {}
    for name, kind, seed in scan_names(opts):
        path = out / "scans" / name
        sidecar = path / SIDECAR_NAME
        if sidecar.is_file() and read_json(sidecar).get("complete"):
            paths[name] = path
            continue
        log(f"simulating {name} ({kind}, seed {seed}, {opts['projections'] - 1} angles)")
        overrides = {
            "n_projections": opts["projections"],
            "det_rows": opts["det_rows"],
            "gt_shape": tuple(opts["gt_shape"]),
            "seed": seed,
        }
        res = simulate(
            path,
            opts["scan_preset"],
            overrides=overrides,
            overwrite=sidecar.is_file(),
            progress=opts["progress"],
            log=log,
            phantom=kind,
        )
        log(f"simulated {name} in {res['time_s']:.1f} s")
        paths[name] = path
    return paths


def _gaussian_ll(err: np.ndarray, std: np.ndarray) -> float:
    """Mean ``log N(err; 0, std²)`` (nats/pixel)."""
    return float(np.mean(-0.5 * np.log(2 * math.pi * std**2) - 0.5 * (err / std) ** 2))


def score_run(run: Path) -> dict:
    """Scores of a finished run folder in its inner square (:func:`ctuq.metrics.inner_square_roi`).

    Reads ``reconstruction.tif``, ``ground_truth.tif``, ``std.tif`` (mm⁻¹) and ``metrics.json``. Returns
    ``coverage_0.5/0.9/0.95`` and ``calibration`` (coverage at :data:`LEVELS`), ``right_scale`` =
    ``sqrt(mean((err/std)²))`` (the factor the std would need), ``marginal_ll`` and ``oracle_ll`` (a constant std
    equal to the RMS error), ``joint_ll_10`` (10×10 patches, from ``metrics.json``) and ``oracle_joint_ll_10`` (the
    oracle is independent across pixels, so its joint LL per pixel equals its marginal one), ``spearman``
    (std against |err|; ``None`` for a constant std),
    ``rmse`` and ``mean_std`` (mm⁻¹), and ``heldout`` (the run's held-out check, if any).
    """
    read = {name: tifffile.imread(run / name).astype(np.float64) for name in (rf.RECONSTRUCTION_NAME,
            rf.GROUND_TRUTH_NAME, rf.STD_NAME)}  # fmt: skip
    roi = inner_square_roi(read[rf.STD_NAME].shape)
    err = (read[rf.RECONSTRUCTION_NAME] - read[rf.GROUND_TRUTH_NAME])[roi].ravel()
    std = read[rf.STD_NAME][roi].ravel()
    if not np.all(np.isfinite(std)) or std.min() <= 0:
        raise StudyError(f"{run / rf.STD_NAME}: the std map has non-positive or non-finite pixels")
    z = np.abs(err) / std
    rmse = float(np.sqrt(np.mean(err**2)))
    metrics = read_json(run / rf.METRICS_NAME)
    oracle = _gaussian_ll(err, np.full_like(err, rmse))
    uq = metrics.get("uq", {}) if isinstance(metrics.get("uq"), dict) else {}
    heldout = {k: v for k, v in uq.items() if "calibration" in k or "heldout" in k or "check" in k}
    return {
        **{f"coverage_{l:g}": float(np.mean(z <= ndtri(0.5 + l / 2))) for l in HEADLINE},
        "calibration": [float(np.mean(z <= ndtri(0.5 + l / 2))) for l in LEVELS],
        "right_scale": float(np.sqrt(np.mean(z**2))),
        "marginal_ll": _gaussian_ll(err, std),
        "oracle_ll": oracle,
        "joint_ll_10": (metrics.get("joint_ll") or {}).get(JOINT_PATCH),
        "oracle_joint_ll_10": oracle,
        # a constant std ranks nothing: no correlation is defined (None, left out of the means)
        "spearman": float(spearmanr(std, np.abs(err)).statistic) if np.ptp(std) > 0 else None,
        "rmse": rmse,
        "mean_std": float(np.mean(std)),
        "heldout": heldout or None,
    }


def _mean_se(xs: list[float]) -> tuple[float, float]:
    a = np.asarray([x for x in xs if x is not None], dtype=np.float64)
    if a.size == 0:
        return math.nan, math.nan
    se = float(a.std(ddof=1) / math.sqrt(a.size)) if a.size > 1 else math.nan
    return float(a.mean()), se


_SCALARS = ("coverage_0.5", "coverage_0.9", "coverage_0.95", "right_scale", "marginal_ll", "oracle_ll",
            "joint_ll_10", "oracle_joint_ll_10", "spearman", "rmse", "mean_std")  # fmt: skip


def aggregate(records: list[dict]) -> list[dict]:
    """Mean ± s.e. over scans of every scalar score, per (angles, combination, content), where content is
    ``all`` and each phantom kind. ``records``: ``{"scan", "kind", "angles", "combination", "scores"}``."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        for content in ("all", r["kind"]):
            groups.setdefault((r["angles"], r["combination"], content), []).append(r)
    rows = []
    for (angles, combo, content), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "all")):
        row = {"angles": angles, "combination": combo, "content": content, "n_scans": len(rs)}
        for key in _SCALARS:
            row[key] = _mean_se([r["scores"][key] for r in rs])
        row["ll_above_oracle_every_scan"] = all(r["scores"]["marginal_ll"] > r["scores"]["oracle_ll"] for r in rs)
        row["min_ll_margin"] = min(r["scores"]["marginal_ll"] - r["scores"]["oracle_ll"] for r in rs)
        row["calibration"] = [float(np.mean([r["scores"]["calibration"][i] for r in rs])) for i in range(len(LEVELS))]
        rows.append(row)
    return rows


def gate_report(rows: list[dict]) -> list[dict]:
    """The acceptance gates per combination, on the ``all`` rows of every angle count: for each gate the worst
    margin over angle counts (positive: inside) and pass/fail; plus ctuq's marginal LL above the oracle's on
    every scan (margin: the smallest difference, nats/pixel)."""
    out = []
    for combo in sorted({r["combination"] for r in rows}):
        rs = [r for r in rows if r["combination"] == combo and r["content"] == "all"]
        gates = {}
        for key, (lo, hi) in GATES.items():
            margins = []
            for r in rs:
                m = r[key][0]
                margins.append(min(m - lo if lo is not None else math.inf, hi - m if hi is not None else math.inf))
            worst = min(margins)
            gates[key] = {"pass": bool(worst >= 0), "margin": float(worst)}
        worst_ll = min(r["min_ll_margin"] for r in rs)
        gates["ll_above_oracle"] = {"pass": bool(worst_ll > 0), "margin": float(worst_ll)}
        out.append({"combination": combo, "angles": sorted(r["angles"] for r in rs), "gates": gates,
                    "pass": all(g["pass"] for g in gates.values())})  # fmt: skip
    return out


def _fmt(ms: tuple[float, float], digits: int = 3) -> str:
    m, s = ms
    if m is None or not math.isfinite(m):
        return "—"
    return f"{m:.{digits}f}" if not math.isfinite(s) else f"{m:.{digits}f} ± {s:.{digits}f}"


def markdown_table(rows: list[dict], gates: list[dict], unavailable: dict[str, str], command: str) -> str:
    """``results.md``: the scores table (mean ± s.e. over scans), the gates and the unavailable combinations."""
    lines = [
        "# Calibration study",
        "",
        f"Command: `{command}`",
        "",
        "Inner square; mean ± s.e. over scans. right scale = sqrt(mean((err/std)²)) (1 is right, > 1: std too "
        "small); oracle = a constant std equal to the RMS error (knows the ground truth); LL in nats/pixel.",
        "",
        "| angles | combination | content | scans | cov 0.5 | cov 0.9 | cov 0.95 | right scale | marginal LL "
        "| oracle LL | joint LL 10×10 | Spearman | LL > oracle on every scan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['angles']} | {r['combination']} | {r['content']} | {r['n_scans']} | {_fmt(r['coverage_0.5'])} "
            f"| {_fmt(r['coverage_0.9'])} | {_fmt(r['coverage_0.95'])} | {_fmt(r['right_scale'], 2)} "
            f"| {_fmt(r['marginal_ll'], 2)} | {_fmt(r['oracle_ll'], 2)} | {_fmt(r['joint_ll_10'], 2)} "
            f"| {_fmt(r['spearman'], 2)} | {'yes' if r['ll_above_oracle_every_scan'] else 'no'} "
            f"(min {r['min_ll_margin']:+.2f}) |"
        )
    lines += ["", "## Acceptance gates (issue 26; worst margin over the angle counts, positive = inside)", ""]
    lines += ["| combination | right scale ∈ [0.85, 1.15] | cov@0.9 ∈ [0.86, 0.94] | cov@0.95 ≥ 0.92 | "
              "LL > oracle on every scan | all |", "|---|---|---|---|---|---|"]  # fmt: skip
    for g in gates:
        cells = [f"{'pass' if v['pass'] else 'FAIL'} ({v['margin']:+.3f})" for v in g["gates"].values()]
        lines.append(f"| {g['combination']} | {' | '.join(cells)} | {'pass' if g['pass'] else 'FAIL'} |")
    if unavailable:
        lines += ["", "## Combinations not run", ""]
        lines += [f"- `{name}`: {why}" for name, why in unavailable.items()]
    return "\n".join(lines) + "\n"


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


def _config(opts: dict, scan: Path, n_angles: int, extra: list[str]) -> Config:
    try:
        return load_config(opts["config"], [*_base_overrides(opts, scan, n_angles), *extra])
    except ConfigError as exc:
        raise StudyError(str(exc)) from None


def _fit_dip(opts: dict, scan: Path, n_angles: int, folder: Path, log: Log) -> Path:
    """The DIP run folder of one scan × angle count (``ctuq reconstruct --no-uq``), fitted or resumed."""
    if rf.is_finished_run(folder):
        return folder
    log(f"fitting the DIP: {folder}")
    cfg = _config(opts, scan, n_angles, [])
    reconstruct(cfg, folder, resume=folder.is_dir(), uq=False, progress=opts["progress"])
    return folder


def _run_combination(opts: dict, scan: Path, n_angles: int, dip: Path, combo: Combination, log: Log) -> Path:
    """The inference of one combination on a copy of the DIP run folder; resumed from its checkpoints."""
    folder = dip.parent / combo.name
    resume = folder.is_dir()
    if not resume:
        tmp = folder.with_name(folder.name + ".copying")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(dip, tmp)
        tmp.rename(folder)
    log(f"inference {combo.name}: {folder}" + (" (resuming)" if resume else ""))
    cfg = _config(opts, scan, n_angles, combo.overrides)
    rerun_uq(cfg, folder, resume=resume, progress=opts["progress"])
    return folder


def run_study(opts: dict, out: Path, command: str, log: Log | None = None) -> dict:
    """Run (or resume) the study of ``opts`` into ``out``; returns the content of ``results.json``.

    Finished parts are skipped: simulated scans (complete sidecar), DIP fits (finished run folder), combinations
    (``score.json`` in their folder). ``study.json`` must hold the same options (``settings`` and the seeds may
    grow). Raises :class:`StudyError` for bad options or an output folder of another study.
    """
    log = log or Log("calibration_study")
    out = Path(out)
    validate_options(opts)
    combos = check_combinations(opts, combinations(opts))
    unavailable = {c.name: c.error for c in combos if c.error is not None}
    for name, why in unavailable.items():
        log(f"combination {name} is not available: {why}")
    runnable = [c for c in combos if c.error is None]
    if not runnable:
        raise StudyError(
            "no combination of the grid can run: " + "; ".join(f"{k}: {v}" for k, v in unavailable.items())
        )
    out.mkdir(parents=True, exist_ok=True)
    check_study_folder(
        out, study_fingerprint(opts, "simulated"), log, growable=("settings", "walnut_seeds", "textured_seeds")
    )
    scans = prepare_scans(opts, out, log)
    kinds = {name: kind for name, kind, _ in scan_names(opts)}
    records = []
    for n_angles in opts["settings"]:
        for name, scan in scans.items():
            dip = _fit_dip(opts, scan, n_angles, out / "runs" / name / f"angles_{n_angles}" / "dip", log)
            for combo in runnable:
                folder = dip.parent / combo.name
                score_path = folder / "score.json"
                if combo.name in unavailable:
                    continue
                if score_path.is_file():
                    scores = read_json(score_path)
                else:
                    try:
                        _run_combination(opts, scan, n_angles, dip, combo, log)
                    except ValueError as exc:  # a user error of the run (CTUQError): that combination cannot run
                        unavailable[combo.name] = f"failed on {name}, {n_angles} angles: {exc}"
                        log(f"combination {combo.name} failed, left out: {exc}")
                        continue
                    scores = score_run(folder)
                    atomic_write_json(score_path, scores)
                records.append(
                    {
                        "scan": name,
                        "kind": kinds[name],
                        "angles": n_angles,
                        "combination": combo.name,
                        "settings": combo.settings,
                        "scores": scores,
                    }  # fmt: skip
                )
                log(
                    f"{name} {n_angles} angles {combo.name}: cov@0.9 {scores['coverage_0.9']:.3f}, right scale "
                    f"{scores['right_scale']:.2f}, LL {scores['marginal_ll']:.2f} vs oracle {scores['oracle_ll']:.2f}"
                )
    rows = aggregate(records)
    gates = gate_report(rows)
    results = {"options": opts, "command": command, "levels": list(LEVELS), "unavailable": unavailable,
               "records": records, "table": rows, "gates": gates}  # fmt: skip
    atomic_write_json(out / "results.json", results)
    md = markdown_table(rows, gates, unavailable, command)
    (out / "results.md.tmp").write_text(md)
    (out / "results.md.tmp").replace(out / "results.md")
    calibration_figure(rows, out / "calibration.png")
    return results


def validate_options(opts: dict) -> None:
    """One-line :class:`StudyError` for an invalid study option (named as its command-line flag)."""
    for key in ("priors", "noises", "calibrations"):
        axis = AXES[{"priors": "uq.prior", "noises": "uq.noise", "calibrations": "uq.calibration"}[key]]
        bad = [v for v in opts[key] if v not in axis]
        if bad or not opts[key]:
            raise StudyError(f"--{key} {' '.join(map(str, opts[key]))}: each must be one of {', '.join(axis)}")
    if not opts["walnut_seeds"] and not opts["textured_seeds"]:
        raise StudyError("--walnut-seeds/--textured-seeds: the study needs at least one scan")
    n = opts["projections"] - 1
    for s in opts["settings"]:
        if s < 1 or n % s:
            raise StudyError(f"--settings {s}: each angle count must divide the scans' {n} angles")
    if opts["scan_preset"] not in ("bundled", "tiny", "walnut"):
        raise StudyError(f"--scan-preset {opts['scan_preset']!r}: must be one of bundled, tiny, walnut")
    try:
        load_config(opts["config"], list(opts["set"]))
    except ConfigError as exc:
        raise StudyError(f"--config/--set: {exc}") from None
