"""Linearised-DIP uncertainty for CT: the glue between a fitted DIP, the ray transform and the inference core.

The core (:mod:`ctuq.linearize`, :mod:`ctuq.priors`, :mod:`ctuq.inference`) knows nothing of CT; this module
builds its inputs for one reconstruction (DESIGN.md §1):

* ``g`` — the fitted U-Net at its DIP weights ``ṽ`` with its fixed input; everything runs in the DIP's *scaled*
  units (data and image × ``scale``, 14 for the walnut), where the network lives. Images handed back (std map,
  samples) are divided by ``scale`` again, i.e. in mm⁻¹.
* ``Φ`` — :class:`~ctuq.linearize.LinearizedNetwork` over the convolution weights (biases and GroupNorm held
  fixed).
* ``s`` — g-prior scales ``1/‖(TΦ)_{:,i}‖`` (exact: ``c`` VJPs; stochastic: ``n`` probes) or isotropic.
* ``Ψ = T Φ diag(s)`` — :class:`~ctuq.inference.LinearizedFeatures` with ``T``'s flat forward/adjoint.
* ``ỹ = y + T(Φṽ − g(ṽ))`` — the U-Net has no dense last layer, so the offset does not cancel (one JVP).
* ``σ²`` — given (scaled data units), or initialised from the DIP's residual ``‖T g(ṽ) − y‖²/c`` and, by
  default, learned by the EM together with ``a``.

Then sampled EM (:class:`~ctuq.inference.SampledEM`) learns the prior precision ``a``, and the dual Matheron
sampler draws zero-mean posterior weight samples ``ζ_j`` whose image-space versions ``x_j = Φ(s ⊙ ζ_j)`` give
the pixelwise std ``sqrt(mean_j x_j²)`` and, against a ground truth, the metrics of :mod:`ctuq.metrics`.

Long runs checkpoint into ``work_dir``: ``uq_state.pt`` after the g-prior, the preconditioner and every EM step,
and one ``uq_samples_XXXX.pt`` per prediction chunk (each chunk has its own seeded generator, so a resumed run
reproduces the same samples). Everything is written atomically; resuming checks a fingerprint of the problem and
settings and refuses a checkpoint that belongs to another run.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ctuq.utils import atomic_torch_save
from ctuq.utils import progress as _progress_bar

__all__ = ["UQSettings", "UQResult", "UQCheckpointMismatch", "run_linearized_uq", "ct_features",
           "STATE_NAME", "SAMPLES_PATTERN"]

STATE_NAME = "uq_state.pt"
SAMPLES_PATTERN = "uq_samples_{:04d}.pt"
_STATE_VERSION = 1


class UQCheckpointMismatch(ValueError):
    """A UQ checkpoint does not belong to the run that tries to resume from it."""


@dataclasses.dataclass
class UQSettings:
    """Settings of :func:`run_linearized_uq` (the ``uq`` section of :class:`ctuq.config.Config` maps 1:1).

    Attributes
    ----------
    prior : {"gprior", "isotropic"}
        Weight-prior scaling ``s``.
    gprior_method : {"exact", "stochastic"}
        Exact column norms of ``TΦ`` (``c`` VJPs) or an unbiased probe estimate (``gprior_probes`` VJPs).
    gprior_probes : int
        Rademacher probes for the stochastic g-prior.
    solver : {"auto", "cg", "exact"}
        Preconditioned CG, one full eigendecomposition of ``K̄`` (``c`` products; small ``c``), or by cost.
    preconditioner : {"nystrom", "halko", "pivoted_cholesky", "none"}
        CG preconditioner (randomised low-rank ``K̄``, built once for every ``a``, ``σ²``).
    rank, oversampling : int
        Preconditioner rank and oversampling.
    cg_tol, cg_max_iter
        CG relative tolerance and iteration cap.
    em_steps, em_samples, em_tol
        Sampled-EM steps, samples per step and stopping tolerance on the relative change of ``a``.
    prior_precision : float
        Initial ``a`` (scaled weights; published initial prior variances 1e-4…1e-2 ↔ ``a`` 1e2…1e4).
    noise_variance : float or None
        ``σ²`` in scaled data units; ``None`` initialises it from the DIP residual.
    learn_noise : bool
        Update ``σ²`` in the EM as well (else it stays at its initial value).
    samples : int
        Prediction samples ``k``.
    sample_chunk : int
        Samples solved together (one CG solve with that many right-hand sides; one checkpoint each).
    chunk_size : int or None
        Vectors per ``vmap`` call of the Jacobian products (``None``: from the memory budget).
    """

    prior: str = "gprior"
    gprior_method: str = "exact"
    gprior_probes: int = 256
    solver: str = "auto"
    preconditioner: str = "nystrom"
    rank: int = 400
    oversampling: int = 10
    cg_tol: float = 1e-3
    cg_max_iter: int = 150
    em_steps: int = 5
    em_samples: int = 16
    em_tol: float = 1e-2
    prior_precision: float = 100.0
    noise_variance: float | None = None
    learn_noise: bool = True
    samples: int = 1024
    sample_chunk: int = 64
    chunk_size: int | None = None

    @classmethod
    def from_config(cls, section: Any) -> "UQSettings":
        """From the ``uq`` config section (any object with these attribute names)."""
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class UQResult:
    """Output of :func:`run_linearized_uq`.

    Attributes
    ----------
    std : torch.Tensor
        ``image_shape`` pixelwise posterior std (mm⁻¹, CPU).
    samples : torch.Tensor
        ``(k, *image_shape)`` zero-mean image-space samples ``x_j`` (mm⁻¹, CPU, float32).
    mean : torch.Tensor
        ``image_shape`` predictive mean ``x̃ = g(ṽ)/scale`` (mm⁻¹, CPU).
    a, sigma2 : float
        Final prior precision and noise variance (scaled units).
    em_trace : list of dict
        One record per EM step (:meth:`ctuq.inference.SampledEM.step`).
    solver : str
        ``"cg"`` or ``"exact"``.
    stats : dict
        Solver statistics (preconditioner, CG iterations and residuals of the prediction solves), g-prior
        summary, sizes (``c``, ``d``, ``d_x``).
    timings : dict
        Seconds per phase (``linearize``, ``gprior``, ``offset``, ``solver_setup``, ``em``, ``prediction``).
    products : dict
        JVPs and VJPs (per sample) spent per phase.
    """

    std: torch.Tensor
    samples: torch.Tensor
    mean: torch.Tensor
    a: float
    sigma2: float
    em_trace: list[dict]
    solver: str
    stats: dict
    timings: dict
    products: dict


def ct_features(model: torch.nn.Module, net_input: torch.Tensor, op, scales_fn: Callable | None = None, *,
                chunk_size: int | None = None):
    """``(network, build)`` for CT: the linearised U-Net and a function ``scales ↦ Ψ = T Φ diag(s)``.

    ``model`` maps ``net_input`` ``(1, C, *image_shape)`` to ``(1, 1, *image_shape)`` (scaled image units);
    ``op`` is the ray transform (its ``forward_flat``/``adjoint_flat`` are ``T``/``Tᵀ`` on flat images).
    """
    from ctuq.inference import LinearizedFeatures
    from ctuq.linearize import LinearizedNetwork

    net = LinearizedNetwork(model, net_input, chunk_size=chunk_size)
    if net.d_out != op.d_x:
        raise ValueError(f"ct_features: the network outputs {tuple(net.output_shape)} ({net.d_out} values) but the "
                         f"operator expects images of shape {op.image_shape} ({op.d_x} pixels)")

    def build(scales: torch.Tensor):
        return LinearizedFeatures(net, scales, op.forward_flat, op.adjoint_flat, n_outputs=op.c)

    return net, build


def _dense_budget(device: torch.device) -> int:
    """Bytes the dense route may use for ``TΦ`` (twice: the assembly and the scaled copy)."""
    if device.type == "cuda":
        return int(0.5 * torch.cuda.mem_get_info(device)[0])
    from ctuq.linearize import _available_host_memory

    avail = _available_host_memory()
    return int(min(8 * 1024**3, 0.4 * avail)) if avail else 4 * 1024**3


def _fingerprint(net, op, y_s: torch.Tensor, scale: float, seed: int, settings: UQSettings) -> dict:
    # Enough to catch resuming with other data, another network or other settings that change the numbers.
    v = net.params().double()
    fp = {
        "image_shape": list(op.image_shape),
        "c": int(op.c),
        "d": int(net.d),
        "y_sum": float(y_s.double().sum()),
        "weights_sum": float(v.sum()),
        "weights_sq_sum": float(v.pow(2).sum()),
        "scale": float(scale),
        "seed": int(seed),
    }
    for key in ("prior", "gprior_method", "gprior_probes", "solver", "preconditioner", "rank", "oversampling",
                "cg_tol", "cg_max_iter", "em_steps", "em_samples", "em_tol", "prior_precision", "noise_variance",
                "learn_noise", "samples", "sample_chunk"):
        fp[key] = getattr(settings, key)
    return fp


def _check_fingerprint(saved: dict, now: dict, path: Path) -> None:
    for key, value in now.items():
        old = saved.get(key)
        if isinstance(value, float) and isinstance(old, (int, float)):
            same = math.isclose(float(old), value, rel_tol=1e-6, abs_tol=1e-12)
        else:
            same = old == value
        if not same:
            raise UQCheckpointMismatch(
                f"cannot resume the uncertainty phase from {path}: its {key} is {old!r} but this run has {value!r} "
                f"(delete {path.parent / 'uq_*'} to start the inference afresh, or use the same data/settings)"
            )


def _check_settings(s: UQSettings) -> None:
    choices = {"prior": ("gprior", "isotropic"), "gprior_method": ("exact", "stochastic"),
               "solver": ("auto", "cg", "exact"), "preconditioner": ("nystrom", "halko", "pivoted_cholesky", "none")}
    for key, valid in choices.items():
        if getattr(s, key) not in valid:
            raise ValueError(f"uq.{key} must be one of {list(valid)}, got {getattr(s, key)!r}")
    for key in ("gprior_probes", "rank", "cg_max_iter", "em_samples", "samples", "sample_chunk"):
        if not isinstance(getattr(s, key), int) or getattr(s, key) < 1:
            raise ValueError(f"uq.{key} must be a positive integer, got {getattr(s, key)!r}")
    if s.samples < 2:
        raise ValueError(f"uq.samples must be >= 2 (a std needs samples), got {s.samples}")
    if not (s.prior_precision > 0 and math.isfinite(s.prior_precision)):
        raise ValueError(f"uq.prior_precision must be positive, got {s.prior_precision}")
    if s.noise_variance is not None and not (s.noise_variance > 0 and math.isfinite(s.noise_variance)):
        raise ValueError(f"uq.noise_variance must be positive or null, got {s.noise_variance}")


def run_linearized_uq(
    model: torch.nn.Module,
    net_input: torch.Tensor,
    op,
    y: torch.Tensor,
    *,
    scale: float = 1.0,
    settings: UQSettings | None = None,
    seed: int = 0,
    work_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
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
    settings : UQSettings
        Inference settings (defaults: the published ones).
    seed : int
        Seeds the g-prior probes, the preconditioner, the EM and the prediction samples.
    work_dir : path, optional
        Folder for checkpoints (``uq_state.pt``, ``uq_samples_XXXX.pt``); ``None``: no checkpoints.
    resume : bool
        Continue from the checkpoints in ``work_dir`` (after checking they belong to this run).
    progress : bool
        Progress bars.
    log : callable, optional
        Receives one-line status messages.

    Returns
    -------
    UQResult
    """
    from ctuq.inference import (CGSolver, DenseFeatures, ExactEigSolver, LowRankEig, SampledEM, Workload,
                                assemble_features, choose_solver, sample_chunks)
    from ctuq.priors import gprior_scales, scales_from_sq_norms

    settings = settings or UQSettings()
    _check_settings(settings)
    say = log or (lambda _msg: None)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"run_linearized_uq: scale must be positive, got {scale}")
    if tuple(y.shape) != tuple(op.measurement_shape):
        raise ValueError(f"run_linearized_uq: y has shape {tuple(y.shape)}; the operator expects "
                         f"{tuple(op.measurement_shape)}")
    if resume and work_dir is None:
        raise ValueError("run_linearized_uq: resume=True needs a work_dir")
    device = op.device
    work = Path(work_dir) if work_dir is not None else None
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    state_path = work / STATE_NAME if work is not None else None
    timings: dict[str, float] = {}
    products: dict[str, dict[str, int]] = {}

    model = model.to(device)
    t0 = time.perf_counter()
    net, build = ct_features(model, net_input.to(device), op, chunk_size=settings.chunk_size)
    y_s = (y.to(device=device, dtype=net.dtype) * scale).reshape(-1)
    timings["linearize"] = time.perf_counter() - t0

    def spent(name: str, before: tuple[int, int]) -> None:
        products[name] = {"jvp": net.n_jvp - before[0], "vjp": net.n_vjp - before[1]}

    fingerprint = _fingerprint(net, op, y_s, scale, seed, settings)
    state: dict = {}
    if resume and state_path is not None and state_path.is_file():
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise UQCheckpointMismatch(f"{state_path} is not a ctuq UQ checkpoint (version {_STATE_VERSION})")
        _check_fingerprint(state["fingerprint"], fingerprint, state_path)
        say(f"resuming the uncertainty phase from {state_path} ({state.get('stage')})")
    state.update({"version": _STATE_VERSION, "fingerprint": fingerprint})

    def save(stage: str) -> None:
        state["stage"] = stage
        if state_path is not None:
            atomic_torch_save(state_path, state)

    # ---------------------------------------------------------------- route
    # Small networks (d < c) whose Jacobian TΦ fits in memory take the *dense* exact route: TΦ is assembled once
    # (d JVPs), which makes the exact g-prior free and every later solve, sample and EM step a dense product.
    t0, before = time.perf_counter(), (net.n_jvp, net.n_vjp)
    route = state.get("route")
    if route is None:
        kind = settings.solver
        if kind == "auto":
            probe = build(torch.ones(net.d, dtype=net.dtype, device=device))
            workload = Workload(em_steps=settings.em_steps, em_samples=settings.em_samples,
                                 prediction_samples=settings.samples, rank=settings.rank,
                                 oversampling=settings.oversampling)
            kind, estimates = choose_solver(probe, workload)
            say("solver cost estimates: " + ", ".join(f"{k} {e.seconds:.0f} s" for k, e in estimates.items()))
        dense_bytes = 2 * op.c * net.d * 8
        route = "dense" if kind == "exact" and net.d < op.c and dense_bytes <= _dense_budget(device) else kind
        state["route"] = route
    timings["route"] = time.perf_counter() - t0
    spent("route", before)

    # ---------------------------------------------------------------- g-prior scales (and dense TΦ)
    t0, before = time.perf_counter(), (net.n_jvp, net.n_vjp)
    jacobian = None
    if route == "dense":
        say(f"assembling TΦ ({op.c} × {net.d}) with {net.d} JVPs")
        jacobian = assemble_features(build(torch.ones(net.d, dtype=net.dtype, device=device)), by="columns",
                                     chunk_size=64, progress=progress)
        if settings.prior == "isotropic":
            scales = torch.ones(net.d, dtype=net.dtype, device=device)
        else:
            # Exact column norms are free once TΦ is assembled (the stochastic setting is not needed here).
            scales = scales_from_sq_norms(jacobian.pow(2).sum(0)).to(net.dtype)
    elif "scales" in state:
        scales = state["scales"].to(device=device, dtype=net.dtype)
    else:
        if settings.prior == "isotropic":
            scales = gprior_scales(None, method="isotropic", n_features=net.d, dtype=net.dtype, device=device)
        else:
            n_vjp = op.c if settings.gprior_method == "exact" else settings.gprior_probes
            say(f"g-prior scales ({settings.gprior_method}, {n_vjp} VJPs)")
            scales = gprior_scales(
                lambda R: net.vjp(op.adjoint_flat(R)), op.c, method=settings.gprior_method,
                n_features=net.d, n_probes=settings.gprior_probes, seed=seed, dtype=net.dtype, device=device,
                chunk_size=64, progress=progress,
            )
        state["scales"] = scales.detach().cpu()
        save("gprior")
    timings["gprior"] = time.perf_counter() - t0
    spent("gprior", before)
    image_features = build(scales)  # Φ diag(s) for image-space samples (and Ψ itself off the dense route)
    if route == "dense":
        features = DenseFeatures(jacobian * scales.double()[None, :])
        del jacobian
    else:
        features = image_features

    # ---------------------------------------------------------------- offset δ = T(Φṽ − g(ṽ))
    t0, before = time.perf_counter(), (net.n_jvp, net.n_vjp)
    with torch.no_grad():
        g0 = net.output()
        phi_v = net.jvp(net.params()[None])[0]
        delta = op.forward_flat((phi_v - g0)[None].to(op.dtype))[0].to(net.dtype)
        residual = op.forward_flat(g0[None].to(op.dtype))[0].to(net.dtype) - y_s
    y_tilde = (y_s + delta).to(features.dtype)
    dip_noise = float(residual.double().pow(2).mean())
    timings["offset"] = time.perf_counter() - t0
    spent("offset", before)

    # ---------------------------------------------------------------- solver (+ preconditioner / eig)
    t0, before = time.perf_counter(), (net.n_jvp, net.n_vjp)
    solver_kind = "exact" if route in ("dense", "exact") else "cg"
    if route == "dense":
        solver = ExactEigSolver(features, side="primal", progress=progress)
        solver.decompose()  # dense GEMM + eigh of the d × d Gram matrix: no Jacobian products
    elif route == "exact":
        solver = ExactEigSolver(features, progress=progress)
        if "exact" in state:
            solver.load_decomposition(state["exact"]["eigenvalues"], state["exact"]["eigenvectors"])
        else:
            solver.decompose()
            state["exact"] = solver.state_dict()
            save("solver")
    else:
        pre = state.get("preconditioner", "build")
        if pre == "build":
            solver = CGSolver(features, preconditioner=settings.preconditioner, rank=settings.rank,
                              oversampling=settings.oversampling, rtol=settings.cg_tol,
                              max_iter=settings.cg_max_iter, seed=seed)
            eig = solver.build_preconditioner()
            state["preconditioner"] = None if eig is None else eig.state_dict()
            save("solver")
        else:
            solver = CGSolver(
                features, preconditioner=LowRankEig.from_state_dict(pre, device) if pre is not None else "none",
                rank=settings.rank, oversampling=settings.oversampling, rtol=settings.cg_tol,
                max_iter=settings.cg_max_iter, seed=seed,
            )
    say(f"solver: {route}" + (f" (rank-{settings.rank} {settings.preconditioner} preconditioner)"
                              if route == "cg" and settings.preconditioner != "none" else "")
        + (f", {int(solver.decompose()[0].numel())} non-zero eigenvalues of K̄" if solver_kind == "exact" else ""))
    timings["solver_setup"] = time.perf_counter() - t0
    spent("solver_setup", before)

    # ---------------------------------------------------------------- sampled EM
    t0, before = time.perf_counter(), (net.n_jvp, net.n_vjp)
    sigma2_0 = settings.noise_variance if settings.noise_variance is not None else dip_noise
    if not sigma2_0 > 0:
        raise FloatingPointError("run_linearized_uq: the DIP fits the data exactly (zero residual); set "
                                 "uq.noise_variance to a positive value")
    em = SampledEM(features, solver, y_tilde, a=settings.prior_precision, sigma2=sigma2_0,
                   learn_noise=settings.learn_noise, n_samples=settings.em_samples, max_steps=settings.em_steps,
                   tol=settings.em_tol, seed=seed)
    if "em" in state:
        em.load_state_dict(state["em"])
    bar = _progress_bar(total=settings.em_steps, initial=em.step_count, desc="EM",
                        disable=None if progress else True)

    def after_step(em_: SampledEM, record: dict) -> None:
        state["em"] = em_.state_dict()
        save("em")
        bar.update(1)
        bar.set_postfix({"a": f"{record['a_new']:.3g}", "γ": f"{record['gamma']:.4g}",
                         "σ²": f"{record['sigma2_new']:.3g}"}, refresh=False)
        say(f"EM step {record['step'] + 1}: a {record['a']:.4g} → {record['a_new']:.4g}, γ {record['gamma']:.5g}, "
            f"‖w*‖² {record['weight_norm_sq']:.4g}, σ² {record['sigma2_new']:.4g}"
            + (f", CG ≤ {record['solver']['max_iterations']} it." if record.get("solver") else ""))

    try:
        em_result = em.run(after_step)
    finally:
        bar.close()
    state["em"] = em.state_dict()
    save("predict")
    timings["em"] = time.perf_counter() - t0
    spent("em", before)

    # ---------------------------------------------------------------- prediction samples
    t0, before = time.perf_counter(), (net.n_jvp, net.n_vjp)
    a, sigma2 = em_result.a, em_result.sigma2
    n_chunks = -(-settings.samples // settings.sample_chunk)
    chunks: list[torch.Tensor] = []
    cg_iters: list[int] = []
    cg_res: list[float] = []
    start = 0
    if resume and work is not None:
        while start < n_chunks and (work / SAMPLES_PATTERN.format(start)).is_file():
            saved = torch.load(work / SAMPLES_PATTERN.format(start), map_location="cpu", weights_only=True)
            chunks.append(saved["images"])
            cg_iters.append(int(saved["cg_iterations"]))
            cg_res.append(float(saved["cg_residual"]))
            start += 1
        if start:
            say(f"reusing {start} of {n_chunks} sample chunks")
    bar = _progress_bar(total=settings.samples, initial=sum(c.shape[0] for c in chunks), desc="samples",
                        disable=None if progress else True)
    try:
        for i, ps in sample_chunks(features, solver, a, sigma2, settings.samples, chunk_size=settings.sample_chunk,
                                   seed=seed + 1, start_chunk=start):
            with torch.no_grad():
                images = (image_features.network_matvec(ps.weights.to(net.dtype)) / scale).to("cpu", torch.float32)
            images = images.reshape(-1, *op.image_shape)
            summary = ps.stats.summary()
            it = int(summary.get("max_iterations") or 0)
            res = float(summary.get("max_relative_residual") or 0.0)
            if work is not None:
                atomic_torch_save(work / SAMPLES_PATTERN.format(i), {"images": images, "cg_iterations": it,
                                                                     "cg_residual": res})
            chunks.append(images)
            cg_iters.append(it)
            cg_res.append(res)
            bar.update(images.shape[0])
    finally:
        bar.close()
    samples = torch.cat(chunks, dim=0)
    timings["prediction"] = time.perf_counter() - t0
    spent("prediction", before)
    save("done")

    std = samples.double().pow(2).mean(0).sqrt().float()
    mean = (g0 / scale).reshape(op.image_shape).to("cpu", torch.float32)
    stats = {
        "c": int(op.c),
        "d": int(net.d),
        "d_x": int(op.d_x),
        "solver": solver_kind,
        "route": route,
        "initial_sigma2": float(sigma2_0),
        "dip_residual_sigma2": dip_noise,
        "prediction_cg_max_iterations": max(cg_iters) if cg_iters else None,
        "prediction_cg_max_residual": max(cg_res) if cg_res else None,
        "em_converged": bool(em_result.converged),
        "em_steps": int(em_result.steps),
        "gprior": {"method": ("isotropic" if settings.prior == "isotropic"
                              else "exact" if route == "dense" else settings.gprior_method),
                   "zero_scales": int((scales == 0).sum()),
                   "scale_min": float(scales[scales > 0].min()) if bool((scales > 0).any()) else None,
                   "scale_max": float(scales.max())},
    }
    if solver_kind == "cg":
        eig = solver.low_rank
        stats["preconditioner"] = None if eig is None else {"method": eig.method, "rank": int(eig.rank),
                                                            "products": int(eig.n_products)}
    return UQResult(std=std, samples=samples, mean=mean, a=float(a), sigma2=float(sigma2),
                    em_trace=[dict(r) for r in em_result.trace], solver=solver_kind, stats=stats,
                    timings=timings, products=products)
