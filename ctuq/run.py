"""Reconstructions with error bars as Python objects: :func:`reconstruct`, :func:`uncertainty`, :func:`load_run` and
the :class:`Run` they return (``ctuq.reconstruct``, ``ctuq.uncertainty``, ``ctuq.load_run``).

A :class:`Run` is a run folder (:mod:`ctuq.pipeline.run_folder`) seen as an object: its images, std map and metrics
as numpy arrays and a dict, its posterior, its held-out check. :func:`reconstruct` runs the phases of ``ctuq
reconstruct`` (the command calls it), so a scan given in memory and the same scan on disk give bitwise the same
arrays; without ``out=`` the run works in a private temporary folder (its checkpoints, figures and files), removed
with the object unless :meth:`Run.save` keeps it. A scan given as arrays is copied into its runs (``scan/``), so a
saved run is complete: :func:`load_run` and ``ctuq uq`` reopen it anywhere.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch
import yaml

from ctuq.calibration import HeldoutCheck
from ctuq.config import Config, ConfigError, load_config
from ctuq.config.engine import apply_overrides
from ctuq.errors import OutDirError
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline import runner
from ctuq.pipeline.ct_model import CTPosterior
from ctuq.pipeline.design import DESIGN_NAME, run_design
from ctuq.pipeline.phases import Phase, RunState, phase_load, phase_restore_dip
from ctuq.scan import Scan
from ctuq.utils import resolve_device

__all__ = ["Run", "reconstruct", "uncertainty", "load_run", "Design", "design_angles", "holds_result"]

_SCAN_DIR = "scan"  # where a run keeps a scan that was given as arrays
_LOCK = ".ctuq.lock.json"
_IMAGES = {"fbp": rf.FBP_NAME, "tv": rf.TV_NAME, "dip": rf.RECONSTRUCTION_NAME}


# --------------------------------------------------------------------------------------------- configs
def _overrides(settings) -> tuple[list[str], dict[str, Any]]:
    """``set`` as ``(KEY=VALUE strings, {key: value})``: a mapping of dotted keys, or ``--set`` strings."""
    if settings is None:
        return [], {}
    if isinstance(settings, Mapping):
        bad = [k for k in settings if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"set: keys must be dotted config keys (str), got {bad[0]!r}")
        return [], dict(settings)
    if isinstance(settings, str) or not isinstance(settings, Sequence):
        raise ConfigError(f"set: a dict of config keys or a list of 'KEY=VALUE' strings, got {type(settings).__name__}")
    return [str(s) for s in settings], {}


def _config(config, settings, flags: dict[str, Any], first: Sequence[str] = ()) -> Config:
    """The resolved config: ``config`` (a bundled name, a YAML file or a :class:`Config`) with the ``KEY=VALUE``
    strings ``first``, then ``settings`` (``set``: ``KEY=VALUE`` strings, or a mapping of dotted keys, whose ``None``
    is YAML's null), then ``flags`` (dotted keys whose values are not ``None``) applied in that order and the
    cross-field checks once after all of them: what :func:`~ctuq.config.load_config` does with ``--set`` strings
    and flags, each error naming the override at fault (``--set KEY=VALUE`` as the command line gives it, ``set
    KEY=VALUE`` for a mapping's key)."""
    strings, values = _overrides(settings)
    if isinstance(config, Config):
        cfg, where = copy.deepcopy(config), "the given Config"
    else:
        cfg = load_config(config)
        where = f"config {config}" if config is not None else "the bundled config demo (the default)"
    # a Config's attributes may have been assigned unchecked: it is checked also without overrides
    apply_overrides(cfg, where, [*first, *strings], values=values, flags=flags, check=isinstance(config, Config))
    return cfg


def _scan_flags(scan, settings) -> tuple[dict[str, Any], Path | None]:
    """The ``data`` keys that name ``scan`` (a :class:`Scan`, a path, or ``None``: the config's) and the folder of a
    scan given as arrays that the run copies into ``scan/``."""
    if scan is None:
        return {}, None
    if not isinstance(scan, Scan):
        return {"data.path": str(scan)}, None
    root = scan
    while root._parent is not None:
        root = root._parent
    flags: dict[str, Any] = {}
    folder = root._folder
    flags["data.path"] = f"{_SCAN_DIR}/scan.yaml" if folder is not None else root.origin
    orbit = getattr(root.source, "orbit", None)
    if orbit is not None:  # a walnut folder holds three orbits: the run reads the one this scan opened
        flags["data.orbit"] = int(orbit)
    if scan.is_subset:
        flags["data.angles"] = [int(i) for i in scan.used_angles]
        given = settings.keys() if isinstance(settings, Mapping) else [str(s).split("=")[0] for s in settings or []]
        if "data.angular_subsampling" not in given:
            flags["data.angular_subsampling"] = 1  # a subset names the measured angles itself
    return flags, folder


# --------------------------------------------------------------------------------------------- folders
def _temporary_folder(kind: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"ctuq-{kind}-"))


def _place_scan(folder: Path, scan_folder: Path | None, *, keep: bool) -> None:
    """Copy a scan given as arrays (its ``scan.yaml`` folder) into the run folder's ``scan/``; a new run replaces
    the one a previous run there left (it would otherwise read that scan), ``keep`` (a resumed run) keeps it."""
    if scan_folder is None:
        return
    target = folder / _SCAN_DIR
    if target.exists() and keep:
        return
    folder.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(scan_folder, target)


def _discarded_on_failure(folder: Path, temporary: bool, work: Callable[[], Any]) -> Any:
    """``work()``; when it raises (an error, Ctrl-C) a ``temporary`` folder is removed: nothing can resume it."""
    try:
        return work()
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _run_folder(path: str | Path, who: str) -> Path:
    """``path`` when it is a run folder (it holds ``config.yaml``); else ``OutDirError`` naming ``who`` (the
    function and its argument) and the folder."""
    path = Path(path).expanduser()
    if not (path / rf.CONFIG_NAME).is_file():
        what = "no such folder" if not path.exists() else "not a folder" if not path.is_dir() else "no config.yaml"
        raise OutDirError(
            f"{who} {path} is not a run folder ({what}); give a folder written by `ctuq reconstruct`, "
            "ctuq.reconstruct(out=...) or Run.save"
        )
    return path


def _copy_run(src: Path, dst: Path) -> None:
    """Copy the run folder ``src`` into ``dst`` (new or empty), without its lock. The copy is made beside ``dst`` and
    renamed into place, so a copy killed half-way leaves no ``dst`` that looks like a run folder."""
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise OutDirError(f"out {dst}: exists and is not an empty folder")
    tmp = dst.with_name(f".{dst.name}.copying")
    shutil.rmtree(tmp, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(_LOCK))
    if dst.exists():
        dst.rmdir()  # empty (checked above)
    tmp.rename(dst)


def holds_result(folder: str | Path, config: Config, *files: str) -> bool:
    """Whether ``folder`` holds the finished result of ``config``: every one of ``files`` (those its work writes
    last, e.g. ``metrics.json``) is there, and its ``config.yaml`` is ``config``. The file is read through the config
    schema, so a key added to ctuq since the run wrote it takes its default (what the run did without it), and both
    are compared as the YAML a run writes; a file this version cannot read (a key it no longer has) holds no result
    of it. What ``reuse=True`` of :func:`reconstruct`, :func:`uncertainty` and :func:`design_angles` asks before it
    loads a folder instead of computing it."""
    folder = Path(folder)
    if not all((folder / name).is_file() for name in files):
        return False
    try:
        saved = load_config(folder / rf.CONFIG_NAME)
    except ConfigError:  # unreadable, not YAML, or a key or value this version does not know
        return False

    def written(cfg: Config) -> Any:
        return yaml.safe_load(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    return written(saved) == written(config)


# --------------------------------------------------------------------------------------------- the API
def reconstruct(
    scan: Scan | str | Path | None = None,
    config: str | Path | Config | None = "demo",
    set: Mapping[str, Any] | Sequence[str] | None = None,  # noqa: A002 - the public name of the overrides
    *,
    out: str | Path | None = None,
    resume: bool = False,
    reuse: bool = False,
    uq: bool = True,
    progress: bool = True,
    device: str | None = None,
    seed: int | None = None,
    save_samples: bool | None = None,
    overwrite: bool = False,
) -> Run:
    """Reconstruct ``scan`` with FBP, TV and the deep image prior and infer the DIP's uncertainty: ``ctuq
    reconstruct`` as a function.

    Parameters
    ----------
    scan : Scan, str, Path or None
        A :class:`~ctuq.scan.Scan` (:func:`~ctuq.scan.load_scan`, :meth:`~ctuq.scan.Scan.from_astra`, a
        :meth:`~ctuq.scan.Scan.subset`), the path of a scan (``--data``), or ``None``: the config's
        ``data.path`` (default the bundled simulated walnut).
    config : str, Path or Config
        A bundled config name (``"demo"``, ``"walnut_2d_60"``, …), a YAML file, or a :class:`ctuq.config.Config`.
    set : dict or list of str
        Config overrides: ``{"dip.iterations": 500}`` or ``["dip.iterations=500"]`` (``--set``).
    out : str or Path, optional
        The run folder to write (``--out``). Default: a temporary folder, removed with the returned run unless
        :meth:`Run.save` keeps it.
    resume, uq, progress, overwrite
        Continue an interrupted run in ``out`` from its checkpoints; run the uncertainty phase; progress bars;
        allow a new run into a folder holding a finished one.
    reuse : bool
        When ``out`` already holds this finished run (its ``metrics.json``, with ``uq`` its ``std.tif``, and a
        ``config.yaml`` equal to this call's config: :func:`holds_result`), load it instead of computing it again
        (:attr:`Run.reused`). With ``resume=True`` a rerun of the same call (a script, a notebook cell, a study)
        loads what finished and continues what was interrupted. Anything else in ``out`` is treated as without it.
    device, seed, save_samples
        Override ``device``, ``seed`` and ``uq.save_samples``.

    Returns
    -------
    Run
        The finished run.

    Raises
    ------
    ConfigError
        A ``set`` key that does not exist (naming the valid keys of its section) or a bad value.
    CTUQError
        Every user error of the run (a damaged scan, an unwritable ``out``, …), one line naming what is at fault.
    """
    if resume and out is None:
        raise OutDirError("reconstruct(resume=True): needs out=, the run folder to continue")
    flags, scan_folder = _scan_flags(scan, set)
    config_file = config
    if resume and config == "demo" and (Path(out) / rf.CONFIG_NAME).is_file():
        config_file = Path(out) / rf.CONFIG_NAME  # a resumed run keeps its own settings
    cfg = _config(config_file, set, {**flags, "device": device, "seed": seed, "uq.save_samples": save_samples})
    if reuse and out is not None and holds_result(out, cfg, rf.METRICS_NAME, *([rf.STD_NAME] if uq else [])):
        return Run(Path(out), reused=True)
    temporary = out is None
    folder = _temporary_folder("run") if temporary else Path(out)
    if not temporary and scan_folder is not None and not resume:
        rf.prepare_out_dir(folder, resume=overwrite, option="out")  # refused before the scan is copied into it

    def work() -> RunState:
        _place_scan(folder, scan_folder, keep=resume)
        return runner.reconstruct(cfg, folder, resume=resume, uq=uq, progress=progress, overwrite=overwrite)

    state = _discarded_on_failure(folder, temporary, work)
    return Run(folder, state=state, temporary=temporary)


def uncertainty(
    run: Run | str | Path,
    set: Mapping[str, Any] | Sequence[str] | None = None,  # noqa: A002 - the public name of the overrides
    *,
    out: str | Path | None = None,
    resume: bool = False,
    reuse: bool = False,
    progress: bool = True,
    device: str | None = None,
    save_samples: bool | None = None,
    shard=None,
    rank_device: torch.device | None = None,
) -> Run:
    """Rerun only the inference of a finished ``run`` with its config changed by ``set`` (``ctuq uq`` as a
    function): the scan is reloaded and the fitted DIP restored, not refitted.

    Parameters
    ----------
    run : Run, str or Path
        The run (or its folder).
    set : dict or list of str
        Overrides of the run's config, e.g. ``{"uq.samples": 256, "uq.calibration": "none"}``.
    out : str or Path, optional
        Where the new run goes: default a temporary copy (the given run is left as it is); ``run.path`` reruns in
        place (what ``ctuq uq RUN`` does); another path gets a copy of the run first (made whole or not at all), or,
        with ``resume=True`` when it already holds a run folder (an earlier call's copy), continues in it.
    resume, progress, device, save_samples
        Continue an interrupted inference; progress bars; override ``device`` and ``uq.save_samples``.
    reuse : bool
        When ``out`` already holds this finished inference (``metrics.json``, ``std.tif`` and a ``config.yaml``
        equal to this call's config, which the inference writes last: :func:`holds_result`), load it instead of
        computing it again (:attr:`Run.reused`); with ``resume=True`` a rerun of the same call loads what finished
        and continues what was interrupted.
    shard : ctuq.inference.Shard, optional
        This process's share of a ``torchrun`` launch (``ctuq uq`` sharded), computing on ``rank_device`` (its own
        GPU; default the config's device).

    Returns
    -------
    Run
    """
    run = run if isinstance(run, Run) else Run(_run_folder(run, "uncertainty: run"))
    cfg = _config(run.path / rf.CONFIG_NAME, set, {"device": device, "uq.save_samples": save_samples})
    if reuse and out is not None and holds_result(out, cfg, rf.METRICS_NAME, rf.STD_NAME):
        return Run(Path(out), reused=True)
    copied = False
    if out is None:
        target, temporary = _temporary_folder("run"), True
        _discarded_on_failure(target, True, lambda: _copy_run(run.path, target))
        copied = True
    else:
        target, temporary = Path(out), False
        continued = resume and (target / rf.CONFIG_NAME).is_file()
        if target.resolve() != run.path.resolve() and not continued:
            _copy_run(run.path, target)
            copied = True
    # a fresh copy has no inference of its own to continue (a checkpoint in it is the source run's)
    resume = resume and not copied
    state = _discarded_on_failure(
        target,
        temporary,
        lambda: runner.rerun_uq(cfg, target, resume=resume, progress=progress, shard=shard, device=rank_device),
    )
    return Run(target, state=state, temporary=temporary)


def load_run(path: str | Path) -> Run:
    """The finished run in the folder ``path`` (written by ``ctuq reconstruct``, :func:`reconstruct` or
    :meth:`Run.save`). ``OutDirError`` naming the folder when it is not a run folder or not finished."""
    path = _run_folder(path, "load_run:")
    if not (path / rf.METRICS_NAME).is_file():
        raise OutDirError(
            f"load_run: {path} is not a finished run (no {rf.METRICS_NAME}); finish it with `ctuq reconstruct "
            f"--resume --out {path}`"
        )
    return Run(path)


class Run:
    """A reconstruction with error bars: a run folder as an object (module docstring).

    Attributes
    ----------
    path : Path
        The run folder behind it (a temporary one for a run made without ``out=``, until :meth:`save`).
    reused : bool
        Whether ``reuse=True`` found this run finished in its folder and loaded it (nothing was computed).
    """

    def __init__(self, path: Path, *, state: RunState | None = None, temporary: bool = False, reused: bool = False):
        self.path = Path(path)
        self._state = state
        self._metrics: dict | None = None
        self._posterior: CTPosterior | None = None
        self.temporary = temporary
        self.reused = reused
        if temporary:
            weakref.finalize(self, shutil.rmtree, self.path, True)

    # ------------------------------------------------------------------------------------------ contents
    @property
    def config(self) -> Config:
        """The run's resolved config (``config.yaml``)."""
        if self._state is not None:
            return self._state.cfg
        return load_config(self.path / rf.CONFIG_NAME)

    @property
    def metrics(self) -> dict:
        """``metrics.json``: PSNR/SSIM per method, the uncertainty's scores, the held-out check, timings, warnings."""
        if self._metrics is None:
            self._metrics = rf.read_metrics(self.path)
        return self._metrics

    @property
    def images(self) -> dict[str, np.ndarray]:
        """The reconstructions by method (``"fbp"``, ``"tv"`` when it ran, ``"dip"``): ``image_shape`` float32
        arrays in mm⁻¹."""
        if self._state is not None and self._state.images:
            return {k: _numpy(v) for k, v in self._state.images.items() if k in _IMAGES}
        return {k: _read(self.path / name) for k, name in _IMAGES.items() if (self.path / name).is_file()}

    @property
    def std(self) -> np.ndarray | None:
        """The shipped pixelwise std map (mm⁻¹, ``std.tif``: the posterior's, recalibrated by ``uq.calibration``
        on the held-out angles); ``None`` for a run without the uncertainty phase."""
        result = None if self._state is None else self._state.uq_result
        if result is not None and getattr(result, "std", None) is not None:
            return _numpy(result.std)
        return _read(self.path / rf.STD_NAME) if (self.path / rf.STD_NAME).is_file() else None

    @property
    def mean(self) -> np.ndarray | None:
        """The predictive mean :attr:`std` belongs to (mm⁻¹): the DIP reconstruction for the linearised posterior,
        the stochastic passes' mean (``mean.tif``) for ``uq.method = mc_dropout``; ``None`` for a run without the
        uncertainty phase."""
        if (self.path / rf.MEAN_NAME).is_file():
            return _read(self.path / rf.MEAN_NAME)
        result = None if self._state is None else self._state.uq_result
        if result is not None and getattr(result, "mean", None) is not None:
            return _numpy(result.mean)
        return self.images.get("dip") if self.std is not None else None

    @property
    def std_uncalibrated(self) -> np.ndarray | None:
        """The posterior's own std map (mm⁻¹): :attr:`std` before its calibration (the same when none applied)."""
        path = self.path / rf.STD_UNCALIBRATED_NAME
        return _read(path) if path.is_file() else self.std

    @property
    def ground_truth(self) -> np.ndarray | None:
        """The scan's ground truth on the reconstruction grid (mm⁻¹), or ``None``."""
        path = self.path / rf.GROUND_TRUTH_NAME
        return _read(path) if path.is_file() else None

    @property
    def warnings(self) -> list[str]:
        return list(self.metrics.get("warnings", []))

    # ------------------------------------------------------------------------------------------ posterior, check
    @property
    def posterior(self) -> CTPosterior:
        """The fitted CT posterior (:class:`~ctuq.pipeline.ct_model.CTPosterior`: samples, std, patch
        log-likelihoods, restrict/extend). A loaded run rebuilds it from its checkpoint (``uq_state.pt``) after
        reloading the scan and restoring the DIP: seconds to minutes. ``OutDirError`` for a run without the
        uncertainty phase."""
        if self._posterior is None:
            result = None if self._state is None else self._state.uq_result
            if result is not None and getattr(result, "posterior", None) is not None:
                self._posterior = CTPosterior(result.posterior, result.mean, self.config.dip.scale)
            else:
                self._posterior = self._rebuild_posterior()
        return self._posterior

    def _rebuild_posterior(self) -> CTPosterior:
        if not (self.path / rf.STD_NAME).is_file():
            raise OutDirError(f"{self.path}: the run has no uncertainty phase (no {rf.STD_NAME}); use uncertainty()")
        cfg = self.config
        state = RunState(cfg=cfg, out_dir=self.path, device=resolve_device(cfg.device), progress=False, command="uq")
        runner.run_phases(state, [Phase("load", phase_load), Phase("restore_dip", phase_restore_dip)])
        fitted = runner.fitted_posterior(state)
        return CTPosterior(fitted.posterior, state.images["dip"], cfg.dip.scale)

    def check(self, *, progress: bool = False) -> HeldoutCheck:
        """The held-out check of the shipped error bars on the scan's angles the run did not use (``ctuq uq RUN
        --check``): rescores the rows the run saved (seconds), writing ``heldout.json`` and its figure into the
        run folder. ``CTUQError`` with the reason when the scan held no angle out."""
        state, rows = runner.check_run(self.config, self.path, progress=progress)
        return HeldoutCheck(rows.report, state.metrics["uq"]["calibration"])

    # ------------------------------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write the run folder to ``path`` (new or empty): every file of the run (images, std map, metrics,
        config, figures, the fitted DIP and posterior checkpoints, a scan given as arrays); :func:`load_run` reads
        it back with the same arrays. Returns ``path``."""
        path = Path(path)
        _copy_run(self.path, path)
        return path

    def __repr__(self) -> str:
        psnr = self.metrics.get("psnr") or {}
        scores = ", ".join(f"{k.upper()} {v:.2f} dB" for k, v in psnr.items() if v is not None)
        uq = "with" if (self.path / rf.STD_NAME).is_file() else "without"
        where = "a temporary folder" if self.temporary else str(self.path)
        return f"Run({where}: {scores or 'no ground truth'}; {uq} uncertainty)"


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _read(path: Path) -> np.ndarray:
    return np.asarray(tifffile.imread(path))


# --------------------------------------------------------------------------------------------- designs
def design_angles(
    scan: Scan | str | Path | None = None,
    config: str | Path | Config | None = "demo",
    set: Mapping[str, Any] | Sequence[str] | None = None,  # noqa: A002 - the public name of the overrides
    *,
    pilot: int | None = None,
    acquire: int | None = None,
    candidates: int | None = None,
    pilot_angles=None,
    plan: bool = False,
    target_rmse: str | None = None,
    target_psnr: str | None = None,
    criterion: str | None = None,
    prior: str | None = None,
    samples: int | None = None,
    device: str | None = None,
    seed: int | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    reuse: bool = False,
    progress: bool = True,
) -> Design:
    """Choose the next scan angles of ``scan`` by Bayesian experimental design (``ctuq design`` as a function): the
    DIP of a pilot scan, its linearised posterior, and greedy acquisition among the candidate angles.

    Parameters
    ----------
    scan, config, set
        As for :func:`reconstruct`; the scan's angles are the candidates (``data.angular_subsampling`` is 1 unless
        ``set`` thins them), its measurements at a chosen angle are what the acquisition "measures".
    pilot, acquire, candidates
        ``design.pilot`` (equidistant pilot angles), ``design.acquire`` (angles to choose), ``design.candidates``.
    pilot_angles : array of float, optional
        The pilot angles in degrees instead of ``pilot``.
    plan : bool
        Only forecast the error after each number of angles (designed and equidistant): nothing is acquired.
    target_rmse, target_psnr : str, optional
        Stop once the forecast meets ``"0.002/mm"`` / ``"30dB"`` (``--target-rmse`` / ``--target-psnr``).
    criterion, prior, samples, device, seed
        Override ``design.criterion``, ``design.prior``, ``design.samples``, ``device`` and ``seed``.
    out, resume, progress
        The design folder (default temporary), continue a killed design, progress bars.
    reuse : bool
        When ``out`` already holds this finished design (``design.json`` and a ``config.yaml`` equal to this call's
        config: :func:`holds_result`), load it instead of computing it again (:attr:`Design.reused`).

    Returns
    -------
    Design
    """
    flags, scan_folder = _scan_flags(scan, set)
    overrides = ["data.angular_subsampling=1", "data.min_angles=1"]  # the candidates are all of the scan's angles
    design_flags = {
        "design.pilot": pilot,
        "design.acquire": acquire,
        "design.candidates": candidates,
        "design.target_rmse": target_rmse,
        "design.target_psnr": target_psnr,
        "design.criterion": criterion,
        "design.prior": prior,
        "design.samples": samples,
        "device": device,
        "seed": seed,
    }
    cfg = _config(config, set, {**flags, **design_flags}, first=overrides)
    if reuse and out is not None and holds_result(out, cfg, DESIGN_NAME):
        return Design(Path(out), reused=True)
    temporary = out is None
    folder = _temporary_folder("design") if temporary else Path(out)
    angles = None if pilot_angles is None else np.asarray(pilot_angles, dtype=np.float64)

    def work() -> None:
        # a finished design there is refused without resume: its scan is left as it is
        _place_scan(folder, scan_folder, keep=resume or (folder / DESIGN_NAME).is_file())
        run_design(cfg, folder, pilot_angles=angles, resume=resume, progress=progress, plan=plan)

    _discarded_on_failure(folder, temporary, work)
    return Design(folder, temporary=temporary)


class Design:
    """A finished design (``ctuq design``'s folder as an object): the chosen angles, the forecast, the std maps.

    Attributes
    ----------
    path : Path
        The design folder (temporary for a design made without ``out=``, until :meth:`save`).
    record : dict
        ``design.json``: candidates, pilot, acquired angles in order with their criterion values, the forecast
        and the reconstructions from the designed and equidistant angles.
    reused : bool
        Whether ``reuse=True`` found this design finished in its folder and loaded it.
    """

    def __init__(self, path: Path, *, temporary: bool = False, reused: bool = False):
        self.path = Path(path)
        try:
            self.record = json.loads((self.path / DESIGN_NAME).read_text())
        except (OSError, ValueError) as exc:
            raise OutDirError(f"{self.path / DESIGN_NAME}: not a finished design ({type(exc).__name__})") from None
        self.temporary = temporary
        self.reused = reused
        if temporary:
            weakref.finalize(self, shutil.rmtree, self.path, True)

    @property
    def pilot_angles(self) -> np.ndarray:
        """The pilot's angles (degrees)."""
        return np.asarray(self.record["pilot"]["angles_deg"], dtype=np.float64)

    @property
    def angles(self) -> np.ndarray:
        """The acquired angles in acquisition order (degrees); empty for a plan."""
        return np.asarray([a["angle_deg"] for a in self.record.get("acquired") or []], dtype=np.float64)

    @property
    def forecast(self) -> dict | None:
        """The error forecast (``design.json["forecast"]``: the plan's curves, the stop), or ``None``."""
        return self.record.get("forecast")

    @property
    def pilot_images(self) -> dict[str, np.ndarray]:
        """The pilot scan's reconstructions by method (``"fbp"``, ``"tv"`` when it ran, ``"dip"``; ``pilot/``):
        ``image_shape`` float32 arrays in mm⁻¹."""
        pilot = self.path / "pilot"
        return {k: _read(pilot / name) for k, name in _IMAGES.items() if (pilot / name).is_file()}

    @property
    def std_pilot(self) -> np.ndarray | None:
        """The posterior std after the pilot (image units), or ``None`` for a plan or ``design.forecast = false``."""
        path = self.path / "std_pilot.tif"
        return _read(path) if path.is_file() else None

    @property
    def std_design(self) -> np.ndarray | None:
        """The posterior std after the design (image units), or ``None`` for a plan."""
        path = self.path / "std_design.tif"
        return _read(path) if path.is_file() else None

    def save(self, path: str | Path) -> Path:
        """Write the design folder to ``path`` (new or empty); returns ``path``."""
        _copy_run(self.path, Path(path))
        return Path(path)

    def __repr__(self) -> str:
        return f"Design({len(self.pilot_angles)} pilot + {len(self.angles)} chosen angles; {self.path})"
