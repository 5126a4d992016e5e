"""Pieces every ctuq study needs: the study folder and its options check, the scan, the exact-reference decision.

A study folder ``OUT`` holds ``study.json`` (the options that change numbers, see :func:`study_fingerprint` and
:func:`check_study_folder`), the scan when it is simulated (``OUT/scan``, :func:`prepare_scan`), and per setting
a folder (:func:`setting_dir`) with the study's run folders: its fits and inferences are calls of the public API
(:func:`ctuq.reconstruct`, :func:`ctuq.uncertainty` with ``resume=True, reuse=True``), whose run folders resume
after a kill and are loaded once finished. Everything a study writes is written atomically, so a killed run
leaves either a finished part or none, and a rerun of the same command resumes where it stopped.

A study's options are one frozen dataclass (:mod:`ctuq.studies.study_options`); a function here that takes
``options`` names the attributes it reads, so any study whose options have them can use it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ctuq.data import simulate_scan
from ctuq.data.walnut import SIDECAR_NAME
from ctuq.design.candidates import equidistant_indices
from ctuq.errors import CTUQError
from ctuq.inference import Workload, estimate_solver_costs
from ctuq.log import ensure_console_logging
from ctuq.memory import GIB, Budget, memory_budget
from ctuq.pipeline.design_scan import rmse_inside
from ctuq.pipeline.lock import hold_until_exit
from ctuq.run import reconstruct
from ctuq.utils import atomic_write_json, json_digest

__all__ = [
    "NEUTRAL_OPTIONS",
    "StudyError",
    "Log",
    "read_json",
    "study_fingerprint",
    "check_study_folder",
    "prepare_scan",
    "angular_subsampling",
    "exact_decision",
    "setting_dir",
    "reconstruct_protocols",
]

_log = logging.getLogger(__name__)

# Options that do not change the numbers of any study: a rerun may change them freely.
NEUTRAL_OPTIONS = frozenset({"device", "progress", "tiny", "threads"})


class StudyError(CTUQError, RuntimeError):
    """Bad input or an output folder that belongs to another study; the message says what and where (a user
    error, :mod:`ctuq.errors`; also a ``RuntimeError``, as it was before)."""


class Log:
    """Timestamped one-line messages (the progress output of a study), logged at INFO (:mod:`ctuq.log`; a study
    folder's ``ctuq.log`` gets them while :func:`ctuq.log.run_log` is open).

    Creating one turns on the terminal handler of :mod:`ctuq.log` if nothing did (the study scripts do not go
    through :func:`ctuq.cli.main`).

    Parameters
    ----------
    name : str
        Prefix of every terminal line (the study's script name), e.g. ``"walnut_study"`` gives
        ``[walnut_study    12.3 s] message``; the time is counted from the creation of the logger.
    """

    def __init__(self, name: str = "study") -> None:
        self.name = name
        self.t0 = time.perf_counter()
        ensure_console_logging()

    def __call__(self, msg: str) -> None:
        elapsed = time.perf_counter() - self.t0
        _log.info(msg, extra={"console_prefix": f"[{self.name} {elapsed:7.1f} s] "})


def read_json(path: Path) -> dict:
    """The JSON file ``path``, or a :class:`StudyError` naming it (and how to recover) if it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StudyError(f"{path} could not be read as JSON ({exc}); delete it to recompute that part") from exc


def study_fingerprint(opts: dict, data: str, neutral: Iterable[str] = NEUTRAL_OPTIONS) -> dict:
    """The options that identify a study: ``opts`` without the ``neutral`` ones, plus the scan.

    Parameters
    ----------
    opts : dict
        The study's resolved options (plain JSON values).
    data : str
        What the scan is: the resolved ``--data`` folder, or ``"simulated"``.
    neutral : iterable of str
        Options that do not change the numbers (device, threads, progress, batch sizes, ...).

    Returns
    -------
    dict
        ``opts`` in its own key order without ``neutral``, with ``"data"`` added; recorded in ``study.json``.
    """
    neutral = set(neutral)
    fp = {k: v for k, v in opts.items() if k not in neutral}
    fp["data"] = data
    return fp


def _study_options(path: Path) -> dict:
    """The options recorded in the ``study.json`` at ``path``, after checking them against their digest
    (:class:`StudyError` naming the file when it is not a study record or was edited)."""
    rec = read_json(path)
    options = rec.get("options") if isinstance(rec, dict) else None
    if not isinstance(options, dict):
        raise StudyError(f"{path}: not a ctuq study record (no options); use another --out, or delete the folder")
    if rec.get("sha256") != json_digest(options):
        raise StudyError(
            f"{path}: its options do not match their digest (the file was edited or damaged), so the results in "
            f"{path.parent} cannot be told apart from another study's; restore it, or use another --out"
        )
    return options


def check_study_folder(out: Path, fingerprint: dict, log: Log, growable: Iterable[str] = ("settings",)) -> None:
    """Take the study folder's lock, then create ``out/study.json``, or check that the existing one holds the same
    options.

    The lock (:mod:`ctuq.pipeline.lock`) is held until the process ends: a second process on ``out`` is refused
    before it changes anything. ``study.json`` records the SHA-256 of its options, so a file edited by hand is
    refused rather than resumed.

    Parameters
    ----------
    out : Path
        The study folder (must exist).
    fingerprint : dict
        :func:`study_fingerprint` of this run.
    log : Log
        Says when an earlier study is resumed.
    growable : iterable of str
        List-valued options that a rerun may extend (e.g. more angle counts in ``settings``): they are exempt
        from the check, and ``study.json`` records the union of the old and new values.

    Raises
    ------
    RunFolderLocked
        Another process is running a study in ``out`` (the message names its PID).
    StudyError
        ``study.json`` holds other options (the message lists each one, there and now), is unreadable, or does
        not match its digest.
    """
    growable = tuple(growable)
    path = out / "study.json"
    hold_until_exit(out)
    if path.is_file():
        saved = _study_options(path)
        diff = sorted(
            k for k in set(saved) | set(fingerprint) if k not in growable and saved.get(k) != fingerprint.get(k)
        )
        if diff:
            details = ", ".join(f"{k}: {saved.get(k)!r} there, {fingerprint.get(k)!r} now" for k in diff)
            raise StudyError(
                f"{out} holds a study with other options ({details}); use another --out, or the same "
                f"options to resume it"
            )
        log(f"resuming the study in {out} (finished parts are skipped)")
        fingerprint = dict(
            fingerprint,
            **{k: sorted(set(saved.get(k, [])) | set(fingerprint[k])) for k in growable if k in fingerprint},
        )
    atomic_write_json(path, {"options": fingerprint, "sha256": json_digest(fingerprint)})


def prepare_scan(options, data: str | None, out: Path, log: Log) -> Path:
    """The scan folder of a study: ``--data`` as given, or a simulated scan in ``out/scan``.

    Parameters
    ----------
    options : study options
        Reads ``scan_preset`` (the :func:`ctuq.data.simulate_scan` preset) and ``progress``.
    data : str or None
        The ``--data`` folder (a ``Walnut{id}`` folder, real or simulated); ``None`` simulates one.
    out : Path
        The study folder; the simulation goes to ``out/scan`` and is reused when a complete simulation of the
        same preset is there (an incomplete one or another preset is overwritten).
    log : Log
        Says whether the scan is simulated or reused.

    Returns
    -------
    Path
        The scan folder.

    Raises
    ------
    StudyError
        ``data`` is not a folder.
    """
    if data is not None:
        path = Path(data).expanduser()
        if not path.is_dir():
            raise StudyError(
                f"--data {data!r} is not a folder (a Walnut{{id}} folder with Projections/ and "
                f"Reconstructions/ is needed)"
            )
        return path
    path = out / "scan"
    sidecar = path / SIDECAR_NAME
    if sidecar.is_file():
        info = read_json(sidecar)
        if info.get("complete") and info.get("preset") == options.scan_preset:
            log(f"reusing the simulated scan {path} (preset {options.scan_preset})")
            return path
    log(f"simulating a walnut scan (preset {options.scan_preset}) into {path}")
    t0 = time.perf_counter()
    simulate_scan(path, preset=options.scan_preset, overwrite=sidecar.is_file(), progress=options.progress)
    log(f"simulated the scan in {time.perf_counter() - t0:.1f} s")
    return path


def angular_subsampling(n_files: int, n_angles: int, path: Path) -> int:
    """Angular subsampling factor that leaves ``n_angles`` of a scan's distinct angles.

    Parameters
    ----------
    n_files : int
        Projection files of the scan; the last one repeats the first angle, so ``n_files − 1`` are distinct.
    n_angles : int
        Wanted angle count.
    path : Path
        The scan (named in the error message).

    Returns
    -------
    int
        ``(n_files − 1) / n_angles``.

    Raises
    ------
    StudyError
        ``n_angles`` does not divide the number of distinct angles (the message lists the valid counts).
    """
    distinct = n_files - 1
    if n_angles > distinct or distinct % n_angles:
        valid = [k for k in range(1, distinct + 1) if distinct % k == 0]
        raise StudyError(
            f"--settings: {n_angles} angles cannot be taken evenly from the {distinct} distinct angles of "
            f"{path} ({n_files} projection files); valid angle counts: {valid}"
        )
    return distinct // n_angles


def exact_decision(mode: str, c: int, d: int, options, device: torch.device) -> tuple[bool, str]:
    """Whether to run the exact linearised inference (``solver="exact"``), and why.

    Parameters
    ----------
    mode : {"auto", "always", "never"}
        ``auto`` runs it when the exact solver's memory estimate (:func:`ctuq.inference.estimate_solver_costs`)
        fits the :data:`~ctuq.memory.Budget.STUDY_EXACT` budget of ``device`` (half the free memory: CUDA's free
        device memory, or the host's available physical memory; 4 GiB when unknown).
    c, d : int
        Number of measurements and of linearised (convolution) weights.
    options : study options
        Reads ``exact_em_steps``, ``em_samples``, ``exact_samples`` and ``rank`` (the exact workload).
    device : torch.device
        Where the inference would run.

    Returns
    -------
    (bool, str)
        The decision and a one-line reason (the route and its memory against the budget, in GiB).
    """
    if mode == "never":
        return False, "--exact never"
    if mode == "always":
        return True, "--exact always"

    budget = memory_budget(Budget.STUDY_EXACT, device)
    wl = Workload(
        em_steps=options.exact_em_steps,
        em_samples=options.em_samples,
        prediction_samples=options.exact_samples,
        rank=options.rank,
    )
    est = estimate_solver_costs(c, d, wl, memory_budget=budget, itemsize=4)["exact"]
    route = "dense TΦ (d < c)" if d < c else "c × c eigendecomposition"
    verdict = f"{route} needs ≈{est.memory_bytes / GIB:.2f} GiB of a {budget / GIB:.1f} GiB budget"
    return bool(est.feasible), verdict


def setting_dir(out: Path, n_angles: int) -> Path:
    """The folder of one angle-count setting in the study folder ``out``: ``out/angles_<n_angles>``."""
    return out / f"angles_{n_angles}"


def reconstruct_protocols(
    whole, cand: np.ndarray, orders: dict, counts, *, sets: list[str], options, out: Path, mask, log: Log, name: str
) -> dict[str, dict[int, dict]]:
    """FBP, TV and the DIP from the first ``n`` angles of each protocol, for every ``n`` of ``counts``.

    Parameters
    ----------
    whole : Scan
        The whole scan (:func:`ctuq.load_scan`); a protocol's ``n`` angles are ``whole.subset(cand[idx])``, the
        rest of the scan held out.
    cand : np.ndarray
        ``(n_cand,)`` scan indices of the design's candidate angles.
    orders : dict
        Protocol name → its candidate indices in acquisition order (the first ``n`` are taken), or ``None`` for
        ``n`` equidistant candidates (not nested across counts).
    sets : list of str
        The config overrides of every reconstruction (``KEY=VALUE``).
    options
        Reads ``config`` and ``progress``.
    out : Path
        Run folders go to ``out/<protocol>_<n:03d>`` (resumed, reused when finished).
    mask : array
        Image-shaped object mask of the RMS errors (:func:`ctuq.pipeline.design_scan.rmse_inside`).

    Returns
    -------
    dict
        ``{protocol: {n: {"rmse": {method: mm⁻¹}, "psnr": {method: dB}, "angles_deg": [...], "scan_indices":
        [...]}}}`` (the angles in degrees and as indices into ``whole.angles``); the same set of angles (the pilot,
        shared by all protocols) is reconstructed once.
    """
    actual: dict = {p: {} for p in orders}
    done: dict[tuple, dict] = {}
    for n in counts:
        for protocol, order in orders.items():
            idx = sorted(equidistant_indices(len(cand), n).tolist() if order is None else order[:n])
            if tuple(idx) not in done:
                run = reconstruct(
                    whole.subset(cand[idx]),
                    config=options.config,
                    set=sets,
                    out=out / f"{protocol}_{n:03d}",
                    uq=False,
                    resume=True,
                    reuse=True,
                    progress=options.progress,
                )
                if not run.reused:
                    log(f"{name}: FBP, TV and DIP from {n} {protocol} angles")
                done[tuple(idx)] = {
                    "rmse": rmse_inside(run.path, run.ground_truth, mask),
                    "psnr": {k: float(v) for k, v in run.metrics["psnr"].items()},
                    "angles_deg": [float(a) for a in whole.angles[cand[idx]]],
                    "scan_indices": [int(i) for i in cand[idx]],
                }
            actual[protocol][n] = done[tuple(idx)]
    return actual
