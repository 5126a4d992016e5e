"""Assembling and running the phase lists: :func:`reconstruct` (``ctuq reconstruct``) and :func:`rerun_uq`
(``ctuq uq``)."""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from ctuq import calibration as cal
from ctuq import interrupt
from ctuq.config import Config, ConfigError
from ctuq.errors import CTUQError, OutDirError
from ctuq.options import UQMethod
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.lock import run_lock
from ctuq.pipeline.mc_dropout_phase import phase_mc_dropout
from ctuq.pipeline.phases import (
    Phase,
    RunState,
    phase_dip,
    phase_fbp,
    phase_load,
    phase_restore_dip,
    phase_tv,
    phase_write,
    split_heldout,
)
from ctuq.pipeline.scan import check_device
from ctuq.pipeline.uq import UQRun
from ctuq.pipeline.uq_phase import phase_uq, write_heldout
from ctuq.utils import atomic_path, resolve_device

__all__ = [
    "uq_phases",
    "build_phases",
    "run_phases",
    "write_config",
    "reconstruct",
    "rerun_uq",
    "check_run",
    "fitted_posterior",
    "reconstruct_problem",
]


def uq_phases(state: RunState) -> list[Phase]:
    """Phases of the uncertainty inference, run after the DIP and before writing (``--no-uq``: none): the
    linearised posterior, or MC dropout (``uq.method``, :mod:`ctuq.pipeline.mc_dropout_phase`)."""
    if state.cfg.uq.method == UQMethod.MC_DROPOUT:
        return [Phase("uq", phase_mc_dropout)]
    return [Phase("uq", phase_uq)]


def build_phases(state: RunState) -> list[Phase]:
    """The phase list of ``ctuq reconstruct`` for ``state.cfg``: load → fbp → [tv] → [dip → [uq]] → write.

    A state whose problem is already given (``state.op`` set, :func:`reconstruct_problem`) skips the load, and the
    2D-only TV baseline with a warning when that problem is a volume. ``dip.enabled = false`` leaves out the DIP and
    so the uncertainty phase (with a warning when one was asked for).
    """
    phases = [Phase("load", phase_load)] if state.op is None else []
    phases.append(Phase("fbp", phase_fbp))
    if state.cfg.tv.enabled and state.op is not None and state.op.ndim != 2:
        state.warn("tv.enabled: the TV baseline is 2D only; skipped for this volume")
    elif state.cfg.tv.enabled:
        phases.append(Phase("tv", phase_tv))
    if state.cfg.dip.enabled:
        phases.append(Phase("dip", phase_dip))
    elif state.uq:
        state.warn("dip.enabled = false: no DIP, so no uncertainty phase")
    if state.uq and state.cfg.dip.enabled:
        phases.extend(uq_phases(state))
    phases.append(Phase("write", phase_write))
    return phases


def run_phases(state: RunState, phases: list[Phase]) -> RunState:
    """Run ``phases`` in order, recording each one's wall time (s) in ``state.timings``; returns ``state``."""
    for phase in phases:
        t0 = time.perf_counter()
        phase.fn(state)
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)
        state.timings[phase.name] = time.perf_counter() - t0
    return state


