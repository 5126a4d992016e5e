"""``LinearizedPosterior``: the Gaussian posterior of a linearised model, as one object that outlives a run.

It holds everything the inference of DESIGN.md §1 needs and nothing CT-specific:

* the unscaled features ``Ψ₀`` (``c × d``; CT: ``T Φ``, classification: ``B^(1/2) Φ``) and the targets ``ỹ``
  (``c``; any offset ``δ`` already added);
* the weight prior ``v − ṽ = L w`` (:mod:`ctuq.inference.priors`: a :class:`~ctuq.inference.priors.WeightPrior`
  from the registry :data:`~ctuq.registry.PRIORS`, e.g. the g-prior ``L = diag(s)``, exact or stochastic, the
  isotropic prior, given scales, or the TV-PredCP block prior) and hence ``Ψ = Ψ₀ L``; the prior fits its own
  hyperparameters, if it has any, in :meth:`LinearizedPosterior.setup` (TV-PredCP: type-II MAP);
* the likelihood (:mod:`ctuq.inference.likelihoods`) with its ``σ²``, and the prior precision ``a``; a likelihood
  with per-row noise variances ``σ² D`` (:class:`~ctuq.inference.likelihoods.DiagonalGaussianLikelihood`) is
  handled by whitening: the solvers, the g-prior, the sampler and the EM see ``D^(−1/2) Ψ₀`` and ``D^(−1/2) ỹ``
  (noise ``σ² I``), while :attr:`base` and :attr:`targets` stay in measurement space and
  :meth:`log_evidence` is that of the measurements;
* a solver from the registry :data:`~ctuq.inference.solvers.SOLVERS` chosen by name or by cost, with its
  preconditioner or eigendecomposition (built once, reused for every ``a``, ``σ²``); every solver goes through
  the same lifecycle (:mod:`ctuq.inference.solvers.base`), so nothing here depends on which one it is;
* an optional output map ``W ↦ Φ (s ⊙ w)`` from scaled weights to network outputs (images), taken from the
  features when they are a linearised network.

Lifecycle (the same for every front end)::

    post = LinearizedPosterior(features, targets, prior="gprior", likelihood=GaussianLikelihood(σ², True),
                               a=100.0, solver="auto", seed=0)
    post.setup()                        # the prior (fit, Ψ), solver set-up   (stage "scales", then "solver")
    post.timings[post.weight_prior.timing_key]   # the prior's set-up seconds (the g-prior's: "gprior")
    post.fit(max_steps=5, n_samples=16) # sampled (or exact) EM for a (and σ²)   (stage "em" after each step)
    for i, chunk in post.sample_outputs(1024, chunk_size=64, seed=1): ...   # zero-mean image samples
    post.mean(); post.log_evidence()    # w*; exact evidence where the solver is exact
    post.state_dict() / post.load_state_dict(state)   # checkpoint/resume at every stage
    post.restrict(rows); post.extend(features_new, targets_new)   # condition on fewer / more measurements

Every stage calls an optional ``on_stage(name)`` hook after it finished, which is where a front end writes
``state_dict()`` atomically; :meth:`load_state_dict` before :meth:`setup` makes the later calls skip the
finished work (the stored scales, decomposition and EM state are reused), so a killed run resumes exactly.

A solver that :attr:`~ctuq.inference.solvers.base.Solver.assembles_features` (``exact_primal``) gets ``Ψ₀``
assembled (``d`` JVPs) and the prior builds a dense ``Ψ`` from it (the exact g-prior then comes from its column
norms at no further cost), so every later solve is dense. That is a property of the solver, so it lives here and not
in a front end.

The core takes keyword arguments only; the mapping from a configuration (the CT ``uq`` section) to these
arguments is :func:`ctuq.pipeline.uq_settings.posterior_arguments`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ctuq.errors import CheckpointMismatch
from ctuq.inference.checks import check_hyper, check_targets
from ctuq.inference.distributed import LocalShard, Shard
from ctuq.inference.em import EMResult, SampledEM
from ctuq.inference.features import FeatureOperator, RowScaledFeatures, stack_features
from ctuq.inference.kernel import assemble_features
from ctuq.inference.likelihoods import GaussianLikelihood, Likelihood
from ctuq.inference.priors import DiagonalPrior, PriorProblem, WeightPrior
from ctuq.inference.sampler import PosteriorSamples, posterior_mean, sample_chunks
from ctuq.inference.solvers import (
    SOLVERS,
    Solver,
    SolverCostEstimate,
    Workload,
    check_solver_options,
    resolve_solver,
    solver_choices,
    solver_kwargs,
)
from ctuq.options import EMUpdate, values
from ctuq.registry import PRIORS

__all__ = ["LinearizedPosterior", "POSTERIOR_STATE_VERSION"]

POSTERIOR_STATE_VERSION = 1


class LinearizedPosterior:
    """Posterior over scaled weights ``w ~ N(0, a⁻¹ I)`` given ``ỹ = Ψ w + ε`` (module docstring).

    Parameters
    ----------
    features : FeatureOperator
        Unscaled ``Ψ₀`` (``c × d``).
    targets : torch.Tensor
        ``ỹ`` ``(c,)``.
    prior : str, torch.Tensor or WeightPrior
        The weight prior ``v − ṽ = L w`` (:mod:`ctuq.inference.priors`): a name of :data:`~ctuq.registry.PRIORS`
        (``"gprior"``, ``"isotropic"``, ``"tv_predcp"``, or any registered later), made with ``prior_options``
        (:meth:`WeightPrior.create <ctuq.inference.priors.WeightPrior.create>`); the scales ``s`` ``(d,)``
        themselves (a :class:`~ctuq.inference.priors.DiagonalPrior`, e.g. kept from an earlier posterior); or an
        instance (such as a fitted :class:`~ctuq.inference.priors.TVPredCPPrior`). A prior with hyperparameters that
        are not final is fitted in :meth:`setup` (TV-PredCP: type-II MAP; it also sets ``σ²`` when the likelihood
        learns it); the features are then ``Ψ = Ψ₀ L``.
    prior_options : dict, optional
        Options of a prior given by name (its :meth:`~ctuq.inference.priors.WeightPrior.option_names`; e.g.
        ``method`` (``"exact"`` or ``"stochastic"`` column norms) and ``probes`` for ``"gprior"``; ``steps``,
        ``scale``, ``image_shape``, ``param_shapes`` (default: the linearised parameters of ``features.network``)
        and ``image_map`` (network weights → outputs, default ``features.network_matvec``) for ``"tv_predcp"``); for
        a given instance, what it takes from the posterior (TV-PredCP: ``image_map``).
    likelihood : Likelihood, optional
        Default ``GaussianLikelihood(1.0)``. A ``DiagonalGaussianLikelihood`` (noise ``σ² D``) must have one
        variance per target; the posterior then whitens by ``D^(−1/2)`` (module docstring).
    a : float
        Initial prior precision (> 0).
    solver : str
        ``"auto"`` (by estimated cost), ``"exact"`` (the cheaper exact side) or a registry name
        (:func:`~ctuq.inference.solvers.solver_choices`).
    solver_options : dict, optional
        Options of the solver's constructor. Flat keys go to whichever solver is chosen if it takes them (e.g.
        ``rank``, ``rtol`` for ``cg``; ``chunk_size`` for the exact solvers); a mapping under a registry name
        (``{"sdd": {"max_iter": 500}}``) holds one solver's own options and overrides flat ones. Names no
        registered solver takes raise. The posterior's ``seed`` and ``progress`` fill in where a solver takes them.
    workload : Workload, optional
        What the run will do (for ``solver="auto"``'s cost model).
    seed : int
        Seeds the prior's probes (the stochastic g-prior), the preconditioner and the EM.
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
        prior: str | torch.Tensor | Any = "gprior",
        prior_options: dict | None = None,
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
        if solver not in solver_choices():
            raise ValueError(f"LinearizedPosterior: solver must be one of {list(solver_choices())}, got {solver!r}")
        self.base = features
        self.targets = check_targets(targets, features, "LinearizedPosterior")
        self.weight_prior = self._make_prior(prior, dict(prior_options or {}), features)
        self.likelihood = likelihood if likelihood is not None else GaussianLikelihood(1.0)
        self._row_scales = self._check_row_scales()
        self.a, _ = check_hyper(a, self.likelihood.sigma2, "LinearizedPosterior")
        self.solver_option = str(solver)
        self.solver_options = dict(solver_options or {})
        check_solver_options(self.solver_options)
        self.workload = workload or Workload()
        self.seed = int(seed)
        self._output_map = output_map
        self.progress = progress
        self.say = log or (lambda _msg: None)
        self.shard = shard if shard is not None else LocalShard()
        # set by setup() / fit() / load_state_dict()
        self.solver_name: str | None = None
        self.cost_estimates: dict[str, SolverCostEstimate] | None = None
        self.features: FeatureOperator | None = None
        self.solver: Solver | None = None
        self.em: SampledEM | None = None
        self.em_result: EMResult | None = None
        self.timings: dict[str, float] = {}
        self._assembled: torch.Tensor | None = None  # Ψ₀ (c, d) when the solver assembled it
        self._pending: dict[str, Any] = {}

    @property
    def sigma2(self) -> float:
        """Noise variance ``σ²`` (the likelihood's)."""
        return self.likelihood.sigma2

    # ------------------------------------------------------------------------------------------ prior
    @staticmethod
    def _make_prior(prior, options: dict, features: FeatureOperator) -> WeightPrior:
        """The :class:`~ctuq.inference.priors.WeightPrior` of the ``prior`` argument (class docstring)."""
        if isinstance(prior, WeightPrior):
            prior.attach(features, **options)
            return prior
        if isinstance(prior, torch.Tensor):
            if tuple(prior.shape) != (features.n_features,):
                raise ValueError(
                    f"LinearizedPosterior: prior scales must have shape ({features.n_features},), "
                    f"got {tuple(prior.shape)}"
                )
            made = DiagonalPrior(prior.detach().to(features.device, features.dtype))
            made.attach(features, **options)
            return made
        if not isinstance(prior, str) or prior not in PRIORS:
            raise ValueError(
                f"LinearizedPosterior: prior must be one of {list(PRIORS.names())}, the scales "
                f"themselves or a WeightPrior, got {prior!r}"
            )
        return PRIORS[prior].create(features, **options)

    @property
    def prior(self) -> str:
        """The weight prior's name (``"gprior"``, ``"isotropic"``, ``"tv_predcp"``, ``"scales"`` for given ones)."""
        return self.weight_prior.name

    @property
    def scales(self) -> torch.Tensor | None:
        """The scales ``s`` ``(d,)`` of a diagonal prior once known (``None`` for other priors and before
        :meth:`setup` computed them)."""
        return self.weight_prior.scales if isinstance(self.weight_prior, DiagonalPrior) else None

    # ------------------------------------------------------------------------------------------ whitening
    def _check_row_scales(self) -> torch.Tensor | None:
        """The likelihood's whitening ``D^(−1/2)`` ``(c,)`` on the features' device and dtype (``None``: white)."""
        r = self.likelihood.row_scales()
        if r is None:
            return None
        if tuple(r.shape) != (self.base.n_outputs,):
            raise ValueError(
                f"LinearizedPosterior: the likelihood's variances have shape {tuple(r.shape)} but there are "
                f"{self.base.n_outputs} targets; give variances of shape ({self.base.n_outputs},)"
            )
        return r.to(device=self.base.device, dtype=self.base.dtype)

    def _whitened(self, base: FeatureOperator) -> FeatureOperator:
        """``D^(−1/2) Ψ₀`` (``Ψ₀`` itself for a white likelihood): what the g-prior and the solvers see."""
        return base if self._row_scales is None else RowScaledFeatures(base, self._row_scales)

    @property
    def whitened_targets(self) -> torch.Tensor:
        """``D^(−1/2) ỹ`` ``(c,)`` (``ỹ`` itself for a white likelihood): the targets of the solves and the EM."""
        return self.targets if self._row_scales is None else self.targets * self._row_scales.to(self.targets)

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
    def setup(self, on_stage: Callable[[str], None] | None = None) -> LinearizedPosterior:
        """Resolve the solver, compute the prior scales, build ``Ψ`` and the solver (idempotent).

        ``on_stage("route")`` once the solver is chosen (:attr:`solver_name`, :attr:`cost_estimates` for
        ``solver="auto"``), ``on_stage("scales")`` after the scales, ``on_stage("solver")`` after the preconditioner or
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
        self.solver_name = name
        self.timings["route"] = time.perf_counter() - t0
        hook("route")  # the solver is chosen (and its cost estimated) before any work: a front end can say so

        t0 = time.perf_counter()
        dense = None
        if SOLVERS[name].assembles_features:
            self.say(f"assembling Ψ₀ ({self.n_outputs} × {self.n_features}) with {self.n_features} JVPs")
            if self._assembled is None:
                self._assembled = assemble_features(self.base, by="columns", chunk_size=64, progress=self.progress)
            dense = self._assembled if self._row_scales is None else self._assembled * self._row_scales[:, None]
        self.weight_prior.restore(self._pending)
        done = self.weight_prior.setup(
            PriorProblem(
                self._whitened(self.base),
                self.whitened_targets,
                a=self.a,
                sigma2=self.sigma2,
                learn_noise=bool(self.likelihood.learn_noise),
                dense=dense,
                seed=self.seed,
                progress=self.progress,
                log=self.say,
            )
        )
        self.features = done.features
        if done.sigma2 is not None and self.likelihood.learn_noise:
            self.likelihood.sigma2 = done.sigma2
        if done.fit_seconds is not None:
            self.timings["prior_fit"] = done.fit_seconds
        self.timings[self.weight_prior.timing_key] = time.perf_counter() - t0
        hook("scales")

        t0 = time.perf_counter()
        self.solver = self._build_solver(name)
        self.timings["solver_setup"] = time.perf_counter() - t0
        self.say(
            f"solver {name} set up (decomposition, preconditioner or step sizes): {self.timings['solver_setup']:.1f} s"
        )
        hook("solver")
        return self

    def _build_solver(self, name: str) -> Solver:
        """The registered solver ``name`` with its options (:func:`~ctuq.inference.solvers.solver_kwargs`), its
        stored state if resuming, and its set-up at the current ``(a, σ²)``."""
        cls = SOLVERS[name]
        kw = solver_kwargs(self.solver_options, name)
        takes = cls.option_names()
        for key, value in (("seed", self.seed), ("progress", self.progress)):
            if key in takes:
                kw.setdefault(key, value)
        solver = cls(self.features, **kw)
        if "solver_state" in self._pending:  # None is meaningful (e.g. CG without a preconditioner)
            solver.load_state_dict(self._pending["solver_state"])
        solver.setup(self.a, self.sigma2)
        note = solver.setup_note()
        if note:
            self.say(note)
        return solver

    def _require_setup(self, what: str) -> None:
        if self.solver is None:
            raise RuntimeError(f"LinearizedPosterior.{what}: call setup() first")

    # ------------------------------------------------------------------------------------------ EM
    def fit(
        self,
        *,
        max_steps: int = 5,
        n_samples: int = 16,
        tol: float = 1e-2,
        gamma: str = "auto",
        callback: Callable[[dict], None] | None = None,
        fixed_probes: bool | None = None,
        stop_on: str = "a",
        update: str = "mackay",
    ) -> EMResult:
        """Sampled (or, with an exact solver, exact) EM for ``a`` (and ``σ²`` if the likelihood learns it).

        ``callback(record)`` after every step (:meth:`SampledEM.step`'s record), after :attr:`a` and the
        likelihood's ``σ²`` were updated. Returns the :class:`EMResult`; :attr:`em_trace` keeps the trace. Calling it
        again continues the same EM (same generator) up to the new ``max_steps`` and ``tol``.

        ``fixed_probes`` (see :class:`SampledEM`): ``None`` uses them with the solvers that take warm starts
        (``sdd``, ``sgd``) and fresh probes otherwise. ``stop_on``: ``"a"`` or ``"a_and_sigma2"``; ``update``:
        ``"mackay"`` or ``"damped"`` (:class:`SampledEM`). With a
        :attr:`shard`, the probes are split across ranks.
        """
        if update not in values(EMUpdate):
            raise ValueError(f"LinearizedPosterior.fit: update must be one of {list(values(EMUpdate))}, got {update!r}")
        self.setup()
        if fixed_probes is None:
            fixed_probes = bool(getattr(self.solver, "warm_starts", False))
        if self.em is not None:
            self.em.max_steps, self.em.tol, self.em.update = int(max_steps), float(tol), str(update)
        else:
            self.em = SampledEM(
                self.features,
                self.solver,
                self.whitened_targets,
                a=self.a,
                likelihood=self.likelihood,
                n_samples=n_samples,
                max_steps=max_steps,
                tol=tol,
                gamma=gamma,
                seed=self.seed,
                fixed_probes=fixed_probes,
                stop_on=stop_on,
                shard=self.shard,
                update=update,
            )
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

    def reset_em(self) -> None:
        """Drop the EM's state (its generator, probes, trace and warm starts): the next :meth:`fit` starts a new
        EM at the current ``a`` and ``σ²``. Scales, solver and its set-up are kept."""
        self.em = None
        self.em_result = None
        self._pending.pop("em", None)

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
        self.targets = check_targets(targets, self.base, "LinearizedPosterior.set_targets")
        if self.em is not None:
            self.em.y_tilde = self.whitened_targets

    # ------------------------------------------------------------------------------------------ prediction
    def mean(self) -> torch.Tensor:
        """Posterior mean weights ``w* = a⁻¹ Ψᵀ C⁻¹ ỹ`` ``(d,)`` (one solve, one VJP)."""
        self._require_setup("mean")
        w, _, _ = posterior_mean(self.features, self.solver, self.whitened_targets, self.a, self.sigma2)
        return w

    def log_evidence(self) -> float:
        """``log N(ỹ; 0, C)`` at the current ``a``, ``σ²`` (nats), ``C = Ψ₀ diag(s)² Ψ₀ᵀ/a + σ² D`` in measurement
        space (the whitened evidence plus the likelihood's ``−½ log det D``); exact solvers only."""
        self._require_setup("log_evidence")
        if not self.solver.exact:
            exact = [n for n, cls in SOLVERS.items() if cls.exact]
            raise ValueError(
                f"log_evidence needs an exact solver ({' / '.join(exact)}); this posterior uses {self.solver_name!r}"
            )
        return self.solver.log_evidence(self.whitened_targets, self.a, self.sigma2) + float(
            self.likelihood.log_evidence_correction()
        )

    def sample(
        self, n: int, *, chunk_size: int = 64, seed: int = 0, start_chunk: int = 0, chunks: Iterable[int] | None = None
    ) -> Iterator[tuple[int, PosteriorSamples]]:
        """Zero-mean posterior weight samples ``ζ`` in chunks: yields ``(i, PosteriorSamples)``.

        Chunk ``i`` draws from its own generator ``(seed, i)``, so starting at ``start_chunk`` reproduces the
        chunks an uninterrupted run would have drawn (:func:`~ctuq.inference.sampler.sample_chunks`). ``chunks``
        restricts to those chunk indices (e.g. a rank's share, ``i ≡ rank (mod world_size)``).
        """
        self._require_setup("sample")
        return sample_chunks(
            self.features,
            self.solver,
            self.a,
            self.sigma2,
            n,
            chunk_size=chunk_size,
            seed=seed,
            start_chunk=start_chunk,
            chunks=chunks,
        )

    def output_samples(self, weights: torch.Tensor) -> torch.Tensor:
        """Network outputs ``Φ (s ⊙ ζ)`` ``(B, d_out)`` of scaled weight samples ``ζ`` ``(B, d)``."""
        self._require_setup("output_samples")
        if self._output_map is not None:
            return self._output_map(weights)
        if not hasattr(self.base, "network_matvec"):
            raise ValueError(
                "LinearizedPosterior: these features have no network to map weights to outputs; pass output_map="
            )
        return self.base.network_matvec(self.weight_prior.apply(weights.to(self.base.dtype)).to(self.base.dtype))

    def sample_outputs(
        self, n: int, *, chunk_size: int = 64, seed: int = 0, start_chunk: int = 0, chunks: Iterable[int] | None = None
    ) -> Iterator[tuple[int, torch.Tensor, PosteriorSamples]]:
        """Zero-mean output-space (image) samples in chunks: yields ``(i, outputs (B, d_out), samples)``."""
        for i, ps in self.sample(n, chunk_size=chunk_size, seed=seed, start_chunk=start_chunk, chunks=chunks):
            with torch.no_grad():
                yield i, self.output_samples(ps.weights), ps

    # ------------------------------------------------------------------------------------------ rows
    def _derived(
        self, base: FeatureOperator, targets: torch.Tensor, assembled: torch.Tensor | None, likelihood: Likelihood
    ):
        other = LinearizedPosterior(
            base,
            targets,
            prior=self.weight_prior.derived(),
            likelihood=likelihood,
            a=self.a,
            solver=self.solver_option,
            solver_options=self.solver_options,
            workload=self.workload,
            seed=self.seed,
            output_map=self._output_map,
            progress=self.progress,
            log=self.say,
            shard=self.shard,
        )
        if self._output_map is None and hasattr(self.base, "network_matvec") and not hasattr(base, "network_matvec"):
            net_base, prior = self.base, other.weight_prior
            other._output_map = lambda W: net_base.network_matvec(prior.apply(W.to(net_base.dtype)).to(net_base.dtype))
        other._assembled = assembled
        return other

    def restrict(self, rows) -> LinearizedPosterior:
        """The posterior given only measurements ``rows`` (index or boolean mask over ``c``).

        Keeps the prior scales ``s`` (once :meth:`setup` computed them; before that the new posterior computes its
        own on its rows), ``a``, ``σ²`` and the rows' noise variances; the solver is set up anew on :meth:`setup`.
        An assembled ``Ψ₀`` is sliced, not recomputed.
        """
        base = self.base.restrict(rows)
        idx = base.rows if hasattr(base, "rows") else torch.as_tensor(rows)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().reshape(-1)
        assembled = None if self._assembled is None else self._assembled[idx.to(self._assembled.device)]
        return self._derived(
            base, self.targets[idx.to(self.targets.device)], assembled, self.likelihood.restrict(idx.cpu())
        )

    def extend(
        self, features: FeatureOperator, targets: torch.Tensor, variances: torch.Tensor | None = None
    ) -> LinearizedPosterior:
        """The posterior given these measurements and new rows ``features`` (unscaled ``Ψ₀`` rows, ``c' × d``)
        with targets ``(c',)``; same scales, ``a``, ``σ²``. ``variances`` ``(c',)``: the new rows' relative noise
        variances, needed by (and only by) a likelihood with per-row variances."""
        base = stack_features([self.base, features])
        new_t = check_targets(targets, features, "LinearizedPosterior.extend")
        likelihood = self.likelihood.extend(variances, features.n_outputs)
        return self._derived(base, torch.cat([self.targets, new_t.to(self.targets)]), None, likelihood)

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything to resume (tensors and plain values; ``torch.load(..., weights_only=True)``-loadable):
        solver name, the prior's entries (:meth:`~ctuq.inference.priors.WeightPrior.checkpoint`: a diagonal prior's
        scales, fitted hyperparameters), the solver's decomposition (CG preconditioner / dual eigendecomposition), the
        EM state, ``a`` and the likelihood."""
        state: dict[str, Any] = {
            "version": POSTERIOR_STATE_VERSION,
            "solver_name": self.solver_name,
            "a": float(self.a),
            "likelihood": self.likelihood.state_dict(),
        }
        state.update(self.weight_prior.checkpoint())
        if self.solver is not None:
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
            raise CheckpointMismatch(
                f"not a LinearizedPosterior state of version {POSTERIOR_STATE_VERSION} (got {got!r})"
            )
        if self.solver is not None:
            raise RuntimeError("LinearizedPosterior.load_state_dict: call it before setup()")
        name = state.get("solver_name")
        if name is not None and name not in SOLVERS:
            raise CheckpointMismatch(f"LinearizedPosterior state names solver {name!r}; valid: {list(SOLVERS)}")
        self._pending = {}
        if name is not None:
            self._pending["solver_name"] = name
            if "solver_state" in state:  # None is meaningful: CG without a preconditioner
                self._pending["solver_state"] = state["solver_state"]
        # the EM's state and the prior's entries (WeightPrior.checkpoint: "scales", "prior_state")
        for key, value in state.items():
            if key not in ("version", "solver_name", "solver_state", "a", "likelihood") and value is not None:
                self._pending[key] = value
        self.a, _ = check_hyper(state["a"], self.sigma2, "LinearizedPosterior.load_state_dict")
        self.likelihood.load_state_dict(state["likelihood"])

    def summary(self) -> dict:
        """Plain numbers for reports: ``c``, ``d``, solver, ``a``, ``σ²``, EM steps, and ``prior``: the weight prior's
        :meth:`~ctuq.inference.priors.WeightPrior.summary` (a diagonal prior's scale range, TV-PredCP's blocks)."""
        return {
            "c": int(self.n_outputs),
            "d": int(self.n_features),
            "solver": self.solver_name,
            "a": float(self.a),
            "sigma2": float(self.sigma2),
            "likelihood": self.likelihood.name,
            "em_steps": len(self.em_trace),
            "prior": self.weight_prior.summary(),
        }

    def __repr__(self) -> str:
        return (
            f"LinearizedPosterior(c={self.n_outputs}, d={self.n_features}, "
            f"solver={self.solver_name or self.solver_option!r}, a={self.a:.4g}, {self.likelihood!r})"
        )
