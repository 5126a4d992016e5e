"""The TV-PredCP block prior itself (ctuq.inference.priors.tv_predcp): block layout, L = blockdiag(σ chol K), the
hyperprior's closed forms against an exact dense computation and against finite differences, state round trip, bad
inputs; prepare (image shape and rate from the output), its options, summary and trace figure."""

import dataclasses
import io
import json
import math

import pytest
import torch
from tv_toy import IMAGE, SHAPES

from ctuq.inference import DenseFeatures
from ctuq.inference.priors import PriorError, PriorProblem, TVPredCPPrior
from ctuq.inference.priors.tv_predcp import anisotropic_tv, block_layout, tap_distances, tap_grams, tv_predcp_terms
from ctuq.linearize import default_linearized_parameters
from ctuq.models import build_unet
from ctuq.registry import PRIORS


def _prior(**kw):
    p = TVPredCPPrior(SHAPES, image_shape=IMAGE, **kw)
    g = torch.Generator().manual_seed(3)
    p.set_theta(p.theta() + 0.4 * torch.randn(p.n_hyper, generator=g, dtype=torch.float64))
    return p


def _phi(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(math.prod(IMAGE), d, generator=g, dtype=torch.float64)


def test_blocks_of_the_tiny_unet_follow_its_modules():
    model = build_unet("tiny")
    params = dict(model.named_parameters())
    shapes = {n: tuple(params[n].shape) for n in default_linearized_parameters(model)}
    blocks = block_layout(shapes)
    assert [(b.name, b.kind) for b in blocks] == [
        ("inc.0", "matern"),
        ("down.0", "matern"),
        ("down.1", "matern"),
        ("up.0", "normal"),
        ("up.0", "matern"),
        ("up.1", "normal"),
        ("up.1", "matern"),
        ("outc", "normal"),
    ]
    assert sum(b.n_weights for b in blocks) == sum(math.prod(s) for s in shapes.values()) == 5008


def test_L_is_the_block_diagonal_cholesky_factor_and_apply_t_its_transpose():
    p = _prior()
    eye = torch.eye(p.d, dtype=torch.float64)
    L = p.apply(eye).T  # columns L e_j
    assert torch.allclose(p.apply_t(eye).T, L.T, atol=1e-14)
    cov = L @ L.T
    ell, var = p.log_lengthscale.exp(), p.log_variance.exp()
    K = torch.exp(-tap_distances() / ell[0]) + 1e-6 * torch.eye(9, dtype=torch.float64)
    assert torch.allclose(cov[:9, :9], var[0] * K, atol=1e-12)  # first filter of block "a"
    assert torch.allclose(cov[9:18, :9], torch.zeros(9, 9, dtype=torch.float64))  # filters are independent
    last = p.d - 1  # the 1×1 weight: normal block
    assert cov[last, last] == pytest.approx(float(var[-1]), rel=1e-12)
    assert torch.count_nonzero(cov[last, :last]) == 0


def _exact(p, Phi, a):
    """Per Matérn block: the exact tap Gram matrices (m, 9, 9) and κ_b(θ) by the dense Gaussian formula
    √(2/π) Σ_i √diag(DΦ L_b L_bᵀ ΦᵀDᵀ)_i / √a, written through L (not through G)."""
    D = anisotropic_tv(Phi.T, IMAGE).T  # (m, d) = D Φ
    ex = torch.eye(p.d, dtype=torch.float64)
    grams, kappas = [], []
    for i in p.matern:
        rows = torch.cat([D[:, lo:hi].reshape(D.shape[0], -1, 9) for lo, hi in p.blocks[i].segments], dim=1)
        grams.append(torch.einsum("ifp,ifq->ipq", rows, rows))
        mask = torch.zeros(p.d, dtype=torch.float64)
        for lo, hi in p.blocks[i].segments:
            mask[lo:hi] = 1

        def kappa(theta, mask=mask):
            L = p.apply(ex, p.factors(theta)).T * mask[None, :]
            return math.sqrt(2 / math.pi) * ((D @ L).pow(2).sum(1) / a).sqrt().sum()

        kappas.append(kappa)
    return grams, kappas


def test_expected_tv_closed_form_matches_the_dense_gaussian_formula():
    """With the exact tap Gram matrices, κ_b and ∂κ_b/∂log ℓ_b agree with the formula through L to 1e-10."""
    p = _prior()
    a = 2.0
    grams, kappas = _exact(p, _phi(p.d), a)
    _, _, details = tv_predcp_terms(p, grams, a=a)
    for j, det in enumerate(details):
        theta = p.theta().requires_grad_(True)
        k = kappas[j](theta)
        (dk,) = torch.autograd.grad(k, theta)
        assert det["kappa"] == pytest.approx(float(k.detach()), rel=1e-10)
        assert det["dkappa_dlog_ell"] == pytest.approx(float(dk[j]), rel=1e-10)


def test_tap_grams_estimate_the_expected_tv_within_its_statistical_error():
    """Ĝ is unbiased; κ̂ from 20000 draws (seed 0) is within 1.5 % of the exact κ (block "b" has two filters: κ̂'s
    relative sd is then ≈ 1/√(2·20000) per entry, 0.5 %, and its entries' errors are correlated)."""
    p = _prior()
    a = 2.0
    Phi = _phi(p.d)
    grams, _ = _exact(p, Phi, a)
    est = tap_grams(
        p,
        lambda W: W @ Phi.T,
        n_samples=20000,
        generator=torch.Generator().manual_seed(0),
        dtype=torch.float64,
        chunk=2000,
    )
    _, _, exact = tv_predcp_terms(p, grams, a=a)
    _, _, approx = tv_predcp_terms(p, est, a=a)
    for e, g in zip(exact, approx):
        assert g["kappa"] == pytest.approx(e["kappa"], rel=0.015)
    for G, Ghat in zip(grams, est):
        assert float((Ghat - G).norm() / G.norm()) < 0.05


def test_hyperprior_gradient_matches_finite_differences_of_its_value():
    """The log hyperprior is a smooth closed form of θ given Ĝ: central differences (h = 1e-5) agree with the
    autograd gradient within 1e-6 relative."""
    p = _prior(rate=0.3)
    Phi = _phi(p.d)
    grams = tap_grams(
        p, lambda W: W @ Phi.T, n_samples=16, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    theta0 = p.theta()

    def value_grad(theta):
        p.set_theta(theta)
        v, g, _ = tv_predcp_terms(p, grams, a=1.5)
        return v, g

    _, grad = value_grad(theta0)
    h = 1e-5
    for k in range(p.n_hyper):
        e = torch.zeros_like(theta0)
        e[k] = h
        fd = (value_grad(theta0 + e)[0] - value_grad(theta0 - e)[0]) / (2 * h)
        assert fd == pytest.approx(float(grad[k]), rel=1e-6, abs=1e-8)


def test_state_round_trip_and_a_mismatched_state_is_refused():
    p = _prior()
    p.trace.append({"step": 0, "data_fit": -1.0})
    p.fitted = True
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    q = TVPredCPPrior(SHAPES, image_shape=IMAGE)
    q.load_state_dict(state)
    assert torch.equal(q.theta(), p.theta()) and q.fitted and q.trace == p.trace
    other = TVPredCPPrior(SHAPES, image_shape=IMAGE, rate=2.0)
    with pytest.raises(PriorError, match="rate"):
        other.load_state_dict(state)
    with pytest.raises(PriorError, match="tv_predcp prior state"):
        q.load_state_dict({"name": "gprior"})


def test_registered_under_its_option_name():
    assert PRIORS["tv_predcp"] is TVPredCPPrior


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rate": 0.0}, "scale"),
        ({"rate": -1.0}, "scale"),
        ({"lengthscale": 0.0}, "lengthscale"),
        ({"lengthscale": 1e4}, "lengthscale"),
        ({"variance": -2.0}, "variance"),
        ({"steps": -1}, "steps"),
        ({"probes": 0}, "probes"),
        ({"image_shape": (1, 5)}, "image_shape"),
    ],
)
def test_bad_hyperparameters_are_one_line_errors(kwargs, match):
    args = {"image_shape": IMAGE, **kwargs}
    with pytest.raises(PriorError, match=match) as info:
        TVPredCPPrior(SHAPES, **args)
    assert "\n" not in str(info.value)


