"""Linearised Laplace for classifiers (ctuq.classify) against dense float64 references on a tiny network:
softmax-Hessian roots, features and g-prior, pseudo-targets (posterior mean = the linearised model's mode, = the
trained network when it is that mode), exact posterior and predictive, EM fixed point, evidence, and sampled vs
exact predictive."""

import copy
import math
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from torch import nn

from ctuq.classify import (
    GPRIOR_FLOOR,
    HESSIAN_RATIO_WARNING,
    OVERFIT_WARNING,
    HessianMismatchWarning,
    LinearizedLaplace,
    OverfitWarning,
    SoftmaxHessianRoot,
    mean_kl,
    overfit_fraction,
    softmax_hessian,
)
from ctuq.classify.jacobians import assemble_whitened_jacobian
from ctuq.inference import LIKELIHOODS, CategoricalLikelihood


# ------------------------------------------------------------------------------------------ fixtures
def _data(n, dim, n_classes, seed):
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(n_classes, dim, generator=g, dtype=torch.float64)
    y = torch.arange(n) % n_classes
    X = centres[y] + torch.randn(n, dim, generator=g, dtype=torch.float64)
    return X, y


def _loader(X, y, batch=16):
    return [(X[i : i + batch], y[i : i + batch]) for i in range(0, len(y), batch)]


@pytest.fixture(scope="module")
def tiny():
    """4-6-3 tanh MLP (d = 51 weights and biases) trained on n = 24 points of 3 classes, and 9 test points."""
    torch.manual_seed(0)
    X, y = _data(33, 4, 3, seed=1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X[:24]), y[:24]) + 1e-3 * sum(
            p.pow(2).sum() for p in model.parameters()
        )
        loss.backward()
        opt.step()
    return {"model": model, "X": X[:24], "y": y[:24], "Xt": X[24:], "yt": y[24:]}


def _dense_jacobian(model, X):
    """J (n·C × d) of the batch logits by torch.func.jacrev (independent of the per-example code)."""
    names = [n for n, _ in model.named_parameters()]
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(*vs):
        return torch.func.functional_call(model, dict(zip(names, vs)), (X,)).reshape(-1)

    jac = torch.func.jacrev(f, argnums=tuple(range(len(names))))(*[params[n] for n in names])
    return torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)


class DenseReference:
    """Linearised Laplace of the tangent model in dense float64 (primal, Newton for the mode)."""

    def __init__(self, model, X, y, Xt, floor=GPRIOR_FLOOR):
        self.J = _dense_jacobian(model, X)
        self.Jt = _dense_jacobian(model, Xt)
        with torch.no_grad():
            self.f, self.ft = model(X).double(), model(Xt).double()
        self.y, self.n, self.C = y, *self.f.shape
        p = torch.softmax(self.f, 1)
        lam, U = torch.linalg.eigh(softmax_hessian(p))
        self.Bhalf = torch.block_diag(*(U @ torch.diag_embed(lam.clamp_min(0).sqrt()) @ U.mT))
        Psi0 = self.Bhalf @ self.J
        norms = Psi0.pow(2).sum(0)  # the g-prior's ridge: δ times the (lower) median of the non-zero norms
        self.s = torch.where(norms > 0, 1.0 / (norms + floor * norms[norms > 0].median()).sqrt(), 0.0)
        self.Psi = Psi0 * self.s
        self.lam = torch.linalg.eigvalsh(self.Psi.T @ self.Psi)
        self.Y = nn.functional.one_hot(y, self.C).double()

    def mode(self, a, iters=50):
        w = torch.zeros(self.J.shape[1], dtype=torch.float64)
        JS = self.J * self.s
        for _ in range(iters):
            q = torch.softmax((JS @ w).reshape(self.n, self.C), 1)
            g = JS.T @ (q - self.Y).reshape(-1) + a * w
            H = JS.T @ torch.block_diag(*softmax_hessian(q)) @ JS + a * torch.eye(len(w), dtype=torch.float64)
            step = torch.linalg.solve(H, g)
            w = w - step
            if float(step.norm()) <= 1e-15 * max(1.0, float(w.norm())):  # Newton: converged to round-off
                break
        return w

    def gamma(self, a):
        return float((self.lam / (self.lam + a)).sum())

    def em_fixed_point(self, a=1.0):
        for _ in range(500):
            a_new = self.gamma(a) / float(self.mode(a).pow(2).sum())
            if abs(a_new - a) < 1e-11 * a:
                return a_new
            a = a_new
        raise RuntimeError("no convergence")

    def covariance(self, a):
        return torch.linalg.inv(self.Psi.T @ self.Psi + a * torch.eye(self.Psi.shape[1], dtype=torch.float64))

    def log_evidence(self, a):
        w = self.mode(a)
        logp = torch.log_softmax(((self.J * self.s) @ w).reshape(self.n, self.C), 1)[torch.arange(self.n), self.y].sum()
        d = len(w)
        _, logdet = torch.linalg.slogdet(self.Psi.T @ self.Psi + a * torch.eye(d, dtype=torch.float64))
        return float(logp - 0.5 * a * w.pow(2).sum() + 0.5 * d * math.log(a) - 0.5 * logdet)


