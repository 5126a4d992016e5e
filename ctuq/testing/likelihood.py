"""The likelihood contract (:class:`LikelihoodContract`, its checks in its docstring) and its case type
(:class:`LikelihoodCase`)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ctuq.inference.likelihoods import Likelihood
from ctuq.registry import LIKELIHOODS

from ._common import _same_state, _saved

__all__ = ["LikelihoodCase", "LikelihoodContract"]


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