def write_config(cfg: Config, out_dir: Path) -> None:
    """Write the resolved config ``cfg`` to ``out_dir/config.yaml`` atomically (what ``--resume`` and ``ctuq uq``
    read back; the first file of every run or design folder)."""
    with atomic_path(out_dir / rf.CONFIG_NAME) as tmp:
        tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def reconstruct(
    cfg: Config,
    out_dir: str | Path,
    *,
    resume: bool = False,
    uq: bool = True,
    progress: bool = True,
    overwrite: bool = False,
) -> RunState:
    """Programmatic ``ctuq reconstruct``: run all phases for ``cfg`` into the run folder ``out_dir``.

    The device and the folder are checked before any work starts (:func:`ctuq.utils.resolve_device`,
    :func:`ctuq.pipeline.run_folder.prepare_out_dir`); the resolved config is written to ``config.yaml`` first.

    Parameters
    ----------
    cfg : Config
        The resolved configuration.
    out_dir : path
        Run folder (created). One holding a finished run (``metrics.json``) is refused unless ``resume`` or
        ``overwrite``.
    resume : bool
        Continue the DIP and the inference from the checkpoints in ``out_dir``.
    uq : bool
        Run the uncertainty phase.
    progress : bool
        Progress bars on stderr.
    overwrite : bool
        Allow a new run into a folder that holds a finished one.

    Returns
    -------
    RunState
        The final state: images, metrics, timings (s), warnings.

    Raises
    ------
    CTUQError (e.g. WalnutFormatError, ModelFileError, CheckpointMismatch), OSError
        User errors (see :mod:`ctuq.errors`), e.g. an unwritable ``out_dir``, a damaged scan, a diverged fit.
    RunFolderLocked
        Another process is writing ``out_dir`` (:mod:`ctuq.pipeline.lock`); nothing there was changed.
    DiskFullError
        The disk filled during a write (the file named was not written; every earlier one is intact).
    ctuq.interrupt.Interrupted
        SIGINT/SIGTERM under :func:`ctuq.interrupt.handling`, after the DIP or the inference checkpointed.
    """
    device = resolve_device(cfg.device)
    check_device(cfg, device)
    out_dir = rf.prepare_out_dir(out_dir, resume=resume or overwrite)
    with run_lock(out_dir):  # a second process on this folder is refused before it writes anything
        interrupt.note_run_folder(out_dir)
        write_config(cfg, out_dir)
        state = RunState(cfg=cfg, out_dir=out_dir, device=device, resume=resume, uq=uq, progress=progress)
        return run_phases(state, build_phases(state))


def _locks_run_folder(fn):
    """``fn(cfg, out_dir, ...)`` run while holding the lock of the run folder ``out_dir`` (:mod:`.lock`; rank 0 only
    in a sharded run), after :func:`~ctuq.pipeline.run_folder.require_run_folder` checked it."""

    @functools.wraps(fn)
    def locked(cfg, out_dir, *args, **kwargs):
        shard = kwargs.get("shard")
        if shard is not None and not shard.is_root:
            return fn(cfg, out_dir, *args, **kwargs)
        rf.require_run_folder(out_dir)
        with run_lock(out_dir, option="RUN_DIR"):
            interrupt.note_run_folder(out_dir)
            return fn(cfg, out_dir, *args, **kwargs)

    return locked


@_locks_run_folder
def rerun_uq(
    cfg: Config,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    shard=None,
    device: torch.device | None = None,
) -> RunState:
    """Programmatic ``ctuq uq``: rerun only the uncertainty phase on the finished run folder ``out_dir``.

    Reloads the scan and the FBP, restores the fitted DIP (``dip_model.pt``, else the checkpoint; no refitting),
    runs the inference with ``cfg.uq`` and rewrites ``std.tif``, the uncertainty figures, ``metrics.json`` (the
    DIP/TV numbers of the original run are kept) and ``config.yaml`` (``cfg``). ``resume`` continues an
    interrupted inference from its checkpoints. Returns the final :class:`RunState`; raises as
    :func:`reconstruct` does, and :class:`~ctuq.errors.OutDirError` when ``out_dir`` is not a run folder.

    ``shard`` (a :class:`ctuq.inference.Shard` from :func:`ctuq.inference.init_from_env`) splits the EM probes and
    the prediction chunks across the ranks of a ``torchrun`` launch; every rank loads the scan and the DIP, rank 0
    sets up the posterior and writes the results. ``device`` overrides ``cfg.device`` (the rank's own GPU).
    """
    out_dir = Path(out_dir)
    rf.require_run_folder(out_dir)
    device = device if device is not None else resolve_device(cfg.device)
    check_device(cfg, device)
    state = RunState(
        cfg=cfg,
        out_dir=out_dir,
        device=device,
        resume=resume,
        uq=True,
        progress=progress and (shard is None or shard.is_root),
        command="uq",
        shard=shard,
    )
    phases = [
        Phase("load", phase_load),
        Phase("fbp", phase_fbp),
        Phase("restore_dip", phase_restore_dip),
        *uq_phases(state),
        Phase("write", phase_write),
    ]
    run_phases(state, phases)
    if state.is_root:
        write_config(cfg, out_dir)
    return state