def test_a_network_without_3x3_convolutions_is_refused():
    with pytest.raises(PriorError, match="no 3×3 convolution") as info:
        TVPredCPPrior({"0.weight": (5, 3), "2.weight": (2, 5)}, image_shape=IMAGE)
    assert "\n" not in str(info.value) and "uq.prior=gprior" in str(info.value)


def test_prepare_takes_the_image_shape_and_the_rate_per_tv_of_the_output():
    p = TVPredCPPrior(SHAPES, scale=0.5)
    assert p.image_shape is None and p.rate == 1.0
    output = torch.arange(math.prod(IMAGE), dtype=torch.float32) ** 1.5
    p.prepare(output=output, output_shape=IMAGE)
    tv = float(anisotropic_tv(output[None].double(), IMAGE).abs().sum())
    assert p.image_shape == IMAGE and p.output_tv == tv and p.rate == 0.5 / tv
    summary = p.summary()
    assert summary["rate"] == p.rate and summary["tv_reconstruction"] == tv and summary["trace"] == []
    with pytest.raises(PriorError, match="constant") as info:
        p.prepare(output=torch.ones(math.prod(IMAGE)), output_shape=IMAGE)
    assert "\n" not in str(info.value)
    with pytest.raises(PriorError, match="29 values"):
        p.prepare(output=output[:-1], output_shape=IMAGE)


