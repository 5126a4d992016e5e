"""``LinearizedPosterior``: the Gaussian posterior of a linearised model, as one object that outlives a run.

It holds everything the inference of DESIGN.md §1 needs and nothing CT-specific:

* the unscaled features ``Ψ₀`` (``c × d``; CT: ``T Φ``, classification: ``B^(1/2) Φ``) and the targets ``ỹ``
  (``c``; any offset ``δ`` already added);
* the prior scales ``s`` (g-prior, exact or stochastic; isotropic; or given) and hence ``Ψ = Ψ₀ diag(s)``;
* the likelihood (:mod:`ctuq.inference.likelihoods`) with its ``σ²``, and the prior precision ``a``;
* a solver from the registry :data:`~ctuq.inference.solvers.SOLVERS` chosen by name or by cost, with its
  preconditioner or eigendecomposition (built once, reused for every ``a``, ``σ²``);
* an optional output map ``W ↦ Φ (s ⊙ w)`` from scaled weights to network outputs (images), taken from the
  features when they are a linearised network.

Lifecycle (the same for every front end)::

    post = LinearizedPosterior(features, targets, prior="gprior", likelihood=GaussianLikelihood(σ², True),
                               a=100.0, solver="auto", seed=0)
    post.setup()                        # prior scales s, Ψ, solver set-up   (stage "scales", then "solver")
    post.fit(max_steps=5, n_samples=16) # sampled (or exact) EM for a (and σ²)   (stage "em" after each step)
    for i, chunk in post.sample_outputs(1024, chunk_size=64, seed=1): ...   # zero-mean image samples
    post.mean(); post.log_evidence()    # w*; exact evidence where the solver is exact
    post.state_dict() / post.load_state_dict(state)   # checkpoint/resume at every stage
    post.restrict(rows); post.extend(features_new, targets_new)   # condition on fewer / more measurements

Every stage calls an optional ``on_stage(name)`` hook after it finished, which is where a front end writes
``state_dict()`` atomically; :meth:`load_state_dict` before :meth:`setup` makes the later calls skip the
finished work (the stored scales, decomposition and EM state are reused), so a killed run resumes exactly.

The ``exact_primal`` solver assembles ``Ψ₀`` (``d`` JVPs): the exact g-prior then comes from its column norms
at no further cost, and every later solve is dense. That is a property of the solver, so it lives here and not
in a front end.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from ctuq.inference.distributed import LocalShard, Shard
from ctuq.inference.em import EM_UPDATES, EMResult, SampledEM
from ctuq.inference.features import DenseFeatures, FeatureOperator, ScaledFeatures, stack_features
from ctuq.inference.kernel import _check_hyper, assemble_features
from ctuq.inference.likelihoods import GaussianLikelihood, Likelihood
from ctuq.inference.preconditioners import LowRankEig
from ctuq.inference.sampler import PosteriorSamples, _check_y, posterior_mean, sample_chunks
from ctuq.inference.solvers import (CGSolver, ExactEigSolver, SOLVERS, Solver, SolverCostEstimate, Workload,
                                    make_solver, resolve_solver)

__all__ = ["LinearizedPosterior", "PRIORS", "GPRIOR_METHODS", "POSTERIOR_STATE_VERSION"]

PRIORS = ("gprior", "isotropic")
"""Weight-prior scalings: the g-prior ``s_i = ‖Ψ₀[:, i]‖⁻¹`` or ``s = 1``."""
GPRIOR_METHODS = ("exact", "stochastic")
"""How the g-prior's column norms are found: ``c`` VJPs, or ``n`` Rademacher probes (unbiased)."""
POSTERIOR_STATE_VERSION = 1


