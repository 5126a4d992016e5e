"""The solver contract (:class:`ctuq.testing.SolverContract`) over every registered solver and over the design's
:class:`~ctuq.design.bordered.BorderedCholesky`."""

import pytest

from ctuq.design.bordered import BorderedCholesky
from ctuq.inference import SOLVERS
from ctuq.testing import SolverCase, SolverContract

# Options that make the iterative solvers accurate enough for a 1e-6 comparison with the dense reference (their
# defaults are tuned for speed on large problems, not for exactness).
OPTIONS = {
    "cg": {"rank": 8, "rtol": 1e-11, "max_iter": 500},
    "sdd": {"max_iter": 5000, "rtol": 1e-11, "momentum": 0.9},
    "sgd": {"max_iter": 5000, "rtol": 1e-11, "momentum": 0.9},
}


class TestRegisteredSolvers(SolverContract):
    """Every solver in the registry at collection time, by name, with :data:`OPTIONS`."""

    @pytest.fixture(params=list(SOLVERS))
    def case(self, request):
        name = request.param
        options = OPTIONS.get(name, {})
        return SolverCase(name, lambda features: SOLVERS[name](features, **options), options)


class TestBorderedCholesky(SolverContract):
    """The design's bordered factor: built for one ``(a, σ²)`` (so every check runs there), not registered (so the
    posterior-level check is skipped)."""

    hyper = ((2.0, 0.5),)
    fixed_hyper = True

    def make_solver(self, features):
        a, s2 = self.hyper[0]
        return BorderedCholesky.from_features(features, a, s2, block=7)


def test_every_registered_solver_has_a_name_summary_and_options():
    assert list(SOLVERS)[:5] == ["exact_primal", "exact_dual", "cg", "sdd", "sgd"]
    for name, cls in SOLVERS.items():
        assert cls.name == name and cls.summary
    assert SOLVERS["cg"].option_names() >= {
        "preconditioner",
        "rank",
        "oversampling",
        "rtol",
        "max_iter",
        "backend",
        "seed",
        "pivoted_diagonal",
        "adaptive_rank",
        "rank_threshold",
        "initial_rank",
    }
    assert (
        SOLVERS["exact_primal"].option_names()
        == SOLVERS["exact_dual"].option_names()
        == {"chunk_size", "memory_budget", "progress"}
    )
    assert SOLVERS["sdd"].option_names() >= {
        "step_size",
        "batch_size",
        "averaging",
        "momentum",
        "max_iter",
        "rtol",
        "seed",
        "lanczos_steps",
        "lambda_max",
    }
    assert SOLVERS["sgd"].option_names() >= {"lr", "lr_decay", "clip", "check_every", "momentum", "max_iter", "rtol"}
    assert SOLVERS["exact_primal"].assembles_features and not SOLVERS["exact_dual"].assembles_features
    assert [n for n, c in SOLVERS.items() if c.exact][:2] == ["exact_primal", "exact_dual"]
    assert [n for n, c in SOLVERS.items() if c.warm_starts][:2] == ["sdd", "sgd"]
    assert not BorderedCholesky.exact  # it holds C for one (a, σ²) only: no γ / evidence at others
