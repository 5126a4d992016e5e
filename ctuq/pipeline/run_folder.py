"""The run-folder contract: every file a ``ctuq reconstruct`` run folder (``--out``) may hold, and the checks an
output folder must pass before any work starts.

Files (all written atomically, so a killed run never leaves a half-written one)::

    config.yaml          the resolved config of the run (what ``--resume`` and ``ctuq uq`` read back)
    metrics.json         PSNR/SSIM per method, UQ metrics, timings per phase, warnings, config, versions, device
    reconstruction.tif   DIP reconstruction (float32, mm⁻¹, (H, W) or (D, H, W))
    fbp.tif              FBP (2D) or FDK (3D) reconstruction
    tv.tif               TV reconstruction (only when the TV baseline ran)
    ground_truth.tif     the ground truth on the reconstruction grid (only when the scan has one)
    std.tif              pixelwise posterior standard deviation (mm⁻¹; only with the uncertainty phase)
    mean.tif             the predictive mean std.tif belongs to, when it is not reconstruction.tif (uq.method =
                         mc_dropout: the mean of the stochastic passes)
    stack.tif            reconstruction, std, |error|, ground truth (those present) as channels (output.stack)
    results.h5           every image above and the geometry: voxel grid, projection vectors (output.hdf5)
    ctuq.log             every message of the run, timestamped; appended by --resume and ``ctuq uq`` (module ctuq.log)
    heldout_rows.npz     the held-out check's rows (only when the scan has unused angles; ctuq.calibration)
    dip_checkpoint.pt    DIP checkpoint: weights, optimizer, RNG, history (``--resume`` continues from it)
    dip_model.pt         the fitted DIP: best weights, fixed input, architecture (``ctuq.models.model_file``)
    uq_state.pt          inference checkpoint: the posterior after the g-prior, the solver set-up, each EM step
    uq_moments.pt        running sums of the prediction samples and the next chunk (resume; deleted when the
                         inference finishes); uq_moments.rank{r}of{N}.pt: rank r's sums in a sharded run
    samples/samples_NNNN.pt   image samples of chunk NNNN, only when asked to keep them (uq.save_samples)
    reconstruction.png   ground truth | FBP | (TV |) DIP | |DIP − ground truth|, PSNRs in the titles
    uncertainty.png      ground truth | DIP | |error| | posterior std (inner-square ROI marked)
    calibration.png      coverage of the central posterior intervals against their level
    joint_ll.png         patch joint log-likelihood against patch size
    error_vs_std.png     |error| against posterior std, binned
    em_trace.png         prior precision, noise variance and evidence per EM step

The ``.tif`` images are ImageJ hyperstacks carrying the voxel size in mm (:func:`ctuq.outputs.write_tiff`;
ImageJ/Fiji and ``ctuq view`` show them at physical scale). The ``uq_*`` files and ``samples/`` are the linearised
inference's checkpoints and outputs, written into any work folder (run folders, study folders; their format:
:mod:`ctuq.pipeline.checkpoints`). Every file name a run folder
holds is spelled here and only here. This module imports nothing from ctuq but :mod:`ctuq.errors` and
:mod:`ctuq.outputs`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ctuq.errors import DiskFullError, OutDirError, RunFolderLocked, is_user_error

__all__ = [
    "discard_if_empty",
    "read_metrics",
    "CONFIG_NAME",
    "METRICS_NAME",
    "RECONSTRUCTION_NAME",
    "FBP_NAME",
    "TV_NAME",
    "GROUND_TRUTH_NAME",
    "STD_NAME",
    "MEAN_NAME",
    "CHECKPOINT_NAME",
    "CANDIDATE_CHECKPOINT",
    "MODEL_NAME",
    "UQ_STATE_NAME",
    "UQ_MOMENTS_NAME",
    "UQ_MOMENTS_SHARD_PATTERN",
    "UQ_SAMPLES_DIR",
    "UQ_SAMPLE_FILE_PATTERN",
    "RECONSTRUCTION_FIGURE",
    "UNCERTAINTY_FIGURE",
    "CALIBRATION_FIGURE",
    "RELIABILITY_FIGURE",
    "JOINT_LL_FIGURE",
    "ERROR_VS_STD_FIGURE",
    "EM_TRACE_FIGURE",
    "UNCERTAINTY_SLICES_FIGURE",
    "FIGURE_NAMES",
    "STD_UNCALIBRATED_NAME",
    "HELDOUT_NAME",
    "HELDOUT_FIGURE",
    "TUNING_FIGURE",
    "STACK_NAME",
    "RESULTS_H5_NAME",
    "LOG_NAME",
    "HELDOUT_ROWS_NAME",
    "prepare_out_dir",
    "check_writable_folder",
    "require_run_folder",
    "new_run_folder",
    "is_finished_run",
]

CONFIG_NAME = "config.yaml"
METRICS_NAME = "metrics.json"
RECONSTRUCTION_NAME = "reconstruction.tif"
FBP_NAME = "fbp.tif"
TV_NAME = "tv.tif"
GROUND_TRUTH_NAME = "ground_truth.tif"
STD_NAME = "std.tif"
MEAN_NAME = "mean.tif"  # uq.method = mc_dropout: the passes' mean (the linearised posterior's is reconstruction.tif)
STD_UNCALIBRATED_NAME = "std_uncalibrated.tif"  # the posterior's std when std.tif is recalibrated (uq.calibration)
HELDOUT_NAME = "heldout.json"  # `ctuq uq RUN --check`'s report
# the held-out check's per-row arrays (residual, image and noise variances, angle): `--check` rescores them without
# rebuilding the posterior
HELDOUT_ROWS_NAME = "heldout_rows.npz"
RESULTS_H5_NAME = "results.h5"  # output.hdf5: images and geometry in one file (ctuq.outputs.write_results_h5)
STACK_NAME = "stack.tif"  # output.stack: the images as one multi-channel ImageJ stack (ctuq.outputs.write_stack)
LOG_NAME = "ctuq.log"  # the run's log file (ctuq.log.run_log); also in design folders and scan folders
CHECKPOINT_NAME = "dip_checkpoint.pt"
CANDIDATE_CHECKPOINT = "dip_checkpoint_tv{}.pt"  # dip.tv_weights: the fit of the i-th candidate TV weight
MODEL_NAME = "dip_model.pt"
# The linearised inference (ctuq.pipeline.uq) writes these into any work folder (run folders, study folders).
UQ_STATE_NAME = "uq_state.pt"
UQ_MOMENTS_NAME = "uq_moments.pt"
UQ_MOMENTS_SHARD_PATTERN = "uq_moments.rank{rank}of{world}.pt"  # rank `rank` of `world` in a sharded prediction
UQ_SAMPLES_DIR = "samples"
UQ_SAMPLE_FILE_PATTERN = "samples_{:04d}.pt"

RECONSTRUCTION_FIGURE = "reconstruction.png"
UNCERTAINTY_FIGURE = "uncertainty.png"
CALIBRATION_FIGURE = "calibration.png"
RELIABILITY_FIGURE = "reliability.png"  # RMSE against RMV per std decile inside the object
JOINT_LL_FIGURE = "joint_ll.png"
ERROR_VS_STD_FIGURE = "error_vs_std.png"
EM_TRACE_FIGURE = "em_trace.png"
UNCERTAINTY_SLICES_FIGURE = "uncertainty_slices.png"  # volumes: axial / coronal / sagittal planes
HELDOUT_FIGURE = "heldout_calibration.png"  # held-out coverage curve and z histogram
TUNING_FIGURE = "tuning.png"  # TV's weight path and the DIP's stopping iteration on held-out angles
FIGURE_NAMES = (
    RECONSTRUCTION_FIGURE,
    UNCERTAINTY_FIGURE,
    CALIBRATION_FIGURE,
    RELIABILITY_FIGURE,
    JOINT_LL_FIGURE,
    ERROR_VS_STD_FIGURE,
    EM_TRACE_FIGURE,
    UNCERTAINTY_SLICES_FIGURE,
)


def read_metrics(folder: str | os.PathLike) -> dict:
    """The ``metrics.json`` of the finished run in ``folder``; :class:`~ctuq.errors.OutDirError` naming the file when
    it is missing or not JSON."""
    path = Path(folder) / METRICS_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise OutDirError(f"{path}: cannot read the run's metrics ({type(exc).__name__}: {exc})") from None


def is_finished_run(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a finished run (its ``metrics.json`` is written last)."""
    return (Path(folder) / METRICS_NAME).is_file()


