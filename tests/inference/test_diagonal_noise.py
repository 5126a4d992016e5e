"""The diagonal-noise likelihood ``ε ~ N(0, σ² D)`` (:class:`DiagonalGaussianLikelihood`) in the core, against
the dense float64 reference written directly from the Gaussian formulas with ``C = ΨΨᵀ/a + σ² D`` (no whitening):
posterior mean, posterior sample covariance, log evidence, the exact EM's fixed point for ``a`` and ``σ²``; rows
restricted and appended with their variances; the state round trip; ``d ≡ 1`` bitwise equal to the homoscedastic
path; and the bad-input errors."""

import io

import numpy as np
import pytest
import scipy.stats
import torch

from ctuq.errors import CheckpointMismatch
from ctuq.inference import DenseFeatures, DenseLinearGaussian, GaussianLikelihood, LinearizedPosterior
from ctuq.inference.likelihoods import DiagonalGaussianLikelihood

C, D = 36, 14


@pytest.fixture(scope="module")
def problem():
    """A random ``Ψ₀`` (36 × 14), targets from the model itself, and relative variances spread over a factor ≈ 20
    (as photon counts through thin and thick material are)."""
    g = torch.Generator().manual_seed(3)
    Psi0 = torch.randn(C, D, generator=g, dtype=torch.float64) * (torch.rand(D, generator=g, dtype=torch.float64) + 0.3)
    d = torch.exp(3.0 * torch.rand(C, generator=g, dtype=torch.float64) - 1.5)
    w = torch.randn(D, generator=g, dtype=torch.float64) * 0.7
    y = Psi0 @ w + 0.2 * d.sqrt() * torch.randn(C, generator=g, dtype=torch.float64)
    # the g-prior of the whitened features, computed here independently: s_j = 1/‖D^(−1/2) Ψ₀ e_j‖
    s = 1.0 / (Psi0 / d.sqrt()[:, None]).norm(dim=0)
    return {"Psi0": Psi0, "d": d, "y": y, "s": s, "ref": DenseLinearGaussian(Psi0 * s, y, noise_variances=d)}


def _post(p, solver, a=2.0, s2=0.05, learn=False, variances="d", **kw):
    v = p["d"] if variances == "d" else variances
    lik = DiagonalGaussianLikelihood(s2, learn, variances=v)
    return LinearizedPosterior(
        DenseFeatures(p["Psi0"]),
        p["y"],
        likelihood=lik,
        a=a,
        solver=solver,
        solver_options={"rank": 14, "rtol": 1e-10, "max_iter": 500},
        seed=0,
        **kw,
    ).setup()


def test_the_reference_is_the_gaussian_density(problem):
    """The reference's evidence is scipy's log N(ỹ; 0, ΨΨᵀ/a + σ² D) (a check of the reference itself)."""
    p = problem
    Psi = (p["Psi0"] * p["s"]).numpy()
    cov = Psi @ Psi.T / 2.0 + 0.05 * np.diag(p["d"].numpy())
    expected = scipy.stats.multivariate_normal(np.zeros(C), cov).logpdf(p["y"].numpy())
    assert p["ref"].log_evidence(2.0, 0.05) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("solver", ["exact_dual", "exact_primal", "cg"])
def test_mean_and_evidence_match_the_dense_reference(problem, solver):
    p = problem
    post = _post(p, solver)
    torch.testing.assert_close(post.scales, p["s"], rtol=1e-10, atol=0)
    torch.testing.assert_close(post.mean(), torch.as_tensor(p["ref"].posterior_mean(2.0, 0.05)), rtol=1e-7, atol=1e-9)
    if solver != "cg":
        assert post.log_evidence() == pytest.approx(p["ref"].log_evidence(2.0, 0.05), rel=1e-10)
    # the targets stay in measurement space; the solves see D^(−1/2) ỹ
    assert torch.equal(post.targets, p["y"])
    torch.testing.assert_close(post.whitened_targets, p["y"] / p["d"].sqrt(), rtol=1e-15, atol=0)


