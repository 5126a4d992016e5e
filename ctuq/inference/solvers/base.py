"""The solver contract: apply ``C⁻¹`` with ``C = K̄/a + σ² I`` to right-hand-side rows ``R`` ``(k, c)``.

Every solver has one lifecycle, so the posterior, the sampler and the EM treat them all alike::

    solver = SOLVERS[name](features, **options)   # cheap: stores Ψ and the options, builds nothing
    solver.load_state_dict(state)                  # optional, before setup: reuse a checkpointed set-up
    solver.setup(a, sigma2)                        # decomposition / preconditioner / step sizes; idempotent
    X, stats = solver.solve(R, a, sigma2, x0=None) # C⁻¹R rows (k, c) and SolveStats
    solver.state_dict()                            # what setup built (plain tensors/numbers), or None

A solver class owns its registry name (:attr:`Solver.name`), a one-line :attr:`Solver.summary`, what it offers
(:attr:`~Solver.exact`, :attr:`~Solver.assembles_features`, :attr:`~Solver.warm_starts`), its options
(:attr:`Solver.Options`, below), its cost estimate (:meth:`Solver.estimate_cost`, used by ``solver="auto"``), its
state, and what a front end reports about it (:meth:`Solver.report`, :meth:`Solver.describe`).
:class:`ExactSolver` adds the exact quantities the EM uses instead of samples (``γ``, ``‖w*‖²``, ``‖ỹ − Ψw*‖²``,
the log evidence) from one decomposition.

Options, in one place: a solver's options are the keyword-only parameters of its ``__init__``, declared once as
the dataclass :attr:`Solver.Options` (fields made with :func:`ctuq.options.option`: default, bounds, help). The
``__init__`` takes its defaults from it (``rank: int = Options.rank``); a class that declares ``Options`` whose
names or defaults differ from its ``__init__``'s is refused when the class is defined. :meth:`Solver.option_names`
and the run configuration's section ``uq.<name>`` (``uq.cg.rank``, ...) are read from it, leaving out
:attr:`Solver.runtime_options` (what the posterior supplies itself). A class that declares no ``Options`` gets one
derived from its ``__init__`` (without help or bounds).

Adding a solver: subclass :class:`Solver` (or :class:`ExactSolver`) in a new module of this package, register it
with ``@SOLVERS.register`` (:data:`ctuq.registry.SOLVERS`), and import the module in the package ``__init__``
(the one registry line).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
import typing
import warnings
from typing import Any, ClassVar

import torch

from ctuq.inference.checks import check_rhs
from ctuq.inference.features import FeatureOperator
from ctuq.inference.kernel import KernelOperator, measurement_covariance
from ctuq.options import option
from ctuq.registry import SOLVERS

__all__ = [
    "Workload",
    "DEFAULT_WORKLOAD",
    "SolverCostEstimate",
    "cost_estimate",
    "ConvergenceWarning",
    "SolveStats",
    "relative_residual",
    "warn_not_converged",
    "NoOptions",
    "Solver",
    "ExactSolver",
]


# ------------------------------------------------------------------------------------------ cost value types
@dataclasses.dataclass(frozen=True)
class Workload:
    """What the inference will do, to estimate solver costs.

    Attributes
    ----------
    em_steps : int
        Sampled-EM steps (default 5).
    em_samples : int
        Posterior samples per EM step (default 16).
    prediction_samples : int
        Weight-space posterior samples for prediction (default 1024).
    cg_iterations : float
        Expected preconditioned CG iterations per solve (published: ≤ 10 with a rank-400 preconditioner).
    rank, oversampling : int
        CG preconditioner rank (the cap with an adaptive rank) and oversampling.
    sdd_iterations, sgd_iterations : float
        Iterations per solve of the first-order solvers (their budgets).
    chunk : int
        Prediction samples solved together: the first-order solvers hold a few ``chunk × c`` (SDD) or
        ``chunk × d`` (SGD) buffers.
    lanczos_steps : int
        Kernel products of the first-order solvers' ``λ_max(K̄)`` estimate.
    """

    em_steps: int = 5
    em_samples: int = 16
    prediction_samples: int = 1024
    cg_iterations: float = 10.0
    rank: int = 400
    oversampling: int = 10
    sdd_iterations: float = 1000.0
    sgd_iterations: float = 1000.0
    chunk: int = 64
    lanczos_steps: int = 20

    @property
    def n_solves(self) -> int:
        """Right-hand sides solved in all: ``k + 1`` per EM step (samples and the mean) and ``n + 1`` for
        prediction."""
        return self.em_steps * (self.em_samples + 1) + (self.prediction_samples + 1)


DEFAULT_WORKLOAD = Workload()
"""The published run (5 EM steps of 16 samples, 1024 prediction samples): the default of every cost query."""


@dataclasses.dataclass
class SolverCostEstimate:
    """Estimated cost of one solver for a :class:`Workload`.

    ``jvp``/``vjp``: Jacobian products; ``dense_flops``: dense linear algebra; ``memory_bytes``: peak extra
    memory of the solver; ``seconds``: ``jvp·t_jvp + vjp·t_vjp + dense_flops/flop_rate``; ``feasible``: fits the
    memory budget; ``t_jvp``/``t_vjp``: the seconds per product (per sample) the estimate used (measured on this
    machine by :func:`choose_solver`), so that a front end can add the products it spends beside the solver's.
    """

    solver: str
    jvp: float
    vjp: float
    dense_flops: float
    memory_bytes: float
    seconds: float
    feasible: bool
    t_jvp: float = 0.0
    t_vjp: float = 0.0


def cost_estimate(
    name: str,
    jvp: float,
    vjp: float,
    dense_flops: float,
    memory_bytes: float,
    *,
    t_jvp: float,
    t_vjp: float,
    flop_rate: float,
    memory_budget: float,
) -> SolverCostEstimate:
    """A :class:`SolverCostEstimate` from counts: seconds ``jvp·t_jvp + vjp·t_vjp + dense_flops/flop_rate``,
    feasible when ``memory_bytes ≤ memory_budget`` (bytes)."""
    return SolverCostEstimate(
        name,
        float(jvp),
        float(vjp),
        float(dense_flops),
        float(memory_bytes),
        jvp * t_jvp + vjp * t_vjp + dense_flops / flop_rate,
        memory_bytes <= memory_budget,
        float(t_jvp),
        float(t_vjp),
    )


class ConvergenceWarning(RuntimeWarning):
    """An iterative solve stopped at its iteration cap above its tolerance."""


@dataclasses.dataclass
class SolveStats:
    """What one batched solve cost and how well it converged.

    Attributes
    ----------
    iterations : torch.Tensor
        ``(k,)`` int, iterations each right-hand side needed (0 for direct solves).
    relative_residual : torch.Tensor
        ``(k,)`` float64, ``‖C x_j − b_j‖ / ‖b_j‖`` at exit (0 for a zero right-hand side).
    converged : torch.Tensor
        ``(k,)`` bool, ``relative_residual ≤ rtol``.
    n_products : int
        Kernel products (one VJP + one JVP each) spent.
    method : str
        ``"pcg"``, ``"linear_cg"``, ``"eig"``, ``"sdd"``, ``"sgd"``, ...
    """

    iterations: torch.Tensor
    relative_residual: torch.Tensor
    converged: torch.Tensor
    n_products: int
    method: str

    @property
    def max_iterations(self) -> int:
        """Largest iteration count over the right-hand sides (0 when there are none)."""
        return int(self.iterations.max()) if self.iterations.numel() else 0

    @property
    def all_converged(self) -> bool:
        """Whether every right-hand side reached its tolerance."""
        return bool(self.converged.all())

    def summary(self) -> dict:
        """JSON-friendly digest: method, max/mean iterations, max residual, converged count, products."""
        k = int(self.iterations.numel())
        return {
            "method": self.method,
            "n_rhs": k,
            "max_iterations": self.max_iterations,
            "mean_iterations": float(self.iterations.double().mean()) if k else 0.0,
            "max_relative_residual": float(self.relative_residual.max()) if k else 0.0,
            "n_converged": int(self.converged.sum()),
            "n_products": int(self.n_products),
        }


def relative_residual(resid: torch.Tensor, bnorm: torch.Tensor) -> torch.Tensor:
    """``‖r_j‖ / ‖b_j‖`` ``(k,)`` float64 for residual rows ``resid`` ``(k, c)`` and right-hand-side norms ``bnorm``
    ``(k,)`` float64; 0 where ``‖b_j‖ = 0`` (a zero right-hand side is solved exactly by ``x = 0``). The one
    definition every solver reports in :class:`SolveStats`."""
    r = torch.linalg.vector_norm(resid.double(), dim=1)
    return torch.where(bnorm > 0, r / bnorm.clamp_min(1e-300), torch.zeros_like(r))


def warn_not_converged(stats: SolveStats, rtol: float, max_iter: int, *, stacklevel: int = 3) -> None:
    """A :class:`ConvergenceWarning` for CG's unconverged right-hand sides (how many, the worst residual)."""
    n_bad = int((~stats.converged).sum())
    warnings.warn(
        f"CG did not converge for {n_bad} of {stats.converged.numel()} right-hand side(s) within {max_iter} "
        f"iterations: largest relative residual {float(stats.relative_residual.max()):.3e} > rtol {rtol:.1e}. "
        f"Raise max_iter, use (a higher-rank) preconditioner, or loosen rtol; results are inaccurate.",
        ConvergenceWarning,
        stacklevel=stacklevel,
    )


