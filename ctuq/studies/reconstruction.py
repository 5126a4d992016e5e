"""The reconstruction study (``scripts/reconstruction_study.py``): FBP, TV and the DIP with fixed settings and tuned on
held-out angles, against the best setting the ground truth would choose (the oracle).

Per setting (a simulated walnut or textured scan of 1200 angles, :func:`ctuq.studies.calibration.prepare_scans`, or
the bundled scan; an image size; an angle count), three runs through the public API (:func:`ctuq.reconstruct`), in
``OUT/<scan>/<size>_<angles>/``:

1. ``fixed/``: the settings before tuning (``tv.tuning = fixed``: ``tv.weight``; ``dip.tuning = fixed``: the lowest
   loss after ``dip.iterations``; ``model.input = noise``), without the uncertainty;
2. ``tuned/``: the defaults (TV's ``λ`` and the DIP's stopping iteration chosen on the tuning half of the held-out
   angles; the DIP started at the TV image, its input, with γ from TV's λ: ``docs/reconstruction.md``) with the
   uncertainty, whose std map is scored against the ground truth
   (:func:`ctuq.studies.calibration.score_run`) at the new linearisation point;
3. ``tv/``: the defaults' TV alone (``dip.enabled = false``) with its whole weight path (``tv.path_stop_early =
   false``, as in ``tuned/``): the TV numbers of the study (a TV rule changed later reruns this run and, since the
   DIP starts at TV's image, ``tuned/``).

The runs record each iteration's PSNR (``output.psnr_trace``) and each path weight's, so the oracles come from the
same fits: the TV weight of the path with the best PSNR, the DIP iterate with the best PSNR. The path also gives the
other rule's choice (the lowest held-out error, unweighted) for comparison. The ground truth is used for nothing
else.

A rerun of the same command resumes (finished runs are loaded). ``OUT/results.md`` holds the tables and the issue's
gates; ``OUT/results.json`` the records.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ctuq.config import ConfigError, load_config
from ctuq.pipeline import run_folder as rf
from ctuq.run import reconstruct
from ctuq.studies.calibration import prepare_scans, score_run
from ctuq.studies.common import NEUTRAL_OPTIONS, Log, StudyError, check_study_folder, read_json, study_fingerprint
from ctuq.studies.study_options import freeze, option, plain
from ctuq.utils import atomic_write_json

__all__ = ["ReconstructionOptions", "DEFAULTS", "TINY", "SIZES", "run_study", "run_setting", "report"]

#: image size → the overrides that give it (the simulated and bundled scans have 256 detector columns)
SIZES = {
    32: ("data.image_shape=[32,32]", "data.detector_subsampling=8"),
    64: ("data.image_shape=[64,64]", "data.detector_subsampling=4"),
    128: ("data.image_shape=[128,128]", "data.detector_subsampling=2"),
}
#: the settings before held-out tuning (what ``ctuq reconstruct`` did until 2026-11-28)
FIXED_SETS = (
    "tv.tuning=fixed",
    "dip.tuning=fixed",
    "model.input=noise",
    "dip.warm_start=none",
    "dip.tv_weight_from_tv=false",
)
_COMMON_SETS = ("output.psnr_trace=true", "output.figure=false")
BUNDLED = "bundled"


@dataclasses.dataclass(frozen=True)
class ReconstructionOptions:
    """The options of one reconstruction study (``scripts/reconstruction_study.py`` builds them from its flags). All
    but ``progress`` and ``tiny`` change numbers, so ``study.json`` records them."""

    walnut_seeds: tuple[int, ...] = option((0,), help="seeds of the simulated walnut scans")
    textured_seeds: tuple[int, ...] = option((0,), help="seeds of the simulated textured scans")
    sizes: tuple[int, ...] = option((64, 128), help=f"image sizes (each one of {sorted(SIZES)})")
    settings: tuple[int, ...] = option((60, 300), help="angle counts of the simulated scans (each divides 1200)")
    bundled: bool = option(True, help="also the bundled scan (60 of its 240 angles, 128²: the demo)")
    config: str = option("demo", help="base config of every run")
    set: tuple[str, ...] = option((), help="config overrides of every run (KEY=VALUE)")
    scan_preset: str = option("bundled", help="ctuq simulate preset of the scans (bundled, tiny, walnut)")
    projections: int = option(1201, help="projection files per scan (the last repeats the first angle)")
    det_rows: int = option(4, help="detector rows of the simulated scans")
    gt_shape: tuple[int, int, int] = option((1, 128, 128), help="ground-truth grid of the simulated scans")
    progress: bool = option(False, help="progress bars of the runs")
    tiny: bool = option(False, help="the test size (TINY)")

    def __post_init__(self) -> None:
        freeze(self)

    def validate(self) -> None:
        """One-line :class:`StudyError` for an invalid option (named as its command-line flag)."""
        bad = [s for s in self.sizes if s not in SIZES]
        if bad or not self.sizes:
            raise StudyError(f"--sizes {' '.join(map(str, self.sizes))}: each must be one of {sorted(SIZES)}")
        n = self.projections - 1
        for s in self.settings:
            if s < 1 or n % s:
                raise StudyError(f"--settings {s}: each angle count must divide the scans' {n} angles")
        try:
            load_config(self.config, [*self.set, *FIXED_SETS])
        except ConfigError as exc:
            raise StudyError(f"--set: {exc}") from None


DEFAULTS = ReconstructionOptions()
# seconds-long runs of the machinery (tests): one tiny scan, 32², 8 of 48 angles, a short DIP and few samples
TINY = ReconstructionOptions(
    textured_seeds=(),
    sizes=(32,),
    settings=(8,),
    bundled=False,
    set=(
        "dip.iterations=60",
        "dip.warm_start_iterations=30",
        "dip.heldout_every=10",
        "dip.checkpoint_every=0",
        "tv.iterations=20",
        "tv.path_iterations=10",
        "tv.per_decade=2",
        "uq.samples=32",
        "uq.em_steps=3",
        "data.min_angles=2",
    ),
    scan_preset="tiny",
    projections=49,
    tiny=True,
)


def _psnr_oracles(metrics: dict) -> dict:
    """The ground-truth-chosen settings of one run: the best PSNR along the DIP's iterations (and where) and along the
    TV path (and at which weight), from its ``metrics.json``."""
    out: dict = {}
    trace = (metrics.get("dip") or {}).get("psnr_trace")
    if trace:
        best = int(np.argmax(trace))
        out["dip"] = {"psnr": float(trace[best]), "iteration": best}
        scored = [int(i) for i, _ in (metrics["dip"].get("heldout_trace") or [])]
        if scored:  # the best of the iterates the held-out rule could keep (every dip.heldout_every-th)
            out["dip"]["scored_psnr"] = float(max(trace[i] for i in scored))
    tuning = (metrics.get("tv") or {}).get("tuning")
    if tuning and tuning.get("psnr"):
        best = int(np.argmax(tuning["psnr"]))
        chosen = tuning["weights"].index(tuning["path_weight"])
        lowest = int(np.argmin(tuning["heldout_error"]))
        # like for like: the path's image at the weight the rule chose, against the path's best
        out["tv"] = {
            "psnr": float(tuning["psnr"][best]),
            "weight": float(tuning["weights"][best]),
            "chosen_psnr": float(tuning["psnr"][chosen]),
            "lowest_heldout_psnr": float(tuning["psnr"][lowest]),
            "lowest_heldout_weight": float(tuning["weights"][lowest]),
        }
    return out


def run_setting(scan: Path | None, size: int, n_angles: int, subsampling: int, options, out: Path, log: Log) -> dict:
    """The fixed, the tuned and the TV run of one scan × size × angle count in ``out`` (resumed/loaded when there);
    returns the setting's record (also ``out/result.json``)."""
    sets = [*SIZES[size], f"data.angular_subsampling={subsampling}", *_COMMON_SETS, *options.set]
    common = dict(config=options.config, resume=True, reuse=True, progress=options.progress)
    fixed = reconstruct(scan, set=[*sets, *FIXED_SETS], out=out / "fixed", uq=False, **common)
    tuned = reconstruct(scan, set=[*sets, "tv.path_stop_early=false"], out=out / "tuned", uq=True, **common)
    tv = reconstruct(
        scan, set=[*sets, "tv.path_stop_early=false", "dip.enabled=false"], out=out / "tv", uq=False, **common
    )
    mf, mt = read_json(fixed.path / rf.METRICS_NAME), read_json(tuned.path / rf.METRICS_NAME)
    mtv = read_json(tv.path / rf.METRICS_NAME)
    applied = ((mt.get("uq") or {}).get("calibration") or {}).get("mode") or "none"
    scores = score_run(tuned.path, calibration=applied)
    dip_t = mt["dip"]
    record = {
        "size": size,
        "angles": n_angles,
        "psnr": {
            "fbp": mt["psnr"]["fbp"],
            "tv_fixed": mf["psnr"]["tv"],
            "tv_tuned": mtv["psnr"]["tv"],
            "dip_fixed": mf["psnr"]["dip"],
            "dip_tuned": mt["psnr"]["dip"],
        },
        "oracle": {"tuned": {**_psnr_oracles(mt), **_psnr_oracles(mtv)}, "fixed": _psnr_oracles(mf)},
        "tv_weight": mtv["tv"]["weight"],
        "tv_criterion": mtv["tv"]["tuning"]["criterion"],
        "dip_iteration": {
            "kept": dip_t["best_iteration"],
            "run": dip_t["iterations"],
            "stopped": dip_t.get("stopped_early"),
        },
        "time_s": {"fixed": mf["timings"]["total_before_write"], "tuned": mt["timings"]["total_before_write"]},
        "tuning_time_s": {"tv": mtv["timings"].get("tv"), "dip": mt["timings"].get("dip")},
        "uq": {
            "calibration": applied,
            "right_scale": scores["right_scale"],
            "coverage_0.9": scores["coverage_0.9"],
            "coverage_0.95": scores["coverage_0.95"],
            "marginal_ll": scores["marginal_ll"],
            "oracle_ll": scores["oracle_ll"],
            # the map's contrast inside the object (DESIGN.md §8) and the truth-fitted reference (issue 44)
            "ence": scores["ence"],
            "decile_coverage": scores["decile_coverage"],
            "spearman_ratio": scores["spearman_ratio"],
            "power_ence": scores["power_ence"],
        },
    }
    atomic_write_json(out / "result.json", record)
    return record


