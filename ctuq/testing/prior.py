"""The weight-prior contract (:class:`PriorContract`, its checks in its docstring) and the problem it checks a
prior on (:class:`PriorCase`)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ctuq.inference.features import FeatureOperator
from ctuq.inference.likelihoods import GaussianLikelihood
from ctuq.inference.posterior import LinearizedPosterior
from ctuq.inference.priors import PriorCost, PriorProblem, WeightPrior
from ctuq.inference.reference import DenseLinearGaussian
from ctuq.registry import PRIORS

from ._common import _check_sample_covariance, _same_state, _saved, contract_problem

__all__ = ["PriorCase", "PriorContract"]


@dataclasses.dataclass
class PriorCase:
    """The problem a prior is checked on: the unscaled features ``Ψ₀`` (``c × d``), their dense float64 matrix and
    the targets ``ỹ`` ``(c,)``."""

    features: FeatureOperator
    matrix: torch.Tensor
    targets: torch.Tensor


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
      :func:`~ctuq.options.option` fields whose names :meth:`~ctuq.inference.priors.WeightPrior.create` takes, a
      label and a timing key (non-empty strings), a set-up cost of finite non-negative product counts
      (:class:`~ctuq.inference.priors.PriorCost`) on either route;
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
        assert isinstance(cls.label, str) and cls.label and isinstance(cls.timing_key, str) and cls.timing_key
        c, d = problem.features.n_outputs, problem.features.n_features
        for assembled in (False, True):
            cost = prior.setup_cost(c, d, assembled=assembled)
            assert isinstance(cost, PriorCost), (assembled, cost)
            assert all(math.isfinite(n) and n >= 0 for n in (cost.jvp, cost.vjp)), (assembled, cost)
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