@dataclasses.dataclass
class NoOptions:
    """A solver without options."""


def _keyword_parameters(cls: type) -> dict[str, inspect.Parameter]:
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _options_from_init(cls: type) -> type:
    """The ``Options`` of a solver class that declares none: its ``__init__``'s keyword-only parameters, with their
    annotations and defaults (no help, no bounds; a parameter without a default is a required field)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # annotations naming what only a type checker sees: the engine then takes any value
        hints = {}
    fields = []
    for name, p in _keyword_parameters(cls).items():
        meta = dict(option().metadata)
        if p.default is inspect.Parameter.empty:
            field = dataclasses.field(metadata=meta)
        elif isinstance(p.default, (list, dict, set)):
            field = dataclasses.field(default_factory=lambda v=p.default: copy.copy(v), metadata=meta)
        else:
            field = dataclasses.field(default=p.default, metadata=meta)
        fields.append((name, hints.get(name, Any), field))
    options = dataclasses.make_dataclass(f"{cls.__name__}Options", fields, kw_only=True)
    options.__module__, options.__qualname__ = cls.__module__, f"{cls.__qualname__}.Options"
    options.__doc__ = f"The keyword-only parameters of {cls.__name__}.__init__ (the class declares no Options)."
    return options


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return inspect.Parameter.empty


def _check_options(cls: type) -> None:
    """Refuse a declared ``Options`` whose names or defaults are not those of ``cls.__init__``."""
    options = cls.Options
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"{cls.__name__}.Options must be a dataclass of option() fields, got {options!r}")
    declared = {f.name: f for f in dataclasses.fields(options)}
    params = _keyword_parameters(cls)
    if set(declared) != set(params):
        raise TypeError(
            f"{cls.__name__}.Options declares {sorted(declared)} but {cls.__name__}.__init__ takes the keyword-only "
            f"options {sorted(params)}; declare each option once, in Options, and take its default from there"
        )
    for name, f in declared.items():
        want, got = _field_default(f), params[name].default
        if not (want is got or want == got):
            raise TypeError(
                f"{cls.__name__}: option {name!r} defaults to {got!r} in __init__ but to {want!r} in Options; "
                f"write the default once (in Options) and use it in __init__ ({name}=Options.{name})"
            )


class Solver(abc.ABC):
    """Applies ``C⁻¹`` for ``C = K̄/a + σ² I``: ``solve(rhs, a, sigma2) -> (X, SolveStats)`` for rows ``(k, c)``.

    Subclasses take ``features`` (``Ψ``, ``c × d``) first and their options as keyword-only arguments, declared in
    :attr:`Options` (module docstring).

    Attributes
    ----------
    name : str
        Registry name (the ``solver=`` value); set by every registered class.
    summary : str
        One line for ``--help`` and docs.
    exact : bool
        Exact ``γ``, ``‖w*‖²`` and log evidence for every ``(a, σ²)`` (an :class:`ExactSolver`): EM at no
        Jacobian cost.
    assembles_features : bool
        The posterior assembles ``Ψ₀`` for it (``d`` JVPs; ``c·d`` floats): the exact g-prior then comes free.
    warm_starts : bool
        Whether :class:`~ctuq.inference.em.SampledEM` should pass the previous step's solutions as ``x0`` (the
        first-order solvers; CG and the exact solvers keep their numbers independent of earlier calls).
    Options : type
        The dataclass of the solver's options (its ``__init__``'s keyword-only parameters; fields made with
        :func:`ctuq.options.option`: default, bounds, help), from which :meth:`option_names` and the config section
        ``uq.<name>`` derive.
    runtime_options : frozenset of str
        Options the posterior supplies itself when the solver takes them (its ``seed``, its ``progress`` flag):
        not configuration, so the config derives no key for them.
    features : FeatureOperator
        ``Ψ``.
    kernel : KernelOperator
        ``K̄ = ΨΨᵀ`` on the same features.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    exact: ClassVar[bool] = False
    assembles_features: ClassVar[bool] = False
    warm_starts: ClassVar[bool] = False
    Options: ClassVar[type] = NoOptions
    runtime_options: ClassVar[frozenset[str]] = frozenset({"seed", "progress"})

    features: FeatureOperator
    kernel: KernelOperator

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__:
            _check_options(cls)
        else:
            cls.Options = _options_from_init(cls)

    def __init__(self, features: FeatureOperator):
        self.features = features
        self.kernel = KernelOperator(features=features)

    # ------------------------------------------------------------------------------------------ class facts
    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The options this solver takes: the fields of :attr:`Options` (its ``__init__``'s keyword-only
        parameters)."""
        return frozenset(f.name for f in dataclasses.fields(cls.Options))

    @classmethod
    def estimate_cost(
        cls,
        c: int,
        d: int,
        workload: Workload,
        *,
        t_jvp: float,
        t_vjp: float,
        flop_rate: float,
        memory_budget: float,
        itemsize: int,
    ) -> SolverCostEstimate | None:
        """Estimated cost of this solver for ``c`` outputs, ``d`` features and ``workload``
        (:func:`~ctuq.inference.solvers.cost.estimate_solver_costs` documents the units); ``None`` keeps the solver
        out of ``solver="auto"`` (the default)."""
        return None

    # ------------------------------------------------------------------------------------------ lifecycle
    def setup(self, a: float, sigma2: float) -> None:
        """Build what every later solve reuses (decomposition, preconditioner, step sizes) at the ``(a, σ²)`` of
        the first solves; idempotent, and a no-op after :meth:`load_state_dict` restored it. Solves call it
        themselves when needed; the posterior calls it once so that the set-up is timed and checkpointed."""
        return None  # solvers with nothing to build (e.g. a direct dense one) keep this default

    @abc.abstractmethod
    def solve(
        self, rhs: torch.Tensor, a: float, sigma2: float, *, x0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, SolveStats]:
        """``C⁻¹ rhs`` for rows ``rhs`` ``(k, c)`` at prior precision ``a`` and noise variance ``σ²``; ``x0``
        ``(k, c)`` is an initial guess for iterative solvers (ignored by direct ones)."""

    def state_dict(self) -> dict | None:
        """What :meth:`setup` built, as plain tensors and numbers (``torch.load(weights_only=True)``-loadable), or
        ``None`` when there is nothing worth storing."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Reuse :meth:`state_dict` output instead of building it in :meth:`setup`; call before :meth:`setup`."""
        if state is not None:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: this solver stores no state, got {type(state).__name__}"
            )

    # ------------------------------------------------------------------------------------------ reporting
    def report(self) -> dict:
        """JSON-friendly facts about the set-up for a run's statistics (e.g. the preconditioner); ``{}`` if none."""
        return {}

    def describe(self) -> str:
        """Tail of the one-line log message naming the solver (e.g. ``" (rank-400 nystrom preconditioner)"``)."""
        return ""

    def setup_note(self) -> str | None:
        """One log line about what :meth:`setup` found (e.g. an adaptive rank), or ``None``."""
        return None

    # ------------------------------------------------------------------------------------------ helpers
    def covariance(self, a: float, sigma2: float):
        """``C = K̄/a + σ² I`` as a LinearOperator sharing this solver's kernel."""
        return measurement_covariance(self.kernel, a, sigma2)

    def _check_rhs(self, rhs: torch.Tensor) -> torch.Tensor:
        return check_rhs(rhs, self.features, f"{type(self).__name__}.solve")


