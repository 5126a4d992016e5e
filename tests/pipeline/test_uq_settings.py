"""The ``uq`` section → the core's arguments (ctuq.pipeline.uq_settings): each solver gets exactly its section's
keys, the cost model its workload."""

import dataclasses

from ctuq.config import UQConfig, load_config
from ctuq.inference import SOLVERS, Solver, Workload, solver_kwargs
from ctuq.options import option
from ctuq.pipeline.uq_settings import posterior_arguments, solver_options, workload

SECTIONS = {
    "solver": "cg",
    "cg": {"preconditioner": "halko", "rank": 12, "oversampling": 3, "rtol": 1e-5, "max_iter": 77},
    "sdd": {"step_size": 0.7, "momentum": 0.9, "batch_size": 5, "max_iter": 33, "rtol": 1e-3},
    "sgd": {"lr": 0.5, "momentum": 0.8, "lr_decay": "linear", "clip": 2.0, "max_iter": 44, "rtol": 1e-3},
}
COMMON = {"prior": "gprior", "gprior": {"method": "stochastic", "probes": 9}, "prior_precision": 3.0}
RUN = {"em_steps": 2, "em_samples": 3, "samples": 10, "sample_chunk": 5}


def test_posterior_arguments_give_each_solver_exactly_its_keys():
    uq = UQConfig(**COMMON, **RUN, **SECTIONS)
    args = posterior_arguments(uq)
    assert set(args) == {"prior", "prior_options", "a", "solver", "solver_options", "workload"}
    assert (args["prior"], args["prior_options"], args["a"], args["solver"]) == (
        "gprior",
        {"method": "stochastic", "probes": 9},  # the prior's section uq.gprior
        3.0,
        "cg",
    )
    assert (
        args["workload"]
        == workload(uq)
        == Workload(
            em_steps=2,
            em_samples=3,
            prediction_samples=10,
            rank=12,
            oversampling=3,
            sdd_iterations=33.0,
            sgd_iterations=44.0,
            chunk=5,
        )
    )
    opts = args["solver_options"]
    assert opts == solver_options(uq) and list(opts) == ["exact_primal", "exact_dual", "cg", "sdd", "sgd"]
    assert solver_kwargs(opts, "cg") == {
        "preconditioner": "halko",
        "rank": 12,
        "oversampling": 3,
        "rtol": 1e-5,
        "max_iter": 77,
        "backend": "pcg",
        "pivoted_diagonal": "exact",
        "adaptive_rank": False,
        "rank_threshold": 1.0,
        "initial_rank": 100,
    }
    assert solver_kwargs(opts, "sdd") == {
        "momentum": 0.9,
        "max_iter": 33,
        "rtol": 1e-3,
        "lanczos_steps": 20,
        "lambda_max": None,
        "step_size": 0.7,
        "batch_size": 5,
        "averaging": None,
    }
    assert solver_kwargs(opts, "sgd") == {
        "momentum": 0.8,
        "max_iter": 44,
        "rtol": 1e-3,
        "lanczos_steps": 20,
        "lambda_max": None,
        "lr": 0.5,
        "lr_decay": "linear",
        "clip": 2.0,
        "check_every": 10,
    }
    assert (
        solver_kwargs(opts, "exact_primal")
        == solver_kwargs(opts, "exact_dual")
        == {
            "chunk_size": 64,
            "memory_budget": None,
        }
    )
    for name in SOLVERS:
        # the posterior supplies the seed and the progress flag itself; every other key is the solver's own
        assert set(solver_kwargs(opts, name)) == SOLVERS[name].option_names() - SOLVERS[name].runtime_options


def test_the_default_settings_pass_every_solver_its_own_defaults():
    opts = solver_options(UQConfig())
    for name, kw in opts.items():
        defaults = SOLVERS[name].Options()
        assert kw == {k: getattr(defaults, k) for k in kw}, name


@dataclasses.dataclass
class _ToyOptions:
    sweeps: int = option(3, ge=1, help="sweeps per solve")


class ToySweeps(Solver):
    name = "toy_sweeps"
    Options = _ToyOptions

    def __init__(self, features, *, sweeps: int = _ToyOptions.sweeps):
        super().__init__(features)

    def solve(self, rhs, a, sigma2, *, x0=None):
        raise NotImplementedError  # only its options are read here


def test_a_later_solver_gets_its_section_as_options():
    SOLVERS.register(ToySweeps)
    try:
        uq = load_config("demo", ["uq.solver=toy_sweeps", "uq.toy_sweeps.sweeps=5"]).uq
        assert solver_kwargs(posterior_arguments(uq)["solver_options"], "toy_sweeps") == {"sweeps": 5}
    finally:
        SOLVERS.unregister("toy_sweeps")
