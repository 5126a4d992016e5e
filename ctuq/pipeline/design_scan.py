"""The scan and the pilot of a ``ctuq design`` run (:mod:`ctuq.pipeline.design`): the candidate angles, the pilot's
reconstructions, the design's prior and engine on them, and the reconstructions from a set of angles.

Two typed objects pass on to the run's later steps: :class:`DesignScan` (the scan, its candidate angles and the
pilot, from :func:`load_candidates`) and :class:`PilotPrior` (the pilot reconstruction, the prior and the design
engine on it, from :func:`pilot_prior`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ctuq.design.candidates import DesignError, check_design_sizes, equidistant_indices, match_angles
from ctuq.design.dip_prior import DIPPrior
from ctuq.design.engine import DesignEngine, auto_route
from ctuq.design.priors import isotropic_model, matern_model
from ctuq.options import DesignPriorKind, DesignRoute
from ctuq.outputs import read_tiff
from ctuq.pipeline import run_folder as rf
from ctuq.pipeline.phases import Phase, RunState, phase_dip, phase_fbp, phase_restore_dip, phase_tv, phase_write
from ctuq.pipeline.runner import run_phases
from ctuq.pipeline.scan import load_scan

if TYPE_CHECKING:
    from ctuq.data.problem import CTData
    from ctuq.operators.base import RayTransform

__all__ = [
    "DesignScan",
    "PilotPrior",
    "load_candidates",
    "pilot_prior",
    "read_angles_file",
    "read_metrics",
    "reconstruct_angles",
    "rmse_inside",
    "WORK_DIR",
]

WORK_DIR = "work"

# the runner's logger, as before these steps moved here: a filter on ctuq design's records still gets theirs
_logger = logging.getLogger("ctuq.pipeline.design")


def _log(msg: str) -> None:
    _logger.info(msg)


def read_angles_file(path) -> np.ndarray:
    """Angles in degrees from a text file (one per line or whitespace-separated, ``#`` comments) or ``.npy``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--pilot-angles {path}: no such file")
    try:
        if path.suffix == ".npy":
            values = np.load(path).astype(np.float64).ravel()
        else:
            lines = [ln.split("#", 1)[0] for ln in path.read_text().splitlines()]
            values = np.array([float(v) for ln in lines for v in ln.split()], dtype=np.float64)
    except (ValueError, OSError) as exc:
        raise DesignError(f"--pilot-angles {path}: not a list of angles in degrees ({exc})") from None
    if values.size == 0:
        raise DesignError(f"--pilot-angles {path}: holds no angles")
    return values


def read_metrics(path: Path) -> dict:
    """A finished reconstruction's ``metrics.json``, or a :class:`DesignError` naming it (and how to recover)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DesignError(f"{path} could not be read as JSON ({exc}); delete it to recompute that part") from exc


def reconstruct_angles(cfg, folder: Path, op, y, gt, device, progress: bool, *, need_model: bool):
    """A run folder of FBP/TV/DIP from ``op``/``y`` (the pipeline's phases); reused when already finished."""
    folder.mkdir(parents=True, exist_ok=True)
    state = RunState(
        cfg=cfg,
        out_dir=folder,
        device=device,
        resume=(folder / rf.CHECKPOINT_NAME).is_file(),
        uq=False,
        progress=progress,
        command="design",
    )
    state.op, state.y, state.ground_truth = op, y.to(device), None if gt is None else gt.to(device)
    state.metrics["data"] = {
        "angles_deg": np.degrees(op.angles).tolist(),
        "measurement_shape": list(op.measurement_shape),
    }
    if rf.is_finished_run(folder):
        if need_model:
            run_phases(state, [Phase("restore_dip", phase_restore_dip)])
        return state, read_metrics(folder / rf.METRICS_NAME)
    phases = [Phase("fbp", phase_fbp)] + ([Phase("tv", phase_tv)] if cfg.tv.enabled else [])
    run_phases(state, phases + [Phase("dip", phase_dip), Phase("write", phase_write)])
    return state, read_metrics(folder / rf.METRICS_NAME)


@dataclasses.dataclass
class DesignScan:
    """The scan of one design, its candidate angles and the pilot (:func:`load_candidates`).

    Attributes
    ----------
    data : CTData
        The loaded scan (``op``, ``y`` in data units, ``ground_truth`` in mm⁻¹ or ``None``).
    path : Path
        Where it was loaded from.
    device : torch.device
        Where it lives and the reconstructions and the design compute.
    period : float
        The angular period (rad): π for parallel beam, else 2π.
    cand_idx : np.ndarray
        ``(n,)`` scan indices of the candidate angles (``design.candidates`` equidistant ones, or all).
    cand_deg : np.ndarray
        ``(n,)`` the candidates' angles in degrees, in ``[0, period)``.
    pilot : list of int
        The pilot's candidate indices.
    cand_op : RayTransform
        The ray transform of the candidates.
    y_cand : torch.Tensor
        ``(n, …)`` the candidates' measurements (data units).
    """

    data: CTData
    path: Path
    device: torch.device
    period: float
    cand_idx: np.ndarray
    cand_deg: np.ndarray
    pilot: list[int]
    cand_op: RayTransform
    y_cand: torch.Tensor

    @property
    def gt(self) -> torch.Tensor | None:
        """The scan's ground truth (image shape, mm⁻¹), or ``None``."""
        return self.data.ground_truth

    def degrees(self, candidates) -> list[float]:
        """The angles (degrees) of the candidate indices ``candidates``, in their order."""
        return self.cand_deg[candidates].tolist()


@dataclasses.dataclass
class PilotPrior:
    """The pilot reconstruction and the design's prior and engine built on it (:func:`pilot_prior`).

    Attributes
    ----------
    state : RunState
        The pilot run folder's state (its images; with ``design.prior = dip`` the fitted network).
    metrics : dict
        The pilot run's ``metrics.json``.
    prior : DIPPrior or None
        The linearised-DIP prior (``design.prior = dip``), else ``None``.
    updater : callable or None
        The prior's update after an acquisition (refresh / retrain), else ``None``.
    route : str
        The design engine's route (``design.route``, ``auto`` resolved).
    engine : DesignEngine
        The engine over the prior's design model.
    fingerprint : dict
        The design checkpoint's fingerprint: the scan, candidates, settings and the prior's ``a``, ``σ²`` at the pilot.
    seconds : float
        Time to build the prior and the engine (``design.json["timings"]["prior_s"]``).
    """

    state: RunState
    metrics: dict
    prior: DIPPrior | None
    updater: Callable | None
    route: str
    engine: DesignEngine
    fingerprint: dict
    seconds: float


def _prior_model(cfg, scan: DesignScan, pilot_state: RunState, work: Path, progress: bool):
    """``(DesignModel, updater, DIPPrior or None)`` of the image prior ``design.prior`` at the pilot."""
    ds, scale = cfg.design, float(cfg.dip.scale)
    cand_op, y_cand, pilot = scan.cand_op, scan.y_cand, scan.pilot
    nv = ds.noise_variance
    if ds.prior == DesignPriorKind.DIP:
        prior = DIPPrior(
            pilot_state.model,
            pilot_state.net_input,
            cand_op,
            y_cand,
            scale,
            settings=ds,
            sigma2=None if nv is None else nv * scale**2,
            dip_settings=cfg.dip,
            work_dir=work,
            seed=cfg.seed,
            progress=progress,
            log=_log,
        )
        return prior.build(pilot, n_steps=ds.acquire), prior.updater, prior
    if nv is None:  # the pilot DIP's mean squared residual, data units
        op_p = cand_op.subset(pilot)
        r = op_p.forward_flat(pilot_state.images["dip"].reshape(1, -1).to(op_p.dtype)) - y_cand[pilot].reshape(1, -1)
        nv = float(r.double().pow(2).mean())
    y_p = y_cand[pilot].reshape(-1).double()
    if ds.prior == DesignPriorKind.ISOTROPIC:
        return isotropic_model(cand_op, pilot, y_p, nv, prior_scale=ds.prior_scale), None, None
    model = matern_model(
        cand_op, pilot, y_p, nv, lengthscales=ds.matern_lengthscales, prior_scale=ds.prior_scale, log=_log
    )
    return model, None, None


def load_candidates(cfg, device, pilot_angles, progress: bool, out: Path) -> DesignScan:
    """The scan (no held-out rows), its candidate angles (``design.candidates``) and the pilot (``--pilot-angles``
    matched to the candidates, or ``design.pilot`` equidistant ones), after checking their sizes."""
    ds = cfg.design
    data, scan_path, warnings = load_scan(cfg, device, progress=progress, heldout=False, run_dir=out)
    for w in warnings:
        _logger.warning(w)
    op = data.op
    n_scan = op.n_angles
    period = math.pi if op.geometry is not None and op.geometry.is_parallel else 2 * math.pi
    if ds.candidates is not None and ds.candidates > n_scan:
        raise DesignError(f"--candidates: {ds.candidates} candidate angles but the scan {scan_path} has {n_scan}")
    cand_idx = np.arange(n_scan) if ds.candidates is None else equidistant_indices(n_scan, ds.candidates)
    cand_deg = np.mod(np.degrees(op.angles[cand_idx]), math.degrees(period))
    if pilot_angles is not None:
        match_angles(pilot_angles, op.angles, period, what="--pilot-angles (the scan's angles)")
        pilot = match_angles(pilot_angles, op.angles[cand_idx], period, what="--pilot-angles").tolist()
    else:
        check_design_sizes(len(cand_idx), ds.pilot, ds.acquire)
        pilot = equidistant_indices(len(cand_idx), ds.pilot).tolist()
    check_design_sizes(len(cand_idx), len(pilot), ds.acquire)
    cand_op = op if ds.candidates is None else op.subset(cand_idx)
    y_cand = data.y[torch.as_tensor(cand_idx)]
    _log(
        f"{scan_path}: {n_scan} angles × {op.measurement_shape[1]} detector pixels; {len(cand_idx)} candidates, "
        f"pilot {len(pilot)}, acquiring {ds.acquire} ({ds.criterion}, prior {ds.prior})"
    )
    return DesignScan(data, scan_path, device, period, cand_idx, cand_deg, pilot, cand_op, y_cand)


def pilot_prior(cfg, out: Path, scan: DesignScan, progress: bool) -> PilotPrior:
    """The pilot's reconstructions (``pilot/``, reused when finished), the prior ``design.prior`` on them and the
    design engine over it (``design.route``; ``auto``: :func:`ctuq.design.engine.auto_route`)."""
    ds, pilot = cfg.design, scan.pilot
    pilot_state, pilot_metrics = reconstruct_angles(
        cfg,
        out / "pilot",
        scan.cand_op.subset(pilot),
        scan.y_cand[pilot],
        scan.gt,
        scan.device,
        progress,
        need_model=True,
    )
    t0 = time.perf_counter()
    model, updater, prior = _prior_model(cfg, scan, pilot_state, out / WORK_DIR, progress)
    refreshed = updater is not None and bool(ds.refresh_every or ds.retrain_every)
    route = auto_route(model, refreshed) if ds.route == DesignRoute.AUTO else ds.route
    engine = DesignEngine(model, route=route, n_samples=ds.samples, seed=cfg.seed, sample_chunk=ds.sample_chunk)
    seconds = time.perf_counter() - t0
    fingerprint = {
        "scan": str(scan.path),
        "y_sum": float(scan.data.y.double().sum()),
        "candidates": scan.cand_idx.tolist(),
        "prior": ds.prior,
        "route": route,
        "samples": ds.samples,
        "jitter": ds.jitter,
        "refresh_every": ds.refresh_every,
        "retrain_every": ds.retrain_every,
        "seed": cfg.seed,
        "sigma2": float(model.sigma2),
        "a": float(model.a),
    }
    return PilotPrior(pilot_state, pilot_metrics, prior, updater, route, engine, fingerprint, seconds)


def rmse_inside(folder: Path, truth, mask) -> dict:
    """RMS error (mm⁻¹) inside ``mask`` (image shape, 0/1) of each reconstruction of the run folder ``folder``
    (``fbp``, ``tv``, ``dip``, those present) against ``truth`` (image shape, mm⁻¹; torch or numpy)."""
    mask = np.asarray(mask) > 0
    truth = truth.detach().cpu().double().numpy() if isinstance(truth, torch.Tensor) else np.asarray(truth, np.float64)
    truth = truth.reshape(mask.shape)
    out = {}
    for name, file in (("fbp", rf.FBP_NAME), ("tv", rf.TV_NAME), ("dip", rf.RECONSTRUCTION_NAME)):
        if (folder / file).is_file():
            x, _ = read_tiff(folder / file)
            out[name] = float(np.sqrt(np.mean((np.asarray(x, np.float64).reshape(mask.shape) - truth)[mask] ** 2)))
    return out
