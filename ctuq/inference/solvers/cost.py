"""Which solver: the cost model, the choice by cost (``solver="auto"``), name resolution and the factory.

Each registered solver class estimates its own cost (:meth:`~ctuq.inference.solvers.base.Solver.estimate_cost`);
:func:`estimate_solver_costs` collects the estimates over the registry (the exact family contributes one
``"exact"`` estimate, resolved to a side afterwards), :func:`choose_solver` picks the cheapest that fits the memory
budget, :func:`resolve_solver` turns an option value (``"auto"``, ``"exact"`` or a registry name) into a registry
name, and :func:`make_solver` builds a solver from a name and one options mapping.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ctuq.inference.features import FeatureOperator
from ctuq.inference.solvers.base import DEFAULT_WORKLOAD, Solver, SolverCostEstimate, Workload
from ctuq.inference.solvers.registry import SOLVERS, check_solver_options, solver_choices, solver_kwargs
from ctuq.memory import Budget
from ctuq.memory import memory_budget as budget_for
from ctuq.options import ExactSide, SolverAlias

__all__ = [
    "estimate_solver_costs",
    "choose_solver",
    "resolve_solver",
    "dense_features_fit",
    "make_solver",
]


def estimate_solver_costs(
    c: int,
    d: int,
    workload: Workload = DEFAULT_WORKLOAD,
    *,
    t_jvp: float = 1.0,
    t_vjp: float = 1.0,
    flop_rate: float = 1e10,
    memory_budget: float = 4 * 1024**3,
    itemsize: int = 4,
) -> dict[str, SolverCostEstimate]:
    """Estimates of every registered solver that has one, for ``c`` outputs, ``d`` features and a workload.

    Keys in registry order (the exact family gives one ``"exact"`` entry): with the built-in solvers ``"exact"``,
    ``"cg"``, ``"sdd"``, ``"sgd"``. Products (per sample; one kernel product = 1 VJP + 1 JVP), with ``k`` EM
    samples, ``n`` prediction samples, ``S`` EM steps, ``i`` CG iterations, rank ``r + p``:

    * exact, dual route (``d ≥ c``): assembly ``c`` VJPs (+ ``c`` JVPs when ``Ψᵀ`` (``c·d`` values) exceeds the
      memory budget); dense ``9c³`` (eigh) + ``2c²d`` (Gram GEMM, if used). Primal route (``d < c``): ``d`` JVPs;
      dense ``2cd²`` (Gram) + ``9d³`` (eigh) + ``2cd²`` (``Q = ΨV``). Either way EM with exact ``γ`` costs
      nothing; prediction ``n`` JVPs (``Ψw₀``) + ``n + 1`` VJPs and ``4c·r·(n+1)`` dense flops for the solves
      (``r = min(c, d)``).
    * cg: preconditioner ``r + p`` kernel products; EM ``S·(k JVPs + (k+1)·i kernel products)``; prediction
      ``n JVPs + (n+1)(i + 1) VJPs + (n+1)·i JVPs``. Dense: ``4c(r+p)`` per CG iteration and column. Memory
      ``2c(r+p)`` float64 (the sketch and the basis).
    * sdd / sgd (``T`` = ``sdd_iterations`` / ``sgd_iterations``, the budget: early stops make it an upper
      bound): ``λ_max`` by ``lanczos_steps`` kernel products; every solve ``T`` kernel products per column plus
      one for the exact final residual (SDD) or ``T/10 + 1`` JVPs for the residual checks and one VJP for a warm
      start (SGD); otherwise as cg. Memory: five ``chunk × c`` buffers (SDD) or four ``chunk × d`` (SGD), plus
      the Lanczos basis ``lanczos_steps × c`` float64.

    Image-space prediction JVPs (``x = Φ(s ⊙ ζ)``) are the same for all and not included. ``t_jvp``/``t_vjp``
    are seconds per sample; ``flop_rate`` dense flops per second; ``memory_budget`` bytes; ``itemsize`` bytes per
    feature value.
    """
    out: dict[str, SolverCostEstimate] = {}
    for cls in SOLVERS.values():
        est = cls.estimate_cost(
            c,
            d,
            workload,
            t_jvp=t_jvp,
            t_vjp=t_vjp,
            flop_rate=flop_rate,
            memory_budget=memory_budget,
            itemsize=itemsize,
        )
        if est is not None and est.solver not in out:
            out[est.solver] = est
    return out


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    """The median wall time of ``repeats`` calls of ``fn()`` (synchronised on CUDA): robust to a call that a busy
    machine delayed."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _measure_rates(features: FeatureOperator, batch: int = 8, repeats: int = 3) -> tuple[float, float, float]:
    """(seconds per JVP, seconds per VJP, dense flops/s) measured on this machine: ``batch`` products of each kind
    (per sample, after one warm-up that pays the tracing and allocation), and a 768² float64 GEMM; each the median
    of ``repeats`` timings."""
    dev = features.device
    W = torch.zeros((batch, features.n_features), dtype=features.dtype, device=dev)
    R = torch.zeros((batch, features.n_outputs), dtype=features.dtype, device=dev)
    features.matvec(W[:1])  # warm-up (tracing, allocation)
    features.rmatvec(R[:1])
    t_jvp = _median_seconds(lambda: features.matvec(W), repeats, dev) / batch
    t_vjp = _median_seconds(lambda: features.rmatvec(R), repeats, dev) / batch
    m = 768
    A = torch.randn((m, m), dtype=torch.float64, device=dev)
    A @ A
    flop_rate = 2.0 * m**3 / max(_median_seconds(lambda: A @ A, repeats, dev), 1e-9)
    return t_jvp, t_vjp, flop_rate