@_locks_run_folder
def check_run(
    cfg: Config,
    out_dir: str | Path,
    *,
    progress: bool = True,
    device: torch.device | None = None,
) -> tuple[RunState, cal.HeldoutRows]:
    """Programmatic ``ctuq uq RUN --check``: the held-out check (:mod:`ctuq.calibration`) of the finished run in
    ``out_dir``, writing only ``heldout.json`` and ``heldout_calibration.png``.

    When the run saved its held-out rows (``heldout_rows.npz``, every run with the uncertainty phase and a check),
    they are rescored with the current statistic in seconds, without opening the scan (a calibration method whose
    row weights the file lacks is left out of the report). Otherwise it loads the scan (its held-out rows come with
    it), restores the fitted DIP and the fitted posterior (resumed from a temporary copy of ``uq_state.pt``, else
    set up and fitted afresh with ``cfg.uq``), projects ``ctuq.calibration.HELDOUT_SAMPLES`` posterior samples onto
    the scan's unused angles and scores them, saving the rows for the next check. Every other file of the folder is
    left untouched. Returns the state (timings in ``state.timings``) and the scored
    :class:`~ctuq.calibration.HeldoutRows`.

    Raises
    ------
    OutDirError
        ``out_dir`` is not a finished run folder, or its run has no uncertainty phase.
    CTUQError
        The scan has no unused angles (or the run is a volume), with the reason.
    """
    out_dir = Path(out_dir)
    rf.require_run_folder(out_dir)
    _require_finished_uq_run(out_dir)
    device = device if device is not None else resolve_device(cfg.device)
    check_device(cfg, device)
    state = RunState(cfg=cfg, out_dir=out_dir, device=device, uq=True, progress=progress, command="uq")
    # what the run ships (its calibration, as it recorded it): the verdict says what the run did about the check
    state.metrics["uq"] = {"calibration": (rf.read_metrics(out_dir).get("uq") or {}).get("calibration")}
    command = f"ctuq uq {out_dir} --check"
    t0 = time.perf_counter()

    saved = cal.read_rows(out_dir / rf.HELDOUT_ROWS_NAME)
    if saved is not None:  # the run kept its held-out rows: rescore them, no posterior to rebuild
        saved.meta["command"] = command
        saved.score(seed=cfg.seed + 1)
        state.timings["check"] = time.perf_counter() - t0
        saved.report["seconds"] = state.timings["check"]
        saved.report["timings"] = dict(state.timings)
        state.log(f"rescored the held-out rows the run saved ({rf.HELDOUT_ROWS_NAME}); no posterior rebuilt")
        write_heldout(out_dir, saved, figure=cfg.output.figure, rows_file=False)
        return state, saved
    run_phases(state, [Phase("load", phase_load)])
    held = state.data.heldout
    if held is None:
        raise CTUQError(f"RUN_DIR {out_dir}: no held-out check: {state.data.heldout_reason}")
    run_phases(state, [Phase("restore_dip", phase_restore_dip)])
    t0 = time.perf_counter()
    run = fitted_posterior(state, log=state.log)
    state.timings["posterior"] = time.perf_counter() - t0
    rows = cal.run_heldout_check(
        run.posterior,
        state.images["dip"].detach().cpu(),
        cfg.dip.scale,
        held,
        # uq.noise = auto: the model the fitted posterior resolved from the scan (its likelihood gives the noise)
        noise_model=run.noise.model,
        n_samples=min(cal.HELDOUT_SAMPLES, cfg.uq.samples),
        chunk_size=cfg.uq.sample_chunk,
        seed=cfg.seed + 1,
        command=command,
        companions={k: state.images[k].detach().cpu() for k in ("fbp", "tv") if k in state.images},
    )
    state.timings["check"] = rows.report["seconds"]
    rows.report["timings"] = dict(state.timings)
    write_heldout(out_dir, rows, figure=cfg.output.figure)
    return state, rows


def _require_finished_uq_run(run_dir: Path) -> None:
    """Refuse ``--check`` on a folder that is not a finished run with the uncertainty phase (one-line
    :class:`~ctuq.errors.OutDirError` naming the folder and the missing file)."""
    if not (run_dir / rf.METRICS_NAME).is_file():
        raise OutDirError(
            f"RUN_DIR {run_dir}: not a finished run (no {rf.METRICS_NAME}); finish it with `ctuq reconstruct "
            f"--resume --out {run_dir}` first"
        )
    if not (run_dir / rf.STD_NAME).is_file():
        raise OutDirError(
            f"RUN_DIR {run_dir}: the run has no uncertainty phase (no {rf.STD_NAME}); run `ctuq uq {run_dir}` first"
        )