class LinearModeReference(DenseReference):
    """The same model with the softmax Hessians at the linearised model's mode ``q(a) = softmax(J (s ⊙ w*(a)))``
    (g-prior scales kept from the network's ``B``): features ``Ψ(a) = B(q)^(1/2) J diag(s)``, the self-consistent
    MacKay fixed point ``a = γ(a; Ψ(a)) / ‖w*(a)‖²`` by Brent's method in ``log a`` and the Laplace-GLM evidence
    at the mode, all dense float64."""

    def features(self, a):
        w = self.mode(a)
        q = torch.softmax(((self.J * self.s) @ w).reshape(self.n, self.C), 1)
        lam, U = torch.linalg.eigh(softmax_hessian(q))
        half = torch.block_diag(*(U @ torch.diag_embed(lam.clamp_min(0).sqrt()) @ U.mT))
        return half @ self.J * self.s, w, q

    def gamma_and_norm(self, a):
        Psi, w, _ = self.features(a)
        lam = torch.linalg.eigvalsh(Psi.T @ Psi)
        return float((lam / (lam + a)).sum()), float(w.pow(2).sum())

    def fixed_point(self):
        def g(x):
            gamma, norm = self.gamma_and_norm(math.exp(x))
            return math.log(gamma / norm) - x

        lo = -4.0  # T(x) − x falls through 0 once: bracket it by unit steps in log a
        while g(lo + 1.0) > 0:
            lo += 1.0
            assert lo < 12, "no fixed point below a = e^12"
        return math.exp(brentq(g, lo, lo + 1.0, xtol=1e-13, rtol=1e-13))

    def log_evidence(self, a):
        Psi, w, _ = self.features(a)
        logp = torch.log_softmax(((self.J * self.s) @ w).reshape(self.n, self.C), 1)[torch.arange(self.n), self.y].sum()
        d = len(w)
        _, logdet = torch.linalg.slogdet(Psi.T @ Psi + a * torch.eye(d, dtype=torch.float64))
        return float(logp - 0.5 * a * w.pow(2).sum() + 0.5 * d * math.log(a) - 0.5 * logdet)


@pytest.fixture(scope="module")
def ref(tiny):
    return DenseReference(tiny["model"], tiny["X"], tiny["y"], tiny["Xt"])


def _fit(tiny, **kw):
    kw = {
        "solver": "exact",
        "prior_precision": 2.0,
        "mode_options": {"gtol": 1e-10, "max_iter": 2000},
        "hessian_at": "network",  # the dense reference's B (the linear-mode tests below pass their own)
        **kw,
    }
    la = LinearizedLaplace(tiny["model"], **kw)
    return la.fit(_loader(tiny["X"], tiny["y"]))


# ------------------------------------------------------------------------------------------ Hessian roots
@pytest.mark.parametrize("root", ["closed_form", "symmetric"])
def test_hessian_roots_factor_the_softmax_hessian_and_solve_for_residuals(root):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(7, 5, generator=g, dtype=torch.float64), 1)
    r = SoftmaxHessianRoot(p, root=root)
    Lt = r.dense()  # blockdiag(Lᵀ)
    torch.testing.assert_close(Lt.T @ Lt, torch.block_diag(*softmax_hessian(p)), rtol=0, atol=1e-13)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    q = torch.softmax(torch.randn(7, 5, generator=g, dtype=torch.float64), 1)
    rho = r.residual_targets(labels, q)
    v = nn.functional.one_hot(labels, 5).double() - q
    torch.testing.assert_close(r.apply(rho[None])[0].reshape(7, 5), v, rtol=0, atol=1e-12)  # L ρ = y − q
    # both roots give the minimum-norm residual: Σ_k (y_k − q_k)²/p_k on 1⊥ ... same norm for both factors
    other = SoftmaxHessianRoot(p, root="symmetric" if root == "closed_form" else "closed_form")
    assert float(rho.norm()) == pytest.approx(float(other.residual_targets(labels, q).norm()), rel=1e-9)


