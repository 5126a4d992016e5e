"""The solver registry's functions: :data:`ctuq.registry.SOLVERS` (registry name → solver class) and the option rule.

The registry itself is :data:`ctuq.registry.SOLVERS` (a :class:`ctuq.registry.Registry` whose provider is this
package, base class :class:`~ctuq.inference.solvers.base.Solver`): a solver module registers its class with
``@SOLVERS.register``, and the package ``__init__`` imports every solver module, so the first lookup fills it.
Everything that offers a choice of solver (the posterior, ``solver="auto"``, the config's ``uq.solver``, ``--help``)
reads the registry when it needs it, so a solver registered later (``SOLVERS.register(cls)``, e.g. in a test) is
available everywhere; ``SOLVERS.unregister(name)`` removes it.

Solver options (:func:`solver_kwargs`): one mapping serves every solver. Flat keys go to whichever solver takes them
(its :meth:`~ctuq.inference.solvers.base.Solver.option_names`); a nested mapping under a registry name
(``{"sdd": {"max_iter": 500}}``) holds options for that solver only and overrides flat ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from ctuq.registry import SOLVERS

__all__ = ["SOLVERS", "solver_choices", "check_solver_options", "solver_kwargs"]


def solver_choices() -> tuple[str, ...]:
    """Every value of a ``solver=`` option now: ``"auto"`` (by estimated cost), ``"exact"`` (the cheaper exact
    side), then the registry names."""
    return SOLVERS.choices()


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
