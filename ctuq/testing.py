"""Contract tests shipped with ctuq: one test base class per extensible abstraction.

As linear_operator ships ``LinearOperatorTestCase``, ctuq ships the checks every implementation must pass; a test
module subclasses a contract and gives only a factory (and, where needed, tolerances)::

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
with the dense matrix, columns, row restriction, stacking, product counters and bad shapes. The contracts of
likelihoods (:class:`LikelihoodContract`), calibration methods (:class:`CalibrationContract`), weight priors
(:class:`PriorContract`), ray-transform backends (:class:`RayTransformContract`) and scan formats
(:class:`ScanFormatContract`) list their checks in their own docstrings.

This module imports pytest: it is for test suites, and nothing in ctuq imports it.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ctuq.calibration import CalibrationMethod, HeldoutRows
from ctuq.config.engine import Derivation, check_section, section_class
from ctuq.data.formats import DATA_FORMATS, detect_format
from ctuq.data.loader import load_slice, read_slice
from ctuq.data.scan_format import CircularOrbit, ScanContent, ScanFormat, ScanOrbit
from ctuq.data.source import count_variance
from ctuq.errors import CTUQError
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.inference.features import DenseFeatures, FeatureOperator, stack_features
from ctuq.inference.likelihoods import GaussianLikelihood, Likelihood
from ctuq.inference.posterior import LinearizedPosterior
from ctuq.inference.priors import PriorProblem, WeightPrior
from ctuq.inference.reference import DenseLinearGaussian
from ctuq.inference.sampler import sample_posterior
from ctuq.inference.solvers import SOLVERS, Solver, SolverCostEstimate, SolveStats, Workload
from ctuq.metrics import SampleMoments
from ctuq.operators import RayTransform, ShapeError, make_ray_transform
from ctuq.registry import CALIBRATIONS, LIKELIHOODS, PRIORS, RAY_TRANSFORMS

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


def _saved(state):
    """``state`` after ``torch.save`` and ``torch.load(weights_only=True)`` (what a checkpoint file gives back)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _check_sample_covariance(zeta: np.ndarray, cov: np.ndarray, tol: float) -> None:
    """Samples ``zeta`` ``(n, d)`` whitened by the covariance ``cov`` ``(d, d)`` have every entry of their second
    moment within ``tol · √(2/n)`` of the identity."""
    w, V = np.linalg.eigh(cov)
    white = zeta @ (V / np.sqrt(w))  # Σ^(−1/2) ζ in the eigenbasis: N(0, I)
    dev = np.abs(white.T @ white / len(zeta) - np.eye(cov.shape[0])).max()
    assert dev <= tol * np.sqrt(2.0 / len(zeta)), dev


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


# ================================================================================================== likelihoods
__all__ += ["LikelihoodCase", "LikelihoodContract"]


@dataclasses.dataclass
class LikelihoodCase:
    """One likelihood under test: ``likelihood`` over ``n`` rows; ``measurement_variances`` ``(n,)``, the rows'
    variances it was built from (what :meth:`~ctuq.inference.likelihoods.Likelihood.noise_variance_of` is asked
    with; ``None`` for a model without per-row noise); ``appended`` ``(m,)``, per-row variances of rows to append
    with :meth:`~ctuq.inference.likelihoods.Likelihood.extend` (``None``: it takes none)."""

    likelihood: Likelihood
    measurement_variances: torch.Tensor | None = None
    appended: torch.Tensor | None = None


class LikelihoodContract:
    """The likelihood contract: a subclass gives :meth:`make_case` (a fresh case per call, seeded); the checks are

    * the noise draws (:meth:`~ctuq.inference.likelihoods.Likelihood.draw_noise`) have covariance ``σ² I`` in the
      whitened coordinates, i.e. the variances :meth:`noise_variance_of` states in measurement coordinates
      (``n_draws`` draws, seed 0; every entry of the sample covariance within ``draw_tol`` standard deviations);
    * the EM's noise update against the hand computation ``‖r‖² / (c − γ)`` (or ``σ²`` kept when not learned) and
      ``c − γ ≤ 0`` refused;
    * :meth:`restrict` and :meth:`extend` consistent with the whitening (row scales, the log-determinant correction,
      the noise variance of the kept rows), and per-row variances refused by a model without them (and vice versa);
    * the ``state_dict`` round trip bitwise (also through ``torch.save``/``torch.load(weights_only=True)``), a state
      of another likelihood refused;
    * :meth:`noise_variance_of` of the rows' own variances equals ``σ²`` over the squared whitening, for any
      ``target_scale``.
    """

    n_draws: int = 20000
    draw_tol: float = 5.0

    def make_case(self) -> LikelihoodCase:
        """A fresh :class:`LikelihoodCase` (override)."""
        raise NotImplementedError

    @pytest.fixture
    def case(self) -> LikelihoodCase:
        return self.make_case()

    @staticmethod
    def _scales(lik: Likelihood, n: int) -> torch.Tensor:
        r = lik.row_scales()
        return torch.ones(n, dtype=torch.float64) if r is None else r.detach().to("cpu", torch.float64)

    @staticmethod
    def _n_rows(case: LikelihoodCase) -> int:
        r = case.likelihood.row_scales()
        if r is not None:
            return int(r.numel())
        return 6 if case.measurement_variances is None else int(case.measurement_variances.numel())

    def test_registered_under_its_name(self, case):
        lik = case.likelihood
        assert isinstance(lik, Likelihood) and lik.name
        if lik.name in LIKELIHOODS:
            assert LIKELIHOODS[lik.name] is type(lik)

    def test_noise_draws_have_the_stated_covariance(self, case):
        lik, n = case.likelihood, self._n_rows(case)
        gen = torch.Generator().manual_seed(0)
        eps = lik.draw_noise(self.n_draws, n, gen, torch.float64)
        assert eps.shape == (self.n_draws, n) and eps.dtype == torch.float64
        cov = eps.T @ eps / self.n_draws / float(lik.sigma2)
        err = (cov - torch.eye(n, dtype=torch.float64)).abs().max()
        assert float(err) <= self.draw_tol * (2.0 / self.n_draws) ** 0.5, f"whitened covariance off by {float(err)}"
        # in measurement coordinates (ε / D^(−1/2)) the variances are the stated noise variances of the rows
        measured = (eps / self._scales(lik, n)).pow(2).mean(0)
        stated = torch.as_tensor(lik.noise_variance_of(case.measurement_variances), dtype=torch.float64)
        rel = (measured / stated.expand(n) - 1.0).abs().max()
        assert float(rel) <= self.draw_tol * (2.0 / self.n_draws) ** 0.5, f"variances off by {float(rel)} (relative)"

    def test_noise_update_against_the_hand_computation(self, case):
        lik, n = case.likelihood, self._n_rows(case)
        r2, gamma = 3.7, 2.5
        expected = r2 / (n - gamma) if lik.learn_noise else float(lik.sigma2)
        assert lik.noise_update(r2, n, gamma) == expected
        if lik.learn_noise:
            with pytest.raises(FloatingPointError, match="c − γ"):
                lik.noise_update(r2, n, float(n))

    def test_restrict_and_extend_are_consistent(self, case):
        lik, n = case.likelihood, self._n_rows(case)
        full = self._scales(lik, n)
        assert lik.log_evidence_correction() == pytest.approx(float(full.log().sum()), rel=1e-12, abs=1e-12)
        rows = torch.tensor([0, 2, n - 1])
        sub = lik.restrict(rows)
        assert sub is not lik and sub.sigma2 == lik.sigma2 and sub.learn_noise == lik.learn_noise
        assert torch.equal(self._scales(sub, len(rows)), full[rows])
        assert sub.log_evidence_correction() == pytest.approx(float(full[rows].log().sum()), rel=1e-12, abs=1e-12)
        if case.measurement_variances is not None:
            kept = torch.as_tensor(sub.noise_variance_of(case.measurement_variances[rows]), dtype=torch.float64)
            every = torch.as_tensor(lik.noise_variance_of(case.measurement_variances), dtype=torch.float64)
            assert torch.equal(kept, every[rows])
        if case.appended is None:
            with pytest.raises(ValueError):
                lik.extend(torch.ones(2, dtype=torch.float64), 2)
            grown = lik.extend(None, 2)
            assert grown.row_scales() is None and grown.sigma2 == lik.sigma2
        else:
            with pytest.raises(ValueError):
                lik.extend(None, len(case.appended))
            grown = lik.extend(case.appended, len(case.appended))
            want = torch.cat([full, case.appended.to(torch.float64).rsqrt()])
            torch.testing.assert_close(self._scales(grown, len(want)), want, rtol=1e-15, atol=0)
            assert grown.sigma2 == lik.sigma2

    def test_state_round_trip_is_bitwise(self, case):
        lik, n = case.likelihood, self._n_rows(case)
        pristine = copy.deepcopy(lik)
        if lik.learn_noise:  # a state that differs from a fresh likelihood's
            lik.sigma2 = lik.noise_update(2.0 * n, n, 0.5)
        state = lik.state_dict()
        for st in (state, _saved(state)):
            fresh = copy.deepcopy(pristine)
            fresh.load_state_dict(st)
            assert fresh.sigma2 == lik.sigma2
            _same_state(fresh.state_dict(), state)
        with pytest.raises(ValueError, match="not"):
            copy.deepcopy(pristine).load_state_dict({**state, "name": "no_such_likelihood"})

    @pytest.mark.parametrize("target_scale", [1.0, 3.0])
    def test_noise_variance_of_matches_the_whitening(self, case, target_scale):
        lik, n = case.likelihood, self._n_rows(case)
        got = lik.noise_variance_of(case.measurement_variances, target_scale=target_scale)
        want = float(lik.sigma2) / target_scale**2 / self._scales(lik, n).pow(2)
        torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64).expand(n), want, rtol=1e-12, atol=0)


