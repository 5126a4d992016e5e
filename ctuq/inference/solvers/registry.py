"""The solver registry: registry name → solver class, filled by the classes themselves.

A solver module decorates its class with :func:`register_solver`; the package ``__init__`` imports every solver
module, so importing :mod:`ctuq.inference.solvers` fills :data:`SOLVERS`. Everything that offers a choice of solver
(the posterior, ``solver="auto"``, the config's ``uq.solver``, ``--help``) reads :data:`SOLVERS` when it needs it,
so a solver registered later (e.g. in a test) is available everywhere.

Solver options (:func:`solver_kwargs`): one mapping serves every solver. Flat keys go to whichever solver takes them
(its :meth:`~ctuq.inference.solvers.base.Solver.option_names`); a nested mapping under a registry name
(``{"sdd": {"max_iter": 500}}``) holds options for that solver only and overrides flat ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from ctuq.inference.solvers.base import Solver
from ctuq.options import SolverAlias, values

__all__ = ["SOLVERS", "register_solver", "unregister_solver", "solver_choices", "check_solver_options", "solver_kwargs"]

SOLVERS: dict[str, type[Solver]] = {}
"""Every registered solver, by name, in registration order."""


def register_solver(cls: type[Solver]) -> type[Solver]:
    """Class decorator: add ``cls`` to :data:`SOLVERS` under ``cls.name`` (a new, non-empty name that is not one
    of the :class:`~ctuq.options.SolverAlias` values)."""
    if not (isinstance(cls, type) and issubclass(cls, Solver)):
        raise TypeError(f"register_solver: {cls!r} is not a Solver subclass")
    name = cls.name
    if not isinstance(name, str) or not name or name in values(SolverAlias):
        raise ValueError(
            f"register_solver: {cls.__name__}.name must be a non-empty string other than "
            f"{list(values(SolverAlias))}, got {name!r}"
        )
    if name in SOLVERS and SOLVERS[name] is not cls:
        raise ValueError(f"register_solver: the name {name!r} is taken by {SOLVERS[name].__name__}")
    SOLVERS[name] = cls
    return cls


def unregister_solver(name: str) -> None:
    """Remove ``name`` from :data:`SOLVERS` (tests that register a solver of their own clean up with this)."""
    SOLVERS.pop(name, None)


def solver_choices() -> tuple[str, ...]:
    """Every value of a ``solver=`` option now: ``"auto"`` (by estimated cost), ``"exact"`` (the cheaper exact
    side), then the registry names."""
    return (*values(SolverAlias), *SOLVERS)


def check_solver_options(options: Mapping, where: str = "LinearizedPosterior") -> None:
    """Refuse option names no registered solver takes (flat keys), unknown registry names, and names a solver does
    not take inside its nested mapping; the messages list the valid names."""
    flat = frozenset().union(*(cls.option_names() for cls in SOLVERS.values()))
    for key, value in options.items():
        if key in SOLVERS:
            if not isinstance(value, Mapping):
                raise ValueError(f"{where}: solver options under {key!r} must be a mapping, got {type(value).__name__}")
            valid = SOLVERS[key].option_names()
            bad = sorted(set(value) - valid)
            if bad:
                raise ValueError(f"{where}: unknown {key} option(s) {bad}; valid: {sorted(valid)}")
        elif key not in flat:
            raise ValueError(
                f"{where}: unknown solver option {key!r}; valid: {sorted(flat)} and per-solver "
                f"mappings under {list(SOLVERS)}"
            )


def solver_kwargs(options: Mapping, name: str) -> dict:
    """The keyword arguments of solver ``name`` from ``options``: the flat keys it takes, then its nested mapping
    ``options[name]`` (which wins)."""
    cls = SOLVERS[name]
    takes = cls.option_names()
    kw = {k: v for k, v in options.items() if k not in SOLVERS and k in takes}
    kw.update(dict(options.get(name, {})))
    return kw