def fitted_posterior(state: RunState, *, log: Callable[[str], None] | None = None) -> UQRun:
    """The fitted posterior of the finished run in ``state.out_dir`` without touching its files: the inference
    checkpoint (``uq_state.pt``) is copied into a temporary folder and resumed there (no EM step is repeated);
    without one the set-up and EM run afresh. ``state`` holds the loaded scan and the restored DIP. Returns the
    :class:`ctuq.pipeline.uq.UQRun` after :meth:`~ctuq.pipeline.uq.UQRun.fit`."""
    with tempfile.TemporaryDirectory(prefix="ctuq-check-") as tmp:
        saved = state.out_dir / rf.UQ_STATE_NAME
        if saved.is_file():
            shutil.copy2(saved, Path(tmp) / rf.UQ_STATE_NAME)
        elif log is not None:
            log(f"no {rf.UQ_STATE_NAME} in {state.out_dir}: setting up and fitting the posterior afresh")
        run = UQRun(
            state.model,
            state.net_input,
            state.op,
            state.y,
            scale=state.cfg.dip.scale,
            settings=state.cfg.uq,
            seed=state.cfg.seed,
            work_dir=tmp,
            resume=saved.is_file(),
            progress=state.progress,
            log=log,
            # uq.noise = per_ray whitens with the scan's per-measurement variances: without them it refuses
            variances=state.data.variances if state.data is not None else None,
        )
        run.set_up().fit()
    return run


def reconstruct_problem(
    cfg: Config,
    out_dir: str | Path,
    data,
    *,
    uq: bool = True,
    resume: bool = False,
    progress: bool = True,
    overwrite: bool = False,
) -> RunState:
    """The phases of ``ctuq reconstruct`` on a problem given in code instead of a scan folder: fbp → dip → [uq] →
    write into the run folder ``out_dir`` (same files and metrics.json as a scan run).

    This is the CPU path of the 3D pipeline: ``data`` may be a volume from
    :func:`ctuq.data.volume.simulate_parallel_volume` (3D U-Net DIP, inference over the volume, streaming 3D
    statistics, orthogonal-slice figures, per-phase timings), which the config's ``data`` section cannot describe
    (a 3D *walnut* scan is cone beam and needs CUDA). ``cfg.data`` is ignored; ``cfg.tv`` is skipped for volumes.

    Parameters
    ----------
    cfg : Config
        Model, DIP, inference and output settings (``cfg.device`` must match ``data.op.device``).
    out_dir : path
        Run folder (created; a finished one is refused unless ``resume`` or ``overwrite``).
    data : ctuq.data.CTData
        ``op`` (any :class:`~ctuq.operators.RayTransform`), ``y`` (``op.measurement_shape``), ``ground_truth``
        (``op.image_shape`` or ``None``), ``meta``.
    uq, resume, progress, overwrite
        As in :func:`reconstruct`.
    """
    device = resolve_device(cfg.device)
    if data.op.device.type != device.type:
        raise ConfigError(
            f"device {cfg.device!r}: the problem's operator lives on {data.op.device}; build it there "
            f"or set device accordingly"
        )
    out_dir = rf.prepare_out_dir(out_dir, resume=resume or overwrite)
    with run_lock(out_dir):
        interrupt.note_run_folder(out_dir)
        return _reconstruct_given(cfg, out_dir, data, device, uq=uq, resume=resume, progress=progress)


def _reconstruct_given(cfg: Config, out_dir: Path, data, device, *, uq: bool, resume: bool, progress: bool):
    """:func:`reconstruct_problem` after its checks, in the locked run folder ``out_dir``."""
    write_config(cfg, out_dir)
    state = RunState(cfg=cfg, out_dir=out_dir, device=device, resume=resume, uq=uq, progress=progress)
    state.data, state.op = data, data.op
    state.y = data.y.to(device)
    state.ground_truth = data.ground_truth.to(device) if data.ground_truth is not None else None
    state.metrics["data"] = {
        "source": "given in code",
        "ndim": int(data.op.ndim),
        "image_shape": list(data.op.image_shape),
        "measurement_shape": list(data.op.measurement_shape),
        "operator": type(data.op).__name__,
        "has_ground_truth": state.ground_truth is not None,
        "meta": dict(getattr(data, "meta", {}) or {}),
    }
    split_heldout(state)
    return run_phases(state, build_phases(state))
