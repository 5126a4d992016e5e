"""The ``uq`` config section → the inference core's keyword arguments: the one place that maps config keys onto the
core (which never names a config key).

:func:`posterior_arguments` gives what :class:`ctuq.inference.LinearizedPosterior` takes from the settings;
:func:`solver_options` the per-solver options (each registered solver's config section, ``uq.<name>``, as the
mapping ``solver_options[name]``); :func:`workload` what ``solver="auto"``'s cost model needs to know about the run.
"""

from __future__ import annotations

from ctuq.config import UQConfig
from ctuq.config.engine import to_dict
from ctuq.inference.solvers import Workload

__all__ = ["posterior_arguments", "solver_options", "workload"]


def solver_options(uq: UQConfig) -> dict[str, dict]:
    """``{name: options}`` for every registered solver with configuration keys: the values of its section ``uq.<name>``
    (``uq.cg.rank`` → ``{"cg": {"rank": ...}}``), which are the fields of its ``Options`` less the ones the posterior
    supplies (``seed``, ``progress``). Each solver gets exactly its own keys."""
    return {name: to_dict(section) for name, section in uq.solver_sections.items()}


def workload(uq: UQConfig) -> Workload:
    """What the run will do, for the solver cost model (``solver="auto"``): EM steps and samples, prediction samples
    and chunk, CG's preconditioner rank and oversampling (``uq.cg``), the first-order solvers' iteration budgets
    (``uq.sdd.max_iter``, ``uq.sgd.max_iter``)."""
    return Workload(
        em_steps=uq.em_steps,
        em_samples=uq.em_samples,
        prediction_samples=uq.samples,
        rank=uq.cg.rank,
        oversampling=uq.cg.oversampling,
        sdd_iterations=float(uq.sdd.max_iter),
        sgd_iterations=float(uq.sgd.max_iter),
        chunk=int(uq.sample_chunk),
    )


def posterior_arguments(uq: UQConfig) -> dict:
    """The keyword arguments of :class:`ctuq.inference.LinearizedPosterior` that the ``uq`` section sets:
    ``prior``, ``a`` (``prior_precision``), ``solver``, ``solver_options`` (:func:`solver_options`) and ``workload``
    (:func:`workload`, for ``solver="auto"``'s cost model); with a prior that has options (a config section
    ``uq.<prior>``: ``uq.gprior``, ``uq.tv_predcp``) also ``prior_options``, that section's values (the prior
    completes itself from the reconstruction: TV-PredCP's rate ``scale / TV``). The front end adds what is not
    configuration (``likelihood``, ``seed``, ``output_map``, ``progress``, ``log``, ``shard``).
    """
    out = {
        "prior": uq.prior,
        "a": uq.prior_precision,
        "solver": uq.solver,
        "solver_options": solver_options(uq),
        "workload": workload(uq),
    }
    prior_sections = dict(uq.prior_sections.items())
    if uq.prior in prior_sections:
        out["prior_options"] = to_dict(prior_sections[uq.prior])
    return out
