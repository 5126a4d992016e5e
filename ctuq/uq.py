"""Linearised-DIP uncertainty for CT: the CT front end of :class:`ctuq.inference.LinearizedPosterior`.

What is CT here, and only that (DESIGN.md §1):

* ``T`` as the output map of the linearised U-Net: ``Ψ₀ = T Φ`` (:func:`ct_features`), ``Φ`` over the
  convolution weights at the DIP weights ``ṽ`` (:class:`~ctuq.linearize.LinearizedNetwork`);
* the DIP's *scale* (data and image × ``scale``, 14 for the walnut): the network and the inference live in scaled
  units; images handed back (std map, samples, mean) are divided by ``scale`` again, i.e. in mm⁻¹;
* the offset ``ỹ = y + T(Φṽ − g(ṽ))`` (the U-Net has no dense last layer, so it does not cancel; one JVP);
* ``σ²`` initialised from the DIP residual ``‖T g(ṽ) − y‖²/c`` unless given, and by default learned;
* the run-folder checkpoints of ``work_dir`` and the streaming image statistics
  (:class:`ctuq.metrics.SampleMoments`): pixelwise and p×p patch second moments are running sums over sample
  chunks, so no image sample is kept in memory unless asked (``keep_samples``) or written
  (``settings.save_samples``).

Everything else — prior scales, solver choice and set-up, sampled EM, Matheron samples — is the posterior's.

Checkpoints in ``work_dir`` (written atomically; resuming checks a fingerprint of problem and settings and
refuses another run's files, and refuses files of another checkpoint version naming both versions):

* ``uq_state.pt``: the posterior's :meth:`~ctuq.inference.LinearizedPosterior.state_dict` after the g-prior,
  the solver set-up and every EM step;
* ``uq_moments.pt``: the running sums of the prediction and the index of the next chunk, written after a chunk
  when :data:`MOMENTS_CHECKPOINT_SECONDS` have passed since the last one, and after the last chunk. Each chunk
  draws from its own seeded generator, so a resumed run reproduces the uninterrupted one bitwise;
* ``samples/samples_NNNN.pt`` (only with ``settings.save_samples``): chunk NNNN's image samples, float32, mm⁻¹.

Sharded runs (``shard``; ``torchrun``, :mod:`ctuq.inference.distributed`): rank 0 sets up the posterior and
broadcasts it, the EM probes and prediction chunks are split round robin with the single-process seeds, rank 0
writes ``uq_state.pt`` and every rank its own running sums ``uq_moments.rank{r}of{N}.pt`` (a resume needs the same
``N``); the sums are added onto rank 0 at the end.

Volumes ``(D, H, W)`` go through the same code: Jacobian products are chunked under ``uq.memory_budget_gb``
(:class:`ctuq.linearize.MemoryBudgetError` when not even one product fits), and the statistics' memory
(:func:`moments_bytes`) is checked against the host's before sampling.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable

import torch

from ctuq.config import UQConfig, check_section
from ctuq.pipeline import run_folder
from ctuq.utils import atomic_torch_save, check_fingerprint
from ctuq.utils import progress as _progress_bar

__all__ = ["UQSettings", "UQResult", "UQCheckpointMismatch", "run_linearized_uq", "ct_features", "ct_posterior",
           "STATE_NAME", "MOMENTS_NAME", "MOMENTS_SHARD_PATTERN", "SAMPLES_DIR", "SAMPLES_PATTERN",
           "MOMENTS_CHECKPOINT_SECONDS", "moments_bytes"]

STATE_NAME = run_folder.UQ_STATE_NAME
MOMENTS_NAME = run_folder.UQ_MOMENTS_NAME
MOMENTS_SHARD_PATTERN = "uq_moments.rank{rank}of{world}.pt"
"""Per-rank running sums of a sharded prediction (rank ``rank`` of ``world``)."""
SAMPLES_DIR = run_folder.UQ_SAMPLES_DIR
SAMPLES_PATTERN = run_folder.UQ_SAMPLE_FILE_PATTERN
MOMENTS_CHECKPOINT_SECONDS = 60.0
_STATE_VERSION = 2  # 1: ctuq 0.1 (samples kept per chunk, routes dense/exact/cg)

UQSettings = UQConfig
"""The inference settings are the ``uq`` config section (:class:`ctuq.config.UQConfig`)."""


class UQCheckpointMismatch(ValueError):
    """A UQ checkpoint does not belong to the run that tries to resume from it."""


@dataclasses.dataclass
class UQResult:
    """Output of :func:`run_linearized_uq`.

    Attributes
    ----------
    std : torch.Tensor
        ``image_shape`` pixelwise posterior std ``sqrt(mean_j x_j²)`` (mm⁻¹, CPU, float32).
    mean : torch.Tensor
        ``image_shape`` predictive mean ``x̃ = g(ṽ)/scale`` (mm⁻¹, CPU, float32).
    moments : SampleMoments
        Running pixel and patch second moments of the ``k`` zero-mean image samples (mm⁻²), in the region and
        patch sizes of the settings: :func:`ctuq.metrics.uq_summary_from_moments` scores them.
    n_samples : int
        ``k``.
    a, sigma2 : float
        Final prior precision and noise variance (scaled units).
    em_trace : list of dict
        One record per EM step (:meth:`ctuq.inference.SampledEM.step`).
    solver : str
        ``"exact"`` or ``"cg"`` (the kind); ``stats["route"]`` names the registry solver.
    stats : dict
        Sizes, solver statistics, g-prior summary.
    timings : dict
        Seconds per phase (``linearize``, ``offset``, ``route``, ``gprior``, ``solver_setup``, ``em``,
        ``prediction``).
    products : dict
        JVPs and VJPs (per sample) spent per phase.
    posterior : LinearizedPosterior
        The fitted posterior itself (sample more, restrict, extend).
    samples : torch.Tensor or None
        ``(k, *image_shape)`` image samples (mm⁻¹) only when ``keep_samples=True``.
    """

    std: torch.Tensor
    mean: torch.Tensor
    moments: object
    n_samples: int
    a: float
    sigma2: float
    em_trace: list[dict]
    solver: str
    stats: dict
    timings: dict
    products: dict
    posterior: object = None
    samples: torch.Tensor | None = None


def ct_features(model: torch.nn.Module, net_input: torch.Tensor, op, *, chunk_size: int | None = None,
                memory_budget: int | None = None):
    """``(network, Ψ₀)`` for CT: the linearised U-Net ``Φ`` and the unscaled features ``Ψ₀ = T Φ``.

    ``model`` maps ``net_input`` ``(1, C, *image_shape)`` to ``(1, 1, *image_shape)`` (scaled image units);
    ``op`` is the ray transform (its ``forward_flat``/``adjoint_flat`` are ``T``/``Tᵀ`` on flat images).
    ``memory_budget`` (bytes) bounds one chunk of Jacobian products; when not even one product fits, the first
    product raises :class:`ctuq.linearize.MemoryBudgetError` naming the sizes (default: automatic).
    """
    from ctuq.inference import LinearizedFeatures
    from ctuq.linearize import LinearizedNetwork

    net = LinearizedNetwork(model, net_input, chunk_size=chunk_size, memory_budget=memory_budget)
    if net.d_out != op.d_x:
        raise ValueError(f"ct_features: the network outputs {tuple(net.output_shape)} ({net.d_out} values) but the "
                         f"operator expects images of shape {op.image_shape} ({op.d_x} pixels)")
    ones = torch.ones(net.d, dtype=net.dtype, device=net.device)
    return net, LinearizedFeatures(net, ones, op.forward_flat, op.adjoint_flat, n_outputs=op.c)


def ct_posterior(model: torch.nn.Module, net_input: torch.Tensor, op, y: torch.Tensor, *, scale: float = 1.0,
                 settings: UQConfig | None = None, seed: int = 0, progress: bool = False,
                 log: Callable[[str], None] | None = None, shard=None):
    """The (not yet set-up) posterior of a fitted DIP: ``(posterior, network, info)``.

    ``info`` holds ``g0`` (the DIP output ``g(ṽ)``, flat, scaled units), ``dip_residual_sigma2``
    (``‖T g(ṽ) − y‖²/c``, scaled units) and ``initial_sigma2``. ``y`` is in data units (mm, not scaled).
    """
    from ctuq.inference import GaussianLikelihood, LinearizedPosterior

    settings = settings or UQConfig()
    budget = None if settings.memory_budget_gb is None else int(settings.memory_budget_gb * 1024**3)
    net, base = ct_features(model, net_input, op, chunk_size=settings.chunk_size, memory_budget=budget)
    y_s = (y.to(device=op.device, dtype=net.dtype) * scale).reshape(-1)
    with torch.no_grad():
        g0 = net.output()
        phi_v = net.jvp(net.params()[None])[0]
        delta = op.forward_flat((phi_v - g0)[None].to(op.dtype))[0].to(net.dtype)
        residual = op.forward_flat(g0[None].to(op.dtype))[0].to(net.dtype) - y_s
    dip_noise = float(residual.double().pow(2).mean())
    sigma2_0 = settings.noise_variance if settings.noise_variance is not None else dip_noise
    if not sigma2_0 > 0:
        raise FloatingPointError("the DIP fits the data exactly (zero residual); set uq.noise_variance to a "
                                 "positive value")
    posterior = LinearizedPosterior.from_settings(
        base, y_s + delta, settings, likelihood=GaussianLikelihood(sigma2_0, settings.learn_noise), seed=seed,
        progress=progress, log=log, shard=shard)
    return posterior, net, {"g0": g0, "dip_residual_sigma2": dip_noise, "initial_sigma2": float(sigma2_0)}


def _fingerprint(net, op, y: torch.Tensor, scale: float, seed: int, settings: UQConfig) -> dict:
    # Enough to catch resuming with other data, another network or other settings that change the numbers.
    v = net.params().double()
    fp = {
        "image_shape": list(op.image_shape),
        "c": int(op.c),
        "d": int(net.d),
        "y_sum": float(y.double().sum() * scale),
        "weights_sum": float(v.sum()),
        "weights_sq_sum": float(v.pow(2).sum()),
        "scale": float(scale),
        "seed": int(seed),
    }
    for key in ("prior", "gprior_method", "gprior_probes", "solver", "preconditioner", "rank", "oversampling",
                "cg_tol", "cg_max_iter", "em_steps", "em_samples", "em_tol", "prior_precision", "noise_variance",
                "learn_noise", "samples", "sample_chunk", "roi", "patch_sizes"):
        fp[key] = getattr(settings, key)
    # Settings added with the first-order solvers enter only when they differ from their defaults, so that the
    # checkpoints of runs that never used them still resume.
    defaults = UQConfig()
    for key in _LATER_KEYS:
        if getattr(settings, key) != getattr(defaults, key):
            fp[key] = getattr(settings, key)
    return fp


_LATER_KEYS = ("adaptive_rank", "rank_threshold", "sdd_step", "sdd_momentum", "sdd_batch", "sdd_iterations",
               "sgd_lr", "sgd_momentum", "sgd_lr_decay", "sgd_clip", "sgd_iterations", "first_order_tol",
               "em_stop_on", "em_fixed_probes", "em_update")


def _load_checkpoint(path: Path, fingerprint: dict) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=True)
    version = state.get("version") if isinstance(state, dict) else None
    if version != _STATE_VERSION:
        raise UQCheckpointMismatch(
            f"cannot resume from {path}: it is a ctuq UQ checkpoint of version {version!r}, this ctuq reads version "
            f"{_STATE_VERSION} (delete {path.parent / 'uq_*'} to start the inference afresh)")
    check_fingerprint(state.get("fingerprint", {}), fingerprint, what=f"cannot resume the uncertainty phase from "
                      f"{path}", error=UQCheckpointMismatch,
                      hint=f"delete {path.parent / 'uq_*'} to start the inference afresh, or use the same "
                           f"data/settings")
    return state


def _shard_world_sizes(work: Path) -> set[int]:
    """The rank counts of the per-rank running sums in ``work`` (files named by :data:`MOMENTS_SHARD_PATTERN`)."""
    import re

    rx = re.compile(re.escape(MOMENTS_SHARD_PATTERN).replace(r"\{rank\}", r"(\d+)").replace(r"\{world\}", r"(\d+)"))
    glob = MOMENTS_SHARD_PATTERN.format(rank="*", world="*")
    return {int(m.group(2)) for p in work.glob(glob) if (m := rx.fullmatch(p.name))}


def _check_shard_checkpoints(work: Path, shard) -> None:
    """Refuse to resume a sharded prediction with another number of ranks than the one that wrote it."""
    other = sorted(_shard_world_sizes(work) - {shard.world_size})
    if other:
        raise UQCheckpointMismatch(
            f"cannot resume the sharded prediction in {work}: its running sums were written by {other[0]} rank(s), "
            f"this run has {shard.world_size}; resume with --nproc_per_node={other[0]} (or delete "
            f"{work / 'uq_moments.rank*'} to sample afresh)")
    if (work / MOMENTS_NAME).is_file():
        raise UQCheckpointMismatch(
            f"cannot resume the sharded prediction in {work}: {MOMENTS_NAME} holds the running sums of a "
            f"single-process run; resume without torchrun (or delete it to sample afresh)")


def moments_bytes(image_shape, settings: UQConfig) -> int:
    """Bytes of the streaming statistics (:class:`ctuq.metrics.SampleMoments`, float64) of ``image_shape`` with
    ``settings``' ROI and patch sizes: the pixel sums of squares plus, per patch size ``p``, ``n_p · p⁴`` patch sums
    (:meth:`ctuq.metrics.SampleMoments.memory_bytes`)."""
    from ctuq.metrics import SampleMoments

    shape = tuple(int(n) for n in image_shape)
    return SampleMoments.memory_bytes(shape, roi=_roi(settings, shape), patch_sizes=settings.patch_sizes)


def _check_moments_memory(settings: UQConfig, image_shape) -> None:
    """Refuse statistics that cannot fit the host memory, naming the sizes and the settings that set them."""
    from ctuq.errors import CTUQError
    from ctuq.utils import free_memory_bytes

    need = moments_bytes(image_shape, settings)
    avail = free_memory_bytes("cpu")
    if avail and need > 0.8 * avail:
        gib = 1024**3
        raise CTUQError(
            f"uq.patch_sizes {list(settings.patch_sizes)}: the streaming statistics of a "
            f"{'×'.join(map(str, image_shape))} image (uq.roi {settings.roi!r}) need {need / gib:.1f} GiB (pixel sums "
            f"plus p×p patch covariances, {sum(p * p for p in settings.patch_sizes)} per ROI pixel per slice) but "
            f"{avail / gib:.1f} GiB of host memory are available; use fewer or smaller patch sizes (e.g. "
            f"uq.patch_sizes=[1,2,4]) or a smaller image")


def _roi(settings: UQConfig, image_shape):
    from ctuq.metrics import inner_square_roi

    return inner_square_roi(image_shape) if settings.roi == "inner_square" else None


def run_linearized_uq(
    model: torch.nn.Module,
    net_input: torch.Tensor,
    op,
    y: torch.Tensor,
    *,
    scale: float = 1.0,
    settings: UQConfig | None = None,
    seed: int = 0,
    work_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    keep_samples: bool = False,
    moments_checkpoint_seconds: float = MOMENTS_CHECKPOINT_SECONDS,
    shard=None,
) -> UQResult:
    """Sampled linearised inference for one DIP reconstruction (module docstring).

    Parameters
    ----------
    model : nn.Module
        The fitted U-Net (its current weights are ``ṽ``); evaluated in eval mode, not modified.
    net_input : torch.Tensor
        Its fixed input ``(1, C, *image_shape)``.
    op : RayTransform
        ``T`` on the device to compute on; ``image_shape`` must be the network's output shape.
    y : torch.Tensor
        ``op.measurement_shape`` measurements in data units (line integrals, mm; NOT scaled).
    scale : float
        The DIP's data/image scale (the network's output is ``scale ×`` the image in mm⁻¹).
    settings : UQConfig
        Inference settings (the ``uq`` config section; defaults: the published ones).
    seed : int
        Seeds the g-prior probes, the preconditioner, the EM and (``seed + 1``) the prediction samples.
    work_dir : path, optional
        Folder for checkpoints; ``None``: no checkpoints.
    resume : bool
        Continue from the checkpoints in ``work_dir`` (after checking they belong to this run).
    progress : bool
        Progress bars.
    log : callable, optional
        Receives one-line status messages.
    keep_samples : bool
        Also return all image samples in memory (``UQResult.samples``; ``k × image`` floats).
    moments_checkpoint_seconds : float
        Minimum time between checkpoints of the prediction's running sums (0: after every chunk).
    shard : ctuq.inference.Shard, optional
        This process's share in a sharded run (``torchrun``; :mod:`ctuq.inference.distributed`): rank 0 sets up
        the posterior and broadcasts it, the EM's probes and the prediction chunks are split round robin, and the
        running sums are summed onto rank 0. Only rank 0 writes ``uq_state.pt`` and gets the statistics
        (``std``, ``moments``; ``None`` on the other ranks); every rank checkpoints its own running sums
        (``uq_moments.rank{r}of{N}.pt``), so a resumed run with the same number of ranks continues each share.

    Returns
    -------
    UQResult
    """
    from ctuq.inference import LocalShard
    from ctuq.metrics import SampleMoments

    settings = settings or UQConfig()
    check_section(settings, "uq")
    shard = shard if shard is not None else LocalShard()
    say = (log or (lambda _msg: None)) if shard.is_root else (lambda _msg: None)
    if not shard.is_root:
        progress = False
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"run_linearized_uq: scale must be positive, got {scale}")
    if tuple(y.shape) != tuple(op.measurement_shape):
        raise ValueError(f"run_linearized_uq: y has shape {tuple(y.shape)}; the operator expects "
                         f"{tuple(op.measurement_shape)}")
    if resume and work_dir is None:
        raise ValueError("run_linearized_uq: resume=True needs a work_dir")
    if keep_samples and shard.distributed:
        raise ValueError("run_linearized_uq: keep_samples is not available in a sharded run (the samples live on "
                         "different ranks); use uq.save_samples")
    work = Path(work_dir) if work_dir is not None else None
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    state_path = work / STATE_NAME if work is not None else None
    moments_name = (MOMENTS_NAME if not shard.distributed
                    else MOMENTS_SHARD_PATTERN.format(rank=shard.rank, world=shard.world_size))
    moments_path = work / moments_name if work is not None else None
    timings: dict[str, float] = {}
    products: dict[str, dict[str, int]] = {}

    model = model.to(op.device)
    t0 = time.perf_counter()
    posterior, net, info = ct_posterior(model, net_input.to(op.device), op, y, scale=scale, settings=settings,
                                        seed=seed, progress=progress, log=say, shard=shard)
    timings["offset"] = time.perf_counter() - t0  # linearisation and the offset's one JVP
    products["offset"] = {"jvp": net.n_jvp, "vjp": net.n_vjp}
    fingerprint = _fingerprint(net, op, y, scale, seed, settings)

    state: dict = {}
    if resume and state_path is not None and state_path.is_file():
        state = _load_checkpoint(state_path, fingerprint)
        say(f"resuming the uncertainty phase from {state_path} ({state.get('stage')})")
        posterior.load_state_dict(state["posterior"])

    def save(stage: str) -> None:
        if state_path is not None and shard.is_root:
            atomic_torch_save(state_path, {"version": _STATE_VERSION, "fingerprint": fingerprint, "stage": stage,
                                           "posterior": posterior.state_dict()})

    counters = [(net.n_jvp, net.n_vjp)]

    def spent(name: str) -> None:
        before = counters[-1]
        products[name] = {"jvp": net.n_jvp - before[0], "vjp": net.n_vjp - before[1]}
        counters.append((net.n_jvp, net.n_vjp))

    def stage_done(stage: str) -> None:
        spent("gprior" if stage == "scales" else "solver_setup")
        save(stage)

    posterior.setup(on_stage=stage_done)
    route = posterior.solver_name
    exact = posterior.exact
    say(f"solver: {route}" + (f" (rank-{settings.rank} {settings.preconditioner} preconditioner)"
                              if route == "cg" and settings.preconditioner != "none" else "")
        + (f", {int(posterior.solver.decompose()[0].numel())} non-zero eigenvalues of K̄" if exact else ""))

    # ---------------------------------------------------------------- sampled EM
    steps_done = int(state.get("posterior", {}).get("em", {}).get("step", 0))
    bar = _progress_bar(total=settings.em_steps, initial=steps_done, desc="EM", disable=None if progress else True)

    def after_step(record: dict) -> None:
        save("em")
        bar.update(1)
        bar.set_postfix({"a": f"{record['a_new']:.3g}", "γ": f"{record['gamma']:.4g}",
                         "σ²": f"{record['sigma2_new']:.3g}"}, refresh=False)
        say(f"EM step {record['step'] + 1}: a {record['a']:.4g} → {record['a_new']:.4g}, γ {record['gamma']:.5g}, "
            f"‖w*‖² {record['weight_norm_sq']:.4g}, σ² {record['sigma2_new']:.4g}"
            + (f", CG ≤ {record['solver']['max_iterations']} it." if record.get("solver") else ""))

    try:
        em_result = posterior.fit(max_steps=settings.em_steps, n_samples=settings.em_samples, tol=settings.em_tol,
                                  callback=after_step, fixed_probes=settings.em_fixed_probes,
                                  stop_on=settings.em_stop_on, update=settings.em_update)
    finally:
        bar.close()
    spent("em")
    save("predict")

    # ---------------------------------------------------------------- prediction samples → running moments
    t0 = time.perf_counter()
    _check_moments_memory(settings, op.image_shape)
    moments = SampleMoments(op.image_shape, roi=_roi(settings, op.image_shape), patch_sizes=settings.patch_sizes)
    n_chunks = -(-settings.samples // settings.sample_chunk)
    mine = [i for i in range(n_chunks) if shard.owns(i)]
    cg_iters: list[int] = []
    cg_res: list[float] = []
    start = 0
    if resume and work is not None and shard.distributed:
        _check_shard_checkpoints(work, shard)
    if resume and moments_path is not None and moments_path.is_file():
        saved = _load_checkpoint(moments_path, fingerprint)
        moments.load_state_dict(saved["moments"])
        start, cg_iters, cg_res = int(saved["next_chunk"]), list(saved["cg_iterations"]), list(saved["cg_residuals"])
        say(f"reusing {start} of {n_chunks} sample chunks" + (f" on each of {shard.world_size} ranks' shares"
                                                             if shard.distributed else ""))
    todo = [i for i in mine if i >= start]
    last_mine = mine[-1] if mine else -1
    if settings.save_samples and work is not None:
        (work / SAMPLES_DIR).mkdir(exist_ok=True)
    kept: list[torch.Tensor] = []
    last_save = time.perf_counter()
    bar = _progress_bar(total=settings.samples, initial=min(settings.samples, start * settings.sample_chunk),
                        desc="samples", disable=None if progress else True)
    try:
        for i, images, ps in posterior.sample_outputs(settings.samples, chunk_size=settings.sample_chunk,
                                                      seed=seed + 1, start_chunk=start, chunks=todo):
            images = (images / scale).to("cpu", torch.float32).reshape(-1, *op.image_shape)
            moments.update(images)
            summary = ps.stats.summary()
            cg_iters.append(int(summary.get("max_iterations") or 0))
            cg_res.append(float(summary.get("max_relative_residual") or 0.0))
            if keep_samples:
                kept.append(images)
            if settings.save_samples and work is not None:
                atomic_torch_save(work / SAMPLES_DIR / SAMPLES_PATTERN.format(i), images)
            now = time.perf_counter()
            if moments_path is not None and (i == last_mine or now - last_save >= moments_checkpoint_seconds):
                atomic_torch_save(moments_path, {"version": _STATE_VERSION, "fingerprint": fingerprint,
                                                 "next_chunk": i + 1, "moments": moments.state_dict(),
                                                 "cg_iterations": cg_iters, "cg_residuals": cg_res})
                last_save = time.perf_counter()
            bar.update(images.shape[0])
    finally:
        bar.close()
    if shard.distributed:
        moments.reduce_(shard)  # every rank's running sums summed onto rank 0
        worst = shard.all_reduce_max(torch.tensor([max(cg_iters, default=0), max(cg_res, default=0.0)],
                                                  dtype=torch.float64))
        cg_iters, cg_res = [int(worst[0])], [float(worst[1])]
    timings["prediction"] = time.perf_counter() - t0
    spent("prediction")
    save("done")
    timings.update({k: v for k, v in posterior.timings.items() if k != "em"})
    timings["em"] = posterior.timings.get("em", 0.0)

    std = moments.std().float() if shard.is_root else None
    mean = (info["g0"] / scale).reshape(op.image_shape).to("cpu", torch.float32)
    post = posterior.summary()
    stats = {
        "c": int(op.c),
        "d": int(net.d),
        "d_x": int(op.d_x),
        "solver": "exact" if exact else route,
        "route": route,
        "initial_sigma2": info["initial_sigma2"],
        "dip_residual_sigma2": info["dip_residual_sigma2"],
        "prediction_cg_max_iterations": max(cg_iters) if cg_iters else None,
        "prediction_cg_max_residual": max(cg_res) if cg_res else None,
        "em_converged": bool(em_result.converged),
        "em_steps": int(em_result.steps),
        "gprior": {"method": ("isotropic" if settings.prior == "isotropic"
                              else "exact" if route == "exact_primal" else settings.gprior_method),
                   "zero_scales": post["scales"]["zero"], "scale_min": post["scales"]["min"],
                   "scale_max": post["scales"]["max"]},
    }
    if route == "cg":
        eig = posterior.solver.low_rank
        stats["preconditioner"] = None if eig is None else {"method": eig.method, "rank": int(eig.rank),
                                                            "products": int(eig.n_products)}
        if eig is not None and settings.adaptive_rank:
            stats["preconditioner"]["adaptive"] = {"cap": int(settings.rank), "threshold": settings.rank_threshold}
    if route in ("sdd", "sgd"):
        stats["lambda_max"] = float(posterior.solver.lambda_max)
    if shard.distributed:
        stats["world_size"] = int(shard.world_size)
    return UQResult(std=std, mean=mean, moments=moments if shard.is_root else None,
                    n_samples=int(moments.n_samples) if shard.is_root else 0, a=float(posterior.a),
                    sigma2=float(posterior.sigma2), em_trace=[dict(r) for r in em_result.trace],
                    solver="exact" if exact else route, stats=stats, timings=timings, products=products,
                    posterior=posterior, samples=torch.cat(kept, dim=0) if keep_samples else None)