def test_whitened_chunks_are_bounded_in_bytes_not_rows():
    """A pass over an assembled ``J`` takes chunks of at most ``max_bytes`` float64 rows (one example's at least), so a
    wide network's ``d`` does not make a fixed row count gigabytes (117k weights: 3.8 GB per 4096 rows, which ran the
    wide digits CNN out of 24 GB); the chunks still make up ``blockdiag(L_iᵀ) J``."""
    from types import SimpleNamespace

    from ctuq.classify.build import whitened_matrix
    from ctuq.classify.jacobians import DenseJacobian

    g = torch.Generator().manual_seed(0)
    n, C, d = 9, 4, 50
    p = torch.softmax(2 * torch.randn(n, C, generator=g, dtype=torch.float64), 1)
    J = torch.randn(n * C, d, generator=g, dtype=torch.float32)
    jac = DenseJacobian(J, SimpleNamespace(d=d, d_out=n * C))
    root = SoftmaxHessianRoot(p)
    reference = (root.dense() @ J.double()).reshape(n, C, d)
    for max_bytes, per_chunk in ((2 * C * d * 8, 2), (C * d * 8 - 1, 1), (10**9, n)):
        chunks = list(jac.whitened_chunks(root, max_bytes=max_bytes))
        assert [s for s, _ in chunks] == list(range(0, n, per_chunk))
        assert all(rows.shape[0] <= per_chunk and rows.dtype == torch.float64 for _, rows in chunks)
        torch.testing.assert_close(torch.cat([rows for _, rows in chunks]), reference)
    torch.testing.assert_close(whitened_matrix(jac, root).double(), reference.reshape(n * C, d), rtol=1e-6, atol=1e-6)


def test_underflowed_probabilities_are_floored_not_divided_by_zero():
    p = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]], dtype=torch.float64)
    r = SoftmaxHessianRoot(p)
    rho = r.residual_targets(torch.tensor([0, 2]))
    assert torch.isfinite(rho).all() and r.n_floored == 1  # example 2's label has p = 0
    torch.testing.assert_close(rho[:3], torch.zeros(3, dtype=torch.float64))  # a perfect fit needs no residual
    with pytest.raises(ValueError, match="sum to 1"):
        SoftmaxHessianRoot(torch.ones(2, 3, dtype=torch.float64))


def test_categorical_likelihood_is_unit_noise_and_registered():
    lik = LIKELIHOODS["categorical"]()
    assert isinstance(lik, CategoricalLikelihood) and lik.sigma2 == 1.0 and not lik.learn_noise
    assert lik.noise_update(123.0, 10, 3.0) == 1.0
    lik.load_state_dict(lik.state_dict())
    with pytest.raises(ValueError, match="noise variance is 1"):
        lik.sigma2 = 0.5


# ------------------------------------------------------------------------------------------ linear-model pieces
def test_features_gprior_and_dense_assembly_match_the_dense_reference(tiny, ref):
    la = _fit(tiny, solver="cg", solver_options={"rank": 20, "rtol": 1e-10})
    P0 = la.posterior.base.to_dense()  # Ψ₀ through the network products and the closed-form root
    ggn = ref.J.T @ ref.Bhalf.T @ ref.Bhalf @ ref.J
    torch.testing.assert_close(P0.T @ P0, ggn, rtol=1e-9, atol=1e-12)  # same GGN whatever the root
    torch.testing.assert_close(la.scales, ref.s, rtol=1e-9, atol=0)  # exact g-prior from per-example Jacobians
    dense = assemble_whitened_jacobian(la._model, tiny["X"], la.param_names, la._root)
    torch.testing.assert_close(dense, P0, rtol=1e-9, atol=1e-12)  # per-example rows = full-batch products


def test_pseudo_targets_make_the_gaussian_posterior_mean_the_linearised_mode(tiny, ref):
    la = _fit(tiny)
    a = la.prior_precision
    torch.testing.assert_close(la._mode.w, ref.mode(a), rtol=1e-5, atol=1e-7)
    Psi, yt = la.posterior.base.to_dense().double() * la.scales, la.posterior.targets.double()  # Lᵀ-coordinates
    mean = torch.linalg.solve(Psi.T @ Psi + a * torch.eye(Psi.shape[1], dtype=torch.float64), Psi.T @ yt)
    torch.testing.assert_close(mean, ref.mode(a), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(la.posterior.mean().double(), ref.mode(a), rtol=1e-5, atol=1e-7)


def test_pseudo_targets_give_the_trained_network_when_it_is_the_mode():
    """Multinomial logistic regression trained to the MAP of the isotropic prior a: the linearisation is exact, the
    trained weights are the mode, and the Gaussian model's posterior mean is the trained network."""
    X, y = _data(40, 3, 3, seed=5)
    model = nn.Linear(3, 3).double()
    a = 0.7
    opt = torch.optim.LBFGS(
        model.parameters(), max_iter=500, tolerance_grad=1e-12, tolerance_change=0, line_search_fn="strong_wolfe"
    )

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y, reduction="sum") + 0.5 * a * sum(
            p.pow(2).sum() for p in model.parameters()
        )
        loss.backward()
        return loss

    opt.step(closure)
    la = LinearizedLaplace(model, prior="isotropic", prior_precision=a, solver="exact").fit(_loader(X, y))
    trained = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(la.posterior.mean().double(), trained, rtol=1e-6, atol=1e-8)