def check_writable_folder(folder: str | os.PathLike, *, option: str = "--out", create: bool = True) -> Path:
    """Check that ``folder`` can be (created and) written, before any work starts; returns it as a ``Path``.

    Parameters
    ----------
    folder : path
        The output folder.
    option : str
        How the user named it (``"--out"``, ``"RUN_DIR"``), for the message.
    create : bool
        Create ``folder`` (and its parents) if missing.

    Raises
    ------
    OutDirError
        ``folder`` is an existing file, one of its parents is a file, it cannot be created, or a probe file cannot
        be written into it. The message is ``"<option> <folder>: <problem>"``.
    """
    folder = Path(folder)
    where = f"{option} {folder}"
    if folder.exists() and not folder.is_dir():
        raise OutDirError(f"{where}: exists and is a file, not a folder; choose another {option}")
    for parent in folder.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutDirError(f"{where}: {parent} is a file, so no folder can be created under it")
            break
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutDirError(f"{where}: cannot create the folder ({exc.strerror or exc})") from None
    elif not folder.is_dir():
        raise OutDirError(f"{where}: no such folder")
    # os.access answers for the real uid and says yes to root on a read-only (chmod) folder, and never knows
    # about read-only mounts: only writing a file tells the truth.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutDirError(f"{where}: not writable (permission denied)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ctuq-write-probe-", dir=folder)
    except OSError as exc:
        raise OutDirError(f"{where}: not writable ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    return folder


def prepare_out_dir(out_dir: str | os.PathLike, *, resume: bool = False, option: str = "--out") -> Path:
    """The output folder of a new (or, with ``resume``, a continued) run: checked, created and writable.

    Raises :class:`~ctuq.errors.OutDirError` as :func:`check_writable_folder` does, and when ``out_dir`` already
    holds a finished run and ``resume`` is false (a new run would overwrite it).
    """
    out_dir = Path(out_dir)
    if not resume and out_dir.is_dir() and is_finished_run(out_dir):
        raise OutDirError(
            f"{option} {out_dir}: already holds a finished run ({METRICS_NAME}); choose another "
            f"{option} or pass --resume"
        )
    return check_writable_folder(out_dir, option=option)


def require_run_folder(run_dir: str | os.PathLike, *, option: str = "RUN_DIR") -> Path:
    """The ``config.yaml`` of the existing, writable run folder ``run_dir`` (what ``ctuq uq`` reruns).

    Raises :class:`~ctuq.errors.OutDirError` naming the folder when it or its config is missing or when it is
    not writable.
    """
    run_dir = Path(run_dir)
    config = run_dir / CONFIG_NAME
    if not config.is_file():
        raise OutDirError(f"{config}: does not exist; {option} must be a folder written by `ctuq reconstruct`")
    check_writable_folder(run_dir, option=option, create=False)
    return config


@contextlib.contextmanager
def discard_if_empty(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Run the block (a command writing the run folder ``out_dir``); when it is refused (a user error, e.g. a bad scan
    or a setting the scan cannot give) before it wrote anything but the run's own bookkeeping (``config.yaml``,
    ``ctuq.log``, the lock files), remove what this invocation created of those, and the folder itself when it
    created it: a refused run leaves nothing behind. A run that wrote a result or a checkpoint keeps everything
    (``--resume`` continues it), and so does one that failed for other reasons (a full disk: its earlier files stay
    as they were; a folder another process holds: nothing of it is touched); files that were there before are
    never removed. The exception propagates."""
    out_dir = Path(out_dir)
    existed = out_dir.exists()
    before = {p.name for p in out_dir.iterdir()} if out_dir.is_dir() else set()
    try:
        yield out_dir
    except BaseException as exc:
        refused = is_user_error(exc) and not isinstance(exc, (RunFolderLocked, DiskFullError))
        if refused and out_dir.is_dir():
            now = {p.name for p in out_dir.iterdir()}
            bookkeeping = {CONFIG_NAME, LOG_NAME, ".ctuq.lock", ".ctuq.lock.json"}
            if now - before <= bookkeeping:
                for name in now - before:
                    with contextlib.suppress(OSError):
                        (out_dir / name).unlink()
                if not existed:
                    with contextlib.suppress(OSError):
                        out_dir.rmdir()
        raise


def new_run_dir(root: str | os.PathLike = "runs") -> Path:
    """A fresh folder ``root/<YYYYmmdd-HHMMSS>[-N]`` (created; ``-N`` appended if the second is taken)."""
    root = Path(root)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


def new_run_folder(root: str | os.PathLike = "runs") -> Path:
    """A fresh ``root/<YYYYmmdd-HHMMSS>[-N]`` (created) under the checked, writable ``root``."""
    return new_run_dir(check_writable_folder(root, option="run folder root"))