def choose_solver(
    features: FeatureOperator,
    workload: Workload = DEFAULT_WORKLOAD,
    *,
    t_jvp: float | None = None,
    t_vjp: float | None = None,
    flop_rate: float | None = None,
    memory_budget: float | None = None,
) -> tuple[str, dict[str, SolverCostEstimate]]:
    """``(name, estimates)``: the cheapest feasible solver for ``workload`` by estimated seconds
    (:func:`estimate_solver_costs`; when none fits the memory budget, the one needing the least memory). ``name`` is
    an estimate's key (``"exact"`` for the exact family, see :func:`resolve_solver`).

    Product times and the dense flop rate are measured (:func:`_measure_rates`: 8 products of each kind and a 768²
    GEMM, medians of 3; the products are counted by the features' counters) unless given. ``memory_budget``
    (bytes) defaults to the :attr:`~ctuq.memory.Budget.SOLVER_CHOICE` budget of the features' device.
    """
    if t_jvp is None or t_vjp is None or flop_rate is None:
        mj, mv, mf = _measure_rates(features)
        t_jvp = mj if t_jvp is None else t_jvp
        t_vjp = mv if t_vjp is None else t_vjp
        flop_rate = mf if flop_rate is None else flop_rate
    if memory_budget is None:
        memory_budget = budget_for(Budget.SOLVER_CHOICE, features.device)
    est = estimate_solver_costs(
        features.n_outputs,
        features.n_features,
        workload,
        t_jvp=t_jvp,
        t_vjp=t_vjp,
        flop_rate=flop_rate,
        memory_budget=memory_budget,
        itemsize=torch.empty((), dtype=features.dtype).element_size(),
    )
    if not est:
        raise ValueError(f"choose_solver: no registered solver estimates its cost ({list(SOLVERS)}); name one")
    feasible = [e for e in est.values() if e.feasible] or [min(est.values(), key=lambda e: e.memory_bytes)]
    best = min(feasible, key=lambda e: e.seconds)
    return best.solver, est


def resolve_solver(
    kind: str,
    features: FeatureOperator,
    workload: Workload = DEFAULT_WORKLOAD,
    *,
    memory_budget: float | None = None,
) -> tuple[str, dict[str, SolverCostEstimate] | None]:
    """The :data:`~ctuq.inference.solvers.registry.SOLVERS` name for option ``kind`` on ``features`` (``c × d``),
    and the cost estimates if any.

    ``"auto"``: by :func:`choose_solver` (which measures product times); ``"exact"``: ``"exact_primal"`` when
    ``d < c`` and the assembled ``Ψ`` (twice, float64: ``2·c·d·8`` bytes) fits ``memory_budget`` (bytes; default
    the :attr:`~ctuq.memory.Budget.DENSE_SOLVER` budget), else ``"exact_dual"``. Registry names pass through.
    """
    choices = solver_choices()
    if kind not in choices:
        raise ValueError(f"resolve_solver: solver must be one of {list(choices)}, got {kind!r}")
    estimates = None
    if kind == SolverAlias.AUTO:
        kind, estimates = choose_solver(features, workload)
    if kind == SolverAlias.EXACT:
        c, d = features.n_outputs, features.n_features
        kind = "exact_primal" if d < c and dense_features_fit(c, d, features.device, memory_budget) else "exact_dual"
    return str(kind), estimates


def dense_features_fit(c: int, d: int, device: torch.device | str, memory_budget: float | None = None) -> bool:
    """Whether an assembled ``Ψ`` (``c × d``) fits the dense budget: two float64 copies, ``2·c·d·8`` bytes, against
    ``memory_budget`` (bytes; default the :attr:`~ctuq.memory.Budget.DENSE_SOLVER` budget of ``device``)."""
    if memory_budget is None:
        memory_budget = budget_for(Budget.DENSE_SOLVER, device)
    return 2 * c * d * 8 <= memory_budget


def make_solver(
    features: FeatureOperator, kind: str = "auto", workload: Workload = DEFAULT_WORKLOAD, **options
) -> Solver:
    """A solver for ``features``, constructed (not yet set up): ``kind`` one of
    :func:`~ctuq.inference.solvers.registry.solver_choices` (resolved by :func:`resolve_solver`).

    ``options``: flat options go to the chosen solver if it takes them (so ``"auto"`` can be given every solver's),
    a mapping under a registry name holds that solver's own (:func:`~ctuq.inference.solvers.registry.solver_kwargs`);
    names no solver takes raise. ``side="primal"|"dual"`` with ``kind="exact"`` picks the exact side. For
    ``"auto"``, flat ``rank``/``oversampling`` also enter the cost model.
    """
    side = options.pop("side", ExactSide.AUTO)
    check_solver_options(options, "make_solver")
    choices = solver_choices()
    if kind not in choices:
        raise ValueError(f"make_solver: kind must be one of {list(choices)}, got {kind!r}")
    if kind == SolverAlias.EXACT and side in (ExactSide.PRIMAL, ExactSide.DUAL):
        kind = f"exact_{side}"
    wl = dataclasses.replace(
        workload,
        rank=int(options.get("rank", workload.rank)),
        oversampling=int(options.get("oversampling", workload.oversampling)),
    )
    name, _ = resolve_solver(kind, features, wl)
    return SOLVERS[name](features, **solver_kwargs(options, name))