# ========================================================================================= calibration methods
__all__ += ["CalibrationCase", "CalibrationContract", "synthetic_heldout_rows"]


def synthetic_heldout_rows(
    *, k: float = 1.0, tau: float = 0.0, m: int = 40000, n_groups: int = 400, seed: int = 0
) -> HeldoutRows:
    """Held-out rows drawn from a predictive whose answer is known (unscored :class:`~ctuq.calibration.HeldoutRows`):
    residuals ``r_i ~ N(0, k² v_i + τ² w_i + σ²)`` with image variances ``v_i ~ U(1e-4, 3e-4)``, bias weights ``w_i``
    ``U(5, 15)`` on half the rows and 0 on the others (an object mask), ``σ² = 6e-4`` (an image share of about 0.2,
    as a CT check's), ``n_groups`` equal blocks (angles). ``k`` is the scale the std map needs, ``τ`` the bias std
    inside the object."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 1.5, m) * 2e-4
    w = np.where(rng.random(m) < 0.5, rng.uniform(5.0, 15.0, m), 0.0)
    s2 = np.full(m, 6e-4)
    r = rng.normal(0.0, np.sqrt(k * k * v + tau * tau * w + s2))
    groups = np.repeat(np.arange(n_groups), -(-m // n_groups))[:m]
    meta = {"n_samples": 256, "n_angles": n_groups, "n_used_angles": n_groups, "noise_model": "homoscedastic"}
    return HeldoutRows(r, v, s2, groups, bias_weight=w, meta=meta)


@dataclasses.dataclass
class CalibrationCase:
    """One calibration method under test: its class, held-out ``rows`` with a known answer (scored by the contract
    when unscored), the ``reconstruction`` ``(H, W)`` (mm⁻¹) whose std map it recalibrates, the ``truth``
    (:meth:`~ctuq.calibration.CalibrationMethod.report` entries the fit must recover) and the relative
    ``tolerance`` of that recovery (state it from the rows' standard error)."""

    method: type[CalibrationMethod]
    rows: HeldoutRows
    reconstruction: np.ndarray
    truth: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 0.1


class CalibrationContract:
    """The calibration-method contract: a subclass gives :meth:`make_case`; the checks are

    * the class facts (a registered name, a summary, report keys) and ``None`` from :meth:`fit` without rows for a
      method that changes the map;
    * the fit recovers the case's known answer within its tolerance;
    * :meth:`apply_std` keeps the type (torch, numpy), shape and dtype, leaves its input alone, gives the same
      numbers from torch and numpy, and :meth:`apply_moments` agrees with it: the std of the applied moments is the
      applied std (1e-12 relative), the input moments unchanged;
    * the report is JSON-serialisable with keys :attr:`report_keys` (and so is the unfitted report), the label and
      the log line are one line each;
    * the state round trip (:meth:`~ctuq.calibration.CalibrationMethod.from_state` of the state) gives the same
      report and the same map, bitwise.
    """

    n_bootstrap: int = 0
    patch_sizes: tuple[int, ...] = (1, 2, 4)

    def make_case(self) -> CalibrationCase:
        """A :class:`CalibrationCase` (override)."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def fitted(cls):
        case = cls().make_case()
        if not case.rows.report:
            case.rows.score(n_bootstrap=cls.n_bootstrap, seed=0)
        return case, case.method.fit(case.rows, case.reconstruction)

    @staticmethod
    def _std(shape, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.2) * 1e-3

    def test_class_facts(self, fitted):
        case, method = fitted
        cls = case.method
        assert cls.name and cls.summary and cls.report_keys
        assert CALIBRATIONS[cls.name] is cls
        assert isinstance(method, cls)
        if cls.changes_std:
            assert cls.fit(None, case.reconstruction) is None
            assert cls.summary_name() and set(cls.summary_fields) <= set(cls.report_keys)
            assert set(cls.parameters) <= set(cls.report_keys)

    def test_fit_recovers_the_known_answer(self, fitted):
        case, method = fitted
        rep = method.report()
        for key, value in case.truth.items():
            assert rep[key] == pytest.approx(value, rel=case.tolerance), (key, rep[key], value)

    def test_apply_std_keeps_type_dtype_and_input(self, fitted):
        case, method = fitted
        shape = np.shape(case.reconstruction)
        std = self._std(shape)
        for x in (std, std.float(), std.numpy(), std.float().numpy()):
            before = x.clone() if isinstance(x, torch.Tensor) else x.copy()
            out = method.apply_std(x)
            assert type(out) is type(x) and tuple(out.shape) == shape and out.dtype == x.dtype
            assert torch.equal(x, before) if isinstance(x, torch.Tensor) else np.array_equal(x, before)
            assert np.all(np.isfinite(np.asarray(out))) and np.all(np.asarray(out) >= 0)
        assert np.array_equal(method.apply_std(std).numpy(), method.apply_std(std.numpy()))

    def test_apply_moments_agrees_with_apply_std(self, fitted):
        case, method = fitted
        shape = np.shape(case.reconstruction)
        g = torch.Generator().manual_seed(1)
        moments = SampleMoments(shape, patch_sizes=self.patch_sizes)
        moments.update(torch.randn(40, *shape, generator=g, dtype=torch.float64) * self._std(shape))
        before = moments.state_dict()
        out = method.apply_moments(moments)
        assert out.n_samples == moments.n_samples and out.image_shape == moments.image_shape
        torch.testing.assert_close(out.std(), method.apply_std(moments.std()), rtol=1e-12, atol=0)
        after = moments.state_dict()
        assert torch.equal(after["sum_sq"], before["sum_sq"])
        assert all(torch.equal(after["patch_sums"][p], t) for p, t in before["patch_sums"].items())

    def test_report_label_and_log_line(self, fitted):
        case, method = fitted
        rep = method.report()
        assert tuple(rep) == case.method.report_keys
        assert json.loads(json.dumps(rep)) == rep
        assert tuple(case.method.unfitted_report()) == case.method.report_keys
        assert json.loads(json.dumps(method.summary_record())) == method.summary_record()
        for text in (method.label(), method.label(applied=False), method.log_line()):
            assert isinstance(text, str) and text and "\n" not in text
        if case.method.changes_std:
            assert method.label(applied=False) != method.label()

    def test_state_round_trip(self, fitted):
        case, method = fitted
        again = case.method.from_state(method.state_dict())
        assert again.report() == method.report()
        std = self._std(np.shape(case.reconstruction), seed=2)
        assert torch.equal(again.apply_std(std), method.apply_std(std))


# ================================================================================================ weight priors
__all__ += ["PriorCase", "PriorContract"]


@dataclasses.dataclass
class PriorCase:
    """The problem a prior is checked on: the unscaled features ``Ψ₀`` (``c × d``), their dense float64 matrix and
    the targets ``ỹ`` ``(c,)``."""

    features: FeatureOperator
    matrix: torch.Tensor
    targets: torch.Tensor


def _same_state(got, want, where: str = "state") -> None:
    """``got`` equals ``want`` bitwise: tensors by ``torch.equal`` (and dtype), containers item by item."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for k in want:
            _same_state(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _out_of_bounds(field: dataclasses.Field) -> list:
    """Values that break the bounds or choices of an :func:`ctuq.options.option` field (empty: it has none)."""
    meta, bad = field.metadata, []
    if meta.get("choices") is not None:
        bad.append("__not_a_choice__")
    for key, step in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
        bound = meta.get(key)
        if bound is not None:
            bad.append(bound + step)  # ge: one below; gt: the bound itself; le: one above; lt: the bound
    return bad


class PriorContract:
    """The weight-prior contract: what every :class:`~ctuq.inference.priors.WeightPrior` must do.

    A subclass sets :attr:`registry_name` and :attr:`options` (the prior is then
    ``PRIORS[registry_name].create(features, **options)``), or overrides :meth:`make_prior`; a prior that needs a
    problem of its own (a network's parameter layout, an image) overrides :meth:`make_problem`. The checks:

    * the class facts: registered under its name, an ``Options`` dataclass of documented
      :func:`~ctuq.options.option` fields whose names :meth:`~ctuq.inference.priors.WeightPrior.create` takes;
    * the built ``Ψ`` equals the dense reference ``Ψ₀ L`` (``L``: the prior's own
      :meth:`~ctuq.inference.priors.WeightPrior.weight_matrix`, ``diag(s)`` or block diagonal) on the matrix-free and
      on the assembled route, within :attr:`build_rtol`, and ``apply`` / ``apply_t`` are ``L`` / ``Lᵀ``;
    * the ``state_dict`` round trip through ``torch.save`` / ``torch.load(weights_only=True)`` is bitwise, and a
      restored prior is set up without a fit and without a product of ``Ψ₀``; a posterior restored from a checkpoint
      gives the same mean bitwise;
    * the posterior with this prior (both exact solvers) matches the dense float64 reference
      (:class:`~ctuq.inference.reference.DenseLinearGaussian` on ``Ψ₀ L``): mean within :attr:`posterior_rtol`,
      whitened sample covariance of :attr:`n_samples` samples (seed 0) within ``sample_tol · √(2/n)`` per entry;
    * bad options: a value outside each ``Options`` field's bounds or choices, and an unknown name, are refused
      with one line naming the option; rows of the wrong width are refused naming the width;
    * :meth:`~ctuq.inference.priors.WeightPrior.summary` is JSON-serialisable and
      :meth:`~ctuq.inference.priors.WeightPrior.figures` writes the files it lists.
    """

    registry_name: str | None = None
    """Registry name (:data:`ctuq.registry.PRIORS`); ``None``: :meth:`make_prior` is overridden."""
    options: dict = {}
    """Options of the prior under test."""
    problem_size: tuple[int, int] = (24, 36)
    a: float = 2.0
    sigma2: float = 0.5
    build_rtol: float = 1e-12
    """Bound on ``‖Ψ − Ψ₀ L‖_F / ‖Ψ₀ L‖_F`` (float64 problem)."""
    posterior_rtol: float = 1e-8
    """Bound on the posterior mean's relative error against the reference (exact solvers, float64)."""
    n_samples: int = 2000
    sample_tol: float = 5.5

    def make_problem(self) -> PriorCase:
        """The problem (default: :func:`contract_problem` of :attr:`problem_size`)."""
        features, matrix, targets = contract_problem(*self.problem_size)
        return PriorCase(features, matrix, targets)

    def make_prior(self, features: FeatureOperator, **overrides):
        """A fresh prior under test on ``features``, its options updated by ``overrides``."""
        return PRIORS[self.registry_name].create(features, **{**self.options, **overrides})

    @pytest.fixture
    def problem(self) -> PriorCase:
        return self.make_problem()

    def _set_up(self, prior, problem: PriorCase, dense: bool = False):
        return prior.setup(
            PriorProblem(
                problem.features,
                problem.targets,
                a=self.a,
                sigma2=self.sigma2,
                dense=problem.matrix if dense else None,
                seed=0,
            )
        )

    @staticmethod
    def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
        err = float((got.double() - want.double()).norm()) / max(float(want.double().norm()), 1e-300)
        assert err <= rtol, (what, err)

    # ------------------------------------------------------------------------------------------ class facts
    def test_class_facts(self, problem):
        prior = self.make_prior(problem.features)
        cls = type(prior)
        assert isinstance(prior, WeightPrior) and prior.d == problem.features.n_features
        assert isinstance(cls.name, str) and cls.name and isinstance(cls.summary_key, str) and cls.summary_key
        assert isinstance(cls.auto_calibration, str) and cls.auto_calibration
        if self.registry_name is not None:
            assert PRIORS[self.registry_name] is cls and cls.name == self.registry_name
        if cls.Options is not None:
            fields = dataclasses.fields(cls.Options)
            assert {f.name for f in fields} <= cls.option_names()
            for f in fields:
                assert f.metadata.get("help"), f"{cls.__name__}.Options.{f.name} has no help (use ctuq.options.option)"
            defaults = dataclasses.asdict(cls.Options())
            assert isinstance(self.make_prior(problem.features, **defaults), cls)  # every default is accepted

    # ------------------------------------------------------------------------------------------ Ψ = Ψ₀ L
    @pytest.mark.parametrize("route", ["matrix_free", "assembled"])
    def test_built_features_are_psi0_times_the_weight_map(self, problem, route):
        prior = self.make_prior(problem.features)
        done = self._set_up(prior, problem, dense=route == "assembled")
        assert isinstance(done.features, FeatureOperator) and prior.fitted
        d = problem.features.n_features
        L = prior.weight_matrix()
        assert tuple(L.shape) == (d, d) and L.dtype == torch.float64
        self._close(done.features.to_dense(), problem.matrix.double() @ L, self.build_rtol, "Ψ vs Ψ₀ L")
        W = torch.randn(3, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        self._close(prior.apply(W), W @ L.T, self.build_rtol, "apply vs L")
        self._close(prior.apply_t(W), W @ L, self.build_rtol, "apply_t vs Lᵀ")

    # ------------------------------------------------------------------------------------------ state
    def test_state_round_trip_is_bitwise(self, problem):
        first = self.make_prior(problem.features)
        built = self._set_up(first, problem).features.to_dense()
        state = _saved(first.state_dict())
        second = self.make_prior(problem.features)
        second.load_state_dict(state)
        _same_state(second.state_dict(), state)
        feats = problem.features
        before = (feats.n_matvec, feats.n_rmatvec)
        done = self._set_up(second, problem)
        assert done.sigma2 is None and done.fit_seconds is None, "a restored prior must not be fitted again"
        assert (feats.n_matvec, feats.n_rmatvec) == before, "a restored prior must not recompute from Ψ₀"
        assert torch.equal(second.weight_matrix(), first.weight_matrix())
        assert torch.equal(done.features.to_dense(), built)

    def test_posterior_checkpoint_resumes_bitwise(self, problem):
        def make():
            return LinearizedPosterior(
                problem.features,
                problem.targets,
                prior=self.make_prior(problem.features),
                likelihood=GaussianLikelihood(self.sigma2),
                a=self.a,
                solver="exact_dual",
                seed=0,
            )

        first = make().setup()
        again = make()
        again.load_state_dict(_saved(first.state_dict()))
        again.setup()
        assert torch.equal(again.mean(), first.mean())

    # ------------------------------------------------------------------------------------------ the posterior
    @pytest.mark.parametrize("solver", ["exact_dual", "exact_primal"])
    def test_posterior_matches_the_dense_reference(self, problem, solver):
        post = LinearizedPosterior(
            problem.features,
            problem.targets,
            prior=self.make_prior(problem.features),
            likelihood=GaussianLikelihood(self.sigma2),
            a=self.a,
            solver=solver,
            seed=0,
        ).setup()
        L = post.weight_prior.weight_matrix()
        ref = DenseLinearGaussian(problem.matrix.double() @ L, problem.targets)
        want = torch.as_tensor(ref.posterior_mean(self.a, self.sigma2))
        self._close(post.mean(), want, self.posterior_rtol, "posterior mean")
        n = self.n_samples
        Z = torch.cat([ps.weights.double() for _, ps in post.sample(n, chunk_size=500, seed=0)]).numpy()
        cov = ref.posterior_covariance(self.a, self.sigma2)
        _check_sample_covariance(Z, cov, self.sample_tol)

    # ------------------------------------------------------------------------------------------ bad input
    def test_options_out_of_bounds_are_refused_in_one_line(self, problem):
        with pytest.raises(ValueError) as info:
            self.make_prior(problem.features, no_such_option=1)
        assert "\n" not in str(info.value) and "no_such_option" in str(info.value)
        options = type(self.make_prior(problem.features)).Options
        if options is None:
            return
        for f in dataclasses.fields(options):
            for bad in _out_of_bounds(f):
                with pytest.raises(ValueError) as info:
                    self.make_prior(problem.features, **{f.name: bad})
                message = str(info.value)
                assert "\n" not in message and f.name in message, (f.name, bad, message)

    def test_rows_of_the_wrong_width_are_refused(self, problem):
        prior = self.make_prior(problem.features)
        self._set_up(prior, problem)
        d = problem.features.n_features
        for method in (prior.apply, prior.apply_t):
            with pytest.raises(ValueError, match=rf"\(B, {d}\)"):
                method(torch.zeros(2, d + 1, dtype=torch.float64))

    # ------------------------------------------------------------------------------------------ report
    def test_summary_is_json_and_figures_are_written(self, problem, tmp_path):
        prior = self.make_prior(problem.features)
        self._set_up(prior, problem)
        json.dumps(prior.summary())
        for path in prior.figures(tmp_path):
            assert path.is_file() and path.parent == tmp_path


# ---------------------------------------------------------------------------------------------- ray transforms
#: The geometry kinds a ray-transform backend may declare (:attr:`ctuq.operators.RayTransform.geometry_kinds`).
GEOMETRY_KINDS = (
    "parallel",
    "parallel_vec",
    "fanflat",
    "fanflat_vec",
    "parallel3d",
    "parallel3d_vec",
    "cone",
    "cone_vec",
)


def _fan_vectors(angles, src: float, det: float, du: float, offset: float = 0.0, tilt: float = 0.0, jitter=None):
    """Walnut-like ``fanflat_vec`` rows: source at ``src`` mm, detector ``det`` mm from the source, sideways detector
    offset (mm), in-plane tilt (rad) and per-view source-distance jitter (mm)."""
    rows = []
    for i, b in enumerate(angles):
        e = np.array([math.cos(b), math.sin(b)])
        p = np.array([-math.sin(b), math.cos(b)])
        s = (src + (0.0 if jitter is None else jitter[i])) * e
        d = s - det * e + offset * p
        rows.append(np.concatenate([s, d, du * (math.cos(tilt) * p - math.sin(tilt) * e)]))
    return np.array(rows)


def contract_geometries() -> dict[str, tuple[VolumeGeometry, ProjectionGeometry]]:
    """One small problem per geometry kind, ``case name → (volume, geometry)`` (mm): grids non-square and
    off-centre, so that an axis swap or flip shows; every geometry has at least 9 angles (the subset checks pick
    index 7); the 3D parallel beam has one detector row per slice (rows at the slices' heights, pitch = voxel size),
    the geometry both a slice-by-slice operator and a true 3D projector accept."""
    vol2 = VolumeGeometry((24, 20), 0.6, (0.4, -0.9))
    ang = np.linspace(0.1, math.pi + 0.1, 9, endpoint=False)
    ang_full = np.linspace(0.0, 2 * math.pi, 12, endpoint=False)
    n_par, d_par, n_fan, d_fan = 41, 0.45, 48, 0.9
    par_vec = []
    for t in ang:
        ray, u = np.array([math.sin(t), -math.cos(t)]), d_par * np.array([math.cos(t), math.sin(t)])
        par_vec.append(np.concatenate([ray, 0.7 * u, u]))  # detector shifted sideways by 0.7 pixel
    jitter = np.random.default_rng(3).normal(0, 0.5, ang_full.size)
    vol3 = VolumeGeometry((4, 12, 10), 0.6, (0.4, -0.9, 0.0))
    par3 = ProjectionGeometry("parallel3d", (4, 21), angles=ang, det_spacing=(0.6, 0.45))
    cone_vol = VolumeGeometry((8, 12, 14), 0.5, (0.4, -0.3, 0.2))
    cone = ProjectionGeometry(
        "cone", (10, 16), angles=ang_full, det_spacing=(0.9, 0.9), source_origin=66.0, origin_det=133.0
    )
    fan = ProjectionGeometry(
        "fanflat", (n_fan,), angles=ang_full, det_spacing=d_fan, source_origin=40.0, origin_det=60.0
    )
    fan_vec = _fan_vectors(ang_full, 40.0, 100.0, d_fan, offset=1.3, tilt=0.04, jitter=jitter)
    return {
        "parallel": (vol2, ProjectionGeometry("parallel", (n_par,), angles=ang, det_spacing=d_par)),
        "parallel_vec": (vol2, ProjectionGeometry("parallel_vec", (n_par,), vectors=np.array(par_vec))),
        "fanflat": (vol2, fan),
        "fanflat_vec": (vol2, ProjectionGeometry("fanflat_vec", (n_fan,), vectors=fan_vec)),
        "parallel3d": (vol3, par3),
        "parallel3d_vec": (vol3, par3.to_vectors()),
        "cone": (cone_vol, cone),
        "cone_vec": (cone_vol, cone.to_vectors()),
    }


__all__ += ["GEOMETRY_KINDS", "contract_geometries", "RayTransformContract"]

_RAY_TRANSFORM_CASES: dict[str, tuple[VolumeGeometry, ProjectionGeometry]] = {}
_RAY_TRANSFORMS_BUILT: dict[tuple, RayTransform] = {}


class RayTransformContract:
    """The ray-transform contract (ODL's ``impl`` fixture pattern): every check runs for each backend of
    :meth:`backends` over every case of :meth:`geometries` whose geometry kind the backend declares
    (``geometry_kinds``), skipped where the backend's availability flag is false.

    Subclass and set :attr:`impl` to a registry name (register the backend with one line,
    ``RAY_TRANSFORMS.register(MyRayTransform, name="mine")``), or leave it ``None`` to check every registered
    backend; operators are built by name through :func:`ctuq.operators.make_ray_transform` (override
    :meth:`make_operator` otherwise). Checked:

    * the class facts a backend declares (geometry kinds, devices, dtypes, ``auto_ndims``, the availability flag);
    * shapes, dtypes and devices: an operator of every declared dtype computes in it, on a declared device;
    * adjointness ``⟨Tx, y⟩ = ⟨x, Tᵀy⟩``: to round-off for exact adjoints (float64 ``1e-12``, float32 ``1e-5``
      relative), to :attr:`inexact_adjoint_rtol` on smooth inputs where ``exact_adjoint`` is false;
    * the dense matrix: ``T`` assembled column by column reproduces ``T x`` and ``Tᵀ y`` on random batches, and an
      exact adjoint's matrix is the transpose of the forward one;
    * batches equal the images one by one; the flat views equal the shaped ones; autograd's backward is ``Tᵀ``;
    * angle subsets: rows of the full operator, adjoint of the zero-filled sinogram, bad index lists refused;
    * bad input (wrong shapes, non-tensors, integer/complex dtypes, another device) raises an error naming it.
    """

    impl: str | None = None
    """Registry name of the backend under test; ``None``: every backend in :data:`ctuq.registry.RAY_TRANSFORMS`."""
    inexact_adjoint_rtol: float = 0.03
    """``|⟨Tx, y⟩ − ⟨x, Tᵀy⟩| / |⟨Tx, y⟩|`` on smooth positive inputs where ``exact_adjoint`` is false (ASTRA's
    voxel-driven back-projection is the transpose of its ray-driven projection to ~1–3 %)."""

    # ------------------------------------------------------------------------------------------ what is checked
    def backends(self) -> dict[str, type[RayTransform]]:
        """Name → class of the backends under test (:attr:`impl`, or every registered one)."""
        if self.impl is None:
            return dict(RAY_TRANSFORMS.items())
        return {self.impl: RAY_TRANSFORMS[self.impl]}

    def geometries(self) -> dict[str, tuple[VolumeGeometry, ProjectionGeometry]]:
        """Case name → ``(volume, geometry)`` (default: :func:`contract_geometries`, built once)."""
        if not _RAY_TRANSFORM_CASES:
            _RAY_TRANSFORM_CASES.update(contract_geometries())
        return _RAY_TRANSFORM_CASES

    def device(self, impl: str) -> str:
        """The device a backend is checked on: the CPU where it runs there, else CUDA."""
        return "cpu" if "cpu" in self.backends()[impl].devices else "cuda"

    def make_operator(self, impl: str, case: str, dtype: torch.dtype = torch.float32) -> RayTransform:
        """The operator of backend ``impl`` for the case ``case`` (built by name; cached, since assembling costs
        more than most checks)."""
        key = (self.backends()[impl], impl, case, dtype)
        if key not in _RAY_TRANSFORMS_BUILT:
            vol, geo = self.geometries()[case]
            _RAY_TRANSFORMS_BUILT[key] = make_ray_transform(
                vol, geo, backend=impl, device=self.device(impl), dtype=dtype
            )
        return _RAY_TRANSFORMS_BUILT[key]

    def pytest_generate_tests(self, metafunc):
        """``impl`` over :meth:`backends` (skipped by their availability flags); with ``case``, every case whose
        geometry kind the backend declares."""
        if "impl" not in metafunc.fixturenames:
            return
        params = []
        for name, cls in self.backends().items():
            mark = pytest.mark.skipif(
                not cls.available(), reason=f"backend {name!r} is not available on this machine (its flag)"
            )
            if "case" in metafunc.fixturenames:
                params += [
                    pytest.param(name, case, id=f"{name}-{case}", marks=mark)
                    for case, (_, geo) in self.geometries().items()
                    if geo.kind in cls.geometry_kinds
                ]
            else:
                params.append(pytest.param(name, id=name, marks=mark))
        metafunc.parametrize("impl,case" if "case" in metafunc.fixturenames else "impl", params)

    # ------------------------------------------------------------------------------------------ inputs
    def _first_case(self, impl: str) -> str:
        kinds = self.backends()[impl].geometry_kinds
        return next(c for c, (_, g) in self.geometries().items() if g.kind in kinds)

    @staticmethod
    def smooth_pair(op: RayTransform, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A smooth positive image (Gaussian blobs over the grid, mm⁻¹) and a smooth positive sinogram (the
        projection of a shifted copy plus a constant), on the operator's device: what an interpolating projector
        handles accurately."""
        centres = op.volume.pixel_centers()
        grids = np.meshgrid(*centres, indexing="ij")
        rng = np.random.default_rng(seed)
        img = np.zeros(op.image_shape)
        half = [0.5 * (c[-1] - c[0]) for c in centres]
        for _ in range(3):
            c = [np.mean(ci) + 0.4 * h * rng.uniform(-1, 1) for ci, h in zip(centres, half)]
            width = 0.3 * min(half)
            img += rng.uniform(0.01, 0.02) * np.exp(-sum((g - ci) ** 2 for g, ci in zip(grids, c)) / (2 * width**2))
        x = torch.tensor(img, dtype=op.dtype, device=op.device)
        y = op(torch.roll(x, shifts=2, dims=-1)) + 0.1
        return x, y

    @staticmethod
    def random_pair(op: RayTransform, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Standard normal images ``(batch, *image_shape)`` and sinograms ``(batch, *measurement_shape)`` in the
        operator's dtype, on its device."""
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((batch, *op.image_shape), generator=gen, dtype=torch.float64)
        y = torch.randn((batch, *op.measurement_shape), generator=gen, dtype=torch.float64)
        return x.to(op.device, op.dtype), y.to(op.device, op.dtype)

    # ------------------------------------------------------------------------------------------ class facts
    def test_class_facts(self, impl):
        cls = self.backends()[impl]
        assert isinstance(cls, type) and issubclass(cls, RayTransform), impl
        assert cls.geometry_kinds and set(cls.geometry_kinds) <= set(GEOMETRY_KINDS), cls.geometry_kinds
        assert cls.devices and set(cls.devices) <= {"cpu", "cuda"}, cls.devices
        assert cls.dtypes and set(cls.dtypes) <= {torch.float32, torch.float64}, cls.dtypes
        assert set(cls.auto_ndims) <= {2, 3} and isinstance(cls.exact_adjoint, bool)
        assert isinstance(cls.available(), bool)

    def test_shapes_dtypes_and_devices(self, impl, case):
        cls = self.backends()[impl]
        vol, geo = self.geometries()[case]
        for dtype in cls.dtypes:
            op = self.make_operator(impl, case, dtype)
            assert op.dtype == dtype and op.device.type in cls.devices
            assert op.image_shape == tuple(vol.shape) and op.n_angles == geo.n_angles and op.ndim == vol.ndim
            assert op.c == math.prod(op.measurement_shape) and op.d_x == math.prod(op.image_shape)
            x, y = self.random_pair(op, 2)
            fwd, adj = op(x), op.adjoint(y)
            assert fwd.shape == (2, *op.measurement_shape) and adj.shape == (2, *op.image_shape)
            assert fwd.dtype == adj.dtype == dtype and fwd.device == adj.device == op.device
            assert op(x[0]).shape == tuple(op.measurement_shape)  # no batch dimension in, none out

    # ------------------------------------------------------------------------------------------ adjointness
    def test_adjointness(self, impl, case):
        cls = self.backends()[impl]
        if not cls.exact_adjoint:
            op = self.make_operator(impl, case)
            x, y = self.smooth_pair(op)
            lhs = float((op(x).double() * y.double()).sum())
            rhs = float((x.double() * op.adjoint(y).double()).sum())
            assert abs(lhs - rhs) < self.inexact_adjoint_rtol * abs(lhs), (lhs, rhs)
            return
        for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            if dtype not in cls.dtypes:
                continue
            op = self.make_operator(impl, case, dtype)
            x, y = self.random_pair(op, 3)
            dims = tuple(range(1, 1 + len(op.measurement_shape)))
            img_dims = tuple(range(1, 1 + len(op.image_shape)))
            lhs = (op(x) * y).sum(dim=dims)
            rhs = (x * op.adjoint(y)).sum(dim=img_dims)
            scale = op(x).flatten(1).norm(dim=1) * y.flatten(1).norm(dim=1)
            # float64: the exact transpose to double precision; float32: the sums differ by rounding only
            assert torch.all((lhs - rhs).abs() <= rtol * scale), (dtype, lhs, rhs)

    def test_dense_matrix(self, impl, case):
        cls = self.backends()[impl]
        dtype = torch.float64 if torch.float64 in cls.dtypes else torch.float32
        op = self.make_operator(impl, case, dtype)
        eye_x = torch.eye(op.d_x, dtype=dtype, device=op.device)
        eye_y = torch.eye(op.c, dtype=dtype, device=op.device)
        M = torch.cat([op.forward_flat(eye_x[i : i + 128]) for i in range(0, op.d_x, 128)]).T  # (c, d_x)
        A = torch.cat([op.adjoint_flat(eye_y[i : i + 128]) for i in range(0, op.c, 128)]).T  # (d_x, c)
        rtol = 1e-10 if dtype == torch.float64 else 1e-4
        x, y = self.random_pair(op, 3, seed=5)
        for got, want in (
            (op.forward_flat(x.flatten(1)), x.flatten(1) @ M.T),
            (op.adjoint_flat(y.flatten(1)), y.flatten(1) @ A.T),
        ):
            assert float((got - want).norm()) <= rtol * float(want.norm()), float((got - want).norm() / want.norm())
        if cls.exact_adjoint:
            # the adjoint's matrix is the forward matrix's transpose, entry by entry
            assert float((A - M.T).norm()) <= rtol * float(M.norm()), float((A - M.T).norm() / M.norm())

    # ------------------------------------------------------------------------------------------ batches and views
    def test_batched_equals_looped(self, impl, case):
        op = self.make_operator(impl, case)
        x, y = self.smooth_pair(op)
        xb = torch.stack([x, 2 * torch.flip(x, dims=[-1]), torch.roll(x, 3, dims=-2)])
        yb = torch.stack([y, torch.flip(y, dims=[-1]), 0.5 * y])
        fwd, adj = op(xb), op.adjoint(yb)
        assert fwd.shape == (3, *op.measurement_shape) and adj.shape == (3, *op.image_shape)
        for i in range(3):
            torch.testing.assert_close(fwd[i], op(xb[i]), rtol=1e-4, atol=1e-5 * float(fwd.abs().max()))
            torch.testing.assert_close(adj[i], op.adjoint(yb[i]), rtol=1e-4, atol=1e-5 * float(adj.abs().max()))

    def test_flat_views_match_shaped(self, impl, case):
        op = self.make_operator(impl, case)
        x, y = self.random_pair(op, 2)
        torch.testing.assert_close(op.forward_flat(x.reshape(2, -1)), op(x).reshape(2, -1), rtol=1e-6, atol=0.0)
        torch.testing.assert_close(op.adjoint_flat(y.reshape(2, -1)), op.adjoint(y).reshape(2, -1), rtol=1e-6, atol=0.0)

    def test_backward_is_adjoint(self, impl, case):
        op = self.make_operator(impl, case)
        x, w = self.smooth_pair(op)
        x = x.clone().requires_grad_(True)
        (op(x) * w).sum().backward()
        expected = op.adjoint(w)
        torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))

    # ------------------------------------------------------------------------------------------ angle subsets
    def test_subset_is_row_selection(self, impl, case):
        op = self.make_operator(impl, case)
        x, _ = self.smooth_pair(op)
        xb = torch.stack([x, torch.flip(x, dims=[-1])])
        full = op(xb)
        idx = [7, 0, 3, -1]
        rows = [7, 0, 3, op.n_angles - 1]
        sub = op.subset(idx)
        assert sub.measurement_shape == (4, *op.measurement_shape[1:]) and sub.image_shape == op.image_shape
        np.testing.assert_array_equal(sub.angles, op.angles[rows])
        torch.testing.assert_close(sub(xb), full[:, rows], rtol=1e-4, atol=1e-5 * float(full.abs().max()))
        # the adjoint of the subset is the full adjoint of the zero-filled sinogram
        gen = torch.Generator().manual_seed(1)
        y = torch.rand((2, *sub.measurement_shape), generator=gen).to(op.device, op.dtype)
        y_full = torch.zeros_like(full)
        y_full[:, rows] = y
        expected = op.adjoint(y_full)
        torch.testing.assert_close(sub.adjoint(y), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))

    def test_subset_bad_indices_raise(self, impl):
        op = self.make_operator(impl, self._first_case(impl))
        with pytest.raises(IndexError, match="out of range"):
            op.subset([0, op.n_angles])
        with pytest.raises(IndexError, match="out of range"):
            op.subset([-op.n_angles - 1])
        with pytest.raises(ValueError, match="empty"):
            op.subset([])

    # ------------------------------------------------------------------------------------------ bad input
    def test_bad_input_errors_name_the_problem(self, impl, case):
        op = self.make_operator(impl, case)
        bad = tuple(s + 1 for s in op.image_shape)
        with pytest.raises(ShapeError, match=r"image has shape " + re.escape(f"{bad}; expected {op.image_shape}")):
            op(torch.zeros(bad, device=op.device))
        bad_y = (3, *op.measurement_shape[:-1], op.measurement_shape[-1] - 1)
        with pytest.raises(ShapeError, match=r"sinogram has shape " + re.escape(str(bad_y))):
            op.adjoint(torch.zeros(bad_y, device=op.device))
        with pytest.raises(ShapeError, match=r"forward_flat: expected \(batch, " + str(op.d_x)):
            op.forward_flat(torch.zeros(2, op.d_x - 1, device=op.device))
        with pytest.raises(ShapeError, match=r"adjoint_flat: expected \(batch, " + str(op.c)):
            op.adjoint_flat(torch.zeros(op.c, device=op.device))
        with pytest.raises(TypeError, match="torch.Tensor"):
            op(np.zeros(op.image_shape))
        with pytest.raises(TypeError, match="int64"):
            op(torch.zeros(op.image_shape, dtype=torch.int64, device=op.device))
        with pytest.raises(TypeError, match="complex64"):
            op(torch.zeros(op.image_shape, dtype=torch.complex64, device=op.device))
        with pytest.raises(ValueError, match="lives on .* but the image is on meta"):
            op(torch.zeros(op.image_shape, device="meta"))
        # another floating dtype is cast, and the result is the operator's dtype
        other = torch.float64 if op.dtype == torch.float32 else torch.float32
        assert op(torch.zeros(op.image_shape, dtype=other, device=op.device)).dtype == op.dtype


# ================================================================================================= scan formats
__all__ += ["Damage", "ScanFormatCase", "ScanFormatContract", "small_scan_content"]


def small_scan_content(
    *,
    n_angles: int = 6,
    det_shape: tuple[int, int] = (4, 10),
    gt_shape: tuple[int, int, int] = (3, 8, 8),
    voxel_size: float = 1.5,
    read_noise: float = 2.0,
    closing: bool = True,
    seed: int = 0,
) -> ScanContent:
    """A seeded small scan to write (:class:`~ctuq.data.scan_format.ScanContent`): one cone-beam orbit 2 of
    ``n_angles`` degree angles (source in the detector centre's plane, 66 mm and 133 mm, 3 mm pixels), uint16 raw
    counts with two flats and one dark (flat ≈ 2000, dark ≈ 100, transmissions 0.3 … 0.95, so every ``−log`` is
    defined), a closing projection, and a float32 ground truth ``gt_shape`` (mm⁻¹) at ``voxel_size`` mm."""
    rng = np.random.default_rng(seed)
    rows, cols = det_shape
    dark = np.round(100.0 + rng.normal(0.0, 3.0, det_shape))
    gain = 2000.0 + rng.normal(0.0, 20.0, det_shape)
    flats = np.stack([np.round(gain + rng.normal(0.0, 40.0, det_shape)) + dark for _ in range(2)])

    def frame() -> np.ndarray:
        return np.round(dark + rng.uniform(0.3, 0.95, det_shape) * gain)

    projections = np.stack([frame() for _ in range(n_angles)])
    geometry = CircularOrbit(
        n_angles=n_angles, pixel_size=3.0, row_pixel_size=3.0, source_object=66.0, object_detector=133.0
    )
    orbit = ScanOrbit(
        geometry,
        projections.astype(np.uint16),
        flats.astype(np.uint16),
        dark[None].astype(np.uint16),
        closing=frame().astype(np.uint16) if closing else None,
    )
    gt = rng.uniform(0.0, 0.05, gt_shape).astype(np.float32)
    return ScanContent(
        orbits={2: orbit},
        ground_truth=gt,
        gt_shape=gt_shape,
        voxel_size=voxel_size,
        read_noise=read_noise,
        title="ctuq contract scan",
    )


@dataclasses.dataclass
class Damage:
    """One way to damage a written scan: ``apply(path)`` edits the scan whose :meth:`ScanFormat.write` returned
    ``path`` (a copy) and returns the text the one-line error must contain (e.g. the damaged file's name)."""

    name: str
    apply: Callable[[Path], str]


def _largest_written(fmt: type[ScanFormat], path: Path) -> Path:
    folder = path if path.is_dir() else path.parent
    files = fmt.written_files(folder) or [p for p in folder.rglob("*") if p.is_file()]
    return max(files, key=lambda p: (p.stat().st_size, str(p)))


def _damage_largest(fmt: type[ScanFormat], name: str, damage: Callable[[Path], Any]) -> Damage:
    def apply(path: Path) -> str:
        victim = _largest_written(fmt, path)
        damage(victim)
        return victim.name

    return Damage(name, apply)


@dataclasses.dataclass
class ScanFormatCase:
    """One format under test: the format class, the options of its ``write`` (a ``--layout``'s), its own malformed
    files (beyond the generic truncated and deleted largest file) and the scan written (default
    :func:`small_scan_content`)."""

    format: type[ScanFormat]
    write_options: dict = dataclasses.field(default_factory=dict)
    damages: list[Damage] = dataclasses.field(default_factory=list)
    content: ScanContent | None = None


class ScanFormatContract:
    """The scan-format contract. Subclass and set :attr:`format` (a :class:`~ctuq.data.scan_format.ScanFormat`
    subclass or a registered name), :attr:`write_options` and :attr:`damages`, or override the class-scoped
    ``case`` fixture (e.g. parametrised over every ``--layout`` of :data:`~ctuq.registry.DATA_FORMATS`).

    Checks, on the written scan opened with the format's ``open``: the class facts (name, what it expects,
    ``--layout`` names, error class; a format detects what it wrote, and registered formats are detected from the
    folder); the geometry (``vectors`` of the distinct angles, detector and grid shape, voxel size) and the
    measurements (every projection, the closing one where the format keeps it, mean flat and dark, read noise,
    ground truth) equal the content bit for bit; line integrals and their variances are
    :func:`~ctuq.data.source.count_variance`'s of the content's counts bit for bit; a slice loads, and a subsampled
    load with ``heldout=True`` splits the all-angle rows bit for bit into the used and held-out rows; damaged files
    (the largest file the write left truncated or deleted, plus :attr:`damages`) raise one line, a
    :class:`~ctuq.errors.CTUQError` naming the file. The default scan has two flats and one dark (the walnut
    layout's), so the mean frames compare bit for bit."""

    format: type[ScanFormat] | str | None = None
    """The format under test."""
    write_options: dict = {}
    """Options of :meth:`ScanFormat.write` (a layout's, e.g. ``{"arrays": "tiff"}``)."""
    damages: list[Damage] = []
    """The format's own malformed files."""

    @pytest.fixture(scope="class")
    @classmethod
    def case(cls) -> ScanFormatCase:
        fmt = DATA_FORMATS[cls.format] if isinstance(cls.format, str) else cls.format
        return ScanFormatCase(fmt, dict(cls.write_options), list(cls.damages))

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, case, tmp_path_factory) -> tuple[Path, ScanContent]:
        """``(path to open, content)`` of the scan written once per case."""
        content = case.content if case.content is not None else small_scan_content()
        folder = tmp_path_factory.mktemp(f"scan_{case.format.name}")
        path = case.format.write(folder / "scan", content, **case.write_options)
        return Path(path), content

    @pytest.fixture
    def scan_format(self, case) -> type[ScanFormat]:
        return case.format

    @pytest.fixture
    def scan(self, scan_format, written):
        return scan_format.open(written[0], 2)

    @staticmethod
    def _orbit(content: ScanContent) -> ScanOrbit:
        return content.orbits[2] if 2 in content.orbits else next(iter(content.orbits.values()))

    @staticmethod
    def _mean_frames(orbit: ScanOrbit) -> tuple[np.ndarray, np.ndarray]:
        """The mean flat and dark of what was written (float64, the readers' summation)."""
        return tuple(f.astype(np.float64).sum(axis=0) * (1.0 / len(f)) for f in (orbit.flats, orbit.darks))

    # ------------------------------------------------------------------------------------------ class facts
    def test_class_facts(self, scan_format, written):
        fmt = scan_format
        assert issubclass(fmt, ScanFormat) and isinstance(fmt.name, str) and fmt.name
        assert isinstance(fmt.expects, str) and fmt.expects and isinstance(fmt.folder_lacks(), str)
        layouts = fmt.write_layouts()
        assert layouts and all(isinstance(k, str) and isinstance(v, dict) for k, v in layouts.items())
        assert issubclass(fmt.error, CTUQError)
        path, _content = written
        assert fmt.detect(path) == path
        folder = path if path.is_dir() else path.parent
        assert fmt.detect(folder) == path, "detecting the folder the write filled gives what open takes"
        assert set(fmt.written_files(folder)) <= {p for p in folder.rglob("*") if p.is_file()}
        if DATA_FORMATS.get(fmt.name) is fmt:
            assert detect_format(folder)[0] is fmt

    def test_nothing_is_detected_in_an_empty_folder(self, scan_format, tmp_path):
        assert scan_format.detect(tmp_path) is None

    # ------------------------------------------------------------------------------------------ round trip
    def test_geometry_round_trip(self, scan, written):
        _path, content = written
        orbit = self._orbit(content)
        rows, files = scan.angle_plan(1)
        assert scan.n_distinct_angles == len(rows) == orbit.geometry.n_angles
        assert np.array_equal(rows, np.arange(orbit.geometry.n_angles))
        assert scan.vectors[rows].tobytes() == orbit.geometry.vectors().tobytes()
        assert tuple(scan.det_shape) == orbit.det_shape
        assert tuple(scan.gt_shape) == content.gt_shape and scan.voxel_size == content.voxel_size
        assert scan.geometry_type == "cone" and isinstance(scan.describe_angles(), str)

    def test_measurements_round_trip(self, scan, written):
        _path, content = written
        orbit = self._orbit(content)
        rows, files = scan.angle_plan(1)
        for k, f in zip(rows, files):
            assert np.array_equal(scan.projection(int(f)), orbit.projections[k].astype(np.float64)), f"projection {k}"
        for f in sorted(set(range(scan.n_files)) - {int(f) for f in files}):  # kept beyond the distinct angles
            want = orbit.closing if orbit.closing is not None else orbit.projections[0]
            assert np.array_equal(scan.projection(f), want.astype(np.float64)), f"closing projection (file {f})"
        assert (scan.n_flats, scan.n_darks) == (len(orbit.flats), len(orbit.darks))
        assert all(np.array_equal(got, want) for got, want in zip(scan.flat_dark(), self._mean_frames(orbit)))
        assert scan.read_noise == content.read_noise

    def test_ground_truth_round_trip(self, scan, written):
        _path, content = written
        assert scan.has_ground_truth == (content.ground_truth is not None)
        if content.ground_truth is not None:
            for k in range(content.gt_shape[0]):
                got = scan.read_ground_truth_slice(k)
                assert got.dtype == np.float64 and np.array_equal(got, content.ground_truth[k].astype(np.float64))

    def test_line_integrals_and_variances(self, scan, written):
        _path, content = written
        orbit = self._orbit(content)
        flat, dark = self._mean_frames(orbit)
        all_rows, all_cols = np.arange(orbit.det_shape[0]), np.arange(orbit.det_shape[1])
        rows, files = scan.angle_plan(1)
        for k, f in zip(rows, files):
            P, F = orbit.projections[k].astype(np.float64) - dark, flat - dark
            ell, var = scan.log_rows(int(f), all_rows, all_cols, None)
            assert ell.tobytes() == (-np.log(P / F)).tobytes(), f"line integrals of projection {k}"
            want = count_variance(P, F, content.read_noise, len(orbit.flats), len(orbit.darks))
            assert var is not None and var.tobytes() == want.tobytes(), f"variances of projection {k}"

    def test_slice_and_heldout_rows_split_the_scan(self, scan):
        full = read_slice(scan, angular_subsampling=1, progress=False)
        n = full.y.shape[0]
        assert full.heldout is None and full.heldout_reason
        assert tuple(full.y.shape) == (n, scan.det_shape[1]) and full.variances is not None
        sub = load_slice(scan, angular_subsampling=2, backend="sparse", heldout=True, progress=False)
        rows = np.asarray(full.meta["geometry_rows"])
        used = np.isin(rows, sub.meta["geometry_rows"])
        assert used.sum() == sub.y.shape[0] == sub.heldout.n_used and (~used).sum() == sub.heldout.n_angles
        assert torch.equal(sub.y, full.y[torch.from_numpy(used)])
        assert torch.equal(sub.variances, full.variances[torch.from_numpy(used)])
        assert np.array_equal(sub.geometry.vectors, full.geometry.vectors[used])
        assert np.array_equal(sub.heldout.geometry_rows, rows[~used]) and sub.heldout_reason == ""
        assert torch.equal(sub.heldout.y, full.y[torch.from_numpy(~used)])
        assert torch.equal(sub.heldout.variances, full.variances[torch.from_numpy(~used)])
        assert tuple(sub.heldout.op.measurement_shape) == tuple(sub.heldout.y.shape)
        assert sub.heldout.op.image_shape == sub.op.image_shape
        if full.ground_truth is not None:
            assert torch.equal(sub.ground_truth, full.ground_truth)

    # ------------------------------------------------------------------------------------------ bad input
    @staticmethod
    def _read_everything(fmt: type[ScanFormat], path: Path) -> None:
        scan = fmt.open(path, 2)
        scan.flat_dark()
        for f in range(scan.n_files):
            scan.projection(f)
        if scan.has_ground_truth:
            for k in range(scan.gt_shape[0]):
                scan.read_ground_truth_slice(k)
        read_slice(scan, angular_subsampling=1, progress=False)

    def test_damaged_files_are_one_line_errors_naming_the_file(self, case, scan_format, written, tmp_path):
        path, _content = written
        source = path if path.is_dir() else path.parent
        damages = [
            _damage_largest(
                scan_format, "truncated file", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
            ),
            _damage_largest(scan_format, "missing file", Path.unlink),
            *case.damages,
        ]
        for i, damage in enumerate(damages):
            copy_dir = tmp_path / f"damage{i}"
            shutil.copytree(source, copy_dir)
            target = copy_dir if path.is_dir() else copy_dir / path.name
            expect = damage.apply(target)
            with pytest.raises(CTUQError) as info:
                self._read_everything(scan_format, target)
            message = str(info.value)
            assert "\n" not in message, f"{damage.name}: not one line: {message!r}"
            assert expect in message, f"{damage.name}: {message!r} does not name {expect!r}"
