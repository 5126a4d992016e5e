"""Running the angle-selection study over its images, and its tables and figures.

Outputs in the study folder (``scripts/angle_selection.py``)::

    results.md, results.json     PSNR mean ± standard error over images per strategy × angle count, for each
                                 reconstruction (TV, DIP) at the fixed iteration budget and as the oracle best over
                                 iterations; the paired difference of each strategy to equidistant angles (same
                                 images); design timings per strategy; for generated phantoms, how close each
                                 sequential strategy's acquired angles are to the phantom's orientation. Built from
                                 every finished (image, strategy) result in the folder, so processes that share a
                                 study folder with different
                                 ``--strategies`` each write the whole table, and ``--report`` rebuilds it
    psnr_<method>.png, psnr_<method>_oracle.png   PSNR against the number of angles, one curve per strategy
    study.json                   the options (a rerun with other options that change numbers is refused; more
                                 ``--recon`` methods are added to the finished results)
    img_<i>/                     per image: pilot/ (the pilot DIP's run folder), per strategy result.json, design/
                                 (a greedy design's folder) and <count>/<tv|dip>/ (the reconstructions' run folders)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ctuq.design.plots import plot_psnr_curves
from ctuq.studies.angle_selection import NEUTRAL, STUDY_STRATEGIES, AngleSelectionOptions, load_images, run_image
from ctuq.studies.common import Log, StudyError, check_study_folder, read_json, study_fingerprint
from ctuq.studies.study_options import plain
from ctuq.utils import atomic_path, atomic_write_json, resolve_device

__all__ = [
    "run_study",
    "aggregate",
    "paired_differences",
    "orientation_distances",
    "collect_results",
    "markdown_tables",
    "LABELS",
]

LABELS = {
    "equidistant": "equidistant",
    "equidistant_grid": "equidistant (grid)",
    "random": "random",
    "isotropic": "isotropic EIG",
    "matern": "Matérn-½ EIG",
    "dip_eig": "lin. DIP EIG",
    "dip_ese": "lin. DIP ESE",
    "dip_eig_retrain": "lin. DIP EIG + retrain",
    "dip_ese_retrain": "lin. DIP ESE + retrain",
}


def _mean_se(values: list[float]) -> tuple[float, float | None, int]:
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return float("nan"), None, 0
    return float(v.mean()), (float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else None), int(v.size)


def _summarise(table: dict) -> dict:
    """``{method: {kind: {strategy: {count: [values]}}}}`` → the same with ``{"mean", "se", "n"}`` per cell."""
    return {
        m: {
            k: {
                s: {c: dict(zip(("mean", "se", "n"), _mean_se(v))) for c, v in sorted(cs.items())}
                for s, cs in ks.items()
            }
            for k, ks in kinds.items()
        }
        for m, kinds in table.items()
    }


def aggregate(per_image: list[dict]) -> dict:
    """``{method: {kind: {strategy: {count: {"mean", "se", "n"}}}}}`` with kind ``psnr`` / ``best_psnr``, and
    ``timings[strategy]`` (means over images of the design's timings)."""
    table: dict = {}
    timings: dict = {}
    for results in per_image:
        for strategy, rec in results.items():
            for count, methods in rec["recon"].items():
                for method, m in methods.items():
                    for kind in ("psnr", "best_psnr"):
                        (
                            table.setdefault(method, {})
                            .setdefault(kind, {})
                            .setdefault(strategy, {})
                            .setdefault(int(count), [])
                            .append(m[kind])
                        )
            t = rec.get("timings") or {}
            for key in (
                "prior_s",
                "setup_s",
                "steps_s",
                "updates_s",
                "total_s",
                "step_s_mean",
                "step_s_first5",
                "step_s_last5",
            ):
                if key in t:
                    timings.setdefault(strategy, {}).setdefault(key, []).append(t[key])
    return {
        "psnr": _summarise(table),
        "timings": {s: {k: float(np.mean(v)) for k, v in t.items()} for s, t in timings.items()},
    }


def collect_results(out: Path, n_images: int) -> list[dict]:
    """``[{strategy: result}]`` per image ``0 … n_images − 1``: every finished ``img_<i>/<strategy>/result.json`` in
    the study folder, whichever process wrote it (strategies in
    :data:`~ctuq.studies.angle_selection.STUDY_STRATEGIES` order)."""
    per_image = []
    for i in range(n_images):
        idir = out / f"img_{i:03d}"
        per_image.append(
            {s: read_json(idir / s / "result.json") for s in STUDY_STRATEGIES if (idir / s / "result.json").is_file()}
        )
    return per_image


def paired_differences(per_image: list[dict], reference: str = "equidistant") -> dict:
    """``{method: {kind: {strategy: {count: {"mean", "se", "n"}}}}}``: PSNR of ``strategy`` minus PSNR of
    ``reference`` on the same image at the same angle count (dB), mean ± standard error over the images that have
    both. Pairing removes the image-to-image spread that dominates the unpaired standard errors."""
    diffs: dict = {}
    for results in per_image:
        ref = results.get(reference)
        if ref is None:
            continue
        for strategy, rec in results.items():
            if strategy == reference:
                continue
            for count, methods in rec["recon"].items():
                for method, m in methods.items():
                    r = ref["recon"].get(count, {}).get(method)
                    if r is None:
                        continue
                    for kind in ("psnr", "best_psnr"):
                        if m[kind] is not None and r[kind] is not None:
                            (
                                diffs.setdefault(method, {})
                                .setdefault(kind, {})
                                .setdefault(strategy, {})
                                .setdefault(int(count), [])
                                .append(m[kind] - r[kind])
                            )
    return _summarise(diffs)


ORIENTATION_PREFIXES = (1, 5, 10, None)
"""Acquisitions over which :func:`orientation_distances` averages: the first 1, 5, 10 and all."""


def orientation_distances(per_image: list[dict], phis, pilot: int) -> dict:
    """``{strategy: {label: {"mean", "se", "n"}}}``: how close a strategy's acquired angles come to the phantom's
    orientation — the mean angular distance (degrees, modulo 90°) of the acquired angles (the ``pilot`` first angles
    left out) to the image's preferential angle ``φ`` (a rectangle's projections are sharpest at ``φ`` and
    ``φ + 90°``), over the first 1, 5, 10 and all acquisitions (``label`` "first k" / "all"), mean ± standard error
    over images. Angles spread evenly give 22.5°. The equidistant strategies are left out (their sets are not
    sequential). ``phis``: one ``φ`` per image, degrees."""
    table: dict = {}
    for phi, results in zip(phis, per_image):
        for strategy, rec in results.items():
            if strategy.startswith("equidistant"):
                continue
            sets = rec["angles_deg"]
            d = (np.asarray(sets[max(sets, key=int)][pilot:], dtype=np.float64) - float(phi)) % 90.0
            d = np.minimum(d, 90.0 - d)
            for k in ORIENTATION_PREFIXES:
                if d.size and (k is None or d.size >= k):
                    table.setdefault(strategy, {}).setdefault("all" if k is None else f"first {k}", []).append(
                        float(d[:k].mean())
                    )
    return {
        s: {lab: dict(zip(("mean", "se", "n"), _mean_se(v))) for lab, v in labs.items()} for s, labs in table.items()
    }


def _orientation_table(dist: dict, strategies: list[str]) -> list[str]:
    labels = [f"first {k}" for k in ORIENTATION_PREFIXES if k is not None] + ["all"]
    lines = [
        "\n**acquired angles against the phantoms' orientation** (mean angular distance, modulo 90°, of the "
        "acquired angles to each phantom's preferential angle φ, degrees, mean ± s.e. over images; 22.5 for "
        "angles spread evenly)\n",
        "| strategy | " + " | ".join(labels) + " |",
        "|---" * (len(labels) + 1) + "|",
    ]
    for s in strategies:
        if s in dist:
            cells = [
                f"{dist[s][lab]['mean']:.1f}" + (f" ± {dist[s][lab]['se']:.1f}" if dist[s][lab]["se"] else "")
                if lab in dist[s]
                else ""
                for lab in labels
            ]
            lines.append(
                f"| {LABELS.get(s, s)} (n={max(e['n'] for e in dist[s].values())}) | " + " | ".join(cells) + " |"
            )
    return lines


def _table(rows: dict, signed: bool = False) -> list[str]:
    counts = sorted({c for r in rows.values() for c in r})
    lines = ["| strategy | " + " | ".join(str(c) for c in counts) + " |", "|---" * (len(counts) + 1) + "|"]
    fmt = "{:+.2f}" if signed else "{:.2f}"
    for s, r in rows.items():
        cells = []
        for c in counts:
            e = r.get(c)
            cells.append("" if e is None else (fmt.format(e["mean"]) + (f" ± {e['se']:.2f}" if e["se"] else "")))
        lines.append(f"| {LABELS.get(s, s)} (n={max(e['n'] for e in r.values())}) | " + " | ".join(cells) + " |")
    return lines


def markdown_tables(agg: dict, strategies: list[str]) -> str:
    """One table per (reconstruction, fixed/oracle): rows strategies, columns angle counts, ``mean ± se`` dB; the
    design times; the distances to the phantoms' orientation when ``agg`` has them."""
    parts = []
    names = {"psnr": "fixed iteration budget", "best_psnr": "oracle: best PSNR over iterations"}
    for method, kinds in agg["psnr"].items():
        for kind in ("psnr", "best_psnr"):
            rows = {s: kinds[kind][s] for s in strategies if s in kinds.get(kind, {})}
            parts.append(f"\n**{method.upper()} — {names[kind]}** (PSNR dB, mean ± s.e. over images)\n")
            parts += _table(rows)
            paired = agg.get("paired", {}).get(method, {}).get(kind, {})
            rows = {s: paired[s] for s in strategies if s in paired}
            if rows:
                parts.append(
                    f"\n**{method.upper()} — {names[kind]}: minus equidistant on the same image** (dB, "
                    f"mean ± s.e. of the paired differences)\n"
                )
                parts += _table(rows, signed=True)
    if agg["timings"]:
        parts.append("\n**design time** (s, mean over images; per step: mean / first 5 / last 5)\n")
        parts.append(
            "| strategy | prior | pilot set-up | steps | prior updates | total | per step | first 5 | last 5 |"
        )
        parts.append("|---|---|---|---|---|---|---|---|---|")
        for s, t in agg["timings"].items():
            cells = [
                f"{t.get(k, float('nan')):.2f}"
                for k in (
                    "prior_s",
                    "setup_s",
                    "steps_s",
                    "updates_s",
                    "total_s",
                    "step_s_mean",
                    "step_s_first5",
                    "step_s_last5",
                )
            ]
            parts.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    if agg.get("orientation"):
        parts += _orientation_table(agg["orientation"], strategies)
    return "\n".join(parts) + "\n"


def _figures(out: Path, agg: dict, strategies: list[str]) -> None:
    for method, kinds in agg["psnr"].items():
        for kind, suffix in (("psnr", ""), ("best_psnr", "_oracle")):
            curves = {}
            for s in strategies:
                r = kinds.get(kind, {}).get(s)
                if r:
                    c = sorted(r)
                    curves[LABELS.get(s, s)] = (c, [r[x]["mean"] for x in c], [r[x]["se"] or 0.0 for x in c])
            title = f"{method.upper()} reconstruction" + (" (oracle: best over iterations)" if suffix else "")
            plot_psnr_curves(out / f"psnr_{method}{suffix}.png", curves, title=title)


def run_study(
    options: AngleSelectionOptions,
    out: Path,
    log: Log | None = None,
    command: str = "",
    report_only: bool = False,
) -> dict:
    """Every image × strategy (resumable), then ``results.md``/``results.json`` and the figures from all finished
    results in ``out`` (also those of other processes sharing the folder). ``report_only``: run nothing, only
    rebuild those from what the folder holds.

    Parameters
    ----------
    options : AngleSelectionOptions
        The study's options (validated here: :class:`~ctuq.studies.StudyError` naming the flag at fault).
    out : Path
        The study folder (created; a rerun resumes in it, refusing options that change numbers).
    log : Log, optional
        Progress lines (default: a :class:`~ctuq.studies.Log` named ``angle_selection``).
    command : str
        The command line, recorded in ``results.md`` and ``results.json``.
    report_only : bool
        Run nothing; rebuild the tables and figures from the finished results.

    Returns
    -------
    dict
        The aggregated results (``results.json`` without ``options``, ``command`` and ``strategies``).
    """
    options.validate()
    log = log or Log("angle_selection")
    if report_only and not (out / "study.json").is_file():
        raise StudyError(f"--report: {out} holds no study (no study.json)")
    out.mkdir(parents=True, exist_ok=True)
    # reconstruction methods may be added to a study: finished results get them at their recorded angles
    check_study_folder(
        out, study_fingerprint(plain(options), options.images_file or "rectangles", NEUTRAL), log, growable=("recon",)
    )
    if options.threads:
        torch.set_num_threads(int(options.threads))
    images, phis = load_images(options, with_angles=True)  # phis: None for an images file
    if not report_only:
        device = resolve_device(options.device)
        for i, gt in enumerate(images):
            run_image(i, gt, options, out, device, log)
    n_images = len(images)
    per_image = collect_results(out, n_images)
    present = [s for s in STUDY_STRATEGIES if any(s in r for r in per_image)]
    agg = {**aggregate(per_image), "paired": paired_differences(per_image)}
    if phis is not None:
        agg["orientation"] = orientation_distances(per_image, phis, options.pilot)
    text = (
        f"# angle-selection study\n\n`{command}`\n\n{n_images} images of {images.shape[1]}², "
        f"{options.candidates} candidates, pilot {options.pilot}, {options.acquire} acquired, m = "
        f"{options.samples}, noise {options.noise:.0%} of mean |Tx|; every finished result in the folder "
        f"(n: images in a row)\n" + markdown_tables(agg, present)
    )
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text(text)
    atomic_write_json(
        out / "results.json", {"options": plain(options), "command": command, "strategies": present, **agg}
    )
    _figures(out, agg, present)
    log(f"wrote {out / 'results.md'}")
    return agg
