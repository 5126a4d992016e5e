"""The TV-PredCP block prior on the posterior object (LinearizedPosterior(prior="tv_predcp")): BlockFeatures pass the
feature contract; posterior mean, sample covariance and evidence against a dense float64 reference with Ψ = Ψ₀ L; the
log-determinant gradient by CG + Hutchinson against the dense gradient; the type-II MAP step raises the objective;
checkpoint round trip; bad inputs."""

import io
import math

import numpy as np
import pytest
import torch
from tv_toy import D_W, IMAGE, SHAPES, toy_problem

from ctuq.inference import DenseFeatures, DenseLinearGaussian, GaussianLikelihood, LinearizedPosterior
from ctuq.inference.block_features import BlockFeatures
from ctuq.inference.priors import TVPredCPPrior
from ctuq.inference.priors.tv_predcp import mll_gradient, tap_grams, tv_predcp_terms
from ctuq.testing import FeatureContract


def _problem(c=24, seed=0):
    """The shared toy problem (tests/tv_toy.py) with ``c`` rows."""
    return toy_problem(c, seed)


def _prior(seed=3, **kw):
    p = TVPredCPPrior(SHAPES, image_shape=IMAGE, **{"steps": 0, **kw})
    g = torch.Generator().manual_seed(seed)
    p.set_theta(p.theta() + 0.4 * torch.randn(p.n_hyper, generator=g, dtype=torch.float64))
    return p


def _dense_L(p):
    return p.apply(torch.eye(p.d, dtype=torch.float64)).T


class TestBlockFeatures(FeatureContract):
    def make_features(self):
        _, Psi0, _ = _problem()
        p = _prior()
        return BlockFeatures(DenseFeatures(Psi0), p), Psi0 @ _dense_L(p)


@pytest.mark.parametrize("solver", ["exact_dual", "exact_primal", "cg"])
def test_mean_evidence_and_samples_match_the_dense_reference(solver):
    """Ψ = Ψ₀ L with the block prior's L: w*, log evidence (exact solvers) and the image-space mean agree with the
    float64 reference to 1e-8 (CG: 1e-5 at rtol 1e-9); the covariance of 3000 samples (seed 1), whitened by the
    reference, is I within 5.5·√(2/n) per entry (d = 73: 5329 entries)."""
    Phi, Psi0, y = _problem()
    p = _prior()
    a, s2 = 2.0, 0.05
    opts = {"cg": {"rtol": 1e-9, "max_iter": 500, "preconditioner": "none"}}
    post = LinearizedPosterior(
        DenseFeatures(Psi0),
        y,
        prior=p,
        prior_options={"image_map": lambda W: W @ Phi.T},
        likelihood=GaussianLikelihood(s2),
        a=a,
        solver=solver,
        solver_options=opts,
        output_map=lambda W: p.apply(W) @ Phi.T,
    ).setup()
    L = _dense_L(p)
    ref = DenseLinearGaussian(Psi0 @ L, y)
    tol = 1e-5 if solver == "cg" else 1e-8
    w_ref = torch.as_tensor(ref.posterior_mean(a, s2))
    assert torch.allclose(post.mean().double(), w_ref, rtol=tol, atol=tol * float(w_ref.abs().max()))
    if solver != "cg":
        assert post.log_evidence() == pytest.approx(ref.log_evidence(a, s2), rel=1e-10)
    n = 3000
    Z = torch.cat([ps.weights.double() for _, ps in post.sample(n, chunk_size=500, seed=1)])
    cov = torch.as_tensor(ref.posterior_covariance(a, s2))
    W = torch.linalg.cholesky(torch.linalg.inv(cov))
    S = W.T @ (Z.T @ Z / n) @ W
    assert float((S - torch.eye(D_W, dtype=torch.float64)).abs().max()) < 5.5 * math.sqrt(2 / n)
    img = post.output_samples(Z[:4].to(post.base.dtype))
    assert torch.allclose(img.double(), (Z[:4] @ L.T) @ Phi.T, atol=1e-10)


def _dense_mll(p, Psi0, y, a, theta, log_s2):
    L = p.apply(torch.eye(p.d, dtype=torch.float64), p.factors(theta)).T
    C = Psi0 @ L @ L.T @ Psi0.T / a + log_s2.exp() * torch.eye(Psi0.shape[0], dtype=torch.float64)
    return torch.distributions.MultivariateNormal(torch.zeros_like(y), covariance_matrix=C).log_prob(y)