def report(records: list[dict]) -> str:
    """The study's tables (markdown): PSNR per setting and method, the oracles, the acceptance gates, and the
    uncertainty's calibration at the tuned linearisation point."""
    lines = [
        "# Reconstruction study: fixed settings, tuned on held-out angles, and the oracle",
        "",
        "PSNR (dB) against the ground truth. fixed: tv.weight, the DIP's lowest-loss iterate from seeded noise; "
        "tuned (the defaults): λ and the DIP's stopping iterate chosen on the tuning half of the held-out angles, "
        "the DIP started at the TV image (its input and a warm start) with γ from TV's λ; oracle: the same fits' "
        "best PSNR (TV: over the weight path, whose points have "
        "tv.path_iterations each, so the gate compares it with the path's point at the chosen weight; DIP: over the "
        "iterations).",
        "",
        "| scan | size | angles | FBP | TV fixed | TV tuned | TV oracle | λ tuned | DIP fixed | DIP tuned | DIP oracle "
        "| kept / run | DIP − max(FBP, TV) | TV − FBP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    gaps_tv, gaps_dip, gaps_scored, margins_dip, margins_tv = [], [], [], [], []
    for r in records:
        p, o = r["psnr"], r["oracle"]["tuned"]
        tv_o, dip_o = o.get("tv", {}).get("psnr", float("nan")), o.get("dip", {}).get("psnr", float("nan"))
        margin_dip = p["dip_tuned"] - max(p["fbp"], p["tv_tuned"])
        margin_tv = p["tv_tuned"] - p["fbp"]
        gaps_tv.append(tv_o - o.get("tv", {}).get("chosen_psnr", float("nan")))
        gaps_dip.append(dip_o - p["dip_tuned"])
        gaps_scored.append(o.get("dip", {}).get("scored_psnr", float("nan")) - p["dip_tuned"])
        margins_dip.append(margin_dip)
        margins_tv.append(margin_tv)
        it = r["dip_iteration"]
        lines.append(
            f"| {r['scan']} | {r['size']}² | {r['angles']} | {p['fbp']:.2f} | {p['tv_fixed']:.2f} "
            f"| {p['tv_tuned']:.2f} | {tv_o:.2f} | {r['tv_weight']:.3g} | {p['dip_fixed']:.2f} "
            f"| {p['dip_tuned']:.2f} | {dip_o:.2f} "
            f"| {it['kept']} / {it['run']} | {margin_dip:+.2f} | {margin_tv:+.2f} |"
        )
    lines += [
        "",
        "TV's weight path (tv.path_iterations per weight, warm-started): PSNR at the weight the rule chose, at the "
        "lowest held-out error (the other rule), and the path's best (the oracle).",
        "",
        "| scan | size | angles | rule | chosen | lowest held-out error | oracle (λ) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        t = r["oracle"]["tuned"].get("tv", {})
        lines.append(
            f"| {r['scan']} | {r['size']}² | {r['angles']} | {r.get('tv_criterion', '?')} "
            f"| {t.get('chosen_psnr', float('nan')):.2f} | {t.get('lowest_heldout_psnr', float('nan')):.2f} "
            f"| {t.get('psnr', float('nan')):.2f} ({t.get('weight', float('nan')):.3g}) |"
        )
    lines += [
        "",
        "## Gates",
        "",
        f"- DIP ≥ max(FBP, TV) − 0.3 dB on every setting: {'yes' if min(margins_dip) >= -0.3 else 'no'} "
        f"(worst {min(margins_dip):+.2f} dB)",
        f"- tuned TV ≥ FBP − 0.3 dB on every setting: {'yes' if min(margins_tv) >= -0.3 else 'no'} "
        f"(worst {min(margins_tv):+.2f} dB)",
        f"- held-out choice within 0.5 dB of the oracle on average: TV {np.mean(gaps_tv):.2f} dB "
        f"(worst {max(gaps_tv):.2f}), DIP {np.mean(gaps_dip):.2f} dB (worst {max(gaps_dip):.2f}); the DIP against "
        f"the best of the iterates it scored (every dip.heldout_every-th): {np.mean(gaps_scored):.2f} dB (worst "
        f"{max(gaps_scored):.2f})",
        "",
        "## The uncertainty at the tuned linearisation point (inner square, the applied calibration)",
        "",
        "Targets of the calibration study: right scale in [0.85, 1.15], coverage@0.9 in [0.86, 0.94], coverage@0.95 "
        "≥ 0.92, marginal LL above a constant std equal to the RMS error (the oracle).",
        "",
        "| scan | size | angles | calibration | right scale | coverage@0.9 | coverage@0.95 | LL | LL oracle "
        "| ENCE (best c·std^γ on the truth) | cov@0.9 per std decile | Spearman ratio | time fixed / tuned (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        u, t = r["uq"], r["time_s"]
        deciles = u.get("decile_coverage") or []
        lines.append(
            f"| {r['scan']} | {r['size']}² | {r['angles']} | {u['calibration']} | {u['right_scale']:.2f} "
            f"| {u['coverage_0.9']:.3f} | {u['coverage_0.95']:.3f} | {u['marginal_ll']:.3f} | {u['oracle_ll']:.3f} "
            f"| {_opt(u.get('ence'))} ({_opt(u.get('power_ence'))}) "
            f"| {(f'{min(deciles):.2f}–{max(deciles):.2f}') if deciles else '—'} | {_opt(u.get('spearman_ratio'))} "
            f"| {t['fixed']:.0f} / {t['tuned']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _opt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _settings(options: ReconstructionOptions, scans: dict[str, Path]) -> list[tuple[str, Path | None, int, int, int]]:
    """``(scan name, path, size, angles, subsampling)`` of every setting: the simulated scans at every size and angle
    count, and the bundled scan at the demo's setting (128², 60 of its 240 angles)."""
    out = []
    for name, path in scans.items():
        for size in options.sizes:
            for n in options.settings:
                out.append((name, path, size, n, (options.projections - 1) // n))
    if options.bundled:
        out.append((BUNDLED, None, 128, 60, 4))
    return out


def run_study(options: ReconstructionOptions, out: Path, log: Log | None = None) -> str:
    """Every setting of ``options`` (scans simulated into ``out/scans`` or reused), then ``results.md`` and
    ``results.json``; returns the markdown. ``out/study.json`` must hold the same options (the seeds, sizes and
    settings may grow); :class:`StudyError` otherwise."""
    log = log or Log("reconstruction_study")
    out = Path(out)
    options.validate()
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = study_fingerprint(plain(options), "simulated", NEUTRAL_OPTIONS)
    check_study_folder(out, fingerprint, log, growable=("walnut_seeds", "textured_seeds", "sizes", "settings"))
    scans = prepare_scans(options, out, log) if (options.walnut_seeds or options.textured_seeds) else {}
    records = []
    for name, path, size, n, sub in _settings(options, scans):
        folder = out / name / f"{size}_{n:03d}"
        done = folder / "result.json"
        if done.is_file():
            rec = read_json(done)
        else:
            log(f"{name}, {size}², {n} angles")
            rec = run_setting(path, size, n, sub, options, folder, log)
        records.append({"scan": name, **rec})
        p = rec["psnr"]
        log(
            f"{name} {size}² {n}: FBP {p['fbp']:.2f}, TV {p['tv_fixed']:.2f} → {p['tv_tuned']:.2f}, "
            f"DIP {p['dip_fixed']:.2f} → {p['dip_tuned']:.2f} dB"
        )
    text = report(records)
    atomic_write_json(out / "results.json", {"options": plain(options), "records": records})
    (out / "results.md").write_text(text)
    log(f"wrote {out / 'results.md'}")
    return text
