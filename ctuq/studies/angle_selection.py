"""The synthetic angle-selection study (Barbano et al. 2022; Antorán's thesis §7.6) behind
``scripts/angle_selection.py``: which angles to scan after a 5-angle pilot, per image, with each strategy, and how
well TV and the DIP reconstruct from them.

Per image (rectangles phantoms, :mod:`ctuq.data.rectangles`, or the user's stack): parallel beam, ``candidates``
angles in ``[0°, 180°)``, ``k = ⌈√2·size⌉ + 1`` detector pixels, noise std ``noise × mean|Tx|`` (one draw of the
whole candidate sinogram per image; the continuous equidistant sets get their own draws). The pilot DIP is fitted
once per image on the pilot angles (candidate indices ``0, n/5, …``). Strategies (:data:`STUDY_STRATEGIES`;
not the design's own ``ctuq.design.STRATEGIES``):

* ``equidistant``: ``n`` angles spread evenly over ``[0°, 180°)`` for each count ``n`` (not tied to the grid);
* ``equidistant_grid``: the candidate-grid version the authors used, at the counts that divide the grid;
* ``random``: the pilot, then uniformly random candidates;
* ``isotropic``, ``matern``: greedy EIG with ``K = I/a`` / Matérn-½ (``ℓ`` and ``a`` by exact pilot evidence);
* ``dip_eig``, ``dip_ese``: greedy EIG / ESE with the linearised DIP (g-prior and ``a`` refreshed every 5 angles);
* ``dip_eig_retrain``, ``dip_ese_retrain``: the same, retraining the DIP (warm start) every 5 angles.

Every ``every`` angles (5, 10, …, pilot + acquire) the angles chosen so far are reconstructed with TV (PDHG) and the
DIP (warm-started from the pilot DIP), recording the PSNR after the fixed iteration budget and — as the authors
reported — the best PSNR over the iterations (an *oracle*: it looks at the ground truth).

Everything runs through the public API on :class:`ctuq.Scan` objects made from the study's arrays
(:meth:`ctuq.Scan.from_astra` with the operator's geometry in ctuq's convention, so the runs' operator is the study's
matrix bit for bit): the pilot DIP and every reconstruction are :func:`ctuq.reconstruct` run folders (the warm start
is ``model.pretrained``, the oracle ``output.psnr_trace``), the greedy strategies :func:`ctuq.design_angles` design
folders (``design.forecast = false``, ``design.noise_variance`` the study's σ², ``design.retrain_lr`` the warm-start
rate). Their one resume mechanism is the API's: a rerun loads every finished folder (``reuse``) and continues an
interrupted one from its checkpoints (``resume``); ``result.json`` per (image, strategy) summarises them. A rerun with
a reconstruction method more (``--recon tv dip`` on a TV-only study) adds its runs at the same angles and data, without
redoing the designs.
Tables and figures: :mod:`ctuq.studies.angle_selection_report`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from pathlib import Path

import numpy as np
import tifffile
import torch

from ctuq.config import Config
from ctuq.data.astra_geometry import from_astra
from ctuq.data.rectangles import parallel_geometry, rectangles_stack
from ctuq.design.candidates import equidistant_angles, equidistant_indices, random_indices
from ctuq.geometry import astra_geometries
from ctuq.metrics import psnr
from ctuq.operators import SparseRayTransform
from ctuq.options import Criterion
from ctuq.pipeline import run_folder as rf
from ctuq.run import design_angles, reconstruct
from ctuq.scan import Scan
from ctuq.studies.common import Log, StudyError
from ctuq.studies.study_options import freeze, option
from ctuq.utils import atomic_write_json

__all__ = ["STUDY_STRATEGIES", "AngleSelectionOptions", "DEFAULTS", "TINY", "NEUTRAL", "load_images", "run_image"]

STUDY_STRATEGIES = (
    "equidistant",
    "equidistant_grid",
    "random",
    "isotropic",
    "matern",
    "dip_eig",
    "dip_ese",
    "dip_eig_retrain",
    "dip_ese_retrain",
)


@dataclasses.dataclass(frozen=True)
class AngleSelectionOptions:
    """The options of one angle-selection study (``scripts/angle_selection.py`` builds them from its flags:
    explicit flags, then ``--tiny`` (:data:`TINY`), then these defaults (:data:`DEFAULTS`)). Every field but
    :data:`NEUTRAL` changes numbers, so ``study.json`` records them and a rerun in the same folder must keep them
    (``recon`` may grow)."""

    images: int = option(30, help="number of images")
    images_file: str | None = option(None, help=".npy or TIFF stack (N, H, W), H = W: own phantoms")
    size: int = option(128, help="image side of the generated phantoms")
    orientation_mean: float | None = option(
        None, help="fix every image's preferential angle (degrees; None: U(0, 180) per image)"
    )
    orientation_std: float = option(2.86, help="rectangles' spread around it (degrees)")
    noise: float = option(0.05, help="noise std as a fraction of mean |Tx|")
    candidates: int = option(200, help="candidate angles in [0°, 180°)")
    pilot: int = option(5, help="pilot angles")
    acquire: int = option(35, help="acquisitions")
    every: int = option(5, help="reconstruct every this many angles")
    samples: int = option(3000, help="m, samples per step of the DIP designs")
    strategies: tuple[str, ...] = option(STUDY_STRATEGIES, help="strategies to run")
    recon: tuple[str, ...] = option(("tv", "dip"), help="reconstructions: tv, dip")
    jitter: float = option(0.01, help="criteria jitter")
    refresh_every: int = option(5, help="DIP g-prior refresh")
    retrain_every: int = option(5, help="retraining period of *_retrain")
    retrain_iterations: int = option(300, help="iterations of one retraining")
    preset: str = option("tiny", help="U-Net preset")
    iterations: int = option(2000, help="pilot DIP iterations")
    lr: float = option(3e-3, help="pilot DIP learning rate")
    tv_weight: float = option(1e-6, help="DIP TV weight")
    clip_grad_norm: float = option(1.0, help="DIP gradient clip (0: none)")
    scale: float = option(1.0, help="DIP data/image scale")
    input_std: float = option(0.1, help="DIP input std")
    warm_iterations: int = option(500, help="iterations of each warm-started DIP reconstruction")
    warm_lr: float = option(1e-3, help="their learning rate")
    tv_lambda: float = option(0.003, help="TV reconstruction weight λ")
    tv_iterations: int = option(300, help="PDHG iterations")
    seed: int = option(0, help="seed of phantoms, noise, networks, samples")
    device: str = option("cpu", help="auto, cpu or cuda")
    threads: int | None = option(None, help="torch CPU threads (None: unchanged)")
    tiny: bool = option(False, help="the test size (TINY)")
    progress: bool = option(True, help="progress bars")

    def __post_init__(self) -> None:
        freeze(self)

    def validate(self) -> None:
        """One-line :class:`~ctuq.studies.StudyError` for an invalid option (named as its command-line flag)."""

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise StudyError(what)

        for key in (
            "images",
            "size",
            "candidates",
            "pilot",
            "acquire",
            "every",
            "samples",
            "iterations",
            "warm_iterations",
            "tv_iterations",
            "retrain_iterations",
        ):
            need(getattr(self, key) >= 1, f"--{key.replace('_', '-')} must be >= 1, got {getattr(self, key)}")
        need(
            self.pilot + self.acquire <= self.candidates,
            f"--acquire: pilot {self.pilot} + {self.acquire} exceed the {self.candidates} candidates",
        )
        need(self.noise > 0 and math.isfinite(self.noise), f"--noise must be positive, got {self.noise}")
        need(self.orientation_std >= 0, f"--orientation-std must be >= 0, got {self.orientation_std}")
        need(len(self.strategies) == len(set(self.strategies)), "--strategies: repeated strategy")
        bad = [s for s in self.strategies if s not in STUDY_STRATEGIES]
        need(not bad, f"--strategies {' '.join(bad)}: each must be one of {', '.join(STUDY_STRATEGIES)}")
        bad = [m for m in self.recon if m not in ("tv", "dip")]
        need(not bad, f"--recon {' '.join(bad)}: each must be tv or dip")


DEFAULTS = AngleSelectionOptions()
# DIP and TV weights tuned on image 0 (equidistant 10/20/40 angles): TV λ 0.003 beat 0.001/0.01/0.03/0.1 at every
# count (29.5/33.2/34.7 dB); DIP TV weight 1e-6 beat 1e-5 and 1e-7 (pilot 26.1 dB after 1000 iterations, 1e-4 left
# the DIP at 19.5 dB whatever the angles: the summed TV outweighed the mean squared data term).
# --tiny: the CI size.
TINY = dataclasses.replace(
    DEFAULTS,
    images=2,
    size=24,
    candidates=20,
    pilot=4,
    acquire=4,
    every=2,
    samples=64,
    retrain_iterations=10,
    iterations=40,
    warm_iterations=10,
    tv_iterations=20,
    refresh_every=2,
    retrain_every=2,
    tiny=True,
)
# More images or strategies may be added to a study folder; everything else changes the numbers.
NEUTRAL = frozenset({"device", "progress", "tiny", "threads", "images", "strategies"})


def load_images(options: AngleSelectionOptions, with_angles: bool = False):
    """``(N, H, H)`` float32 ground truths: the rectangles generator, or ``images_file`` (``.npy`` / TIFF stack).

    ``with_angles``: return ``(images, φ)`` with the generated phantoms' preferential angles ``(N,)`` in degrees
    (``None`` for an ``images_file``)."""
    if options.images_file:
        path = Path(options.images_file)
        if not path.is_file():
            raise StudyError(f"--images-file {path}: no such file")
        try:
            if path.suffix == ".npy":
                stack = np.load(path)
            else:
                stack = tifffile.imread(path)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the file
            raise StudyError(f"--images-file {path}: cannot be read as .npy or TIFF ({exc})") from None
        stack = np.asarray(stack, dtype=np.float32)
        if stack.ndim == 2:
            stack = stack[None]
        if stack.ndim != 3 or stack.shape[1] != stack.shape[2] or not np.isfinite(stack).all():
            raise StudyError(f"--images-file {path}: need a finite stack (N, H, W) with H = W, got {stack.shape}")
        return (stack[: options.images], None) if with_angles else stack[: options.images]
    stack, phis = rectangles_stack(
        options.images,
        options.size,
        seed=options.seed,
        orientation_mean=options.orientation_mean,
        orientation_std=options.orientation_std,
    )
    return (stack, phis) if with_angles else stack


def _operator(size: int, angles_rad, device):
    vol, geo = parallel_geometry(size, angles_rad)
    return SparseRayTransform(vol, geo, device=device)


def _noisy(op, x: torch.Tensor, noise: float, seed_words) -> tuple[torch.Tensor, float]:
    y0 = op(x)
    sigma = noise * float(y0.abs().mean())
    g = torch.Generator().manual_seed(int(np.random.SeedSequence(seed_words).generate_state(1)[0]))
    return y0 + sigma * torch.randn(y0.shape, generator=g).to(y0), sigma


def _psnr(x: torch.Tensor, gt: torch.Tensor) -> float:
    return float(psnr(x.detach().cpu(), gt.cpu()))


def _scan(op, y: torch.Tensor, gt_np: np.ndarray) -> Scan:
    """The study's problem ``y = T x + noise`` as a :class:`ctuq.Scan`: ``op``'s geometry handed to
    :meth:`~ctuq.Scan.from_astra` in ctuq's own convention (:func:`ctuq.geometry.astra_geometries`), so the runs'
    operator is ``op``'s matrix bit for bit, with the rows of ``y`` in their order (acquisition order for a design)."""
    vol_geom, proj_geom = astra_geometries(op.volume, op.geometry)
    return Scan.from_astra(y.detach().cpu().numpy(), proj_geom, vol_geom, ground_truth=gt_np, units="mm")


