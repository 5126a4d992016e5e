"""Acceptance: a weight prior defined here and registered in one line passes the prior contract, is built by name by
``LinearizedPosterior``, and runs through ``ctuq uq RUN --set uq.prior=...``, touching no file of ``ctuq/``."""

import dataclasses
import json
import shutil
from collections.abc import Sequence

import numpy as np
import pytest
import tifffile
import torch

from ctuq.cli import main
from ctuq.inference import DenseLinearGaussian, GaussianLikelihood, LinearizedPosterior, column_sq_norms
from ctuq.inference.priors import DiagonalPrior, PriorError
from ctuq.options import option
from ctuq.registry import PRIORS
from ctuq.testing import PriorContract, contract_problem


class LayerwisePrior(DiagonalPrior):
    """One scale per parameter tensor: the g-prior averaged over each layer, ``s_i = (mean_{j∈layer} ‖Ψ₀[:, j]‖² +
    floor · median over layers)^(−1/2)`` (exact column norms, ``c`` VJPs)."""

    name = "layerwise"

    @dataclasses.dataclass
    class Options:
        floor: float = option(0.0, ge=0.0, help="ridge on the layer means, in units of their median")

    def __init__(self, sizes: Sequence[int], floor: float = 0.0):
        super().__init__()
        if not (isinstance(floor, (int, float)) and floor >= 0):
            raise PriorError(f"uq.layerwise.floor must be a number >= 0, got {floor!r}")
        self.sizes = [int(n) for n in sizes]
        self.floor = float(floor)
        self.d = sum(self.sizes)

    @classmethod
    def create(cls, features, *, sizes=None, **options):
        cls.check_option_names(options)
        if sizes is None:  # the linearised network's parameter tensors
            net = features.network
            sizes = [t.numel() for t in net.unflatten(net.params()).values()]
        prior = cls(sizes, **options)
        prior.attach(features)
        return prior

    @property
    def method(self) -> str:
        return "layerwise"

    def compute_scales(self, problem):
        b = problem.features
        sq = column_sq_norms(b.rmatvec, b.n_outputs, dtype=b.dtype, device=b.device)
        means = torch.stack([part.mean() for part in sq.split(self.sizes)])
        means = means + self.floor * means.median()
        return torch.repeat_interleave(means.rsqrt(), torch.tensor(self.sizes)).to(b.dtype)


@pytest.fixture(autouse=True, scope="module")
def toy_registered():
    PRIORS.register(LayerwisePrior)  # the one registry line
    yield
    PRIORS.unregister("layerwise")


SIZES = [10, 20, 6]


class TestLayerwiseContract(PriorContract):
    registry_name = "layerwise"
    options = {"sizes": SIZES, "floor": 0.5}


def test_the_posterior_builds_it_by_name():
    feats, Psi, y = contract_problem(24, sum(SIZES))
    post = LinearizedPosterior(
        feats, y, prior="layerwise", prior_options={"sizes": SIZES}, likelihood=GaussianLikelihood(0.5), a=2.0
    ).setup()
    assert isinstance(post.weight_prior, LayerwisePrior) and post.prior == "layerwise"
    norms = Psi.pow(2).sum(0)
    want = torch.cat([part.mean().rsqrt().expand(n) for n, part in zip(SIZES, norms.split(SIZES))])
    torch.testing.assert_close(post.scales, want, rtol=1e-12, atol=0)
    ref = DenseLinearGaussian(Psi * want, y)
    np.testing.assert_allclose(post.mean().numpy(), ref.posterior_mean(2.0, 0.5), rtol=1e-8)
    assert post.summary()["prior"]["method"] == "layerwise"


@pytest.mark.slow
def test_the_uq_command_runs_it(tiny_run_none, tmp_path):
    out = shutil.copytree(tiny_run_none, tmp_path / "run")
    assert main(["uq", str(out), "--set", "uq.prior=layerwise", "--no-progress"]) == 0
    # the posterior of another prior: another std map than the g-prior's of the run
    assert not np.array_equal(tifffile.imread(out / "std.tif"), tifffile.imread(tiny_run_none / "std.tif"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["uq"]["prior"] == "layerwise"
    summary = metrics["uq"]["stats"][LayerwisePrior.summary_key]
    assert summary["method"] == "layerwise" and summary["zero_scales"] >= 0 and summary["scale_max"] > 0
