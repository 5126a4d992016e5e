"""The run of the linearised inference on one CT reconstruction: :class:`UQRun`, set up or resume → fit (sampled EM) →
stream moments (prediction samples into running sums) → report (:class:`UQResult`); :meth:`UQRun.run` does all four.

What it runs on lives beside it: the CT model of the linearised DIP (features ``Ψ₀ = T Φ``, scale, offset, ``σ²₀``:
:mod:`ctuq.pipeline.ct_model`), the noise model ``uq.noise``, resolved once per run (:mod:`ctuq.pipeline.noise`,
recorded in ``stats["noise"]``), and the streaming image statistics' region and memory check
(:mod:`ctuq.pipeline.moments`). Everything else — prior scales, solver choice and set-up, sampled EM, Matheron
samples — is the posterior's (:class:`ctuq.inference.LinearizedPosterior`); the ``uq`` config section becomes its
keyword arguments through :func:`ctuq.pipeline.uq_settings.posterior_arguments`. Images handed back (std map,
samples, mean) are divided by the DIP's ``scale`` again, i.e. in mm⁻¹. The pixelwise and p×p patch second moments
(:class:`ctuq.metrics.SampleMoments`) are running sums over sample chunks, so no image sample is kept in memory
unless asked (``keep_samples``) or written (``settings.save_samples``).

Checkpoints in ``work_dir`` (format and resume checks: :mod:`ctuq.pipeline.checkpoints`; names:
:mod:`ctuq.pipeline.run_folder`): ``uq_state.pt`` after the g-prior, the solver set-up and every EM step;
``uq_moments.pt`` after a chunk when :data:`MOMENTS_CHECKPOINT_SECONDS` have passed since the last one, and after
the last chunk (each chunk draws from its own seeded generator, so a resumed run reproduces the uninterrupted one
bitwise); ``samples/samples_NNNN.pt`` (only with ``settings.save_samples``): chunk NNNN's image samples, float32,
mm⁻¹. Under :func:`ctuq.interrupt.handling` a SIGINT/SIGTERM during the EM or the prediction stops after the running
EM step or sample chunk, once it is checkpointed (:class:`ctuq.interrupt.Interrupted`; not in a sharded run, whose
ranks stop at once).

Sharded runs (``shard``; ``torchrun``, :mod:`ctuq.inference.distributed`): rank 0 sets up the posterior and
broadcasts it, the EM probes and prediction chunks are split round robin with the single-process seeds, rank 0
writes ``uq_state.pt`` and every rank its own running sums ``uq_moments.rank{r}of{N}.pt`` (a resume needs the same
``N``); the sums are added onto rank 0 at the end.

Volumes ``(D, H, W)`` go through the same code: Jacobian products are chunked under ``uq.memory_budget_gb``
(:class:`ctuq.linearize.MemoryBudgetError` when not even one product fits), and the statistics' memory
(:func:`ctuq.pipeline.moments.moments_bytes`) is checked against the host's before sampling
(:data:`ctuq.memory.Budget.STATISTICS`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ctuq import interrupt
from ctuq.config import UQConfig, check_section
from ctuq.inference import LinearizedPosterior, LocalShard
from ctuq.linearize import MemoryBudgetError
from ctuq.log import duration
from ctuq.metrics import SampleMoments
from ctuq.pipeline import checkpoints
from ctuq.pipeline.ct_model import ct_posterior
from ctuq.pipeline.moments import check_moments_memory, statistics_roi
from ctuq.pipeline.noise import resolve_noise
from ctuq.pipeline.run_folder import UQ_SAMPLE_FILE_PATTERN, UQ_SAMPLES_DIR, UQ_STATE_NAME
from ctuq.registry import SOLVERS
from ctuq.utils import atomic_torch_save
from ctuq.utils import progress as _progress_bar

__all__ = ["UQSettings", "UQResult", "UQRun", "MOMENTS_CHECKPOINT_SECONDS"]


MOMENTS_CHECKPOINT_SECONDS = 60.0

UQSettings = UQConfig
"""The inference settings are the ``uq`` config section (:class:`ctuq.config.UQConfig`)."""


@dataclasses.dataclass
class UQResult:
    """Output of :meth:`UQRun.run` (:meth:`UQRun.report`).

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
        ``"exact"`` or the registry solver's name (``"cg"``, ``"sdd"``, ``"sgd"``); ``stats["route"]`` names the
        registry solver in every case.
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


