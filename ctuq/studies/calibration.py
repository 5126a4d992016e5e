"""Calibration study (issue 26): is the std map's scale right on scans ctuq never saw, for which combination of
prior × noise model × recalibration?

Over simulated scans of two content types (the ellipsoid walnut and the textured phantom,
:func:`ctuq.data.phantom.make_phantom`, several seeds each), every scan simulated once with 1200 angles so that
every angle count of the study is a subset and the other angles stay unused (held out), the study

1. fits the DIP once per scan × angle count through the public API (:func:`ctuq.reconstruct` with ``uq=False``,
   ``ctuq reconstruct --no-uq``): the run folder ``OUT/runs/<scan>/angles_<N>/dip`` (:func:`dip_run`);
2. per inference setting (``uq.prior`` × ``uq.noise``), reruns only the inference on a copy of that run folder, once
   (:func:`ctuq.uncertainty` with ``out=`` the folder ``<prior>-<noise>`` beside it, as ``ctuq uq RUN --set
   uq.prior=… --set uq.noise=… --set uq.calibration=none`` would: :func:`inference_run`), so every setting shares the
   DIP and differs only in the settings;
   ``uq.calibration`` is post-processing of that one posterior, so each of its values (a registered calibration
   method, :data:`ctuq.registry.CALIBRATIONS`; by default those with ``study_default``) is scored from the same run
   instead of a second inference: the method is fitted on the run's saved held-out rows (``heldout_rows.npz``,
   rescored with the current statistic), applied to the posterior's ``std.tif``
   (:meth:`ctuq.calibration.CalibrationMethod.apply_std`: ``none`` as it is, ``heldout`` × ``k``, ``bias``
   ``sqrt(std² + τ² M)``), and its 10×10 joint LL taken from what the run recorded for it
   (:meth:`~ctuq.calibration.CalibrationMethod.recorded_joint_ll`: the run's ``summary_recalibrated`` /
   ``summary_bias``); a method with a ``side_score`` (the bias model) is also scored beside the posterior's own map
   on the runs that applied none;
3. scores the std map against its reconstruction and ground truth in the inner square
   (:func:`score_run`): coverage at 0.5/0.9/0.95 and over 0.05…0.99, the right-scale factor
   ``sqrt(mean((err/std)²))``, the marginal log-likelihood against the best constant std (the oracle: a constant
   std equal to the RMS error, which knows the ground truth), the 10×10 joint log-likelihood (``metrics.json``)
   against the same oracle, Spearman(std, |err|) over the square and inside the object, the AUC of the std map for
   the 10 % largest errors, coverage@0.9 per decile of std, and the held-out check when the run made one;
4. aggregates mean ± s.e. over scans per (angle count, combination), also per content type, and, when the user
   passes targets (:attr:`CalibrationOptions.targets`: metric → ``[low, high]``, e.g. an issue's acceptance ranges),
   reports each combination's margin against them (:func:`~ctuq.studies.calibration_report.gate_report`). No
   target is built in: by default the results show the measured numbers only.

A combination (prior × noise × calibration) is named ``<prior>-<noise>-<calibration>`` in the tables; its
inference folder is ``<prior>-<noise>``. An inference setting the config does not know yet (e.g. ``uq.prior:
tv_predcp`` before it exists) is reported as unavailable before any work starts (:func:`check_combinations`); a
baseline value (``gprior``, ``homoscedastic``) is simply left out when its key does not exist, since it is what the
code does without it. A run that fails with a user error (e.g. a CG solve that does not converge on one scan) is
listed under ``failures`` with its scan and angle count; the combination goes on with the other scans, its rows
count the scans it covers, and it fails the targets as a whole.

The study's state is its run folders: a rerun of the same command calls the API on the same folders with
``resume=True, reuse=True``, so a finished run is loaded, an interrupted one continues from its checkpoints, and only
what is missing is computed; ``score.json`` in an inference folder holds the scores derived from that run (rescored
when the API had to compute the run, or with ``rescore``). The options are one frozen dataclass,
:class:`CalibrationOptions` (:data:`DEFAULTS`, :data:`TINY`); ``study.json`` records them. The script is
``scripts/calibration_study.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import tifffile
from scipy.special import ndtri
from scipy.stats import spearmanr

from ctuq import calibration as cal
from ctuq.config import ConfigError, load_config
from ctuq.data.walnut import SIDECAR_NAME
from ctuq.metrics import inner_square_roi
from ctuq.metrics.calibration import OBJECT_FRACTION, error_localisation, power_fit
from ctuq.options import PhantomKind
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.simulate import simulate
from ctuq.registry import CALIBRATIONS, RegistryError

# the public API (ctuq.reconstruct, ctuq.uncertainty, ctuq.Run), imported from its home module
from ctuq.run import Run, reconstruct, uncertainty
from ctuq.studies.calibration_report import (
    LEVELS,
    STATISTICS,
    TARGET_METRICS,
    _side_scored,
    aggregate,
    calibration_figure,
    gate_report,
    markdown_table,
    parse_target,
)
from ctuq.studies.common import NEUTRAL_OPTIONS, Log, StudyError, check_study_folder, read_json, study_fingerprint
from ctuq.studies.study_options import freeze, option, plain
from ctuq.utils import atomic_write_json

__all__ = [
    "AXES",
    "CalibrationOptions",
    "DEFAULTS",
    "TINY",
    "TARGET_METRICS",
    "LEVELS",
    "STATISTICS",
    "Combination",
    "combinations",
    "check_combinations",
    "scan_names",
    "prepare_scans",
    "dip_run",
    "inference_run",
    "score_run",
    "heldout_rows",
    "aggregate",
    "gate_report",
    "markdown_table",
    "calibration_figure",
    "run_study",
    "parse_target",
]

# The inference grid: config key → values; the first value of each axis is what ctuq does without the key. The
# calibrations scored from each inference are registered methods (CALIBRATIONS): by default those whose class says
# study_default.
AXES: dict[str, tuple[str, ...]] = {
    "uq.prior": ("gprior", "tv_predcp"),
    "uq.noise": ("homoscedastic", "per_ray"),
}

HEADLINE = (0.5, 0.9, 0.95)
JOINT_PATCH = "10"


@dataclasses.dataclass(frozen=True)
class CalibrationOptions:
    """The options of one calibration study (``scripts/calibration_study.py`` builds them from its flags). Every
    field but ``targets``, ``progress``, ``rescore`` and ``tiny`` changes numbers, so ``study.json`` records them
    and a rerun in the same folder must keep them (the seeds, ``settings``, ``priors``, ``noises`` and
    ``calibrations`` may grow)."""

    walnut_seeds: tuple[int, ...] = option((0, 1, 2, 3, 4), help="seeds of the simulated walnut scans")
    textured_seeds: tuple[int, ...] = option((0, 1, 2, 3, 4), help="seeds of the simulated textured scans")
    settings: tuple[int, ...] = option((60, 300), help="angle counts (each divides the scans' angles)")
    priors: tuple[str, ...] = option(AXES["uq.prior"], help="uq.prior values to run")
    noises: tuple[str, ...] = option(AXES["uq.noise"], help="uq.noise values to run")
    calibrations: tuple[str, ...] = option(
        tuple(name for name, method in CALIBRATIONS.items() if method.study_default),
        help="uq.calibration values scored from each inference",
    )
    targets: Mapping[str, list[float | None]] = option(
        factory=dict, help="metric → [low, high] (None: unbounded) to report margins against; none by default"
    )
    config: str = option("demo", help="base config of every run (a bundled name or a YAML file)")
    set: tuple[str, ...] = option((), help="config overrides of every run, as `ctuq reconstruct --set KEY=VALUE`")
    # the scans: the bundled preset's detector and ground-truth pixels, 1200 angles, 4 detector rows (the central
    # slice lies between the middle two), one ground-truth slice
    scan_preset: str = option("bundled", help="ctuq simulate preset of the scans (bundled, tiny, walnut)")
    projections: int = option(1201, help="projection files per scan (the last repeats the first angle)")
    det_rows: int = option(4, help="detector rows of the simulated scans")
    gt_shape: tuple[int, int, int] = option((1, 128, 128), help="ground-truth grid of the simulated scans")
    progress: bool = option(False, help="progress bars of the runs")
    rescore: bool = option(False, help="recompute every score from the finished runs (no inference is repeated)")
    tiny: bool = option(False, help="the test size (TINY)")

    def __post_init__(self) -> None:
        freeze(self)

    def validate(self) -> None:
        """One-line :class:`StudyError` for an invalid option (named as its command-line flag)."""
        axes = {"priors": AXES["uq.prior"], "noises": AXES["uq.noise"], "calibrations": CALIBRATIONS.names()}
        for key, axis in axes.items():
            given = getattr(self, key)
            bad = [v for v in given if v not in axis]
            if bad or not given:
                raise StudyError(f"--{key} {' '.join(map(str, given))}: each must be one of {', '.join(axis)}")
        if not self.walnut_seeds and not self.textured_seeds:
            raise StudyError("--walnut-seeds/--textured-seeds: the study needs at least one scan")
        n = self.projections - 1
        for s in self.settings:
            if s < 1 or n % s:
                raise StudyError(f"--settings {s}: each angle count must divide the scans' {n} angles")
        if not isinstance(self.targets, Mapping):
            raise StudyError(f"--target: the targets must be a mapping metric → [low, high], got {self.targets!r}")
        for key, bounds in self.targets.items():
            text = f"{key}={'' if bounds[0] is None else bounds[0]}:{'' if bounds[1] is None else bounds[1]}"
            parse_target(text)  # the same checks as on the command line
        if self.scan_preset not in ("bundled", "tiny", "walnut"):
            raise StudyError(f"--scan-preset {self.scan_preset!r}: must be one of bundled, tiny, walnut")
        try:
            load_config(self.config, list(self.set))
        except ConfigError as exc:
            raise StudyError(f"--config/--set: {exc}") from None


DEFAULTS = CalibrationOptions()

# --tiny: seconds per combination (for tests); tiny scans, 32 angles, a short DIP and few samples; the g-prior only:
# the study's machinery is what the test checks (TV-PredCP's hyperparameter fit takes minutes).
TINY = CalibrationOptions(
    walnut_seeds=(0,),
    textured_seeds=(0,),
    settings=(8,),
    priors=("gprior",),
    scan_preset="tiny",
    projections=33,
    set=(
        "data.detector_subsampling=1",
        "data.image_shape=[32, 32]",
        "data.min_angles=2",
        "dip.iterations=20",
        "dip.checkpoint_every=10",
        "tv.enabled=false",
        "uq.samples=32",
        "uq.em_steps=3",
        "output.figure=false",
    ),
    tiny=True,
)


class Combination:
    """One inference setting of the grid: ``settings`` (config key → value) and the ``--set`` strings that realise
    it (the baseline values of keys the config does not have are left out). ``error``: why it cannot run, or
    ``None``."""

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


def combinations(options: CalibrationOptions) -> list[Combination]:
    """The inference settings ``priors × noises`` of ``options`` as :class:`Combination` s (unchecked); each is run
    once and scored for every value of ``options.calibrations``."""
    grid = itertools.product(options.priors, options.noises)
    return [Combination({"uq.prior": prior, "uq.noise": noise}) for prior, noise in grid]


def check_combinations(options: CalibrationOptions, combos: list[Combination]) -> list[Combination]:
    """Resolve each combination's ``--set`` strings against the config, up front: a setting the config rejects
    (an unknown key, or a value not in its choices) makes the combination unavailable, with the config's own
    one-line message in ``error``; a baseline value of an unknown key is dropped (the code's behaviour without
    it). Returns ``combos`` (updated in place)."""
    for combo in combos:
        combo.overrides, combo.error = [], None
        for key, value in combo.settings.items():
            text = f"{key}={value}"
            try:
                load_config(options.config, [*options.set, text])
            except ConfigError as exc:
                unknown = "unknown config key" in str(exc)
                if unknown and value == AXES[key][0]:
                    continue
                combo.error = f"{text}: not available yet ({exc})" if unknown else str(exc)
                break
            combo.overrides.append(text)
        if combo.error is None:
            try:
                load_config(options.config, [*options.set, *combo.overrides])
            except ConfigError as exc:  # a pair of settings that is invalid together
                combo.error = str(exc)
    return combos


def scan_names(options) -> list[tuple[str, str, int]]:
    """``(name, kind, seed)`` of every scan of ``options`` (its ``walnut_seeds``, ``textured_seeds`` and, where the
    study has them, ``laminate_seeds``): ``walnut_<seed>``, ``textured_<seed>``, ``laminate_<seed>``."""
    out = [(f"walnut_{s}", PhantomKind.WALNUT.value, int(s)) for s in options.walnut_seeds]
    out += [(f"textured_{s}", PhantomKind.TEXTURED.value, int(s)) for s in options.textured_seeds]
    return out + [(f"laminate_{s}", PhantomKind.LAMINATE.value, int(s)) for s in getattr(options, "laminate_seeds", ())]


def prepare_scans(options, out: Path, log: Log) -> dict[str, Path]:
    """Simulate every scan of ``options`` into ``out/scans/<name>`` (:func:`ctuq.pipeline.simulate.simulate`),
    reusing complete ones. ``options``: a study's options with the simulated-scan fields (``walnut_seeds``,
    ``textured_seeds``, ``scan_preset``, ``projections``, ``det_rows``, ``gt_shape``, ``progress``:
    :class:`CalibrationOptions`, :class:`ctuq.studies.stop_rule.StopRuleOptions`). Returns name → folder."""
    paths = {}
    for name, kind, seed in scan_names(options):
        path = out / "scans" / name
        sidecar = path / SIDECAR_NAME
        if sidecar.is_file() and read_json(sidecar).get("complete"):
            paths[name] = path
            continue
        log(f"simulating {name} ({kind}, seed {seed}, {options.projections - 1} angles)")
        overrides = {
            "n_projections": options.projections,
            "det_rows": options.det_rows,
            "gt_shape": tuple(options.gt_shape),
            "seed": seed,
        }
        res = simulate(
            path,
            options.scan_preset,
            overrides=overrides,
            overwrite=sidecar.is_file(),
            progress=options.progress,
            log=log,
            phantom=kind,
        )
        log(f"simulated {name} in {res['time_s']:.1f} s")
        paths[name] = path
    return paths


def _gaussian_ll(err: np.ndarray, std: np.ndarray) -> float:
    """Mean ``log N(err; 0, std²)`` (nats/pixel)."""
    return float(np.mean(-0.5 * np.log(2 * math.pi * std**2) - 0.5 * (err / std) ** 2))


def heldout_rows(run: Path) -> cal.HeldoutRows | None:
    """The held-out check of a finished run folder with the current statistic: its saved rows
    (``heldout_rows.npz``), scored (:meth:`ctuq.calibration.HeldoutRows.score`, seed 0: the methods fitted on them
    bootstrap the same way); ``None`` when the run made no check. A method whose row weights the rows lack is not
    fitted on them (:func:`score_run` says so for that method)."""
    rows = cal.read_rows(Path(run) / rf.HELDOUT_ROWS_NAME)
    if rows is not None:
        rows.score()
    return rows


def _fitted(run: Path, calibration: str, rows: cal.HeldoutRows | None, reconstruction) -> cal.CalibrationMethod:
    """The calibration method ``calibration`` fitted on the run's held-out ``rows``; :class:`StudyError` naming the
    run when it cannot be (no check, or rows without what it needs)."""
    try:
        method_cls = CALIBRATIONS[calibration]
    except RegistryError as exc:
        raise StudyError(f"score_run: calibration {calibration!r}: {exc}") from None
    method = method_cls.fit(rows, reconstruction)
    if method is None:
        if rows is None:
            raise StudyError(f"{run}: uq.calibration = {calibration} needs the run's held-out check; it has none")
        raise StudyError(
            f"{run}: uq.calibration = {calibration} cannot be fitted on the run's held-out rows (they lack its row "
            f"weights: rerun `ctuq uq {run}`)"
        )
    return method


def score_run(run: Path, calibration: str = "none", heldout: cal.HeldoutRows | None = None) -> dict:
    """Scores of a finished run folder in its inner square (:func:`ctuq.metrics.inner_square_roi`), for the std map
    of the calibration method ``calibration`` (a name of :data:`ctuq.registry.CALIBRATIONS`): the method fitted on
    the run's held-out rows ``heldout`` (scored :class:`ctuq.calibration.HeldoutRows`; default
    :func:`heldout_rows`) and applied to the posterior's map (``std_uncalibrated.tif`` when the run recalibrated,
    else ``std.tif``): ``none`` the map as it is, ``heldout`` × the held-out ``k``, ``bias`` ``sqrt(std² + τ² M)``.

    Reads ``reconstruction.tif``, ``ground_truth.tif``, the std map (mm⁻¹) and ``metrics.json``. Returns
    ``coverage_0.5/0.9/0.95`` and ``calibration`` (coverage at :data:`LEVELS`), ``right_scale`` =
    ``sqrt(mean((err/std)²))`` (the factor the std would need), ``marginal_ll`` and ``oracle_ll`` (a constant std
    equal to the RMS error), ``joint_ll_10`` (10×10 patches, what ``metrics.json`` recorded for this map:
    :meth:`~ctuq.calibration.CalibrationMethod.recorded_joint_ll`, ``None`` when it did not) and
    ``oracle_joint_ll_10`` (the oracle is independent across pixels, so its joint LL per pixel equals its marginal
    one), ``spearman`` (std against |err|; ``None`` for a constant std), where the errors are
    (:func:`ctuq.metrics.calibration.error_localisation`: ``spearman_inside`` the object, ``auc_top10``,
    ``decile_coverage`` with its ``_min``/``_max``: coverage@0.9 per decile of std inside the object, ``ence`` and
    ``reliability`` over the same deciles, ``spearman_reference`` and ``spearman_ratio``), the reference fitted on
    the truth (:func:`ctuq.metrics.calibration.power_fit` of the posterior's map inside the object: ``power_gamma``
    and the ENCE of that ``c·std^γ``, ``power_ence``), ``rmse`` and
    ``mean_std`` (mm⁻¹), ``k`` and
    ``tau`` (the method's report entries of those names, the global scale and bias std, mm⁻¹, ``None`` when it has
    none) and ``heldout`` (the held-out check's headline numbers, if the run made one); then, per registered method
    with a :attr:`~ctuq.calibration.CalibrationMethod.side_score` (the bias model: ``bias``), for a method that
    leaves the map alone (``none``), that method fitted on the rows and its map scored beside the posterior's: its
    :meth:`~ctuq.calibration.CalibrationMethod.side_parameters` (``tau``, mm⁻¹) and the ``right_scale``,
    ``coverage_0.9``/``0.95`` and ``marginal_ll`` of its map (``sqrt(std² + τ² M)``: docs/calibration.md, "τ
    alone"); ``None`` otherwise or when it cannot be fitted on the rows.
    """
    base = rf.STD_UNCALIBRATED_NAME if (run / rf.STD_UNCALIBRATED_NAME).is_file() else rf.STD_NAME
    read = {name: tifffile.imread(run / name).astype(np.float64) for name in (rf.RECONSTRUCTION_NAME,
            rf.GROUND_TRUTH_NAME, base)}  # fmt: skip
    roi = inner_square_roi(read[base].shape)
    err = (read[rf.RECONSTRUCTION_NAME] - read[rf.GROUND_TRUTH_NAME])[roi].ravel()
    std = read[base][roi].ravel()
    if not np.all(np.isfinite(std)) or std.min() <= 0:
        raise StudyError(f"{run / base}: the std map has non-positive or non-finite pixels")
    metrics = read_json(run / rf.METRICS_NAME)
    uq = metrics.get("uq", {}) if isinstance(metrics.get("uq"), dict) else {}
    if heldout is None:
        heldout = heldout_rows(run)
    summary = uq.get("summary_uncalibrated") or uq.get("summary") or {"joint_ll": metrics.get("joint_ll")}
    method = _fitted(run, calibration, heldout, read[rf.RECONSTRUCTION_NAME])
    joint = method.recorded_joint_ll(uq, (summary.get("joint_ll") or {}).get(JOINT_PATCH), JOINT_PATCH)
    applied = method.report()
    std_map = method.apply_std(read[base])
    abs_error = np.abs(read[rf.RECONSTRUCTION_NAME] - read[rf.GROUND_TRUTH_NAME])
    where = error_localisation(std_map, abs_error, read[rf.GROUND_TRUTH_NAME], roi)
    deciles = where["conditional_coverage_0.9"] or [None]
    # the reference no ground-truth-free method is asked to beat: the best c·std^γ of the posterior's own map,
    # fitted on the truth inside the object (issue 44)
    truth = read[rf.GROUND_TRUTH_NAME]
    inside = np.zeros(truth.shape, dtype=bool)
    inside[roi] = truth[roi] > OBJECT_FRACTION * truth[roi].max()
    reference = power_fit(read[base], abs_error, inside) or {}
    std = std_map[roi].ravel()
    z = np.abs(err) / std
    rmse = float(np.sqrt(np.mean(err**2)))
    oracle = _gaussian_ll(err, np.full_like(err, rmse))
    sides = {}
    for side_cls in _side_scored():
        beside = side_cls.fit(heldout, read[rf.RECONSTRUCTION_NAME]) if not method.changes_std else None
        side = None
        if beside is not None:
            sd = beside.apply_std(read[base])[roi].ravel()
            zb = np.abs(err) / sd
            side = {
                **beside.side_parameters(),
                "right_scale": float(np.sqrt(np.mean(zb**2))),
                **{f"coverage_{l:g}": float(np.mean(zb <= ndtri(0.5 + l / 2))) for l in HEADLINE[1:]},
                "marginal_ll": _gaussian_ll(err, sd),
            }
        sides[side_cls.side_score.key] = side
    return {
        **{f"coverage_{l:g}": float(np.mean(z <= ndtri(0.5 + l / 2))) for l in HEADLINE},
        "calibration": [float(np.mean(z <= ndtri(0.5 + l / 2))) for l in LEVELS],
        "right_scale": float(np.sqrt(np.mean(z**2))),
        "marginal_ll": _gaussian_ll(err, std),
        "oracle_ll": oracle,
        "joint_ll_10": joint,
        "oracle_joint_ll_10": oracle,
        # a constant std ranks nothing: no correlation is defined (None, left out of the means)
        "spearman": float(spearmanr(std, np.abs(err)).statistic) if np.ptp(std) > 0 else None,
        # where the errors are (DESIGN.md §8): ranks inside the object, the largest errors found, coverage per decile
        "spearman_inside": where["spearman_inside"],
        "auc_top10": where["auc_top10"],
        "decile_coverage_min": min(deciles) if deciles[0] is not None else None,
        "decile_coverage_max": max(deciles) if deciles[0] is not None else None,
        "decile_coverage": where["conditional_coverage_0.9"],
        "ence": where["ence"],
        "reliability": where["reliability"],
        "spearman_reference": where["spearman_reference"],
        "spearman_ratio": where["spearman_ratio"],
        "power_gamma": reference.get("gamma"),
        "power_ence": reference.get("ence"),
        "rmse": rmse,
        "mean_std": float(np.mean(std)),
        "k": applied.get("k"),
        "tau": applied.get("tau"),
        "heldout": None if heldout is None else _heldout_headline(heldout.report),
        **sides,
    }


def _heldout_headline(rep: dict) -> dict:
    """The held-out check's numbers a study table needs (the full report stays in the run folder)."""
    out = {
        "k": rep["scale"]["k"],
        "k_se": rep["scale"].get("se_bootstrap"),
        "coverage_headline": rep["coverage_headline"],
        "image_variance_fraction": rep["image_variance_fraction"],
        "z_mean": rep["z"]["mean"],
        "z_std": rep["z"]["std"],
        "k_joint": (rep.get("scale_with_noise") or {}).get("k"),
        "noise_scale_joint": (rep.get("scale_with_noise") or {}).get("noise_scale"),
    }
    if rep.get("scale_image_rows") is not None:
        out["k_image_rows"] = rep["scale_image_rows"]["k"]
    if rep.get("scale_photon") is not None:
        out["k_photon"] = rep["scale_photon"]["k"]
        out["image_variance_fraction_photon"] = rep["scale_photon"]["image_variance_fraction"]
    return out


def dip_run(options: CalibrationOptions, scan: Path, n_angles: int, folder: Path) -> Run:
    """The DIP run of one scan × angle count in ``folder`` (:func:`ctuq.reconstruct` with ``uq=False``: ``ctuq
    reconstruct --no-uq``): loaded when finished, continued from its checkpoints when interrupted, else fitted."""
    subsampling = (options.projections - 1) // n_angles
    return reconstruct(
        scan,
        config=options.config,
        set=[*options.set, f"data.angular_subsampling={subsampling}"],
        out=folder,
        uq=False,
        resume=True,
        reuse=True,
        progress=options.progress,
    )


# Every inference of the study: the posterior's own std map (the calibrations are scored from it), and no
# uq_state.pt left behind (an exact dual decomposition is c² float64: 100 MB at 60 angles, per run).
_INFERENCE_SETS = ("uq.calibration=none", "output.keep_checkpoint=false")


def inference_run(options: CalibrationOptions, dip: Run, combo: Combination) -> Run:
    """The inference of one prior × noise setting on a copy of the DIP run, in ``<prior>-<noise>`` beside it
    (:func:`ctuq.uncertainty`): loaded when finished, continued from its checkpoints when interrupted."""
    return uncertainty(
        dip,
        set=[*combo.overrides, *_INFERENCE_SETS],
        out=dip.path.parent / combo.name,
        resume=True,
        reuse=True,
        progress=options.progress,
    )


def _scores(options: CalibrationOptions, run: Run) -> dict:
    """Every calibration's scores of the inference ``run`` (:func:`score_run`), kept in its ``score.json``: read
    from there when the run was loaded as it was when they were computed (and not ``options.rescore``), else
    computed and written."""
    path = run.path / "score.json"
    if run.reused and not options.rescore and path.is_file():
        saved = read_json(path)
        if set(options.calibrations) <= set(saved):
            return saved
    held = heldout_rows(run.path)
    scores = {name: score_run(run.path, name, held) for name in options.calibrations}
    atomic_write_json(path, scores)
    return scores


def run_study(options: CalibrationOptions, out: Path, command: str, log: Log | None = None) -> dict:
    """Run (or resume) the study of ``options`` into ``out``; returns the content of ``results.json``.

    Every run goes through the API on its folder with ``resume=True, reuse=True`` (:func:`dip_run`,
    :func:`inference_run`): finished runs are loaded, interrupted ones continued, simulated scans with a complete
    sidecar reused. ``study.json`` must hold the same options (``settings``, the seeds, ``priors``, ``noises`` and
    ``calibrations`` may grow). Raises :class:`StudyError` for bad options or an output folder of another study.
    """
    log = log or Log("calibration_study")
    out = Path(out)
    options.validate()
    combos = check_combinations(options, combinations(options))
    unavailable = {c.name: c.error for c in combos if c.error is not None}
    for name, why in unavailable.items():
        log(f"combination {name} is not available: {why}")
    runnable = [c for c in combos if c.error is None]
    if not runnable:
        raise StudyError(
            "no combination of the grid can run: " + "; ".join(f"{k}: {v}" for k, v in unavailable.items())
        )
    out.mkdir(parents=True, exist_ok=True)
    growable = ("settings", "walnut_seeds", "textured_seeds", "priors", "noises", "calibrations")
    # the targets change no number, only the margins reported against them
    neutral = NEUTRAL_OPTIONS | {"rescore", "targets"}
    check_study_folder(out, study_fingerprint(plain(options), "simulated", neutral), log, growable)
    scans = prepare_scans(options, out, log)
    kinds = {name: kind for name, kind, _ in scan_names(options)}
    records = []
    failures: dict[str, list[str]] = {}  # combination → the runs that failed ("scan, angles: error")
    for n_angles in options.settings:
        for name, scan in scans.items():
            t0 = time.perf_counter()
            dip = dip_run(options, scan, n_angles, out / "runs" / name / f"angles_{n_angles}" / "dip")
            if not dip.reused:
                log(f"fitted the DIP in {time.perf_counter() - t0:.1f} s: {dip.path}")
            for combo in runnable:
                t0 = time.perf_counter()
                try:
                    run = inference_run(options, dip, combo)
                except ValueError as exc:  # a user error of this run (CTUQError): the other scans still run
                    failures.setdefault(combo.name, []).append(f"{name}, {n_angles} angles: {exc}")
                    log(f"combination {combo.name} failed on {name}, {n_angles} angles: {exc}")
                    continue
                if not run.reused:
                    log(f"inference {combo.name}: {run.path} in {time.perf_counter() - t0:.1f} s")
                by_cal = _scores(options, run)
                for calibration in options.calibrations:
                    scores = by_cal[calibration]
                    records.append(
                        {
                            "scan": name,
                            "kind": kinds[name],
                            "angles": n_angles,
                            "combination": f"{combo.name}-{calibration}",
                            "settings": {**combo.settings, "uq.calibration": calibration},
                            "scores": scores,
                        }  # fmt: skip
                    )
                    log(
                        f"{name} {n_angles} angles {combo.name}-{calibration}: cov@0.9 "
                        f"{scores['coverage_0.9']:.3f}, right scale {scores['right_scale']:.2f}, LL "
                        f"{scores['marginal_ll']:.2f} vs oracle "
                        f"{scores['oracle_ll']:.2f}"
                    )
    targets = dict(options.targets)
    rows = aggregate(records, targets)
    gates = gate_report(rows, targets, failures)
    results = {"options": plain(options), "command": command, "levels": list(LEVELS), "unavailable": unavailable,
               "failures": failures, "records": records, "table": rows, "gates": gates}  # fmt: skip
    atomic_write_json(out / "results.json", results)
    md = markdown_table(rows, gates, unavailable, command, failures, targets)
    (out / "results.md.tmp").write_text(md)
    (out / "results.md.tmp").replace(out / "results.md")
    calibration_figure(rows, out / "calibration.png")
    return results