def test_mll_gradient_by_cg_and_hutchinson_matches_the_dense_gradient():
    """4000 Rademacher probes (seed 0) and CG at rtol 1e-10: relative error of the whole gradient (prior
    hyperparameters and log σ²) below 5 % (Hutchinson's relative sd here is ≈ √(2/4000) ≈ 2 % of the trace terms)."""
    _, Psi0, y = _problem()
    p = _prior()
    a, s2 = 2.0, 0.05
    g, info = mll_gradient(
        p,
        DenseFeatures(Psi0),
        y,
        a=a,
        sigma2=s2,
        n_probes=4000,
        generator=torch.Generator().manual_seed(0),
        learn_noise=True,
        rtol=1e-10,
        max_iter=500,
    )
    theta = p.theta().requires_grad_(True)
    log_s2 = torch.tensor(math.log(s2), dtype=torch.float64, requires_grad=True)
    ll = _dense_mll(p, Psi0, y, a, theta, log_s2)
    g_theta, g_s2 = torch.autograd.grad(ll, (theta, log_s2))
    want = torch.cat([g_theta, g_s2[None]])
    assert float((g - want).norm() / want.norm()) < 0.05
    C_inv_y = torch.linalg.solve(
        Psi0 @ _dense_L(p) @ _dense_L(p).T @ Psi0.T / a + s2 * torch.eye(len(y), dtype=torch.float64), y
    )
    assert info["data_fit"] == pytest.approx(-0.5 * float(y @ C_inv_y), rel=1e-8)


def test_type_ii_map_fit_raises_the_map_objective():
    """30 Adam steps (seed 0) raise J = log N(ỹ; 0, C) + log p_TV, evaluated exactly (dense log-det, the fit's own tap
    Gram matrices); the trace has one finite record per step."""
    Phi, Psi0, y = _problem()
    a, s2 = 2.0, 0.05
    p = TVPredCPPrior(SHAPES, image_shape=IMAGE, rate=0.05, steps=30, lr=0.05, probes=16, tv_samples=64, precond_rank=8)
    grams = tap_grams(
        p, lambda W: W @ Phi.T, n_samples=64, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )

    def objective():
        theta = p.theta()
        ll = _dense_mll(p, Psi0, y, a, theta, torch.tensor(math.log(post.sigma2), dtype=torch.float64))
        return float(ll) + tv_predcp_terms(p, grams, a=a)[0]

    post = LinearizedPosterior(
        DenseFeatures(Psi0),
        y,
        prior=p,
        prior_options={"image_map": lambda W: W @ Phi.T},
        likelihood=GaussianLikelihood(s2, learn_noise=True),
        a=a,
        solver="exact_dual",
        seed=0,
    )
    before = objective()
    post.setup()
    after = objective()
    assert p.fitted and len(p.trace) == 30
    assert all(math.isfinite(r["data_fit"]) and math.isfinite(r["log_hyperprior"]) for r in p.trace)
    assert post.sigma2 != s2  # the fit learned the noise too
    assert after > before + 1.0, (before, after)


def test_checkpoint_round_trip_restores_the_fitted_prior_without_refitting(tmp_path):
    Phi, Psi0, y = _problem()
    opts = {"image_shape": IMAGE, "steps": 4, "probes": 4, "tv_samples": 8, "precond_rank": 8, "param_shapes": SHAPES}
    kw = dict(
        prior="tv_predcp", likelihood=GaussianLikelihood(0.05, learn_noise=True), a=2.0, solver="exact_dual", seed=0
    )
    post = LinearizedPosterior(DenseFeatures(Psi0), y, prior_options={**opts, "image_map": lambda W: W @ Phi.T}, **kw)
    post.setup()
    post.fit(max_steps=3)
    buf = io.BytesIO()
    torch.save(post.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    def no_image_map(W):
        raise AssertionError("a restored, fitted prior must not be fitted again")

    again = LinearizedPosterior(DenseFeatures(Psi0), y, prior_options={**opts, "image_map": no_image_map}, **kw)
    again.load_state_dict(state)
    again.setup()
    assert torch.equal(again.weight_prior.theta(), post.weight_prior.theta())
    assert again.weight_prior.trace == post.weight_prior.trace
    assert again.sigma2 == post.sigma2
    assert torch.equal(again.mean(), post.mean())
    again.fit(max_steps=3)
    assert again.a == post.a
    sub = post.restrict(torch.arange(10))
    assert sub.weight_prior is post.weight_prior
    sub.setup()
    assert sub.features.n_outputs == 10


def test_bad_prior_arguments_are_clear():
    _, Psi0, y = _problem()
    with pytest.raises(ValueError, match="prior must be one of"):
        LinearizedPosterior(DenseFeatures(Psi0), y, prior="matern")
    with pytest.raises(ValueError, match="param_shapes"):
        LinearizedPosterior(DenseFeatures(Psi0), y, prior="tv_predcp", prior_options={"image_shape": IMAGE})
    with pytest.raises(ValueError, match="covers 73 weights"):
        LinearizedPosterior(
            DenseFeatures(Psi0[:, :40]),
            y,
            prior="tv_predcp",
            prior_options={"image_shape": IMAGE, "param_shapes": SHAPES},
        )
    with pytest.raises(ValueError, match="image_map"):
        LinearizedPosterior(
            DenseFeatures(Psi0), y, prior="tv_predcp", prior_options={"image_shape": IMAGE, "param_shapes": SHAPES}
        )
    with pytest.raises(ValueError, match=r"prior_options \['steps'\] are not options of the 'gprior' prior"):
        LinearizedPosterior(DenseFeatures(Psi0), y, prior="gprior", prior_options={"steps": 3})
    assert np.isfinite(float(Psi0.sum()))
