"""Acceptance: a diagonal weight prior defined here and registered in one line passes the prior contract and reaches
every front end by name, touching no file of ``ctuq/``: ``ctuq reconstruct`` (``uq.prior``), the linearised-DIP
design prior (``design.weight_prior``, ``ctuq design``) and the classifier (``LinearizedLaplace(model, prior=...)``).

The prior is a tempered g-prior, ``s_i = ‖Ψ₀[:, i]‖^(−p)`` (``p = 1``: the g-prior, ``p = 0``: isotropic), so each
front end's scales can be checked against its g-prior's: ``s_toy = s_g^p``."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from tiny import QUICK, sets, tiny_args

from ctuq.cli import main
from ctuq.config import DesignConfig, load_config
from ctuq.inference.priors import DiagonalPrior, PriorCost, PriorError
from ctuq.options import option
from ctuq.registry import PRIORS
from ctuq.testing import PriorContract


class TemperedGPrior(DiagonalPrior):
    """``s_i = n_i^(−p/2)`` with ``n_i = ‖Ψ₀[:, i]‖²`` exact (the front end's own norms where it has them, else ``c``
    VJPs); zero columns get ``s_i = 0``."""

    name = "toy"

    @dataclasses.dataclass
    class Options:
        power: float = option(0.5, ge=0.0, le=1.0, help="p: 1 is the g-prior, 0 the isotropic prior")

    def __init__(self, power: float = 0.5):
        super().__init__()
        if not (isinstance(power, (int, float)) and 0.0 <= power <= 1.0):
            raise PriorError(f"uq.toy.power must lie in [0, 1], got {power!r}")
        self.power = float(power)

    @property
    def method(self) -> str:
        return f"tempered (p = {self.power:g})"

    def compute_scales(self, problem):
        n = problem.exact_column_sq_norms().double()
        s = torch.where(n > 0, n.clamp_min(1e-300).pow(-self.power / 2), torch.zeros_like(n))
        return s.to(problem.features.dtype) if problem.column_norms is None else s

    def setup_cost(self, n_outputs, n_features, *, assembled):
        return PriorCost() if assembled else PriorCost(vjp=n_outputs)


@pytest.fixture(autouse=True, scope="module")
def toy_registered():
    PRIORS.register(TemperedGPrior)  # the one registry line
    yield
    PRIORS.unregister("toy")


class TestTemperedContract(PriorContract):
    registry_name = "toy"
    options = {"power": 0.5}


def test_its_hooks_have_the_defaults_of_a_new_prior():
    assert (TemperedGPrior.label, TemperedGPrior.timing_key, TemperedGPrior.diagonal) == ("prior toy", "toy", True)
    assert TemperedGPrior().setup_cost(10, 4, assembled=False) == PriorCost(vjp=10)


# ------------------------------------------------------------------------------------------ ctuq reconstruct
@pytest.mark.slow
def test_reconstruct_runs_it_as_uq_prior(tiny_scan, tmp_path):
    out = tmp_path / "run"
    extra = ("uq.prior=toy", "uq.toy.power=0.5", "uq.samples=8", "uq.sample_chunk=8", "uq.em_steps=1", *QUICK)
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *tiny_args(*extra)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["uq"]["prior"] == "toy" and metrics["config"]["uq"]["toy"] == {"power": 0.5}
    assert "gprior" not in metrics["config"]["uq"]  # only the chosen prior's section
    assert metrics["uq"]["stats"]["prior"]["method"] == "tempered (p = 0.5)"
    assert "toy" in metrics["uq"]["timings"] and "gprior" not in metrics["uq"]["timings"]  # its own timing key
    assert "linearised DIP, prior toy:" in metrics["uq"]["method"]  # its label


# ------------------------------------------------------------------------------------------ the design
@pytest.fixture(scope="module")
def design_problem():
    from ctuq.data.rectangles import parallel_geometry, rectangles_image
    from ctuq.models import make_net_input
    from ctuq.operators import SparseRayTransform

    img, _ = rectangles_image(np.random.default_rng(0), 16, supersampling=2)
    vol, geo = parallel_geometry(16, np.arange(10) * math.pi / 10)
    op = SparseRayTransform(vol, geo)
    y = op(torch.from_numpy(img)) + 0.02 * torch.randn(op.measurement_shape, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.LeakyReLU(0.2), torch.nn.Conv2d(4, 1, 3, padding=1)
    )
    return op, y, net, make_net_input((16, 16), seed=0)


@pytest.mark.parametrize("dense", ["always", "never"])
def test_the_design_prior_takes_it_by_name(design_problem, dense):
    from ctuq.design.dip_prior import DIPPrior

    op, y, net, ni = design_problem
    pilot = [0, 5]

    def model(*overrides):
        cfg = load_config("demo", [f"design.dense={dense}", "design.refresh_every=0", *overrides]).design
        return DIPPrior(net, ni, op, y, 14.0, settings=cfg, sigma2=0.05).build(pilot)

    gprior, toy = model(), model("design.weight_prior=toy", "design.toy.power=0.5")
    s_g = gprior.scales.double()
    torch.testing.assert_close(toy.scales.double(), s_g.pow(0.5), rtol=1e-5, atol=0)
    # the energy rule a = tr(T K̄ Tᵀ) / (‖ỹ‖² − c σ²) with each prior's trace: the g-prior's is the number of non-zero
    # scales, the toy's Σ s_i² n_i = Σ n_i^(1/2) = Σ 1/s_g,i (n_i = 1/s_g,i², the same rows and targets)
    nonzero = s_g > 0
    assert toy.a / gprior.a == pytest.approx(float((1 / s_g[nonzero]).sum()) / int(nonzero.sum()), rel=1e-5)
    # its section is the design's own, next to the inference's
    cfg = load_config("demo", ["design.weight_prior=toy", "design.toy.power=0.25", "uq.prior=isotropic"])
    assert (cfg.design.toy.power, cfg.uq.toy.power) == (0.25, 0.5)
    assert cfg.to_dict()["design"]["toy"] == {"power": 0.25} and "gprior" not in cfg.to_dict()["design"]
    assert DesignConfig(weight_prior="toy", toy={"power": 1.0}).toy.power == 1.0


@pytest.mark.slow
def test_ctuq_design_runs_it(tmp_path):
    out = tmp_path / "design"
    # the tiny design of tests/pipeline/test_design_run.py, on the bundled scan, with the toy prior
    tiny = ("data.image_shape=[32, 32]", "data.detector_subsampling=8", "dip.iterations=10", "tv.iterations=10")
    tiny += ("design.std_samples=16", "design.dense=never", "output.figure=false", "design.reconstruct=false")
    toy = ("design.weight_prior=toy", "design.toy.power=0.5")
    argv = ["--no-progress", "--candidates", "24", "--acquire", "3", "--samples", "64", *sets(*tiny, *toy)]
    assert main(["design", "--out", str(out), "--pilot", "4", *argv]) == 0
    rec = json.loads((out / "design.json").read_text())
    assert rec["prior"]["kind"] == "dip" and len(rec["acquired"]) == 3
    cfg = load_config(out / "config.yaml")
    assert cfg.design.weight_prior == "toy" and cfg.design.toy.power == 0.5


# ------------------------------------------------------------------------------------------ the classifier
@pytest.mark.filterwarnings("ignore::ctuq.classify.mode.OverfitWarning")  # 30 random points: not what is tested
def test_the_classifier_takes_it_by_name():
    from ctuq.classify import LinearizedLaplace

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(30, 4, generator=g), torch.arange(30) % 3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=10)
    plain = LinearizedLaplace(model, prior_options={"floor": 0.0}, solver="exact").fit(loader)
    toy = LinearizedLaplace(model, prior="toy", prior_options={"power": 0.5}, solver="exact").fit(loader)
    # the exact GGN diagonal handed to the prior: the g-prior's scales, tempered
    torch.testing.assert_close(toy.scales, plain.scales.pow(0.5), rtol=1e-12, atol=0)
    toy.optimize_prior("exact", max_steps=3)
    probs = toy.predict(X, samples=16, seed=0)
    assert probs.shape == (30, 3) and torch.allclose(probs.sum(1), torch.ones(30, dtype=probs.dtype))
    # the state keeps the prior and its options
    again = LinearizedLaplace.from_state_dict(model, toy.state_dict())
    assert (again.prior, again.prior_options) == ("toy", {"power": 0.5})