@pytest.mark.parametrize("solver", ["exact_dual", "cg"])
def test_sample_covariance_matches_the_dense_posterior(problem, solver):
    """n = 6000 weight samples (seed 11): the whitened sample covariance L⁻¹ Ŝ L⁻ᵀ of the reference's Σ = LLᵀ has
    entries of sd ≤ √(2/n) = 0.018 around I; every one of the 105 distinct entries within 4.5 sd."""
    p = problem
    post = _post(p, solver)
    n = 6000
    W = torch.cat([ps.weights for _, ps in post.sample(n, chunk_size=1000, seed=11)]).numpy()
    assert W.shape == (n, D)
    S = W.T @ W / n  # zero-mean samples: no centring
    L = np.linalg.cholesky(p["ref"].posterior_covariance(2.0, 0.05))
    white = np.linalg.solve(L, np.linalg.solve(L, S).T)
    dev = np.abs(white - np.eye(D)).max()
    assert dev < 4.5 * (2 / n) ** 0.5, dev


def test_exact_em_reaches_the_reference_fixed_point(problem):
    """Exact EM (exact_dual, exact γ) with the scale σ² learned: MacKay's fixed point of the reference for a and σ²
    (its σ² update uses (ỹ − Ψw*)ᵀ D⁻¹ (ỹ − Ψw*)), and the trace's evidence is the measurements' evidence."""
    p = problem
    post = _post(p, "exact_dual", a=1.0, s2=0.3, learn=True)
    res = post.fit(max_steps=3000, tol=1e-12, stop_on="a_and_sigma2")
    a_ref, s2_ref, _ = p["ref"].em_fixed_point(1.0, 0.3, learn_noise=True, rtol=1e-13)
    assert res.converged
    assert res.a == pytest.approx(a_ref, rel=1e-7) and post.sigma2 == pytest.approx(s2_ref, rel=1e-7)
    last = res.trace[-1]
    assert last["log_evidence"] == pytest.approx(p["ref"].log_evidence(last["a"], last["sigma2"]), rel=1e-10)
    # the homoscedastic model's fixed point is another one: the variances matter
    a_h, s2_h, _ = DenseLinearGaussian(p["Psi0"] * p["s"], p["y"]).em_fixed_point(1.0, 0.3, learn_noise=True)
    assert abs(a_h / a_ref - 1) > 0.05 or abs(s2_h / s2_ref - 1) > 0.05


@pytest.mark.parametrize("solver", ["exact_dual", "exact_primal", "cg"])
def test_unit_variances_are_the_homoscedastic_path_bitwise(problem, solver):
    p = problem
    kw = dict(a=1.0, solver=solver, solver_options={"rank": 14, "rtol": 1e-10, "max_iter": 500}, seed=0)
    hom = LinearizedPosterior(DenseFeatures(p["Psi0"]), p["y"], likelihood=GaussianLikelihood(0.3, True), **kw)
    ones = torch.ones(C, dtype=torch.float64)
    diag = LinearizedPosterior(
        DenseFeatures(p["Psi0"]), p["y"], likelihood=DiagonalGaussianLikelihood(0.3, True, variances=ones), **kw
    )
    rh = hom.fit(max_steps=4, n_samples=8, tol=0.0)
    rd = diag.fit(max_steps=4, n_samples=8, tol=0.0)
    assert torch.equal(hom.scales, diag.scales)
    assert [(r["a_new"], r["sigma2_new"], r["log_evidence"]) for r in rh.trace] == [
        (r["a_new"], r["sigma2_new"], r["log_evidence"]) for r in rd.trace
    ]
    assert torch.equal(hom.mean(), diag.mean())
    if solver != "cg":
        assert hom.log_evidence() == diag.log_evidence()
    (_, sh), (_, sd) = next(iter(hom.sample(16, seed=5))), next(iter(diag.sample(16, seed=5)))
    assert torch.equal(sh.weights, sd.weights)