def _settings(o: AngleSelectionOptions) -> dict:
    """The config keys every run of the study shares (on :class:`ctuq.config.Config`'s defaults): the scan as
    given, the U-Net and the DIP's loss, and the PSNR after every iteration (``output.psnr_trace``)."""
    return {
        "data.ndim": 2,
        "data.backend": "sparse",
        "data.angular_subsampling": 1,
        "data.detector_subsampling": 1,
        "data.min_angles": 1,
        "model.preset": o.preset,
        "model.input_std": o.input_std,
        "dip.tv_weight": o.tv_weight,
        "dip.clip_grad_norm": o.clip_grad_norm or None,
        "dip.scale": o.scale,
        "output.psnr_trace": True,
        "output.figure": False,
    }


def _pilot_settings(o: AngleSelectionOptions) -> dict:
    """The pilot DIP's keys (the runs' and the designs' pilot): ``iterations`` at ``lr``, no TV baseline."""
    return {
        **_settings(o),
        "dip.iterations": o.iterations,
        "dip.lr": o.lr,
        "dip.checkpoint_every": max(50, o.iterations // 10),
        "tv.enabled": False,
    }


def _run(scan: Scan, settings: dict, folder: Path, ctx: types.SimpleNamespace, progress: bool):
    """:func:`ctuq.reconstruct` of ``scan`` into the run folder ``folder`` without the uncertainty phase: loaded
    when finished there (``reuse``), continued when interrupted (``resume``)."""
    o = ctx.options
    return reconstruct(
        scan,
        Config(),
        settings,
        out=folder,
        uq=False,
        resume=True,
        reuse=True,
        progress=progress,
        device=str(ctx.device),
        seed=o.seed,
    )


def _reconstructions(ctx: types.SimpleNamespace, folder: Path, op, y: torch.Tensor) -> dict:
    """TV and the DIP warm-started from the pilot DIP (``model.pretrained``) from ``op``/``y``, each a run folder
    ``folder/<method>``: the PSNR at the fixed budget and the oracle best over the iterations (``psnr_trace``)."""
    o, out = ctx.options, {}
    scan = _scan(op, y, ctx.gt_np)
    for method in ("tv", "dip"):
        if method not in o.recon:
            continue
        if method == "tv":
            extra = {
                "dip.enabled": False,
                "tv.enabled": True,
                "tv.weight": o.tv_lambda,
                "tv.iterations": o.tv_iterations,
                "tv.init": "zero",
            }
        else:
            extra = {
                "tv.enabled": False,
                "dip.iterations": o.warm_iterations,
                "dip.lr": o.warm_lr,
                "model.pretrained": str(ctx.pilot_model),
            }
        run = _run(scan, {**_settings(o), **extra}, folder / method, ctx, progress=False)
        trace = run.metrics[method]["psnr_trace"]
        out[method] = {
            "psnr": _psnr(torch.from_numpy(run.images[method]), ctx.gt),
            "best_psnr": max(trace),
            "best_iteration": int(np.argmax(trace)),
        }
    return out


def _design(strategy: str, ctx: types.SimpleNamespace, sdir: Path, log: Log) -> tuple[list[int], dict]:
    """Candidate indices in acquisition order (pilot first) and the design's timings for a greedy strategy:
    :func:`ctuq.design_angles` on the candidates' scan into ``sdir/design`` (its pilot DIP refitted there with the
    pilot's settings; ``design.forecast = false``: the plain greedy loop; σ² the study's noise variance)."""
    o = ctx.options
    retrain = strategy.endswith("_retrain")
    if strategy in ("isotropic", "matern"):
        prior, criterion = strategy, Criterion.EIG.value
    else:
        prior, criterion = "dip", strategy.split("_")[1]
    settings = {
        **_pilot_settings(o),
        "design.noise_variance": ctx.sigma**2,
        "design.reconstruct": False,
        "design.forecast": False,
        "design.jitter": o.jitter,
        "design.refresh_every": o.refresh_every,
        "design.retrain_every": o.retrain_every if retrain else 0,
        "design.retrain_iterations": o.retrain_iterations,
        "design.retrain_lr": o.warm_lr,
        "design.dense": "auto",
    }
    design = design_angles(
        ctx.candidates,
        Config(),
        settings,
        pilot_angles=ctx.pilot_scan_deg,
        acquire=o.acquire,
        criterion=criterion,
        prior=prior,
        samples=o.samples,
        device=str(ctx.device),
        seed=o.seed,
        out=sdir / "design",
        resume=True,
        reuse=True,
        progress=o.progress,
    )
    if design.reused:
        log(f"image {ctx.image}: {strategy}: the design finished in an earlier run ({design.path})")
    rec = design.record
    if rec["pilot"]["candidates"] != ctx.pilot:
        raise StudyError(f"{design.path}: its pilot {rec['pilot']['candidates']} is not the study's {ctx.pilot}")
    times = [a["time_s"] for a in rec["acquired"]]
    timings = {k: v for k, v in rec["timings"].items() if k != "resumed_steps"}
    return ctx.pilot + [a["candidate"] for a in rec["acquired"]], {
        **timings,
        "step_s_mean": float(np.mean(times)),
        "step_s_first5": float(np.mean(times[:5])),
        "step_s_last5": float(np.mean(times[-5:])),
        "route": rec["route"],
        "prior": {k: v for k, v in rec["prior"].items() if k != "evidence_grid"},
    }


def _equidistant_set(n: int, gt: torch.Tensor, o: dict, i: int, device):
    """``n`` equidistant angles over [0°, 180°) (radians), their operator and their own noisy data (seeded by the
    image and ``n``)."""
    ang = equidistant_angles(n)
    op_n = _operator(gt.shape[0], ang, device)
    y_n, _ = _noisy(op_n, gt, o.noise, [o.seed, i, 1000 + n])
    return ang, op_n, y_n


def run_image(i: int, gt_np: np.ndarray, options: AngleSelectionOptions, out: Path, device, log: Log) -> dict:
    """All strategies for image ``i``: ``{strategy: result}`` (each also in ``out/img_<i>/<strategy>/result.json``).

    Everything is a run or design folder of the public API, loaded when finished and continued when interrupted
    (``reuse``/``resume``): ``img_<i>/pilot`` (the pilot DIP), ``img_<i>/<strategy>/design`` (a greedy design) and
    ``img_<i>/<strategy>/<count>/<method>`` (a reconstruction); ``result.json`` summarises them. A rerun with
    another ``recon`` adds or reads the reconstruction runs at the same angles and data."""
    o = options
    idir = out / f"img_{i:03d}"
    idir.mkdir(parents=True, exist_ok=True)
    size = gt_np.shape[0]
    gt = torch.from_numpy(gt_np).to(device)
    cand_rad = np.arange(o.candidates) * math.pi / o.candidates
    op = _operator(size, cand_rad, device)
    y_cand, sigma = _noisy(op, gt, o.noise, [o.seed, i, 0])
    pilot = equidistant_indices(o.candidates, o.pilot).tolist()
    counts = list(range(o.pilot, o.pilot + o.acquire + 1, o.every))
    candidates = _scan(op, y_cand, gt_np)
    # the design matches pilot angles to the scan's own angles (those of its vector geometry, ``op.angles``)
    vec_angles = from_astra(*astra_geometries(op.volume, op.geometry))[1].angles
    ctx = types.SimpleNamespace(
        options=o,
        image=i,
        device=device,
        gt=gt,
        gt_np=gt_np,
        sigma=sigma,
        pilot=pilot,
        candidates=candidates,
        pilot_scan_deg=np.mod(np.degrees(vec_angles[pilot]), 180.0),
        pilot_model=None,
    )
    if "dip" in o.recon:
        pilot_run = _run(
            _scan(op.subset(pilot), y_cand[pilot], gt_np), _pilot_settings(o), idir / "pilot", ctx, o.progress
        )
        if pilot_run.reused:
            log(f"image {i}: the pilot DIP finished in an earlier run ({pilot_run.path})")
        ctx.pilot_model = (pilot_run.path / rf.MODEL_NAME).resolve()
    results: dict[str, dict] = {}
    for strategy in o.strategies:
        sdir = idir / strategy
        sdir.mkdir(exist_ok=True)
        log(f"image {i}: {strategy}")
        t0 = time.perf_counter()
        timings: dict = {}
        recon: dict[str, dict] = {}
        if strategy == "equidistant":
            chosen_deg = {}
            for n in counts:
                ang, op_n, y_n = _equidistant_set(n, gt, o, i, device)
                recon[str(n)] = _reconstructions(ctx, sdir / f"{n:03d}", op_n, y_n)
                chosen_deg[str(n)] = np.degrees(ang).tolist()
            record = {"angles_deg": chosen_deg}
        else:
            if strategy == "equidistant_grid":  # the counts that divide the grid (200: 5, 8, 10, 20, 25, 40)
                top = o.pilot + o.acquire
                sets = {
                    n: equidistant_indices(o.candidates, n).tolist()
                    for n in range(o.pilot, top + 1)
                    if o.candidates % n == 0
                }
            else:
                if strategy == "random":
                    chosen = (
                        pilot + random_indices(o.candidates, o.acquire, exclude=pilot, seed=o.seed * 1000 + i).tolist()
                    )
                else:
                    chosen, timings = _design(strategy, ctx, sdir, log)
                sets = {n: chosen[:n] for n in counts}
            for n, idx in sets.items():
                recon[str(n)] = _reconstructions(ctx, sdir / f"{n:03d}", op.subset(idx), y_cand[idx])
            record = {"angles_deg": {str(n): np.degrees(cand_rad[idx]).tolist() for n, idx in sets.items()}}
        record.update(
            {
                "strategy": strategy,
                "image": i,
                "recon": recon,
                "timings": timings,
                "time_s": time.perf_counter() - t0,
                "sigma": sigma,
            }
        )
        atomic_write_json(sdir / "result.json", record)
        results[strategy] = record
    return results
