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
reported — the best PSNR over the iterations (an *oracle*: it looks at the ground truth). Each (image, strategy) is
finished when its ``result.json`` exists; reruns skip it (and greedy designs resume from their checkpoints). A rerun
with a reconstruction method the result lacks (``--recon tv dip`` on a TV-only study) adds it at the recorded angles
from the same data, without redoing the designs.
Tables and figures: :mod:`ctuq.studies.angle_selection_report`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import types
from pathlib import Path

import numpy as np
import tifffile
import torch

from ctuq.config import DesignConfig, DIPConfig
from ctuq.data.rectangles import parallel_geometry, rectangles_stack
from ctuq.design import DesignEngine, auto_route, greedy_design
from ctuq.design.candidates import equidistant_angles, equidistant_indices, random_indices
from ctuq.design.dip_prior import DIPPrior
from ctuq.design.priors import isotropic_model, matern_model
from ctuq.metrics import psnr
from ctuq.operators import SparseRayTransform
from ctuq.options import Criterion
from ctuq.reconstruct.classical import tv_reconstruction
from ctuq.reconstruct.dip import fit_dip
from ctuq.studies.common import Log, StudyError, fit_or_load_dip, read_json
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


def reconstruct(op, y, gt, options: AngleSelectionOptions, pilot_dip) -> dict:
    """TV and warm-started DIP from ``op``/``y``: PSNR at the fixed budget and the oracle best over iterations."""
    out: dict[str, dict] = {}
    if "tv" in options.recon:
        hist: list[float] = []
        res = tv_reconstruction(
            op,
            y,
            weight=options.tv_lambda,
            iterations=options.tv_iterations,
            progress=False,
            callback=lambda i, x: hist.append(_psnr(x, gt)),
        )
        out["tv"] = {
            "psnr": _psnr(res["reconstruction"], gt),
            "best_psnr": max(hist),
            "best_iteration": int(np.argmax(hist)),
        }
    if "dip" in options.recon:
        model, net_input = copy.deepcopy(pilot_dip[0]), pilot_dip[1]
        res = fit_dip(
            op,
            y,
            model=model,
            net_input=net_input,
            iterations=options.warm_iterations,
            lr=options.warm_lr,
            tv_weight=options.tv_weight,
            clip_grad_norm=options.clip_grad_norm or None,
            scale=options.scale,
            ground_truth=gt,
            seed=options.seed,
            progress=False,
        )
        out["dip"] = {
            "psnr": _psnr(res.reconstruction, gt),
            "best_psnr": max(res.psnr_history),
            "best_iteration": int(np.argmax(res.psnr_history)),
        }
    return out


def _design(strategy: str, ctx: types.SimpleNamespace, sdir: Path, log: Log) -> tuple[list[int], dict]:
    """Candidate indices in acquisition order (pilot first) and the design's timings for a greedy strategy."""
    o, pilot = ctx.options, ctx.pilot
    t0 = time.perf_counter()
    y_p = ctx.y_cand[pilot].reshape(-1).double()
    updater, criterion = None, Criterion.EIG.value
    if strategy == "isotropic":
        model = isotropic_model(ctx.op, pilot, y_p, ctx.sigma**2)
    elif strategy == "matern":
        model = matern_model(ctx.op, pilot, y_p, ctx.sigma**2)
    else:
        retrain = strategy.endswith("_retrain")
        criterion = strategy.split("_")[1]
        ds = DesignConfig(
            refresh_every=o.refresh_every,
            retrain_every=o.retrain_every if retrain else 0,
            retrain_iterations=o.retrain_iterations,
            dense="auto",
            samples=o.samples,
        )
        dipc = DIPConfig(lr=o.warm_lr, tv_weight=o.tv_weight, clip_grad_norm=o.clip_grad_norm or None)
        prior = DIPPrior(
            ctx.dip[0],
            ctx.dip[1],
            ctx.op,
            ctx.y_cand,
            o.scale,
            settings=ds,
            sigma2=(ctx.sigma * o.scale) ** 2,
            dip_settings=dipc,
            work_dir=sdir,
            seed=o.seed,
            log=log,
        )
        if ctx.linearized is not None:  # the pilot DIP's Jacobian, assembled once per image
            prior.factor, prior.g0, prior.delta = ctx.linearized
        model = prior.build(pilot, n_steps=o.acquire)
        ctx.linearized = ctx.linearized or (prior.factor, prior.g0, prior.delta)
        updater = prior.updater
    route = auto_route(model, updater is not None and bool(o.refresh_every or strategy.endswith("_retrain")))
    engine = DesignEngine(model, route=route, n_samples=o.samples, seed=o.seed)
    prior_s = time.perf_counter() - t0
    res = greedy_design(
        engine,
        pilot,
        o.acquire,
        criterion=criterion,
        angles_deg=ctx.angles_deg,
        jitter=o.jitter,
        updater=updater,
        checkpoint=sdir / "design_state.pt",
        fingerprint={"strategy": strategy, "samples": o.samples},
        progress=o.progress,
        log=log,
    )
    times = [s["time_s"] for s in res.steps]
    return res.chosen, {
        "prior_s": prior_s,
        **res.timings,
        "step_s_mean": float(np.mean(times)),
        "step_s_first5": float(np.mean(times[:5])),
        "step_s_last5": float(np.mean(times[-5:])),
        "route": route,
        "prior": engine.model.summary(),
    }