def test_restrict_and_extend_carry_the_row_variances(problem):
    p = problem
    full = _post(p, "exact_dual")
    rows = torch.arange(0, C, 3)
    rest = torch.tensor([i for i in range(C) if i % 3])
    sub = full.restrict(rows).setup()
    assert torch.equal(sub.likelihood.variances, p["d"][rows])
    ref = DenseLinearGaussian(p["Psi0"][rows] * p["s"], p["y"][rows], noise_variances=p["d"][rows])
    assert sub.log_evidence() == pytest.approx(ref.log_evidence(2.0, 0.05), rel=1e-10)
    torch.testing.assert_close(sub.mean(), torch.as_tensor(ref.posterior_mean(2.0, 0.05)), rtol=1e-7, atol=1e-9)
    both = sub.extend(DenseFeatures(p["Psi0"][rest]), p["y"][rest], variances=p["d"][rest]).setup()
    assert both.log_evidence() == pytest.approx(full.log_evidence(), rel=1e-10)
    torch.testing.assert_close(both.mean(), full.mean(), rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError, match=r"the 24 appended rows need their relative noise variances \(variances"):
        sub.extend(DenseFeatures(p["Psi0"][rest]), p["y"][rest])
    with pytest.raises(ValueError, match=r"variances must have shape \(24,\), got \(3,\)"):
        sub.extend(DenseFeatures(p["Psi0"][rest]), p["y"][rest], variances=p["d"][:3])
    hom = LinearizedPosterior(DenseFeatures(p["Psi0"]), p["y"], solver="exact_dual")
    with pytest.raises(ValueError, match="the appended rows have no per-row variances in this noise model"):
        hom.extend(DenseFeatures(p["Psi0"][rest]), p["y"][rest], variances=p["d"][rest])


def test_state_round_trips_weights_only(problem):
    p = problem
    post = _post(p, "exact_dual", a=1.0, s2=0.3, learn=True)
    post.fit(max_steps=3, tol=0.0)
    buf = io.BytesIO()
    torch.save(post.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["likelihood"]["name"] == "diagonal_gaussian"
    fresh = LinearizedPosterior(
        DenseFeatures(p["Psi0"]),
        p["y"],
        likelihood=DiagonalGaussianLikelihood(1.0, True, variances=p["d"]),
        solver="exact_dual",
    )
    fresh.load_state_dict(state)
    fresh.setup()
    assert fresh.sigma2 == post.sigma2 and fresh.a == post.a
    assert fresh.log_evidence() == post.log_evidence()
    other = LinearizedPosterior(
        DenseFeatures(p["Psi0"]),
        p["y"],
        likelihood=DiagonalGaussianLikelihood(1.0, True, variances=p["d"] * 1.5),
        solver="exact_dual",
    )
    with pytest.raises(CheckpointMismatch, match="relative noise variances differ"):
        other.load_state_dict(state)
    white = LinearizedPosterior(DenseFeatures(p["Psi0"]), p["y"], solver="exact_dual")
    with pytest.raises(ValueError, match="state is for likelihood 'diagonal_gaussian', not 'gaussian'"):
        white.load_state_dict(state)


@pytest.mark.parametrize(
    "variances, message",
    [
        (torch.ones(C - 1, dtype=torch.float64), r"variances have shape \(35,\) but there are 36 targets"),
        (torch.ones(C, 1, dtype=torch.float64), r"variances must be a 1-D tensor of shape \(c,\), got \(36, 1\)"),
        (torch.tensor([1.0] * 5 + [0.0] + [1.0] * 30), r"1 are not \(first at row 5: 0.0\)"),
        (torch.tensor([1.0] * 7 + [-2.0] + [1.0] * 28), r"1 are not \(first at row 7: -2.0\)"),
        (torch.tensor([1.0] * 2 + [float("nan")] + [1.0] * 33), r"1 are not \(first at row 2: nan\)"),
        (torch.ones(C, dtype=torch.int64), "variances must be a float tensor, got torch.int64"),
        ([1.0] * C, "variances must be a 1-D tensor of shape"),
    ],
)
def test_bad_variances_are_named(problem, variances, message):
    p = problem
    with pytest.raises(ValueError, match=message) as info:
        LinearizedPosterior(
            DenseFeatures(p["Psi0"]), p["y"], likelihood=DiagonalGaussianLikelihood(1.0, variances=variances)
        )
    assert "\n" not in str(info.value)
