"""The protocol study (``scripts/protocol_study.py``): designed angles against equidistant and golden-angle ones, at
every count, and whether the plan ranks designed against equidistant the right way.

Per simulated scan (walnut, textured and laminate phantoms, :func:`ctuq.studies.calibration.prepare_scans`; 1200
angles), in ``OUT/<scan>/``, everything through the public API:

1. ``plan_<spread>/``: ``ctuq design --plan`` from the pilot (:func:`ctuq.design_angles` with ``plan=True``) with
   ``design.spread`` = ``spread``: the predicted RMS error inside the object after ``n`` angles, designed and
   equidistant (:mod:`ctuq.design.plan`);
2. ``design_<spread>/``: the design on the scan's measurements (``design.forecast = false``, nothing
   reconstructed), the angles a user of ``ctuq design`` would get;
3. ``actual/<protocol>_<n>/``: FBP, TV and the DIP (cold start, the ``dip`` section) from the first ``n`` angles of
   each protocol (:func:`ctuq.reconstruct` of the scan's :meth:`~ctuq.scan.Scan.subset`, ``uq=False``): each
   design's (``designed_<spread>``), ``n`` equidistant candidates (:func:`~ctuq.design.candidates.
   equidistant_indices`) and the first ``n`` of the golden-angle sequence (:func:`~ctuq.design.candidates.
   golden_indices`); PSNR and RMS error inside the pilot DIP's object mask against the ground truth;
4. ``tv_best.json``: TV from the same angles at its best weight, chosen on the ground truth (:func:`best_tv`): what
   the angles allow apart from how a run tunes its reconstruction on the held-out angles;
5. ``result.json``: the scan's record, derived from those folders.

The report (:func:`report`) gives, per content kind and count, the DIP, TV and best-weight TV PSNR of every
protocol, each minus equidistant (and the protocol the plan recommends, :func:`ctuq.design.plan.recommend`'s rule:
its margin and :func:`~ctuq.design.plan.trusted_count`), and the plan's ranking: the sign of its predicted designed
− equidistant error against the sign of the actual one (the DIP's, and the best-weight TV's) where the PSNR differs
by more than 0.3 dB. A rerun of the same command
resumes (every design and run is asked of the API with ``resume=True, reuse=True``). The options are one frozen
dataclass, :class:`ProtocolOptions` (:data:`DEFAULTS`, :data:`TINY`), recorded in ``OUT/study.json``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from ctuq.calibration.maps import object_mask
from ctuq.config import ConfigError, load_config
from ctuq.design.candidates import golden_indices
from ctuq.design.plan import recommends_designed, trusted_count
from ctuq.reconstruct.heldout import weight_grid
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
from ctuq.utils import atomic_path, atomic_write_json

__all__ = [
    "ProtocolOptions",
    "DEFAULTS",
    "TINY",
    "BASELINES",
    "run_study",
    "run_scan",
    "report",
    "protocol_name",
    "best_tv",
]

BASELINES = ("equidistant", "golden")
RANK_MARGIN_DB = 0.3  # the margin: pairs whose actual difference is smaller are not ranked
BEST_TV_PER_DECADE = 8  # weights a decade of the best-TV search (the runs' own path has 4)
BEST_TV_ITERATIONS = 300  # PDHG iterations per weight: the runs' path stops at 60, far from converged at 64²


@dataclasses.dataclass(frozen=True)
class ProtocolOptions:
    """The options of one protocol study (``scripts/protocol_study.py`` builds them from its flags). All but
    ``progress`` and ``tiny`` change numbers, so ``study.json`` records them and a rerun in the same folder must keep
    them (the seeds and the spreads may grow)."""

    walnut_seeds: tuple[int, ...] = option((0,), help="seeds of the simulated walnut scans")
    textured_seeds: tuple[int, ...] = option((0,), help="seeds of the simulated textured scans")
    laminate_seeds: tuple[int, ...] = option((0,), help="seeds of the simulated laminate scans")
    config: str = option("demo", help="base config of every design and reconstruction")
    set: tuple[str, ...] = option(
        ("data.image_shape=[64,64]", "data.detector_subsampling=4"),
        help="config overrides of every design and reconstruction (KEY=VALUE)",
    )
    candidates: int = option(120, help="candidate angles of the designs (design.candidates)")
    pilot: int = option(10, help="equidistant pilot angles (design.pilot)")
    counts: tuple[int, ...] = option((10, 20, 40, 60, 80), help="angle counts compared (the first: the pilot's)")
    spreads: tuple[float, ...] = option((0.0, 0.5), help="design.spread of the designs compared (0: plain greedy)")
    scan_preset: str = option("bundled", help="ctuq simulate preset of the scans (bundled, tiny, walnut)")
    projections: int = option(1201, help="projection files per scan (the last repeats the first angle)")
    det_rows: int = option(4, help="detector rows of the simulated scans")
    gt_shape: tuple[int, int, int] = option((1, 128, 128), help="ground-truth grid of the simulated scans")
    progress: bool = option(False, help="progress bars of the designs and runs")
    tiny: bool = option(False, help="the test size (TINY)")

    def __post_init__(self) -> None:
        freeze(self)

    @property
    def acquire(self) -> int:
        """Angles each design acquires: up to the last count."""
        return self.counts[-1] - self.pilot

    def validate(self) -> None:
        """One-line :class:`StudyError` for an invalid option (named as its command-line flag)."""
        if not (self.walnut_seeds or self.textured_seeds or self.laminate_seeds):
            raise StudyError("--walnut-seeds/--textured-seeds/--laminate-seeds: the study needs at least one scan")
        if len(self.counts) < 2 or list(self.counts) != sorted(set(self.counts)) or self.counts[0] != self.pilot:
            raise StudyError(
                f"--counts {list(self.counts)}: at least two increasing counts from the pilot ({self.pilot})"
            )
        if self.counts[-1] > self.candidates:
            raise StudyError(f"--counts {list(self.counts)}: the last exceeds the {self.candidates} candidates")
        if (
            not self.spreads
            or any(not 0.0 <= s <= 1.0 for s in self.spreads)
            or len(set(self.spreads)) < len(self.spreads)
        ):
            raise StudyError(f"--spreads {list(self.spreads)}: distinct values in [0, 1]")
        try:
            load_config(self.config, list(self.set))
        except ConfigError as exc:
            raise StudyError(f"--set: {exc}") from None


DEFAULTS = ProtocolOptions()
# seconds-long runs of the machinery (tests)
TINY = ProtocolOptions(
    walnut_seeds=(0,),
    textured_seeds=(),
    laminate_seeds=(),
    set=(
        "data.image_shape=[32,32]",
        "data.detector_subsampling=8",
        "dip.iterations=200",
        "dip.warm_start_iterations=30",
        "tv.path_iterations=10",
        "tv.per_decade=2",
        "design.samples=50",
        "design.plan_samples=50",
        "design.forecast_samples=16",
        "design.calibration_angles=8",
    ),
    candidates=24,
    pilot=4,
    counts=(4, 6, 8),
    spreads=(0.0, 1.0),
    scan_preset="tiny",
    projections=49,
    tiny=True,
)


def protocol_name(spread: float) -> str:
    """``designed_<spread>`` (``designed_0``, ``designed_0.5``): the protocol of the design with that spread."""
    return f"designed_{spread:g}"


def _sets(options: ProtocolOptions, spread: float | None = None) -> list[str]:
    """The config overrides of every design and reconstruction of a scan (and a design's spread); the plan's counts
    are every 10th of the way from the pilot to the last count, so they hold the study's counts when those lie on
    that grid."""
    out = ["data.min_angles=1", *options.set]
    if spread is not None:
        out += ["design.forecast_points=8" if not options.tiny else f"design.forecast_points={len(options.counts)}"]
        if spread:
            out.append(f"design.spread={spread:g}")
    return out


def _plan_at(plan_rec: list[dict], n: int) -> float:
    """The plan's predicted RMS error (mm⁻¹) at count ``n``, linear in log error between its counts."""
    counts = [r["count"] for r in plan_rec]
    return float(np.exp(np.interp(n, counts, np.log([r["rmse"] for r in plan_rec]))))


def run_scan(name: str, scan: Path, options: ProtocolOptions, out: Path, log: Log) -> dict:
    """Plans, designs and the reconstructions of every protocol of one scan into ``out/<name>``; returns its record
    (``result.json``, derived from the folders there)."""
    sdir = out / name
    common = dict(
        config=options.config,
        candidates=options.candidates,
        pilot=options.pilot,
        acquire=options.acquire,
        resume=True,
        reuse=True,
        progress=options.progress,
    )
    orders: dict[str, list[int] | None] = {}
    plans: dict[str, dict] = {}
    mask = cand = None
    for spread in options.spreads:
        tag, key = f"{spread:g}", protocol_name(spread)
        plan = design_angles(scan, set=_sets(options, spread), plan=True, out=sdir / f"plan_{tag}", **common)
        plans[key] = plan.record["forecast"]["plan"]
        extra = ["design.forecast=false", "design.reconstruct=false"]
        des = design_angles(scan, set=[*_sets(options, spread), *extra], out=sdir / f"design_{tag}", **common)
        log(f"{name}: spread {tag}: plan and design {'loaded' if plan.reused and des.reused else 'done'}")
        orders[key] = des.record["pilot"]["candidates"] + [a["candidate"] for a in des.record["acquired"]]
        if mask is None:
            cand = np.asarray(des.record["candidates"]["scan_indices"])
            mask = object_mask(np.asarray(des.pilot_images["dip"], np.float64)) > 0
    orders["equidistant"] = None  # per count: not nested
    orders["golden"] = golden_indices(len(cand), options.counts[-1]).tolist()
    whole = load_scan(scan)
    by_count = reconstruct_protocols(
        whole, cand, orders, options.counts, sets=_sets(options), options=options, out=sdir / "actual",
        mask=mask, log=log, name=name,
    )  # fmt: skip
    _best_tv_all(whole, by_count, options, sdir / "tv_best.json", log, name)
    actual = {p: {str(n): rec for n, rec in runs.items()} for p, runs in by_count.items()}
    record = {
        "scan": name,
        "kind": name.split("_")[0],
        "counts": list(options.counts),
        "spreads": list(options.spreads),
        "plan": {
            p: {
                "designed": {str(n): _plan_at(rec["designed"], n) for n in options.counts},
                "equidistant": {str(n): _plan_at(rec["equidistant"], n) for n in options.counts},
                "time_s": rec["time_s"],
            }
            for p, rec in plans.items()
        },
        "max_designed": trusted_count(mask.shape),
        "orders": {p: o for p, o in orders.items() if o},
        "actual": actual,
    }
    done = sdir / "result.json"
    atomic_write_json(done, record)
    return read_json(done)


def best_tv(op, y, truth, weights, *, iterations: int = BEST_TV_ITERATIONS) -> dict:
    """The TV image of the highest PSNR over ``weights``: what the angles allow TV when its weight is chosen on the
    ground truth, apart from how a run chooses it (the held-out angles). A study's diagnostic, never a method.

    From the largest weight down, each starts from the previous one's image (a warm path,
    :func:`ctuq.reconstruct.classical.tv_reconstruction`, ``iterations`` PDHG iterations each) and the path stops
    once the PSNR has fallen for two weights in a row past its best.

    Parameters
    ----------
    op, y : RayTransform, torch.Tensor
        ``T`` and the sinogram ``op.measurement_shape`` (data units).
    truth : array
        ``op.image_shape`` ground truth (mm⁻¹).
    weights : sequence of float
        Candidate ``λ > 0``, any order.

    Returns
    -------
    dict
        ``weight`` (the best λ), ``psnr`` (dB), ``weights`` and ``psnrs`` along the path as run.
    """
    import torch

    from ctuq.metrics.image import psnr
    from ctuq.reconstruct.classical import tv_reconstruction

    truth = torch.as_tensor(np.asarray(truth), dtype=torch.float32)
    x, run, scores = None, [], []
    for w in sorted((float(v) for v in weights), reverse=True):
        x = tv_reconstruction(op, y, weight=w, iterations=iterations, x0=x, progress=False)["reconstruction"]
        run.append(w)
        scores.append(float(psnr(x.detach().cpu(), truth)))
        if len(scores) - 1 - int(np.argmax(scores)) >= 2:
            break
    best = int(np.argmax(scores))
    return {"weight": run[best], "psnr": scores[best], "weights": run, "psnrs": scores}


def _best_tv_all(whole, by_count: dict, options: ProtocolOptions, cache: Path, log: Log, name: str) -> None:
    """:func:`best_tv` of every protocol's angles at every count into its record (``rec["tv_best"]``), kept in
    ``cache`` (JSON, by the angles' scan indices, with the search's weights and iterations: another search starts
    afresh; written after each new one, so an interruption loses one)."""
    cfg = load_config(options.config, _sets(options))
    weights = weight_grid(cfg.tv.weight_min, cfg.tv.weight_max, BEST_TV_PER_DECADE)
    settings = {"weights": weights, "iterations": BEST_TV_ITERATIONS}
    kept = read_json(cache) if cache.exists() else {}
    if kept.get("settings") != settings:  # another search: start afresh
        kept = {"settings": settings, "sets": {}}
    for runs in by_count.values():
        for rec in runs.values():
            key = ",".join(str(i) for i in rec["scan_indices"])
            if key not in kept["sets"]:
                data = whole.subset(rec["scan_indices"]).load(
                    image_shape=cfg.data.image_shape,
                    detector_subsampling=cfg.data.detector_subsampling,
                    slice_index=cfg.data.slice_index,
                    heldout=False,
                )
                kept["sets"][key] = best_tv(data.op, data.y, data.ground_truth, weights)
                atomic_write_json(cache, kept)
                log(
                    f"{name}: best-weight TV from {len(rec['scan_indices'])} angles: {kept['sets'][key]['psnr']:.2f} dB"
                )
            rec["tv_best"] = {k: kept["sets"][key][k] for k in ("weight", "psnr")}


def _dip(rec: dict, protocol: str, n: int) -> float:
    """The DIP's PSNR (dB) from the first ``n`` angles of ``protocol`` in the scan's record."""
    return rec["actual"][protocol][str(n)]["psnr"]["dip"]


def _tv_best(rec: dict, protocol: str, n: int) -> float:
    """The PSNR (dB) of TV at its best weight (:func:`best_tv`) from the same angles."""
    return rec["actual"][protocol][str(n)]["tv_best"]["psnr"]


def _recommended(rec: dict, design: str, n: int) -> str:
    """What the plan recommends at count ``n`` (:func:`ctuq.design.plan.recommends_designed`, the rule of
    :func:`~ctuq.design.plan.recommend`): ``design`` where it predicts clearly less RMS error than equidistant
    angles and ``n`` is within the image's :func:`~ctuq.design.plan.trusted_count`, else ``"equidistant"``."""
    plan = rec["plan"][design]
    designed, equidistant = plan["designed"][str(n)], plan["equidistant"][str(n)]
    return design if recommends_designed(designed, equidistant, n, max_designed=rec["max_designed"]) else "equidistant"


def _mean(values) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _differences(records, protocols, counts, score, recommended: bool) -> list[str]:
    """Rows of each protocol minus equidistant under ``score`` (:func:`_dip`, :func:`_tv_best`), mean over the scans
    of each kind and of all; with ``recommended`` also the protocol the plan recommends at each count."""
    lines = ["| kind | protocol | " + " | ".join(str(n) for n in counts) + " |", "|---|---|" + "---|" * len(counts)]
    for kind in [*sorted({rec["kind"] for rec in records}), "all"]:
        recs = [r for r in records if kind in ("all", r["kind"])]
        for p in [q for q in protocols if q != "equidistant"]:
            diffs = [_mean([score(r, p, n) - score(r, "equidistant", n) for r in recs]) for n in counts]
            lines.append(f"| {kind} | {p} | " + " | ".join(f"{d:+.2f}" for d in diffs) + " |")
        for p in [q for q in protocols if q.startswith("designed") and recommended]:  # the plan's pick per count
            diffs = [
                _mean([score(r, _recommended(r, p, n), n) - score(r, "equidistant", n) for r in recs]) for n in counts
            ]
            lines.append(f"| {kind} | recommended ({p}) | " + " | ".join(f"{d:+.2f}" for d in diffs) + " |")
    return lines


def _ranking(records, protocols, counts, score) -> list[str]:
    """Rows of the plan's ranking of each design against equidistant angles where ``score`` differs by more than
    :data:`RANK_MARGIN_DB`: the share with the sign the plan predicted, and the misses."""
    lines = [
        "| design | pairs | ranked right | wrong (scan, n: actual dB, predicted error ratio designed/equidistant) |",
        "|---|---|---|---|",
    ]
    for p in [q for q in protocols if q.startswith("designed")]:
        right, wrong = 0, []
        for rec in records:
            for n in counts[1:]:
                act = score(rec, p, n) - score(rec, "equidistant", n)
                if abs(act) <= RANK_MARGIN_DB:
                    continue
                pred = rec["plan"][p]["designed"][str(n)] / rec["plan"][p]["equidistant"][str(n)]
                if (pred < 1) == (act > 0):
                    right += 1
                else:
                    wrong.append(f"{rec['scan']}, {n}: {act:+.2f}, {pred:.3f}")
        total = right + len(wrong)
        share = f"{100 * right / total:.0f} %" if total else "–"
        lines.append(f"| {p} | {total} | {share} | {'; '.join(wrong) or '–'} |")
    return lines


def report(records: list[dict]) -> str:
    """The study's tables (markdown): PSNR per protocol, designed − equidistant per kind and count (DIP, and TV at
    its best weight), the protocol the plan recommends, and the plan's ranking against both."""
    counts = records[0]["counts"]
    protocols = [p for p in records[0]["actual"] if p.startswith("designed")] + list(BASELINES)
    lines = ["# Protocol study: designed against equidistant and golden-angle scans", ""]
    scores = {
        "DIP": _dip,
        "TV": lambda rec, p, n: rec["actual"][p][str(n)]["psnr"]["tv"],
        "TV at its best weight (chosen on the truth)": _tv_best,
    }
    for title, score in scores.items():
        lines += [f"## {title}: PSNR (dB) per scan and count", ""]
        lines += ["| scan | n | " + " | ".join(protocols) + " |", "|---|---|" + "---|" * len(protocols)]
        for rec in records:
            for n in counts:
                cells = [f"{score(rec, p, n):.2f}" for p in protocols]
                lines.append(f"| {rec['scan']} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    limits = sorted({rec["max_designed"] for rec in records})
    lines += ["## Each protocol minus equidistant, DIP PSNR (dB), mean over the scans of a kind", ""]
    lines += _differences(records, protocols, counts, _dip, recommended=True)
    lines += [
        "",
        f"The recommended protocol: designed where the plan predicts at least the margin less error and the count is "
        f"at most {', '.join(map(str, limits))} angles (`ctuq.design.plan.trusted_count`), else equidistant.",
        "",
        "## Each protocol minus equidistant, TV at its best weight (chosen on the truth), PSNR (dB)",
        "",
        "What the angles allow apart from how a run tunes its reconstruction.",
        "",
        *_differences(records, protocols, counts, _tv_best, recommended=False),
    ]
    for title, score in (("actual DIP", _dip), ("TV at its best weight", _tv_best)):
        lines += [
            "",
            f"## The plan's ranking of designed against equidistant: pairs whose {title} PSNR differs by > "
            f"{RANK_MARGIN_DB} dB",
            "",
            *_ranking(records, protocols, counts, score),
        ]
    return "\n".join(lines) + "\n"


def run_study(options: ProtocolOptions, out: Path, log: Log | None = None) -> str:
    """Every scan of ``options`` (scans simulated into ``out/scans`` or reused), then ``results.md``; returns it.
    ``out/study.json`` must hold the same options (the seeds and spreads may grow); :class:`StudyError` otherwise."""
    log = log or Log("protocol_study")
    out = Path(out)
    options.validate()
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = study_fingerprint(plain(options), "simulated", NEUTRAL_OPTIONS)
    check_study_folder(out, fingerprint, log, growable=("walnut_seeds", "textured_seeds", "laminate_seeds", "spreads"))
    scans = prepare_scans(options, out, log)
    records = [run_scan(name, path, options, out, log) for name, path in scans.items()]
    text = report(records)
    atomic_write_json(out / "results.json", {"records": records})
    with atomic_path(out / "results.md") as tmp:
        tmp.write_text(text)
    log(f"wrote {out / 'results.md'}")
    return text