class UQRun:
    """Sampled linearised inference for one DIP reconstruction (module docstring): the state of one run, advanced by
    its steps :meth:`set_up` → :meth:`fit` → :meth:`stream_moments` → :meth:`report`, in that order (:meth:`run`: all
    four).

    The constructor only checks the arguments and prepares ``work_dir``; every step records its seconds in
    ``timings`` and its Jacobian products in ``products``, and checkpoints into ``work_dir`` (when given).

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
    variances : torch.Tensor, optional
        ``op.measurement_shape`` per-measurement variances of ``y`` (data units², :attr:`ctuq.data.CTData.variances`);
        needed by ``uq.noise = per_ray`` (normalised to mean 1 there), ignored by ``homoscedastic``.

    Raises
    ------
    CheckpointMismatch
        ``resume`` with checkpoints of another run, version or rank count (from :meth:`set_up` and
        :meth:`stream_moments`).
    """

    def __init__(
        self,
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
        variances: torch.Tensor | None = None,
    ):
        settings = settings or UQConfig()
        check_section(settings, "uq")
        # uq.noise resolved once, before the DIP is linearised (an unusable per_ray fails here): the posterior's
        # likelihood, the stats and the held-out check all take this one model; the settings carry the model it
        # resolved to, so the checkpoint's fingerprint holds the model actually used
        self.noise = resolve_noise(settings, variances, op.measurement_shape)
        settings = dataclasses.replace(settings, noise=self.noise.model.value)
        shard = shard if shard is not None else LocalShard()
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"UQRun: scale must be positive, got {scale}")
        if tuple(y.shape) != tuple(op.measurement_shape):
            raise ValueError(f"UQRun: y has shape {tuple(y.shape)}; the operator expects {tuple(op.measurement_shape)}")
        if resume and work_dir is None:
            raise ValueError("UQRun: resume=True needs a work_dir")
        if keep_samples and shard.distributed:
            raise ValueError(
                "UQRun: keep_samples is not available in a sharded run (the samples live on "
                "different ranks); use uq.save_samples"
            )
        self.model, self.net_input, self.op, self.y = model, net_input, op, y
        self.scale, self.settings, self.seed, self.shard = scale, settings, seed, shard
        self.resume, self.keep_samples = resume, keep_samples
        self.moments_checkpoint_seconds = moments_checkpoint_seconds
        self.progress = progress and shard.is_root
        self.say = (log or (lambda _msg: None)) if shard.is_root else (lambda _msg: None)
        if self.noise.automatic:
            self.say(f"noise model: {self.noise.model} ({self.noise.reason})")
        self.work = Path(work_dir) if work_dir is not None else None
        if self.work is not None:
            self.work.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / UQ_STATE_NAME if self.work is not None else None
        self.moments_path = (self.work / checkpoints.moments_file_name(shard)) if self.work is not None else None
        self.timings: dict[str, float] = {}
        self.products: dict[str, dict[str, int]] = {}
        # set by the steps
        self.posterior: LinearizedPosterior | None = None
        self.net = None
        self.info: dict = {}
        self.fingerprint: dict = {}
        self.resumed_state: dict = {}
        self.em_result = None
        self.moments: SampleMoments | None = None
        self.cg_iterations: list[int] = []
        self.cg_residuals: list[float] = []
        self.kept: list[torch.Tensor] = []
        self._counters: list[tuple[int, int]] = []

    # ------------------------------------------------------------------------------------------ bookkeeping
    def _spent(self, name: str) -> None:
        """Record the JVPs/VJPs since the last call as phase ``name``."""
        before = self._counters[-1]
        self.products[name] = {"jvp": self.net.n_jvp - before[0], "vjp": self.net.n_vjp - before[1]}
        self._counters.append((self.net.n_jvp, self.net.n_vjp))

    def _save(self, stage: str) -> None:
        """Checkpoint the posterior after ``stage`` (rank 0 only)."""
        if self.state_path is not None and self.shard.is_root:
            checkpoints.save_uq_checkpoint(
                self.state_path, self.fingerprint, stage=stage, posterior=self.posterior.state_dict()
            )

    @property
    def solver_name(self) -> str:
        """The registry name of the solver the posterior set up (e.g. ``"exact_primal"``, ``"cg"``)."""
        return self.posterior.solver_name

    # ------------------------------------------------------------------------------------------ steps
    def run(self) -> UQResult:
        """All four steps: :meth:`set_up` → :meth:`fit` → :meth:`stream_moments` → :meth:`report`.

        A :class:`~ctuq.linearize.MemoryBudgetError` of the core is raised again naming the run's config keys that
        set the memory it needs."""
        try:
            return self.set_up().fit().stream_moments().report()
        except MemoryBudgetError as exc:
            # The core names its own arguments; the run's config keys that set them are named here.
            raise MemoryBudgetError(f"{exc} (in a ctuq run: uq.memory_budget_gb, data.image_shape)") from exc

    def set_up(self) -> UQRun:
        """Linearise the DIP, compute the offset and ``σ²₀`` (:func:`ct_posterior`), resume the posterior from
        ``uq_state.pt`` when asked, then set it up (g-prior scales, solver), checkpointing after each stage."""
        self.model = self.model.to(self.op.device)
        t0 = time.perf_counter()
        self.posterior, self.net, self.info = ct_posterior(
            self.model,
            self.net_input.to(self.op.device),
            self.op,
            self.y,
            scale=self.scale,
            settings=self.settings,
            seed=self.seed,
            progress=self.progress,
            log=self.say,
            shard=self.shard,
            noise=self.noise,
        )
        self.timings["offset"] = time.perf_counter() - t0  # linearisation and the offset's one JVP
        self.products["offset"] = {"jvp": self.net.n_jvp, "vjp": self.net.n_vjp}
        self.fingerprint = checkpoints.uq_fingerprint(self.net, self.op, self.y, self.scale, self.seed, self.settings)
        if self.resume and self.state_path is not None and self.state_path.is_file():
            self.resumed_state = checkpoints.load_uq_checkpoint(self.state_path, self.fingerprint)
            self.say(f"resuming the uncertainty phase from {self.state_path} ({self.resumed_state.get('stage')})")
            self.posterior.load_state_dict(self.resumed_state["posterior"])
        self._counters = [(self.net.n_jvp, self.net.n_vjp)]

        def stage_done(stage: str) -> None:
            if stage == "route":  # chosen, nothing computed yet: say which and how long the inference will take
                self._spent("route")
                self.say(self._route_line())
                return
            self._spent(self.posterior.weight_prior.timing_key if stage == "scales" else "solver_setup")
            self._save(stage)

        t_setup = time.perf_counter()
        self.posterior.setup(on_stage=stage_done)
        self._started = t_setup
        self.say(f"solver {self.solver_name} ready{self.posterior.solver.describe()}")
        return self

    def inference_estimate(self) -> dict | None:
        """The whole inference's estimated seconds on this machine (``solver="auto"`` only: from the cost model's
        measured product times), per candidate solver: its own estimate (set-up, EM, prediction solves) plus the
        products the front end spends beside it: the image-space prediction samples (one JVP each), the held-out
        check's samples (a solve and a JVP each) and the weight prior's set-up
        (:meth:`~ctuq.inference.priors.WeightPrior.setup_cost`: the g-prior's ``c`` VJPs, or its probes, for a solver
        that does not assemble ``Ψ₀``). ``None`` without estimates (a solver named explicitly, a resumed set-up)."""
        est = self.posterior.cost_estimates
        if not est:
            return None
        st = self.settings
        prior = self.posterior.weight_prior
        heldout = min(256, st.samples)  # ctuq.calibration.HELDOUT_SAMPLES
        out = {}
        for name, e in est.items():
            extra = (st.samples + heldout) * e.t_jvp + heldout * (e.t_jvp + e.t_vjp)
            # the exact family (key "exact") has Ψ₀ or K̄ at hand; an iterative solver pays for the prior's products
            assembles = SOLVERS[name].assembles_features if name in SOLVERS else True
            cost = prior.setup_cost(self.posterior.n_outputs, self.posterior.n_features, assembled=assembles)
            if cost.jvp or cost.vjp:
                extra += cost.seconds(e.t_jvp, e.t_vjp)
            out[name] = e.seconds + extra
        return out

    def _estimate_key(self, by: dict) -> str:
        """The key of the chosen solver among the estimates (the exact family has one, ``"exact"``)."""
        chosen = self.solver_name
        return "exact" if chosen.startswith("exact") and "exact" in by else chosen

    def _route_line(self) -> str:
        """One line: the solver chosen, why, and how long the inference should take here."""
        chosen = self.solver_name
        by = self.inference_estimate()
        if by is None:
            return f"solver: {chosen} (uq.solver = {self.settings.solver})"
        key = self._estimate_key(by)
        others = ", ".join(f"{name} {duration(sec)}" for name, sec in by.items() if name != key)
        return (
            f"solver: {chosen}, the cheapest by the cost model measured on this machine; the inference should take "
            f"about {duration(by[key])} (other solvers: {others})"
        )

    def fit(self) -> UQRun:
        """The sampled EM (``uq.em_*``) from where a resumed state left it, checkpointing after every step."""
        st = self.settings
        steps_done = int(self.resumed_state.get("posterior", {}).get("em", {}).get("step", 0))
        bar = _progress_bar(total=st.em_steps, initial=steps_done, desc="EM", disable=None if self.progress else True)

        def after_step(record: dict) -> None:
            self._save("em")
            bar.update(1)
            bar.set_postfix(
                {"a": f"{record['a_new']:.3g}", "γ": f"{record['gamma']:.4g}", "σ²": f"{record['sigma2_new']:.3g}"},
                refresh=False,
            )
            self.say(
                f"EM step {record['step'] + 1}: a {record['a']:.4g} → {record['a_new']:.4g}, γ "
                f"{record['gamma']:.5g}, ‖w*‖² {record['weight_norm_sq']:.4g}, σ² {record['sigma2_new']:.4g}"
                + (f", CG ≤ {record['solver']['max_iterations']} it." if record.get("solver") else "")
            )
            if interrupt.requested() is not None:  # Ctrl-C/SIGTERM: this step is checkpointed, stop here
                interrupt.stop(f"the EM after step {record['step'] + 1} of {st.em_steps}", self.state_path)

        try:
            # a sharded run's ranks step together: each stops at once, from the last common checkpoint
            with interrupt.safe_points(enabled=not self.shard.distributed):
                self.em_result = self.posterior.fit(
                    max_steps=st.em_steps,
                    n_samples=st.em_samples,
                    tol=st.em_tol,
                    callback=after_step,
                    fixed_probes=st.em_fixed_probes,
                    stop_on=st.em_stop_on,
                    update=st.em_update,
                )
        finally:
            bar.close()
        self._spent("em")
        self._save("predict")
        return self

    def stream_moments(self) -> UQRun:
        """Draw the prediction samples chunk by chunk (this rank's chunks in a sharded run) into the running pixel
        and patch moments, resuming from and checkpointing to the running sums' file; sum the ranks' moments onto
        rank 0."""
        st, op, shard, work = self.settings, self.op, self.shard, self.work
        t0 = time.perf_counter()
        check_moments_memory(st, op.image_shape)
        moments = SampleMoments(op.image_shape, roi=statistics_roi(st, op.image_shape), patch_sizes=st.patch_sizes)
        n_chunks = -(-st.samples // st.sample_chunk)
        mine = [i for i in range(n_chunks) if shard.owns(i)]
        start, cg_iters, cg_res = self._resume_moments(moments, n_chunks)
        todo = [i for i in mine if i >= start]
        last_mine = mine[-1] if mine else -1
        if st.save_samples and work is not None:
            (work / UQ_SAMPLES_DIR).mkdir(exist_ok=True)
        last_save = time.perf_counter()
        bar = _progress_bar(
            total=st.samples,
            initial=min(st.samples, start * st.sample_chunk),
            desc="samples",
            disable=None if self.progress else True,
        )
        try:
            chunks = self.posterior.sample_outputs(
                st.samples, chunk_size=st.sample_chunk, seed=self.seed + 1, start_chunk=start, chunks=todo
            )
            # Ctrl-C/SIGTERM: the running chunk is finished and checkpointed, then the run stops
            for i, images, ps in interrupt.safe_iter(chunks, enabled=not shard.distributed):
                images = (images / self.scale).to("cpu", torch.float32).reshape(-1, *op.image_shape)
                moments.update(images)
                summary = ps.stats.summary()
                cg_iters.append(int(summary.get("max_iterations") or 0))
                cg_res.append(float(summary.get("max_relative_residual") or 0.0))
                if self.keep_samples:
                    self.kept.append(images)
                if st.save_samples and work is not None:
                    atomic_torch_save(work / UQ_SAMPLES_DIR / UQ_SAMPLE_FILE_PATTERN.format(i), images)
                now = time.perf_counter()
                stopping = interrupt.requested() is not None
                if self.moments_path is not None and (
                    stopping or i == last_mine or now - last_save >= self.moments_checkpoint_seconds
                ):
                    checkpoints.save_uq_checkpoint(
                        self.moments_path,
                        self.fingerprint,
                        next_chunk=i + 1,
                        moments=moments.state_dict(),
                        cg_iterations=cg_iters,
                        cg_residuals=cg_res,
                    )
                    last_save = time.perf_counter()
                bar.update(images.shape[0])
                if stopping:
                    interrupt.stop(f"the prediction after sample chunk {i + 1} of {n_chunks}", self.moments_path)
        finally:
            bar.close()
        if shard.distributed:
            cg_iters, cg_res = self._reduce_ranks(moments, cg_iters, cg_res)
        self.moments, self.cg_iterations, self.cg_residuals = moments, cg_iters, cg_res
        self.timings["prediction"] = time.perf_counter() - t0
        self._spent("prediction")
        self._save("done")
        return self

    def _resume_moments(self, moments: SampleMoments, n_chunks: int) -> tuple[int, list[int], list[float]]:
        """``(next chunk, CG iterations, CG residuals)`` so far: from the running sums' checkpoint (loaded into
        ``moments``) when resuming, after checking that a sharded run's checkpoints match its ranks; else from
        the start."""
        shard = self.shard
        if self.resume and self.work is not None and shard.distributed:
            checkpoints.check_shard_checkpoints(self.work, shard)
        if not (self.resume and self.moments_path is not None and self.moments_path.is_file()):
            return 0, [], []
        saved = checkpoints.load_uq_checkpoint(self.moments_path, self.fingerprint)
        moments.load_state_dict(saved["moments"])
        start = int(saved["next_chunk"])
        self.say(
            f"reusing {start} of {n_chunks} sample chunks"
            + (f" on each of {shard.world_size} ranks' shares" if shard.distributed else "")
        )
        return start, list(saved["cg_iterations"]), list(saved["cg_residuals"])

    def _reduce_ranks(self, moments: SampleMoments, cg_iters: list[int], cg_res: list[float]):
        """Every rank's running sums summed onto rank 0 (in place); returns the worst CG iterations and residual
        over the ranks, as one-element lists."""
        moments.reduce_(self.shard)
        worst = self.shard.all_reduce_max(
            torch.tensor([max(cg_iters, default=0), max(cg_res, default=0.0)], dtype=torch.float64)
        )
        return [int(worst[0])], [float(worst[1])]

    def report(self) -> UQResult:
        """The :class:`UQResult` of the finished steps: std and mean in mm⁻¹, sizes, solver and g-prior statistics,
        timings and products (rank 0 gets the statistics; other ranks ``None``)."""
        op, shard, posterior = self.op, self.shard, self.posterior
        timings = self.timings
        timings.update({k: v for k, v in posterior.timings.items() if k != "em"})
        timings["em"] = posterior.timings.get("em", 0.0)
        solver_name, exact = self.solver_name, posterior.exact
        std = self.moments.std().float() if shard.is_root else None
        mean = (self.info["g0"] / self.scale).reshape(op.image_shape).to("cpu", torch.float32)
        post = posterior.summary()
        cg_iters, cg_res = self.cg_iterations, self.cg_residuals
        stats = {
            "c": int(op.c),
            "d": int(self.net.d),
            "d_x": int(op.d_x),
            "solver": "exact" if exact else solver_name,
            "route": solver_name,
            "initial_sigma2": self.info["initial_sigma2"],
            "dip_residual_sigma2": self.info["dip_residual_sigma2"],
            "prediction_cg_max_iterations": max(cg_iters) if cg_iters else None,
            "prediction_cg_max_residual": max(cg_res) if cg_res else None,
            "em_converged": bool(self.em_result.converged),
            "em_steps": int(self.em_result.steps),
            "noise": self.noise.record(),
            **posterior.solver.report(),
        }
        # the prior's own report (g-prior / isotropic: uq.stats.gprior; TV-PredCP: uq.stats.prior) and figures
        stats[posterior.weight_prior.summary_key] = post["prior"]
        if self.work is not None and shard.is_root:
            posterior.weight_prior.figures(self.work)
        if "variance_mean" in self.info:
            # σ² d_i is ray i's variance in scaled units; Var y_i = g · v_i for a gain of g counts per photon
            stats["per_ray"] = {
                "relative_variance_min": self.info["relative_variance_min"],
                "relative_variance_max": self.info["relative_variance_max"],
                "whitened_residual_sigma2": self.info["whitened_residual_sigma2"],
                "implied_gain": float(posterior.sigma2) / (self.scale**2 * self.info["variance_mean"]),
            }
        if shard.distributed:
            stats["world_size"] = int(shard.world_size)
        by = self.inference_estimate()
        if by is not None:
            key = self._estimate_key(by)
            stats["estimate"] = {"solver": key, "seconds": by[key], "by_solver": by}
        return UQResult(
            std=std,
            mean=mean,
            moments=self.moments if shard.is_root else None,
            n_samples=int(self.moments.n_samples) if shard.is_root else 0,
            a=float(posterior.a),
            sigma2=float(posterior.sigma2),
            em_trace=[dict(r) for r in self.em_result.trace],
            solver="exact" if exact else solver_name,
            stats=stats,
            timings=timings,
            products=self.products,
            posterior=posterior,
            samples=torch.cat(self.kept, dim=0) if self.keep_samples else None,
        )
