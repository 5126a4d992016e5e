"""The weight-prior contract (ctuq.testing.PriorContract) over every built-in registered prior, and given scales."""

import torch
from tv_toy import IMAGE, SHAPES, toy_problem

from ctuq.inference import DenseFeatures
from ctuq.inference.priors import DiagonalPrior, TVPredCPPrior
from ctuq.registry import PRIORS
from ctuq.testing import PriorCase, PriorContract


class TestGPriorExact(PriorContract):
    registry_name = "gprior"
    options = {"method": "exact"}


class TestGPriorStochastic(PriorContract):
    registry_name = "gprior"
    options = {"method": "stochastic", "probes": 64}


class TestIsotropic(PriorContract):
    registry_name = "isotropic"


class TestGivenScales(PriorContract):
    def make_prior(self, features, **overrides):
        if overrides:  # given scales take no options
            raise ValueError(f"DiagonalPrior: given scales take no options, got {sorted(overrides)}")
        g = torch.Generator().manual_seed(5)
        prior = DiagonalPrior(torch.rand(features.n_features, generator=g, dtype=torch.float64) + 0.5)
        prior.attach(features)
        return prior


class TestTVPredCP(PriorContract):
    """On the shared toy network (tests/tv_toy.py: 73 weights in three 3×3 blocks and a 1×1 one, a 5 × 6 image):
    a three-step type-II MAP runs inside every set-up."""

    registry_name = "tv_predcp"
    options = {"steps": 3, "probes": 4, "tv_samples": 8, "precond_rank": 8}
    n_samples = 3000
    build_rtol = 1e-10

    def make_problem(self):
        self.phi, psi0, y = toy_problem(24)
        return PriorCase(DenseFeatures(psi0), psi0, y)

    def make_prior(self, features, **overrides):
        phi = self.phi
        return TVPredCPPrior.create(
            features,
            param_shapes=SHAPES,
            image_map=lambda W: W @ phi.T.to(W.dtype),
            image_shape=IMAGE,
            rate=0.05,
            **{**self.options, **overrides},
        )


def test_every_built_in_prior_has_a_contract_test_here():
    built_in = {name for name, cls in PRIORS.items() if cls.__module__.startswith("ctuq.")}
    tested = {cls.registry_name for cls in PriorContract.__subclasses__() if cls.__module__ == __name__}
    assert built_in <= tested, sorted(built_in - tested)
