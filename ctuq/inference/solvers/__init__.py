"""Solvers for ``C X = R`` with ``C = K̄/a + σ² I`` (rows ``R`` ``(k, c)``), their registry and the choice between them.

Where things are:

* :mod:`.base`: the contract (:class:`Solver`, :class:`ExactSolver`), :class:`SolveStats`,
  :class:`ConvergenceWarning`, :func:`relative_residual`, and the cost model's value types (:class:`Workload`,
  :class:`SolverCostEstimate`, :func:`cost_estimate`);
* :mod:`.registry`: the functions of :data:`ctuq.registry.SOLVERS` (registry name → class, filled by
  ``@SOLVERS.register``; re-exported here as :data:`SOLVERS`), the option rule;
* :mod:`.cost`: the cost model over the registry, ``solver="auto"`` (:func:`choose_solver`),
  :func:`resolve_solver`, :func:`make_solver`;
* one module per solver family: :mod:`.exact` (``exact_primal``, ``exact_dual``), :mod:`.cg` (``cg``, with
  :mod:`.preconditioners`), :mod:`.sdd` and :mod:`.sgd` (on :mod:`.first_order`).

A new solver is one module here plus one import line below (its ``@SOLVERS.register`` does the rest; its
``Options`` become the config section ``uq.<name>``).
"""

from ctuq.inference.solvers.base import (
    ConvergenceWarning,
    ExactSolver,
    Solver,
    SolverCostEstimate,
    SolveStats,
    Workload,
    cost_estimate,
    relative_residual,
    warn_not_converged,
)
from ctuq.inference.solvers.cost import (
    choose_solver,
    dense_features_fit,
    estimate_solver_costs,
    make_solver,
    resolve_solver,
)
from ctuq.inference.solvers.registry import (
    SOLVERS,
    check_solver_options,
    solver_choices,
    solver_kwargs,
)

# The registry lines: importing a solver module registers its classes, in this order (the order of SOLVERS, of
# solver_choices() and of the cost estimates), so the block is kept out of import sorting.
# isort: off
from ctuq.inference.solvers.exact import ExactDualSolver, ExactEigSolver, ExactPrimalSolver
from ctuq.inference.solvers.cg import CGSolver, pcg
from ctuq.inference.solvers.sdd import SDDSolver
from ctuq.inference.solvers.sgd import SGDSolver
# isort: on

from ctuq.inference.solvers.first_order import FirstOrderSolver, lanczos_top_eigenvalue
from ctuq.inference.solvers.preconditioners import (
    LowRankEig,
    LowRankPreconditioner,
    adaptive_nystrom_eig,
    pivoted_cholesky_eig,
    randomized_eig,
)

__all__ = [
    "Solver",
    "ExactSolver",
    "SolveStats",
    "ConvergenceWarning",
    "relative_residual",
    "warn_not_converged",
    "SOLVERS",
    "solver_choices",
    "check_solver_options",
    "solver_kwargs",
    "Workload",
    "SolverCostEstimate",
    "cost_estimate",
    "estimate_solver_costs",
    "choose_solver",
    "resolve_solver",
    "dense_features_fit",
    "make_solver",
    "ExactEigSolver",
    "ExactPrimalSolver",
    "ExactDualSolver",
    "CGSolver",
    "pcg",
    "SDDSolver",
    "SGDSolver",
    "FirstOrderSolver",
    "lanczos_top_eigenvalue",
    "LowRankEig",
    "LowRankPreconditioner",
    "randomized_eig",
    "adaptive_nystrom_eig",
    "pivoted_cholesky_eig",
]