def _equidistant_set(n: int, gt: torch.Tensor, o: dict, i: int, device):
    """``n`` equidistant angles over [0°, 180°) (radians), their operator and their own noisy data (seeded by the
    image and ``n``)."""
    ang = equidistant_angles(n)
    op_n = _operator(gt.shape[0], ang, device)
    y_n, _ = _noisy(op_n, gt, o.noise, [o.seed, i, 1000 + n])
    return ang, op_n, y_n


def _recorded_sets(
    strategy: str, record: dict, ctx: types.SimpleNamespace, gt: torch.Tensor, i: int, sdir: Path
) -> dict:
    """``{count: (operator, data)}`` of a finished result's recorded angle sets (``record["angles_deg"]``): the
    equidistant sets with their own noise draws, the others as rows of the candidates' data — the data the
    result's reconstructions were made from. Raises :class:`StudyError` when a recorded angle is not what the
    study's options give (another candidate grid)."""
    o, out = ctx.options, {}
    for key, deg in record["angles_deg"].items():
        deg = np.asarray(deg, dtype=np.float64)
        if strategy == "equidistant":
            ang, op_n, y_n = _equidistant_set(int(key), gt, o, i, gt.device)
            ok = np.allclose(np.degrees(ang), deg, atol=1e-9)
        else:
            idx = np.rint(deg * o.candidates / 180.0).astype(int)
            ok = bool((idx >= 0).all() and (idx < o.candidates).all()) and np.allclose(
                ctx.angles_deg[np.clip(idx, 0, o.candidates - 1)], deg, atol=1e-6
            )
            op_n, y_n = ctx.op.subset(idx.tolist()), ctx.y_cand[idx.tolist()]
        if not ok:
            raise StudyError(
                f"{sdir / 'result.json'}: the recorded angles of {key} are not those of this study's "
                f"options ({o.candidates} candidates); use the options the study was run with"
            )
        out[key] = (op_n, y_n)
    return out


def run_image(i: int, gt_np: np.ndarray, options: AngleSelectionOptions, out: Path, device, log: Log) -> dict:
    """All strategies for image ``i``: ``{strategy: result}`` (each also in ``out/img_<i>/<strategy>/result.json``)."""
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
    ctx = types.SimpleNamespace(
        options=o,
        op=op,
        y_cand=y_cand,
        sigma=sigma,
        pilot=pilot,
        linearized=None,
        angles_deg=np.degrees(cand_rad),
        dip=None,
    )
    results: dict[str, dict] = {}

    def pilot_dip():
        if ctx.dip is None:
            data = types.SimpleNamespace(op=op.subset(pilot), y=y_cand[pilot], ground_truth=gt)
            model, net_input, _, _ = fit_or_load_dip("dip", idir, data, o, device, log)
            ctx.dip = (model, net_input)
        return ctx.dip

    for strategy in o.strategies:
        sdir = idir / strategy
        if (sdir / "result.json").is_file():
            record = read_json(sdir / "result.json")
            missing = [m for m in o.recon if any(m not in r for r in record["recon"].values())]
            if missing:  # reconstruction methods added to a study: the recorded angles, the same data
                if "dip" in missing:
                    pilot_dip()
                log(f"image {i}: {strategy}: adding {', '.join(missing)} reconstructions at the recorded angles")
                for key, (op_n, y_n) in _recorded_sets(strategy, record, ctx, gt, i, sdir).items():
                    record["recon"].setdefault(key, {}).update(
                        reconstruct(op_n, y_n, gt, dataclasses.replace(o, recon=tuple(missing)), ctx.dip)
                    )
                atomic_write_json(sdir / "result.json", record)
            results[strategy] = record
            continue
        sdir.mkdir(exist_ok=True)
        if "dip" in o.recon or strategy.startswith("dip"):
            pilot_dip()
        log(f"image {i}: {strategy}")
        t0 = time.perf_counter()
        timings: dict = {}
        recon: dict[str, dict] = {}
        if strategy == "equidistant":
            chosen_deg = {}
            for n in counts:
                ang, op_n, y_n = _equidistant_set(n, gt, o, i, device)
                recon[str(n)] = reconstruct(op_n, y_n, gt, o, ctx.dip)
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
                recon[str(n)] = reconstruct(op.subset(idx), y_cand[idx], gt, o, ctx.dip)
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
