"""The likelihood contract (:class:`ctuq.testing.LikelihoodContract`) over every registered likelihood, and the
registry itself (:data:`ctuq.registry.LIKELIHOODS`)."""

import pytest
import torch

from ctuq.inference import LIKELIHOODS, CategoricalLikelihood, DiagonalGaussianLikelihood, GaussianLikelihood
from ctuq.registry import RegistryError
from ctuq.testing import LikelihoodCase, LikelihoodContract


def _measurement_variances(n: int = 7) -> torch.Tensor:
    """Absolute per-row variances spread over a factor ≈ 20 (photon counts through thin and thick material), seed 0."""
    g = torch.Generator().manual_seed(0)
    return torch.exp(3.0 * torch.rand(n, generator=g, dtype=torch.float64) - 1.5) * 2e-3


def _diagonal() -> LikelihoodCase:
    v = _measurement_variances()
    mean = v.mean()
    lik = DiagonalGaussianLikelihood(0.3, True, variances=v / mean, normaliser=float(mean))
    return LikelihoodCase(lik, measurement_variances=v, appended=torch.tensor([0.5, 2.0], dtype=torch.float64))


# One case per registered likelihood; a likelihood registered later adds its own here (the test below says so).
CASES = {
    "gaussian": lambda: LikelihoodCase(GaussianLikelihood(0.3, learn_noise=True)),
    "diagonal_gaussian": _diagonal,
    "categorical": lambda: LikelihoodCase(CategoricalLikelihood()),
}


class TestRegisteredLikelihoods(LikelihoodContract):
    """Every likelihood in the registry at collection time."""

    @pytest.fixture(params=list(LIKELIHOODS))
    def name(self, request):
        return request.param

    @pytest.fixture
    def case(self, name):
        return CASES[name]()


class TestFixedNoiseGaussian(LikelihoodContract):
    """The homoscedastic likelihood with σ² fixed (the EM keeps it)."""

    def make_case(self):
        return LikelihoodCase(GaussianLikelihood(2.5, learn_noise=False))


def test_every_registered_likelihood_has_a_contract_case():
    assert list(LIKELIHOODS) == list(CASES), "add a LikelihoodCase for the new likelihood to CASES"
    for name, cls in LIKELIHOODS.items():
        assert cls.name == name


def test_an_unknown_likelihood_names_the_valid_ones():
    with pytest.raises(RegistryError, match="unknown likelihood 'poisson'; valid: gaussian, diagonal_gaussian"):
        LIKELIHOODS["poisson"]


def test_held_out_rows_take_the_fitted_rows_normaliser():
    """Per-ray noise of rows the likelihood was not fitted on: σ² × their variance over the fitted rows' mean, in the
    rows' units (÷ target_scale²), computed as (σ²/s²) · (v/mean) (the order the CT front end always used)."""
    v = _measurement_variances()
    mean = float(v.mean())
    lik = DiagonalGaussianLikelihood(0.3, False, variances=v / v.mean(), normaliser=mean)
    held = torch.tensor([[1e-3, 4e-3], [2e-3, 8e-3]], dtype=torch.float64)
    got = lik.noise_variance_of(held, target_scale=14.0)
    assert got.shape == (4,) and got.dtype == torch.float64
    assert torch.equal(got, (0.3 / 14.0**2) * (held.reshape(-1) / mean))
    assert lik.restrict(torch.tensor([1, 2])).normaliser == mean and lik.extend(torch.ones(1), 1).normaliser == mean
    with pytest.raises(ValueError, match="needs the rows' own measurement variances"):
        lik.noise_variance_of(None)
    with pytest.raises(ValueError, match="normaliser must be positive"):
        DiagonalGaussianLikelihood(0.3, variances=v, normaliser=0.0)
    homo = GaussianLikelihood(0.3)
    assert homo.noise_variance_of(held, target_scale=14.0) == homo.noise_variance_of(None, target_scale=14.0)
    assert homo.noise_variance_of(None, target_scale=14.0) == 0.3 / 14.0**2