def test_exact_posterior_predictive_covariance(tiny, ref):
    la = _fit(tiny, prior_precision=3.0)
    Sigma = ref.covariance(3.0)
    G = ref.Jt * ref.s
    expected = (G @ Sigma @ G.T).reshape(9, 3, 9, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (9, 3, 3)
    k = 4000
    mean, cov = la.predict_logits(tiny["Xt"], n_samples=k, seed=3)
    torch.testing.assert_close(mean, ref.ft)
    # Monte Carlo covariance from k = 4000 Gaussian samples: entry sd ≤ sqrt(2/k)·(σ_a σ_b) ≈ 2.2 %; 5 sd bound.
    scale = expected.diagonal(dim1=1, dim2=2).sqrt()
    err = (cov - expected) / (scale[:, :, None] * scale[:, None, :])
    assert float(err.abs().max()) < 5 * (2 / k) ** 0.5, float(err.abs().max())


def test_exact_em_reaches_the_dense_fixed_point_and_evidence(tiny, ref):
    la = _fit(tiny)
    la.optimize_prior("exact", max_steps=40, tol=1e-12)
    a_ref = ref.em_fixed_point()
    assert la.prior_precision == pytest.approx(a_ref, rel=1e-6)
    assert la.log_evidence() == pytest.approx(ref.log_evidence(la.prior_precision), rel=1e-8, abs=1e-8)
    # the MacKay fixed point is a stationary point of the evidence
    eps = 1e-3
    up, down = ref.log_evidence(a_ref * (1 + eps)), ref.log_evidence(a_ref * (1 - eps))
    assert abs(up - down) / (2 * eps) < 1e-4 * abs(ref.log_evidence(a_ref))


@pytest.mark.slow
def test_sampled_em_fluctuates_around_the_exact_fixed_point(tiny, ref):
    """CG solver, 64 samples per step: γ̂ has relative sd ≈ sqrt(2/(64·γ)) (γ ≈ 5 here: ≈ 8 %); the mean of 20
    steps' a lies within 10 % of the exact fixed point (seed 0)."""
    la = _fit(tiny, solver="cg", solver_options={"rank": 30, "rtol": 1e-8})
    la.optimize_prior("sampled_em", max_steps=30, n_samples=64, tol=0.0)
    tail = np.mean([r["a_new"] for r in la.em_trace[-20:]])
    assert tail == pytest.approx(ref.em_fixed_point(), rel=0.10)
    assert all(abs(r["weight_norm_sq"] / r["mode_norm_sq"] - 1) < 1e-5 for r in la.em_trace)


def _sym_kl(p, q):
    return ((p - q) * (p.log() - q.log())).sum(1)


def test_sampled_predictive_matches_the_exact_predictive(tiny, ref):
    """Symmetrised KL between the MC predictive of the CG posterior (2000 samples) and the exact predictive (MC over
    200000 draws from the dense Gaussian over logits): mean over test points < 2e-3 nats (seeded; the Monte Carlo
    floor of 2000 samples is ~3e-4 here); the same bound for the probit link against probit with exact
    variances."""
    a = 2.0
    la = _fit(tiny, solver="cg", prior_precision=a, solver_options={"rank": 30, "rtol": 1e-8})
    p_cg = la.predict(tiny["Xt"], link="mc", samples=2000, seed=1)
    G = ref.Jt * ref.s
    cov = G @ ref.covariance(a) @ G.T
    g = torch.Generator().manual_seed(0)
    Lc = torch.linalg.cholesky(cov + 1e-12 * torch.eye(cov.shape[0], dtype=torch.float64))
    draws = (torch.randn(200000, cov.shape[0], generator=g, dtype=torch.float64) @ Lc.T).reshape(-1, 9, 3)
    p_exact = torch.softmax(ref.ft[None] + draws, -1).mean(0)
    assert float(_sym_kl(p_cg, p_exact).mean()) < 2e-3
    # probit: the sampled logit variances against the exact ones, through the same approximation
    p_probit = la.predict(tiny["Xt"], link="probit", samples=2000, seed=1)
    probit_exact = torch.softmax(ref.ft / (1 + math.pi / 8 * cov.diagonal().reshape(9, 3)).sqrt(), -1)
    assert float(_sym_kl(p_probit, probit_exact).mean()) < 2e-3


def test_dense_features_for_an_iterative_solver_give_the_product_route_posterior(tiny, monkeypatch):
    """``dense_features="always"``: Ψ₀ assembled from per-example Jacobians also for CG (every product a GEMM); the
    same EM trace and predictive as through Jacobian products (same seeds; CG to 1e-10), and a clear error when Ψ₀
    does not fit the dense budget."""
    kw = dict(solver="cg", solver_options={"rank": 20, "rtol": 1e-10})
    runs = {}
    for dense in ("always", "never"):
        la = _fit(tiny, dense_features=dense, **kw)
        la.optimize_prior("sampled_em", max_steps=3, n_samples=16, tol=0.0)
        runs[dense] = (la, [r["a_new"] for r in la.em_trace], la.predict(tiny["Xt"], link="mc", samples=64, seed=2))
    from ctuq.classify.jacobians import DenseJacobian
    from ctuq.linearize import LinearizedNetwork

    # the iterative route keeps J itself (Ψ₀ = blockdiag(Lᵀ) J per product), which the mode finder needs too
    assert isinstance(runs["always"][0].posterior.base.network, DenseJacobian)
    assert runs["always"][0]._mode_finder.net is runs["always"][0].posterior.base.network
    assert isinstance(runs["never"][0].posterior.base.network, LinearizedNetwork)
    # an exact EM after the iterative one whitens the held J instead of computing Jacobians again
    la = runs["always"][0]
    la.optimize_prior("exact", max_steps=1)
    torch.testing.assert_close(
        la.posterior.base.matrix, runs["never"][0].posterior.base.to_dense(), rtol=1e-9, atol=1e-12
    )
    with pytest.raises(ValueError, match=r"DenseJacobian: matrix has shape \(3, 4\), the network's Jacobian is"):
        DenseJacobian(torch.zeros(3, 4, dtype=torch.float64), runs["never"][0].posterior.base.network)
    # columns of Ψ₀ over the held J are slices, not products (an exact solver's assembly)
    from ctuq.inference import assemble_features

    base = _fit(tiny, dense_features="always", **kw).posterior.base
    with monkeypatch.context() as m:
        m.setattr(DenseJacobian, "jvp", lambda *a: pytest.fail("a product where a slice of J does"))
        torch.testing.assert_close(
            assemble_features(base, by="columns"), la.posterior.base.matrix, rtol=1e-12, atol=1e-14
        )
    np.testing.assert_allclose(runs["always"][1], runs["never"][1], rtol=1e-6)
    torch.testing.assert_close(runs["always"][2], runs["never"][2], rtol=1e-6, atol=1e-9)
    import ctuq.classify.laplace as lap

    monkeypatch.setattr(lap, "memory_budget", lambda purpose, device: 1024)
    with pytest.raises(MemoryError, match=r"Ψ₀ \(\d+ × \d+, torch.float64\) needs .* dense budget"):
        _fit(tiny, dense_features="always", **kw)
    with pytest.raises(ValueError, match="dense_features must be one of"):
        LinearizedLaplace(tiny["model"], dense_features="sometimes")


# ------------------------------------------------------------------------------------------ B at the linear mode
@pytest.fixture(scope="module")
def lin_ref(tiny):
    return LinearModeReference(tiny["model"], tiny["X"], tiny["y"], tiny["Xt"])


def test_linear_mode_em_reaches_the_self_consistent_dense_fixed_point(tiny, lin_ref):
    """Exact solver, B rebuilt at the linearised model's mode after every step: the EM's joint fixed point in (a, B),
    the features, the diagnostic and the Laplace-GLM evidence equal the dense float64 reference's."""
    la = _fit(tiny, hessian_at="linear_mode")
    la.optimize_prior("exact", max_steps=40, tol=1e-11)
    a = la.prior_precision
    a_ref = lin_ref.fixed_point()
    assert a == pytest.approx(a_ref, rel=1e-7)
    Psi, w, q = lin_ref.features(a)
    torch.testing.assert_close(la._mode.w, w, rtol=1e-6, atol=1e-8)
    P0 = la.posterior.base.to_dense().double() * la.scales  # the posterior's Ψ: B at the mode, the network's s
    torch.testing.assert_close(P0.T @ P0, Psi.T @ Psi, rtol=1e-5, atol=1e-7)  # w* to L-BFGS gtol vs Newton
    torch.testing.assert_close(la.scales, lin_ref.s, rtol=1e-9, atol=0)
    trace = lambda p: float((1 - p.pow(2).sum(1)).mean())  # noqa: E731
    assert la.hessian_ratio == pytest.approx(trace(q) / trace(torch.softmax(lin_ref.f, 1)), rel=1e-6)
    assert la.log_evidence() == pytest.approx(lin_ref.log_evidence(a), rel=1e-8, abs=1e-8)
    assert la.em_trace[-1]["hessian_ratio"] == pytest.approx(la.hessian_ratio, rel=1e-6)
    # the posterior mean is the linear mode with the rebuilt targets, and the network stays the predictive mean
    torch.testing.assert_close(la.posterior.mean().double(), w, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(la.predict_logits(tiny["Xt"], n_samples=4)[0], lin_ref.ft)
    # the network's B gives another fixed point (the published shortcut): the two differ on this network
    assert abs(a / DenseReference.em_fixed_point(lin_ref) - 1) > 0.2


def test_network_hessian_warns_when_the_linear_mode_is_far_more_curved(tiny):
    la = _fit(tiny, prior_precision=6.0)  # hessian_at="network"
    with pytest.warns(HessianMismatchWarning, match=r"hessian_at='network'.*\d+\.\d+× that at the trained network"):
        la.optimize_prior("exact", max_steps=3)
    assert la.hessian_ratio > HESSIAN_RATIO_WARNING
    with warnings.catch_warnings():
        warnings.simplefilter("error", HessianMismatchWarning)
        _fit(tiny, hessian_at="linear_mode", prior_precision=6.0).optimize_prior("exact", max_steps=3)


# ------------------------------------------------------------------------------------------ over-fitting check
def test_overfit_fraction_and_mean_kl_against_hand_computations():
    f = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    eta = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    # network right and mode wrong: row 1 only (row 3: the network is wrong too, an under-fit, not an over-fit)
    assert overfit_fraction(f, eta, torch.tensor([0, 1, 2, 2])) == 0.25
    assert overfit_fraction(f, eta, torch.tensor([0, 1, 2, 0])) == 0.5
    p, q = torch.softmax(f, 1).numpy(), torch.softmax(eta, 1).numpy()
    assert mean_kl(f, eta) == pytest.approx(float(np.mean(np.sum(p * np.log(p / q), axis=1))), rel=1e-12)
    assert mean_kl(f, f) == 0.0
    with pytest.raises(ValueError, match=r"network_logits \(4, 3\) and mode_logits \(4, 2\)"):
        overfit_fraction(f, eta[:, :2], torch.tensor([0, 1, 2, 2]))
    with pytest.raises(ValueError, match=r"labels \(3,\) \(n,\)"):
        overfit_fraction(f, eta, torch.tensor([0, 1, 2]))


def _memorising(flip_fraction, seed=0, n=40):
    """4-16-16-3 tanh MLP trained to zero training error on n points of 3 classes, with a fraction of the labels
    moved to another class at random (memorised: training accuracy 1)."""
    torch.manual_seed(seed)
    X, y = _data(n, 4, 3, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    flip = torch.rand(n, generator=g) < flip_fraction
    y = y.clone()
    y[flip] = (y[flip] + 1 + torch.randint(0, 2, (int(flip.sum()),), generator=g)) % 3
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(600):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    with torch.no_grad():
        assert bool((model(X).argmax(1) == y).all())
    return model, X, y, int(flip.sum())


def test_overfit_warning_when_the_network_memorises_labels_its_linearisation_calls_noise():
    """Labels flipped at random and memorised by the network: at the evidence's a the linearised model's mode gives
    some of them back to their cluster's class (3 of 40 here), and the EM warns; on the clean labels the mode
    reproduces every training label and the EM is silent."""
    model, X, y, flipped = _memorising(0.3)
    assert flipped == 11
    la = LinearizedLaplace(model, solver="exact", prior_precision=1.0).fit(_loader(X, y))
    with pytest.warns(
        OverfitWarning, match=r"3 of the 40 training labels \(7\.5%\) are predicted by the trained network"
    ):
        la.optimize_prior("exact", max_steps=20, tol=1e-6)
    assert la.overfit_fraction > OVERFIT_WARNING
    assert la.em_trace[-1]["overfit_fraction"] == la.overfit_fraction
    assert la.overfit_fraction == overfit_fraction(la._mode_finder.f, la._mode.logits, y)
    assert la.mode_kl == mean_kl(la._mode_finder.f, la._mode.logits) > 0

    model, X, y, flipped = _memorising(0.0)
    la = LinearizedLaplace(model, solver="exact", prior_precision=1.0).fit(_loader(X, y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverfitWarning)
        la.optimize_prior("exact", max_steps=20, tol=1e-6)
    assert la.overfit_fraction == 0.0


# ------------------------------------------------------------------------------------------ ELLA route
def _centred(cov):
    """``P Σ P`` with ``P = I − 11ᵀ/C`` per input ``(N, C, C)``: the logit covariance the softmax sees (a uniform
    shift of all logits, which no training label constrains, changes no probability)."""
    C = cov.shape[-1]
    P = torch.eye(C, dtype=cov.dtype) - 1.0 / C
    return P @ cov @ P


def test_ella_with_every_direction_the_data_see_is_the_exact_linearised_predictive(tiny, ref):
    """M = n·C landmark rows and K = the rank they have: V spans the row space of Ψ, and ELLA's logit covariance at
    the test inputs equals the exact linearised Laplace's up to the uniform logit shift (which the softmax ignores,
    and along which only the prior speaks) to round-off; its sampled predictive agrees within Monte Carlo error."""
    la = _fit(tiny, prior_precision=3.0, approximation="ella", landmarks=72, rank=44)
    assert la.basis.rank_found == 44 and la.posterior.n_features == 44 and la.posterior.exact
    Phi = la.posterior.features.to_dense()
    Sigma_u = torch.linalg.inv(Phi.T @ Phi + 3.0 * torch.eye(44, dtype=torch.float64))
    G = ref.Jt * ref.s
    GV = G @ la.basis.V
    ella = (GV @ Sigma_u @ GV.T).reshape(9, 3, 9, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    exact = (G @ ref.covariance(3.0) @ G.T).reshape(9, 3, 9, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    torch.testing.assert_close(_centred(ella), _centred(exact), rtol=1e-8, atol=1e-12)
    k = 4000
    mean, cov = la.predict_logits(tiny["Xt"], n_samples=k, seed=3)
    torch.testing.assert_close(mean, ref.ft)
    scale = ella.diagonal(dim1=1, dim2=2).sqrt()
    err = (cov - ella) / (scale[:, :, None] * scale[:, None, :])
    assert float(err.abs().max()) < 5 * (2 / k) ** 0.5, float(err.abs().max())  # as the exact route's test


def test_ella_error_falls_with_rank_and_its_state_round_trips(tiny, ref, tmp_path):
    """Fewer directions, a larger error of the centred logit variances; a saved ELLA predicts the same from its
    file; the EM runs in the K coordinates."""
    G = ref.Jt * ref.s
    exact = _centred((G @ ref.covariance(3.0) @ G.T).reshape(9, 3, 9, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1))
    errors = []
    for k in (4, 12, 44):
        la = _fit(tiny, prior_precision=3.0, approximation="ella", landmarks=72, rank=k)
        Phi = la.posterior.features.to_dense()
        GV = G @ la.basis.V
        cov = GV @ torch.linalg.inv(Phi.T @ Phi + 3.0 * torch.eye(k, dtype=torch.float64)) @ GV.T
        var = _centred(cov.reshape(9, 3, 9, 3).diagonal(dim1=0, dim2=2).permute(2, 0, 1)).diagonal(dim1=1, dim2=2)
        errors.append(float(((var - exact.diagonal(dim1=1, dim2=2)).abs() / exact.diagonal(dim1=1, dim2=2)).mean()))
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-8, errors
    la.optimize_prior("exact", max_steps=3)
    assert la.em_trace and la.prior_precision != 3.0
    p = la.predict(tiny["Xt"], link="probit", samples=32)
    path = la.save(tmp_path / "ella.pt")
    again = LinearizedLaplace.load(tiny["model"], path)
    assert again.approximation == "ella" and again.rank == 44 and torch.equal(again.basis.V, la.basis.V)
    torch.testing.assert_close(again.predict(tiny["Xt"], link="probit", samples=32), p)
    assert "approximation='ella', landmarks=72, rank=44" in repr(again)


def test_ella_predicts_from_k_feature_directions_what_its_lifted_samples_give(tiny, monkeypatch):
    """ELLA's predictive takes K Jacobian-vector products per input (the directions J(x)(s ⊙ V)) and combines them
    with the samples' coordinates; the same deviations as one product per lifted sample w = V u, to round-off."""
    import ctuq.classify.predictive as predictive
    from ctuq.classify import logit_samples

    la = _fit(tiny, approximation="ella", landmarks=40, rank=12)
    tangents = []

    class Counting(predictive.LinearizedNetwork):
        def jvp(self, U):
            tangents.append(U.shape[0])
            return super().jvp(U)

    monkeypatch.setattr(predictive, "LinearizedNetwork", Counting)
    X = tiny["Xt"].clone()
    f, Z = la.logit_deviations(X, 48, seed=2)
    assert tangents == [12] and Z.shape == (48, 9, 3)
    # the directions do not depend on a: the same inputs again (a grid search, the guard) take no product
    la.set_prior_precision(7.0)
    f7, Z7 = la.logit_deviations(X, 48, seed=2)
    assert tangents == [12] and not torch.allclose(Z7, Z)
    X[0] += 0.5  # modified in place, or other inputs: the directions again
    la.logit_deviations(X, 8, seed=2)
    la.logit_deviations(tiny["Xt"][:4], 8, seed=2)
    assert tangents == [12, 12, 12]
    monkeypatch.undo()
    torch.testing.assert_close(la.logit_deviations(tiny["Xt"].clone(), 48, seed=2)[1], Z7, rtol=0, atol=0)
    la.set_prior_precision(2.0)
    f_ref, Z_ref = logit_samples(la._model, la.param_names, tiny["Xt"], la.posterior_samples(48, 2), la.scales)
    torch.testing.assert_close(f, f_ref, rtol=0, atol=0)
    torch.testing.assert_close(Z, Z_ref, rtol=1e-10, atol=1e-12)
    assert float(Z.abs().max()) > 1e-3  # deviations, not zeros


def test_whitened_products_restrict_rows_from_their_own_examples(tiny, ref):
    """Rows of Ψ₀ through products, restricted: the dense reference's B^(1/2) J rows, with no product over the
    training inputs (an index and a boolean mask alike)."""
    from ctuq.classify.build import WhitenedProducts
    from ctuq.classify.hessian import SoftmaxHessianRoot
    from ctuq.linearize import LinearizedNetwork

    model, X = tiny["model"], tiny["X"]
    names = [n for n, _ in model.named_parameters()]
    net = LinearizedNetwork(model, X, param_names=names)
    with torch.no_grad():
        root = SoftmaxHessianRoot(torch.softmax(model(X).double(), 1), "symmetric")
    features = WhitenedProducts(net, root, model, X, names, chunk_size=5)
    rows = torch.tensor([70, 3, 4, 41, 0, 29, 71])
    got = features.restrict(rows)
    torch.testing.assert_close(got.matrix, (ref.Bhalf @ ref.J)[rows], rtol=1e-10, atol=1e-12)
    mask = torch.zeros(72, dtype=torch.bool)
    mask[rows] = True
    torch.testing.assert_close(features.restrict(mask).matrix, (ref.Bhalf @ ref.J)[rows.sort().values])
    assert net.counters() == {"jvp": 0, "vjp": 0}
    with pytest.raises(ValueError, match="duplicates"):
        features.restrict(torch.tensor([1, 1]))


def _subspace_mode(ref, V, a, iters=60):
    """Newton's mode of the tangent model restricted to ``w = V u``: ``argmin_u Σ CE(J s V u) + ½ a ‖u‖²``."""
    G = (ref.J * ref.s) @ V
    u = torch.zeros(V.shape[1], dtype=torch.float64)
    for _ in range(iters):
        q = torch.softmax((G @ u).reshape(ref.n, ref.C), 1)
        H = G.T @ torch.block_diag(*softmax_hessian(q)) @ G + a * torch.eye(len(u), dtype=torch.float64)
        u = u - torch.linalg.solve(H, G.T @ (q - ref.Y).reshape(-1) + a * u)
    return u


@pytest.mark.parametrize("rank", [12, 44])
def test_ella_runs_its_mode_and_em_in_the_k_coordinates(tiny, ref, rank):
    """ELLA's linearised model is the tangent model restricted to w = V u: its mode is that K-dimensional problem's
    (Newton on the dense reference); at the full rank of the rows V u* is the full route's mode (w* lies in Ψ's
    row space). The exact posterior's mean is u* (the pseudo-targets' identity Φᵀρ = a u*). After G = J diag(s) V
    (K JVPs over the training inputs) no product with the network over the data runs: an EM costs none. The M
    landmark rows come from their examples' own Jacobians, not from a product over all inputs per row."""
    la = _fit(tiny, prior_precision=3.0, approximation="ella", landmarks=72, rank=rank)
    counts = la._net.counters()
    assert counts == {"jvp": rank, "vjp": 0}  # the K columns of G only
    u = _subspace_mode(ref, la.basis.V, 3.0)
    assert la._mode.w.shape == (rank,)
    torch.testing.assert_close(la._mode.w, u, rtol=1e-6, atol=1e-7)  # L-BFGS to gtol 1e-10
    if rank == 44:
        torch.testing.assert_close(la.basis.lift(u[None])[0], ref.mode(3.0), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(la.posterior.mean().double(), u, rtol=1e-6, atol=1e-7)
    la.optimize_prior("exact", max_steps=3)
    assert la._net.counters() == counts and len(la.em_trace) == 3


def test_ella_at_the_linear_mode_rebuilds_its_features_in_the_same_subspace(tiny):
    la = _fit(tiny, approximation="ella", landmarks=72, rank=20, hessian_at="linear_mode")
    V = la.basis.V.clone()
    before = la.posterior.features.to_dense().clone()
    la.optimize_prior("exact", max_steps=2)
    assert torch.equal(la.basis.V, V) and la.posterior.n_features == 20
    assert not torch.allclose(la.posterior.features.to_dense(), before)  # B moved with the mode: Ψ V rebuilt
    assert la.predict(tiny["Xt"], samples=16).shape == (9, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(landmarks=5, rank=10), r"landmarks M = 5 must be at least the rank K = 10"),
        (dict(landmarks=72, rank=50), r"rank K = 50 exceeds the rank 44 of the 72 landmark rows"),
        (dict(approximation="nystrom"), r"approximation must be one of \['full', 'ella'\]"),
        (dict(rank=0), "rank must be a positive int, got 0"),
    ],
)
def test_ella_bad_settings_are_one_line_errors(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _fit(tiny, **{"approximation": "ella", **kwargs})


@pytest.mark.parametrize("approximation", ["full", "ella"])
def test_a_model_without_forward_mode_support_is_one_line_before_the_fit(tiny, approximation):
    class NoForward(torch.autograd.Function):  # backward and vmap, no jvp
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return torch.tanh(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(output)

        @staticmethod
        def backward(ctx, g):
            (out,) = ctx.saved_tensors
            return g * (1 - out**2)

    class Act(nn.Module):
        def forward(self, x):
            return NoForward.apply(x)

    model = copy.deepcopy(tiny["model"])
    model[1] = Act()
    with pytest.raises(ValueError, match="does not support forward-mode differentiation"):
        LinearizedLaplace(
            model, approximation=approximation, landmarks=20, rank=5, hessian_at="network", solver="exact"
        ).fit(_loader(tiny["X"], tiny["y"]))