def test_a_fit_without_an_image_shape_says_what_is_missing():
    Phi = _phi(73)
    p = TVPredCPPrior(SHAPES, steps=2)
    p.image_map = lambda W: W @ Phi.T
    problem = PriorProblem(DenseFeatures(torch.ones(4, 73, dtype=torch.float64)), torch.ones(4), a=1.0, sigma2=1.0)
    with pytest.raises(PriorError, match=r"no image shape.*prepare"):
        p.setup(problem)


def test_its_options_are_the_uq_tv_predcp_section():
    fields = {f.name: f for f in dataclasses.fields(TVPredCPPrior.Options)}
    assert list(fields) == [
        "scale",
        "steps",
        "optimizer",
        "tol",
        "max_step",
        "lr",
        "probes",
        "tv_samples",
        "lengthscale",
        "variance",
        "precond_rank",
    ]
    assert all(f.metadata["help"] for f in fields.values()) and fields["optimizer"].metadata["choices"] == (
        "lbfgs",
        "adam",
    )
    p = TVPredCPPrior(SHAPES, image_shape=IMAGE)
    for name, value in dataclasses.asdict(TVPredCPPrior.Options()).items():
        got = math.exp(float(p.log_lengthscale[0])) if name == "lengthscale" else getattr(p, name, None)
        if name == "variance":
            got = math.exp(float(p.log_variance[0]))
        assert got == pytest.approx(value), name
    with pytest.raises(PriorError, match=r"unknown option\(s\) \['sale'\]"):
        TVPredCPPrior(SHAPES, sale=1.0)


def test_summary_and_the_trace_figure(tmp_path):
    p = _prior()
    assert p.figures(tmp_path) == []
    keys = ("lengthscale", "variance", "sigma2", "data_fit", "log_hyperprior")
    p.trace = [{"step": k, **{key: [1.0 + k] if key in keys[:2] else 1.0 + k for key in keys}} for k in range(3)]
    (path,) = p.figures(tmp_path)
    assert path == tmp_path / TVPredCPPrior.TRACE_FIGURE and path.stat().st_size > 0
    assert json.loads(json.dumps(p.summary()))["trace"] == p.trace