class ExactSolver(Solver):
    """A solver with one decomposition from which ``γ``, ``‖w*‖²``, ``‖ỹ − Ψw*‖²`` and the log evidence are exact
    for every ``(a, σ²)``: :class:`~ctuq.inference.em.SampledEM` then needs no samples and no Jacobian products."""

    exact: ClassVar[bool] = True

    @abc.abstractmethod
    def decompose(self):
        """Build (once) and return the decomposition every exact quantity is read from."""

    def setup(self, a: float, sigma2: float) -> None:
        """The decomposition (independent of ``a`` and ``σ²``)."""
        self.decompose()

    @abc.abstractmethod
    def gamma(self, a: float, sigma2: float) -> float:
        """Effective dimension ``γ = tr(K̄ C⁻¹)/a``."""

    @abc.abstractmethod
    def weight_norm_sq(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``‖w*‖²`` of the posterior mean ``w* = a⁻¹ΨᵀC⁻¹ỹ`` for targets ``ỹ`` ``(c,)``."""

    @abc.abstractmethod
    def residual_norm_sq(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``‖ỹ − Ψw*‖² = σ⁴‖C⁻¹ỹ‖²``."""

    @abc.abstractmethod
    def log_evidence(self, y_tilde: torch.Tensor, a: float, sigma2: float) -> float:
        """``log N(ỹ; 0, C)`` in nats."""


SOLVERS.set_base(Solver)
