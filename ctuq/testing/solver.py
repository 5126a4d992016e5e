"""The solver contract (:class:`SolverContract`) and its case type (:class:`SolverCase`).

:class:`SolverContract` checks, on a seeded dense problem against a float64 numpy reference: solves at several
``(a, σ²)``; the posterior sample covariance (statistical, seed and tolerance stated); the ``state_dict`` /
``load_state_dict`` round trip (solutions after restoring are bitwise equal, and restoring spends no products);
warm starts (``x0``); resuming the EM mid-way through :class:`~ctuq.inference.LinearizedPosterior` (bitwise
equal traces); the class facts (name, summary, options, cost estimate, report); and bad input (rhs shape, ``a ≤ 0``,
``σ² ≤ 0``, NaN).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch

from ctuq.config.engine import Derivation, check_section, section_class
from ctuq.inference.features import FeatureOperator
from ctuq.inference.likelihoods import GaussianLikelihood
from ctuq.inference.posterior import LinearizedPosterior
from ctuq.inference.sampler import sample_posterior
from ctuq.inference.solvers import SOLVERS, Solver, SolverCostEstimate, SolveStats, Workload

from ._common import _check_sample_covariance, _saved, contract_problem

__all__ = ["SolverCase", "SolverContract"]


def _reference_solve(Psi: torch.Tensor, R: torch.Tensor, a: float, sigma2: float) -> np.ndarray:
    P = Psi.double().numpy()
    C = P @ P.T / a + sigma2 * np.eye(P.shape[0])
    return np.linalg.solve(C, R.double().numpy().T).T


@dataclasses.dataclass
class SolverCase:
    """One solver under test: its registry name (``None`` when not registered), a factory features → solver, and
    the options the factory uses (handed to the posterior as ``solver_options={name: options}``)."""

    name: str | None
    factory: Callable[[FeatureOperator], Solver]
    options: dict = dataclasses.field(default_factory=dict)


class SolverContract:
    """The solver contract (module docstring). Subclass and set :attr:`registry_name` and :attr:`options`, or
    override :meth:`make_solver` (or the ``case`` fixture, e.g. parametrised over a registry); tolerances are the
    class attributes below."""

    registry_name: str | None = None
    """Registry name; with it the posterior-level checks run (the solver must be registered)."""
    options: dict = {}
    """Constructor options of the solver under test."""
    hyper: tuple[tuple[float, float], ...] = ((2.0, 0.5), (0.25, 1.5))
    """``(a, σ²)`` pairs every solve is checked at (a solver built for one pair lists only that one)."""
    solve_rtol: float = 1e-6
    """Bound on ``‖X − X_ref‖_F / ‖X_ref‖_F`` against the float64 reference."""
    n_samples: int = 2000
    sample_seed: int = 0
    sample_tol: float = 5.5
    """Whitened sample covariance ``Ŝ`` of ``n_samples`` posterior samples (seed ``sample_seed``): every entry of
    ``Ŝ − I`` within ``sample_tol · √(2/n)`` (entries have sd ``≤ √(2/n)``; ``d² = 1296`` of them)."""
    fixed_hyper: bool = False
    """The solver is built for the one pair in :attr:`hyper` (the warm-start check then stays at it)."""
    problem_size: tuple[int, int] = (24, 36)

    def make_solver(self, features: FeatureOperator) -> Solver:
        """The solver under test on ``features`` (default: the registered class with :attr:`options`)."""
        return SOLVERS[self.registry_name](features, **self.options)

    @pytest.fixture
    def case(self) -> SolverCase:
        return SolverCase(self.registry_name, self.make_solver, dict(self.options))

    @pytest.fixture
    def problem(self):
        c, d = self.problem_size
        return contract_problem(c, d)

    @staticmethod
    def _rhs(c: int, k: int = 5, seed: int = 1) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        R = torch.randn(k, c, generator=g, dtype=torch.float64)
        R[2] = 0.0  # a zero right-hand side is solved exactly by 0
        return R

    # ------------------------------------------------------------------------------------------ class facts
    def test_class_facts(self, case, problem):
        feats, _, _ = problem
        solver = case.factory(feats)
        assert isinstance(solver, Solver) and solver.features is feats
        cls = type(solver)
        if case.name is not None:
            assert SOLVERS.get(case.name) is cls and cls.name == case.name
            assert cls.summary and "\n" not in cls.summary
        names = cls.option_names()
        assert isinstance(names, frozenset) and set(case.options) <= names
        # its options, declared once (Options), are what option_names and its config section uq.<name> read; the
        # section's defaults lie within their own bounds
        assert dataclasses.is_dataclass(cls.Options) and names == {f.name for f in dataclasses.fields(cls.Options)}
        section = section_class(cls, Derivation(SOLVERS, "Options", exclude="runtime_options"))
        if section is not None:
            check_section(section(), f"uq.{cls.name or cls.__name__}")
        est = cls.estimate_cost(100, 50, Workload(), t_jvp=1.0, t_vjp=1.0, flop_rate=1e9, memory_budget=1e9, itemsize=8)
        assert est is None or (isinstance(est, SolverCostEstimate) and est.seconds > 0)
        a, s2 = self.hyper[0]
        solver.setup(a, s2)
        json.dumps(solver.report())
        assert isinstance(solver.describe(), str)

    # ------------------------------------------------------------------------------------------ solves
    def test_solve_matches_dense_reference(self, case, problem):
        feats, Psi, _ = problem
        solver = case.factory(feats)
        R = self._rhs(feats.n_outputs)
        for a, s2 in self.hyper:
            solver.setup(a, s2)
            X, stats = solver.solve(R.to(feats.dtype), a, s2)
            assert X.shape == R.shape and X.dtype == feats.dtype
            ref = _reference_solve(Psi, R, a, s2)
            err = np.linalg.norm(X.double().numpy() - ref) / np.linalg.norm(ref)
            assert err <= self.solve_rtol, (a, s2, err)
            assert isinstance(stats, SolveStats)
            assert stats.iterations.shape == stats.relative_residual.shape == stats.converged.shape == (R.shape[0],)
            assert float(stats.relative_residual[2]) == 0.0 and bool(stats.converged.all())

    def test_setup_is_idempotent(self, case, problem):
        feats, _, _ = problem
        solver = case.factory(feats)
        a, s2 = self.hyper[0]
        solver.setup(a, s2)
        before = (feats.n_matvec, feats.n_rmatvec)
        solver.setup(a, s2)
        assert (feats.n_matvec, feats.n_rmatvec) == before

    def test_posterior_sample_covariance(self, case, problem):
        feats, Psi, _ = problem
        solver = case.factory(feats)
        a, s2 = self.hyper[0]
        solver.setup(a, s2)
        gen = torch.Generator().manual_seed(self.sample_seed)
        zeta = sample_posterior(feats, solver, a, s2, self.n_samples, generator=gen).weights.double().numpy()
        P = Psi.numpy()
        cov = np.linalg.inv(P.T @ P / s2 + a * np.eye(P.shape[1]))
        _check_sample_covariance(zeta, cov, self.sample_tol)

    # ------------------------------------------------------------------------------------------ state
    def test_state_round_trip_is_bitwise(self, case, problem):
        feats, _, _ = problem
        R = self._rhs(feats.n_outputs).to(feats.dtype)
        a, s2 = self.hyper[-1]
        first = case.factory(feats)
        first.setup(a, s2)
        X1, _ = first.solve(R, a, s2)
        state = _saved(first.state_dict())
        second = case.factory(feats)
        second.load_state_dict(state)
        before = (feats.n_matvec, feats.n_rmatvec)
        second.setup(a, s2)
        if state is not None:  # the stored set-up is reused, not rebuilt
            assert (feats.n_matvec, feats.n_rmatvec) == before
        X2, _ = second.solve(R, a, s2)
        assert torch.equal(X1, X2)

    def test_warm_start(self, case, problem):
        feats, Psi, _ = problem
        solver = case.factory(feats)
        R = self._rhs(feats.n_outputs).to(feats.dtype)
        a, s2 = self.hyper[0]
        solver.setup(a, s2)
        X, _ = solver.solve(R, a, s2)
        # the next EM step: a moved by 10 %, the previous solutions as the initial guess
        a2 = a if self.fixed_hyper else 1.1 * a
        cold, st_cold = solver.solve(R, a2, s2)
        warm, st_warm = solver.solve(R, a2, s2, x0=X)
        ref = _reference_solve(Psi, R, a2, s2)
        for Y in (cold, warm):
            assert np.linalg.norm(Y.double().numpy() - ref) / np.linalg.norm(ref) <= self.solve_rtol
        if solver.warm_starts and not self.fixed_hyper:
            assert st_warm.n_products < st_cold.n_products

    def test_resume_mid_em_through_the_posterior(self, case, problem):
        if case.name is None:
            pytest.skip("not a registered solver: the posterior cannot build it by name")
        feats, _, y = problem

        def make():
            return LinearizedPosterior(
                feats,
                y,
                likelihood=GaussianLikelihood(0.5, True),
                a=1.0,
                solver=case.name,
                solver_options={case.name: case.options},
                seed=3,
            )

        full = make()
        full.fit(max_steps=3, n_samples=4, tol=0.0)
        part = make()
        part.fit(max_steps=1, n_samples=4, tol=0.0)
        resumed = make()
        resumed.load_state_dict(_saved(part.state_dict()))
        resumed.fit(max_steps=3, n_samples=4, tol=0.0)
        keys = ("a", "sigma2", "gamma", "a_new", "sigma2_new")
        assert [[r[k] for k in keys] for r in resumed.em_trace] == [[r[k] for k in keys] for r in full.em_trace]
        assert torch.equal(resumed.mean(), full.mean())

    # ------------------------------------------------------------------------------------------ bad input
    def test_bad_input_is_refused(self, case, problem):
        feats, _, _ = problem
        solver = case.factory(feats)
        a, s2 = self.hyper[0]
        solver.setup(a, s2)
        c = feats.n_outputs
        R = self._rhs(c).to(feats.dtype)
        for bad in (R[:, :-1], R[0], torch.zeros((2, c + 1), dtype=feats.dtype)):
            with pytest.raises(ValueError, match="rhs"):
                solver.solve(bad, a, s2)
        nan = R.clone()
        nan[1, 3] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            solver.solve(nan, a, s2)
        for bad_a in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="prior precision a"):
                solver.solve(R, bad_a, s2)
        for bad_s2 in (0.0, -1.0, float("nan")):
            with pytest.raises(ValueError, match="noise variance sigma2"):
                solver.solve(R, a, bad_s2)
