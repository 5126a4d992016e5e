"""Contract tests shipped with ctuq: one test base class per abstraction of the inference core.

As linear_operator ships ``LinearOperatorTestCase``, ctuq ships the checks every solver and every feature operator
must pass; a test module subclasses a contract and gives only a factory (and, where needed, tolerances)::

    from ctuq.testing import SolverContract

    class TestMySolver(SolverContract):
        registry_name = "my_solver"          # enables the posterior-level checks (needs registration)
        options = {"tol": 1e-12}             # its constructor options

    class TestMyFeatures(FeatureContract):
        def make_features(self):
            return MyFeatures(...), dense_float64_matrix

:class:`SolverContract` checks, on a seeded dense problem against a float64 numpy reference: solves at several
``(a, σ²)``; the posterior sample covariance (statistical, seed and tolerance stated); the ``state_dict`` /
``load_state_dict`` round trip (solutions after restoring are bitwise equal, and restoring spends no products);
warm starts (``x0``); resuming the EM mid-way through :class:`~ctuq.inference.LinearizedPosterior` (bitwise
equal traces); the class facts (name, summary, options, cost estimate, report); and bad input (rhs shape, ``a ≤ 0``,
``σ² ≤ 0``, NaN). :class:`FeatureContract` checks adjointness ``⟨Ψu, v⟩ = ⟨u, Ψᵀv⟩`` within round-off, agreement
with the dense matrix, columns, row restriction, stacking, product counters and bad shapes.

This module imports pytest: it is for test suites, and nothing in ctuq imports it.
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch

from ctuq.inference.features import DenseFeatures, FeatureOperator, stack_features
from ctuq.inference.likelihoods import GaussianLikelihood
from ctuq.inference.posterior import LinearizedPosterior
from ctuq.inference.sampler import sample_posterior
from ctuq.inference.solvers import SOLVERS, Solver, SolverCostEstimate, SolveStats, Workload

__all__ = ["SolverCase", "SolverContract", "FeatureContract", "contract_problem"]


def contract_problem(
    c: int = 24,
    d: int = 36,
    *,
    seed: int = 0,
    top: float = 10.0,
    bottom: float = 0.01,
    dtype: torch.dtype = torch.float64,
) -> tuple[DenseFeatures, torch.Tensor, torch.Tensor]:
    """A seeded dense problem: ``(features, Ψ (c, d) float64, targets ỹ (c,))`` with the singular values of ``Ψ``
    log-spaced from ``√top`` to ``√bottom`` (so ``K̄`` has eigenvalues ``top … bottom``)."""
    g = torch.Generator().manual_seed(seed)
    r = min(c, d)
    U, _ = torch.linalg.qr(torch.randn(c, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))
    sv = torch.logspace(np.log10(top) / 2, np.log10(bottom) / 2, r, dtype=torch.float64)
    Psi = (U * sv) @ V.T
    y = Psi @ torch.randn(d, generator=g, dtype=torch.float64) + 0.3 * torch.randn(c, generator=g, dtype=torch.float64)
    return DenseFeatures(Psi.to(dtype)), Psi, y.to(dtype)


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
        w, V = np.linalg.eigh(cov)
        white = zeta @ (V / np.sqrt(w))  # Σ^(−1/2) ζ in the eigenbasis: N(0, I)
        S = white.T @ white / self.n_samples
        dev = np.abs(S - np.eye(S.shape[0])).max()
        assert dev <= self.sample_tol * np.sqrt(2.0 / self.n_samples), dev

    # ------------------------------------------------------------------------------------------ state
    def test_state_round_trip_is_bitwise(self, case, problem):
        feats, _, _ = problem
        R = self._rhs(feats.n_outputs).to(feats.dtype)
        a, s2 = self.hyper[-1]
        first = case.factory(feats)
        first.setup(a, s2)
        X1, _ = first.solve(R, a, s2)
        state = first.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
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
        buf = io.BytesIO()
        torch.save(part.state_dict(), buf)
        buf.seek(0)
        resumed = make()
        resumed.load_state_dict(torch.load(buf, weights_only=True))
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


class FeatureContract:
    """The feature-operator contract (module docstring). Subclass and give :meth:`make_features`, returning the
    operator and its dense float64 matrix ``(c, d)``; :attr:`rtol` bounds round-off (float64 default)."""

    rtol: float = 1e-10

    def make_features(self) -> tuple[FeatureOperator, torch.Tensor]:
        raise NotImplementedError

    @pytest.fixture
    def features(self):
        return self.make_features()

    @staticmethod
    def _draws(features: FeatureOperator, B: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        U = torch.randn(B, features.n_features, generator=g, dtype=torch.float64).to(features.dtype)
        V = torch.randn(B, features.n_outputs, generator=g, dtype=torch.float64).to(features.dtype)
        return U, V

    def _close(self, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.double().cpu(), want.double().cpu()
        scale = float(torch.linalg.matrix_norm(want)) if want.ndim == 2 else float(want.norm())
        assert float((got - want).norm()) <= self.rtol * max(scale, 1e-300), (got - want).abs().max()

    def test_adjointness(self, features):
        F, _ = features
        U, V = self._draws(F)
        lhs = (F.matvec(U).double() * V.double()).sum(1)
        rhs = (U.double() * F.rmatvec(V).double()).sum(1)
        scale = F.matvec(U).double().norm(dim=1) * V.double().norm(dim=1)
        assert torch.all((lhs - rhs).abs() <= self.rtol * scale), (lhs - rhs).abs().max()

    def test_matches_the_dense_matrix(self, features):
        F, M = features
        assert (F.n_outputs, F.n_features) == tuple(M.shape)
        U, V = self._draws(F)
        self._close(F.matvec(U), U.double() @ M.T)
        self._close(F.rmatvec(V), V.double() @ M)
        self._close(F.to_dense(chunk_size=5), M)

    def test_columns(self, features):
        F, M = features
        d = F.n_features
        lo, hi = d // 4, min(d, d // 4 + 5)
        self._close(F.columns(lo, hi), M[:, lo:hi].T)
        vals = torch.linspace(0.5, 2.0, hi - lo, dtype=torch.float64).to(F.dtype)
        self._close(F.columns(lo, hi, vals), (M[:, lo:hi] * vals.double()).T)
        self._close(F.row_range(1, 3), M[1:3])

    def test_row_restriction(self, features):
        F, M = features
        c = F.n_outputs
        rows = torch.tensor([c - 1, 0, c // 2])
        mask = torch.zeros(c, dtype=torch.bool)
        mask[rows] = True
        for sel, want in ((rows, M[rows]), (mask, M[mask])):
            sub = F.restrict(sel)
            assert (sub.n_outputs, sub.n_features) == tuple(want.shape)
            U, V = self._draws(sub)
            self._close(sub.matvec(U), U.double() @ want.T)
            self._close(sub.rmatvec(V), V.double() @ want)
        for bad in (torch.tensor([0, 0]), torch.tensor([c]), torch.tensor([], dtype=torch.long)):
            with pytest.raises(ValueError, match="row"):
                F.restrict(bad)

    def test_stacking(self, features):
        F, M = features
        rows = torch.tensor([1, 3])
        stacked = stack_features([F, F.restrict(rows)])
        want = torch.cat([M, M[rows]])
        U, V = self._draws(stacked)
        self._close(stacked.matvec(U), U.double() @ want.T)
        self._close(stacked.rmatvec(V), V.double() @ want)

    def test_counters_count_rows(self, features):
        F, _ = features
        F.reset_counters()
        U, V = self._draws(F, B=4)
        F.matvec(U)
        F.rmatvec(V[:3])
        assert F.counters() == {"matvec": 4, "rmatvec": 3}
        F.columns(0, 2)
        F.row_range(0, 3)
        assert (F.n_matvec, F.n_rmatvec) == (6, 6)
        F.reset_counters()
        assert F.counters() == {"matvec": 0, "rmatvec": 0}

    def test_bad_shapes_name_the_shape(self, features):
        F, _ = features
        with pytest.raises(ValueError, match=rf"shape \(2, {F.n_features + 1}\)"):
            F.matvec(torch.zeros(2, F.n_features + 1, dtype=F.dtype))
        with pytest.raises(ValueError, match=rf"expected \(batch, {F.n_outputs}\)"):
            F.rmatvec(torch.zeros(2, F.n_outputs + 2, dtype=F.dtype))