def _check_solver_options(options: dict) -> None:
    """Refuse names no solver takes: flat options of the exact solvers and CG, and ``"sdd"``/``"sgd"`` dicts of
    their own (the vocabulary is each :class:`~ctuq.inference.solvers.SolverSpec`'s ``options``)."""
    flat = set().union(*(SOLVERS[n].options for n in SOLVERS if n not in ("sdd", "sgd")))
    for key, value in options.items():
        if key in ("sdd", "sgd"):
            bad = sorted(set(dict(value)) - SOLVERS[key].options)
            if bad:
                raise ValueError(f"LinearizedPosterior: unknown {key} option(s) {bad}; valid: "
                                 f"{sorted(SOLVERS[key].options)}")
        elif key not in flat:
            raise ValueError(f"LinearizedPosterior: unknown solver option {key!r}; valid: {sorted(flat)} and "
                             f"'sdd' / 'sgd' dicts")


class LinearizedPosterior:
    """Posterior over scaled weights ``w ~ N(0, a⁻¹ I)`` given ``ỹ = Ψ w + ε`` (module docstring).

    Parameters
    ----------
    features : FeatureOperator
        Unscaled ``Ψ₀`` (``c × d``).
    targets : torch.Tensor
        ``ỹ`` ``(c,)``.
    prior : {"gprior", "isotropic"} or torch.Tensor
        Prior scaling, or the scales ``s`` ``(d,)`` themselves (e.g. kept from an earlier posterior).
    gprior_method : {"exact", "stochastic"}
        Exact column norms (``c`` VJPs) or ``gprior_probes`` probes.
    gprior_probes : int
        Probes of the stochastic g-prior.
    likelihood : Likelihood, optional
        Default ``GaussianLikelihood(1.0)``.
    a : float
        Initial prior precision (> 0).
    solver : str
        A :data:`~ctuq.inference.solvers.SOLVER_CHOICES` value.
    solver_options : dict, optional
        CG: ``preconditioner``, ``rank``, ``oversampling``, ``rtol``, ``max_iter``, ``adaptive_rank``,
        ``rank_threshold``; exact: ``chunk_size``; SDD: ``sdd`` (a dict of :class:`~ctuq.inference.sdd.SDDSolver`
        options); SGD: ``sgd`` (a dict of :class:`~ctuq.inference.sgd.SGDSolver` options).
    workload : Workload, optional
        What the run will do (for ``solver="auto"``'s cost model).
    seed : int
        Seeds the g-prior probes, the preconditioner and the EM.
    output_map : callable, optional
        ``W`` ``(B, d)`` scaled weights → ``(B, d_out)`` network outputs; default ``Φ(s ⊙ w)`` when
        ``features`` has ``network_matvec`` (a :class:`~ctuq.inference.features.LinearizedFeatures`).
    progress : bool
        Progress bars for assembly and probes.
    log : callable, optional
        One-line status messages.
    shard : Shard, optional
        This process's share of the EM probes and prediction chunks (:mod:`ctuq.inference.distributed`); the
        set-up is done on rank 0 and broadcast. Default: one process.
    """

    def __init__(
        self,
        features: FeatureOperator,
        targets: torch.Tensor,
        *,
        prior: str | torch.Tensor = "gprior",
        gprior_method: str = "exact",
        gprior_probes: int = 256,
        likelihood: Likelihood | None = None,
        a: float = 1.0,
        solver: str = "auto",
        solver_options: dict | None = None,
        workload: Workload | None = None,
        seed: int = 0,
        output_map: Callable[[torch.Tensor], torch.Tensor] | None = None,
        progress: bool = False,
        log: Callable[[str], None] | None = None,
        shard: Shard | None = None,
    ):
        if isinstance(prior, str) and prior not in PRIORS:
            raise ValueError(f"uq.prior must be one of {list(PRIORS)}, got {prior!r}")
        if isinstance(prior, torch.Tensor) and tuple(prior.shape) != (features.n_features,):
            raise ValueError(f"LinearizedPosterior: prior scales must have shape ({features.n_features},), "
                             f"got {tuple(prior.shape)}")
        if gprior_method not in GPRIOR_METHODS:
            raise ValueError(f"uq.gprior_method must be one of {list(GPRIOR_METHODS)}, got {gprior_method!r}")
        self.base = features
        self.targets = _check_y(targets, features, "LinearizedPosterior")
        self.prior = prior
        self.gprior_method = gprior_method
        self.gprior_probes = int(gprior_probes)
        self.likelihood = likelihood if likelihood is not None else GaussianLikelihood(1.0)
        self.a, _ = _check_hyper(a, self.likelihood.sigma2, "LinearizedPosterior")
        self.solver_option = solver
        self.solver_options = dict(solver_options or {})
        _check_solver_options(self.solver_options)
        self.workload = workload or Workload()
        self.seed = int(seed)
        self._output_map = output_map
        self.progress = progress
        self.say = log or (lambda _msg: None)
        self.shard = shard if shard is not None else LocalShard()
        # set by setup() / fit() / load_state_dict()
        self.solver_name: str | None = None
        self.cost_estimates: dict[str, SolverCostEstimate] | None = None
        self.scales: torch.Tensor | None = prior.detach().to(features.device, features.dtype) \
            if isinstance(prior, torch.Tensor) else None
        self.features: FeatureOperator | None = None
        self.solver: Solver | None = None
        self.em: SampledEM | None = None
        self.em_result: EMResult | None = None
        self.timings: dict[str, float] = {}
        self._assembled: torch.Tensor | None = None  # Ψ₀ (c, d) when the solver assembled it
        self._pending: dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------ settings
    @classmethod
    def from_settings(cls, features: FeatureOperator, targets: torch.Tensor, settings: Any, **kwargs):
        """Build from a settings object with the ``uq`` config section's attribute names (``prior``,
        ``gprior_method``, ``gprior_probes``, ``solver``, ``preconditioner``, ``rank``, ``oversampling``,
        ``cg_tol``, ``cg_max_iter``, ``prior_precision``, ``em_steps``, ``em_samples``, ``samples``); ``kwargs``
        (``likelihood``, ``seed``, ``output_map``, ``progress``, ``log``) pass through."""
        s = settings
        options = {"preconditioner": s.preconditioner, "rank": s.rank, "oversampling": s.oversampling,
                   "rtol": s.cg_tol, "max_iter": s.cg_max_iter}
        workload = Workload(em_steps=s.em_steps, em_samples=s.em_samples, prediction_samples=s.samples,
                            rank=s.rank, oversampling=s.oversampling)
        # Settings of the scale issue (adaptive rank, first-order solvers): read with defaults so that settings
        # objects written before them keep working.
        if getattr(s, "adaptive_rank", False):
            options.update(adaptive_rank=True, rank_threshold=float(getattr(s, "rank_threshold", 1.0)))
        if hasattr(s, "sdd_iterations"):
            options["sdd"] = {"step_size": s.sdd_step, "momentum": s.sdd_momentum, "batch_size": s.sdd_batch,
                              "max_iter": s.sdd_iterations, "rtol": s.first_order_tol}
            options["sgd"] = {"lr": s.sgd_lr, "momentum": s.sgd_momentum, "lr_decay": s.sgd_lr_decay,
                              "clip": s.sgd_clip, "max_iter": s.sgd_iterations, "rtol": s.first_order_tol}
            workload = dataclasses.replace(workload, sdd_iterations=float(s.sdd_iterations),
                                           sgd_iterations=float(s.sgd_iterations), chunk=int(s.sample_chunk))
        return cls(features, targets, prior=s.prior, gprior_method=s.gprior_method, gprior_probes=s.gprior_probes,
                   a=s.prior_precision, solver=s.solver, solver_options=options, workload=workload, **kwargs)

    @property
    def sigma2(self) -> float:
        """Noise variance ``σ²`` (the likelihood's)."""
        return self.likelihood.sigma2

    @property
    def n_outputs(self) -> int:
        """``c``."""
        return self.base.n_outputs

    @property
    def n_features(self) -> int:
        """``d``."""
        return self.base.n_features

    @property
    def exact(self) -> bool:
        """Whether the solver gives exact ``γ``, ``‖w*‖²`` and log evidence."""
        return bool(self.solver is not None and self.solver.exact)

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self, on_stage: Callable[[str], None] | None = None) -> "LinearizedPosterior":
        """Resolve the solver, compute the prior scales, build ``Ψ`` and the solver (idempotent).

        ``on_stage("scales")`` after the scales, ``on_stage("solver")`` after the preconditioner or
        eigendecomposition (the moments to checkpoint :meth:`state_dict`).
        """
        if self.solver is not None:
            return self
        if self.shard.distributed and not getattr(self, "_synced", False):
            # Rank 0 does the set-up (g-prior, solver decomposition) once; the others load its state.
            self._synced = True
            state = None
            if self.shard.is_root:
                self.setup(on_stage)
                state = self.state_dict()
            state = self.shard.broadcast_object(state)
            if self.shard.is_root:
                return self
            self.load_state_dict(state)
        hook = on_stage or (lambda _stage: None)
        t0 = time.perf_counter()
        name = self._pending.get("solver_name")
        if name is None:
            name, self.cost_estimates = resolve_solver(self.solver_option, self.base, self.workload)
            if self.cost_estimates:
                self.say("solver cost estimates: "
                         + ", ".join(f"{k} {e.seconds:.0f} s" for k, e in self.cost_estimates.items()))
        self.solver_name = name
        self.timings["route"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        if SOLVERS[name].assembles_features:
            self.say(f"assembling Ψ₀ ({self.n_outputs} × {self.n_features}) with {self.n_features} JVPs")
            if self._assembled is None:
                self._assembled = assemble_features(self.base, by="columns", chunk_size=64, progress=self.progress)
            if self.scales is None:
                # Exact column norms are free once Ψ₀ is assembled (a stochastic g-prior is not needed here).
                from ctuq.priors import scales_from_sq_norms

                self.scales = (torch.ones(self.n_features, dtype=self.base.dtype, device=self.base.device)
                               if self.prior == "isotropic"
                               else scales_from_sq_norms(self._assembled.pow(2).sum(0)).to(self.base.dtype))
            self.features = DenseFeatures(self._assembled * self.scales.double()[None, :])
        else:
            if self.scales is None and "scales" in self._pending:
                self.scales = self._pending["scales"].to(device=self.base.device, dtype=self.base.dtype)
            if self.scales is None:
                self.scales = self._prior_scales()
            self.features = ScaledFeatures(self.base, self.scales)
        self.timings["gprior"] = time.perf_counter() - t0
        hook("scales")

        t0 = time.perf_counter()
        self.solver = self._build_solver(name)
        self.timings["solver_setup"] = time.perf_counter() - t0
        self.say(f"solver {name} set up (decomposition, preconditioner or step sizes): "
                 f"{self.timings['solver_setup']:.1f} s")
        hook("solver")
        return self

    def _prior_scales(self) -> torch.Tensor:
        from ctuq.priors import gprior_scales

        b = self.base
        if self.prior == "isotropic":
            return gprior_scales(None, method="isotropic", n_features=b.n_features, dtype=b.dtype, device=b.device)
        n = b.n_outputs if self.gprior_method == "exact" else self.gprior_probes
        self.say(f"g-prior scales ({self.gprior_method}, {n} VJPs)")
        return gprior_scales(b.rmatvec, b.n_outputs, method=self.gprior_method, n_features=b.n_features,
                             n_probes=self.gprior_probes, seed=self.seed, dtype=b.dtype, device=b.device,
                             chunk_size=64, progress=self.progress)

    def _build_solver(self, name: str) -> Solver:
        """Construct through :func:`~ctuq.inference.make_solver` (the solver options: flat for exact and CG,
        nested under ``"sdd"``/``"sgd"`` for the first-order solvers, as :meth:`from_settings` writes them), then
        decompose, precondition or restore."""
        opts = self.solver_options
        kw = dict(opts.get(name, {})) if name in ("sdd", "sgd") else \
            {k: v for k, v in opts.items() if k not in ("sdd", "sgd")}
        kw.setdefault("seed", self.seed)  # make_solver passes each solver only the options it takes
        kw.setdefault("progress", self.progress)
        saved = self._pending.get("solver_state")
        if name == "cg" and "solver_state" in self._pending:  # a restored preconditioner (or none) instead of a new one
            kw["preconditioner"] = LowRankEig.from_state_dict(saved, self.base.device) if saved is not None else "none"
        solver = make_solver(self.features, name, self.workload, **kw)
        if name == "exact_dual" and saved is not None:
            solver.load_decomposition(saved["eigenvalues"], saved["eigenvectors"])
        elif name.startswith("exact"):
            solver.decompose()  # primal: dense GEMM + eigh of the d × d Gram ΨᵀΨ, no Jacobian products
        elif name == "cg":
            solver.build_preconditioner(self.a, self.sigma2)
            eig = solver.low_rank
            if eig is not None and solver.adaptive_rank:
                self.say(f"adaptive preconditioner: rank {eig.rank} ({eig.n_products} kernel products; cap "
                         f"{solver.rank}, smallest eigenvalue/a {float(eig.eigenvalues[-1]) / self.a:.3g} vs "
                         f"{solver.rank_threshold:g}·σ² = {solver.rank_threshold * self.sigma2:.3g})")
        else:
            if saved is not None:
                solver.load_state_dict(saved)
            solver.build()
        return solver

    def _require_setup(self, what: str) -> None:
        if self.solver is None:
            raise RuntimeError(f"LinearizedPosterior.{what}: call setup() first")

    # ------------------------------------------------------------------------------------------ EM
    def fit(self, *, max_steps: int = 5, n_samples: int = 16, tol: float = 1e-2, gamma: str = "auto",
            callback: Callable[[dict], None] | None = None, fixed_probes: bool | None = None,
            stop_on: str = "a", update: str = "mackay") -> EMResult:
        """Sampled (or, with an exact solver, exact) EM for ``a`` (and ``σ²`` if the likelihood learns it).

        ``callback(record)`` after every step (:meth:`SampledEM.step`'s record), after :attr:`a` and the
        likelihood's ``σ²`` were updated. Returns the :class:`EMResult`; :attr:`em_trace` keeps the trace. Calling it
        again continues the same EM (same generator) up to the new ``max_steps`` and ``tol``.

        ``fixed_probes`` (see :class:`SampledEM`): ``None`` uses them with the solvers that take warm starts
        (``sdd``, ``sgd``) and fresh probes otherwise. ``stop_on``: ``"a"`` or ``"a_and_sigma2"``; ``update``:
        ``"mackay"`` or ``"damped"`` (:class:`SampledEM`). With a
        :attr:`shard`, the probes are split across ranks.
        """
        if update not in EM_UPDATES:
            raise ValueError(f"LinearizedPosterior.fit: update must be one of {list(EM_UPDATES)}, got {update!r}")
        self.setup()
        if fixed_probes is None:
            fixed_probes = bool(getattr(self.solver, "warm_starts", False))
        if self.em is not None:
            self.em.max_steps, self.em.tol, self.em.update = int(max_steps), float(tol), update
        else:
            self.em = SampledEM(self.features, self.solver, self.targets, a=self.a, likelihood=self.likelihood,
                                n_samples=n_samples, max_steps=max_steps, tol=tol, gamma=gamma, seed=self.seed,
                                fixed_probes=fixed_probes, stop_on=stop_on, shard=self.shard, update=update)
            if "em" in self._pending:
                self.em.load_state_dict(self._pending["em"])
                self.a = self.em.a
        t0 = time.perf_counter()

        def after(em: SampledEM, record: dict) -> None:
            self.a = em.a
            if callback is not None:
                callback(record)

        self.em_result = self.em.run(after)
        self.a = self.em_result.a
        self.timings["em"] = self.timings.get("em", 0.0) + time.perf_counter() - t0
        return self.em_result

    @property
    def em_trace(self) -> list[dict]:
        """One record per EM step so far (empty before :meth:`fit`)."""
        return [] if self.em is None else list(self.em.trace)

    def set_targets(self, targets: torch.Tensor) -> None:
        """Replace ``ỹ`` (same ``c``); a running EM continues with the new targets from its next step.

        For front ends whose targets depend on the hyperparameters: classification's pseudo-targets are rebuilt
        from the linearised model's mode at every EM step (:mod:`ctuq.classify.laplace`), typically from the
        ``callback`` of :meth:`fit`. Nothing else (scales, solver, decomposition) depends on the targets.
        """
        self.targets = _check_y(targets, self.base, "LinearizedPosterior.set_targets")
        if self.em is not None:
            self.em.y_tilde = self.targets

    # ------------------------------------------------------------------------------------------ prediction
    def mean(self) -> torch.Tensor:
        """Posterior mean weights ``w* = a⁻¹ Ψᵀ C⁻¹ ỹ`` ``(d,)`` (one solve, one VJP)."""
        self._require_setup("mean")
        w, _, _ = posterior_mean(self.features, self.solver, self.targets, self.a, self.sigma2)
        return w

    def log_evidence(self) -> float:
        """``log N(ỹ; 0, C)`` at the current ``a``, ``σ²`` (nats); exact solvers only."""
        self._require_setup("log_evidence")
        if not self.solver.exact:
            raise ValueError(f"log_evidence needs an exact solver (exact_primal / exact_dual); this posterior "
                             f"uses {self.solver_name!r}")
        return self.solver.log_evidence(self.targets, self.a, self.sigma2)

    def sample(self, n: int, *, chunk_size: int = 64, seed: int = 0, start_chunk: int = 0,
               chunks: Iterable[int] | None = None) -> Iterator[tuple[int, PosteriorSamples]]:
        """Zero-mean posterior weight samples ``ζ`` in chunks: yields ``(i, PosteriorSamples)``.

        Chunk ``i`` draws from its own generator ``(seed, i)``, so starting at ``start_chunk`` reproduces the
        chunks an uninterrupted run would have drawn (:func:`~ctuq.inference.sampler.sample_chunks`). ``chunks``
        restricts to those chunk indices (e.g. a rank's share, ``i ≡ rank (mod world_size)``).
        """
        self._require_setup("sample")
        return sample_chunks(self.features, self.solver, self.a, self.sigma2, n, chunk_size=chunk_size,
                             seed=seed, start_chunk=start_chunk, chunks=chunks)

    def output_samples(self, weights: torch.Tensor) -> torch.Tensor:
        """Network outputs ``Φ (s ⊙ ζ)`` ``(B, d_out)`` of scaled weight samples ``ζ`` ``(B, d)``."""
        self._require_setup("output_samples")
        if self._output_map is not None:
            return self._output_map(weights)
        if not hasattr(self.base, "network_matvec"):
            raise ValueError("LinearizedPosterior: these features have no network to map weights to outputs; "
                             "pass output_map=")
        return self.base.network_matvec(weights.to(self.base.dtype) * self.scales)

    def sample_outputs(self, n: int, *, chunk_size: int = 64, seed: int = 0, start_chunk: int = 0,
                       chunks: Iterable[int] | None = None) -> Iterator[tuple[int, torch.Tensor, PosteriorSamples]]:
        """Zero-mean output-space (image) samples in chunks: yields ``(i, outputs (B, d_out), samples)``."""
        for i, ps in self.sample(n, chunk_size=chunk_size, seed=seed, start_chunk=start_chunk, chunks=chunks):
            with torch.no_grad():
                yield i, self.output_samples(ps.weights), ps

    # ------------------------------------------------------------------------------------------ rows
    def _derived(self, base: FeatureOperator, targets: torch.Tensor, assembled: torch.Tensor | None):
        other = LinearizedPosterior(
            base, targets, prior=self.scales if self.scales is not None else self.prior,
            gprior_method=self.gprior_method, gprior_probes=self.gprior_probes,
            likelihood=copy.deepcopy(self.likelihood), a=self.a, solver=self.solver_option,
            solver_options=self.solver_options, workload=self.workload, seed=self.seed,
            output_map=self._output_map, progress=self.progress, log=self.say, shard=self.shard,
        )
        if self._output_map is None and hasattr(self.base, "network_matvec") and not hasattr(base, "network_matvec"):
            net_base = self.base
            other._output_map = lambda W: net_base.network_matvec(W.to(net_base.dtype) * other.scales)
        other._assembled = assembled
        return other

    def restrict(self, rows) -> "LinearizedPosterior":
        """The posterior given only measurements ``rows`` (index or boolean mask over ``c``).

        Keeps the prior scales ``s`` (once :meth:`setup` computed them; before that the new posterior computes its
        own on its rows), ``a`` and ``σ²``; the solver is set up anew on :meth:`setup`. An assembled ``Ψ₀`` is
        sliced, not recomputed.
        """
        base = self.base.restrict(rows)
        idx = base.rows if hasattr(base, "rows") else torch.as_tensor(rows)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().reshape(-1)
        assembled = None if self._assembled is None else self._assembled[idx.to(self._assembled.device)]
        return self._derived(base, self.targets[idx.to(self.targets.device)], assembled)

    def extend(self, features: FeatureOperator, targets: torch.Tensor) -> "LinearizedPosterior":
        """The posterior given these measurements and new rows ``features`` (unscaled ``Ψ₀`` rows, ``c' × d``)
        with targets ``(c',)``; same scales, ``a``, ``σ²``."""
        base = stack_features([self.base, features])
        new_t = _check_y(targets, features, "LinearizedPosterior.extend")
        return self._derived(base, torch.cat([self.targets, new_t.to(self.targets)]), None)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything to resume (tensors and plain values; ``torch.load(..., weights_only=True)``-loadable):
        solver name, scales, the solver's decomposition (CG preconditioner / dual eigendecomposition), the EM
        state, ``a`` and the likelihood."""
        state: dict[str, Any] = {
            "version": POSTERIOR_STATE_VERSION,
            "solver_name": self.solver_name,
            "a": float(self.a),
            "likelihood": self.likelihood.state_dict(),
        }
        if self.scales is not None:
            state["scales"] = self.scales.detach().cpu()
        if isinstance(self.solver, CGSolver):
            eig = self.solver.low_rank
            state["solver_state"] = None if eig is None else eig.state_dict()
        elif isinstance(self.solver, ExactEigSolver) and self.solver_name == "exact_dual":
            state["solver_state"] = self.solver.state_dict()
        elif self.solver_name in ("sdd", "sgd") and self.solver is not None:
            state["solver_state"] = self.solver.state_dict()
        if self.em is not None:
            state["em"] = self.em.state_dict()
        elif "em" in self._pending:  # loaded but not fitted yet: the EM progress is still part of the state
            state["em"] = self._pending["em"]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` output; call before :meth:`setup` and :meth:`fit`."""
        if not isinstance(state, dict) or state.get("version") != POSTERIOR_STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a LinearizedPosterior state of version {POSTERIOR_STATE_VERSION} (got {got!r})")
        if self.solver is not None:
            raise RuntimeError("LinearizedPosterior.load_state_dict: call it before setup()")
        name = state.get("solver_name")
        if name is not None and name not in SOLVERS:
            raise ValueError(f"LinearizedPosterior state names solver {name!r}; valid: {list(SOLVERS)}")
        self._pending = {}
        if name is not None:
            self._pending["solver_name"] = name
            if "solver_state" in state:  # None is meaningful: CG without a preconditioner
                self._pending["solver_state"] = state["solver_state"]
        for key in ("scales", "em"):
            if state.get(key) is not None:
                self._pending[key] = state[key]
        self.a, _ = _check_hyper(state["a"], self.sigma2, "LinearizedPosterior.load_state_dict")
        self.likelihood.load_state_dict(state["likelihood"])

    def summary(self) -> dict:
        """Plain numbers for reports: ``c``, ``d``, solver, ``a``, ``σ²``, EM steps, g-prior scale range."""
        s = self.scales
        out = {"c": int(self.n_outputs), "d": int(self.n_features), "solver": self.solver_name,
               "a": float(self.a), "sigma2": float(self.sigma2), "likelihood": self.likelihood.name,
               "em_steps": len(self.em_trace)}
        if s is not None:
            pos = s[s > 0]
            out["scales"] = {"zero": int((s == 0).sum()), "min": float(pos.min()) if pos.numel() else None,
                             "max": float(s.max())}
        return out

    def __repr__(self) -> str:
        return (f"LinearizedPosterior(c={self.n_outputs}, d={self.n_features}, solver={self.solver_name or self.solver_option!r}, "
                f"a={self.a:.4g}, {self.likelihood!r})")

