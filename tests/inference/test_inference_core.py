"""ctuq.inference on problems small enough to assemble Ψ and K̄: solvers, sampler, EM against a dense reference."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from ctuq.errors import CheckpointMismatch
from ctuq.inference import (
    CGSolver,
    ConvergenceWarning,
    DenseFeatures,
    DenseLinearGaussian,
    ExactEigSolver,
    KernelOperator,
    LinearizedFeatures,
    LowRankEig,
    SampledEM,
    ScaledFeatures,
    Workload,
    assemble_kernel,
    choose_solver,
    chunk_generator,
    estimate_solver_costs,
    make_solver,
    measurement_covariance,
    pcg,
    posterior_mean,
    randomized_eig,
    sample_chunks,
    sample_posterior,
)
from ctuq.utils import atomic_torch_save


def _problem(c=30, d=60, log_top=2.0, log_bottom=-2.0, seed=0, noise=0.5, dtype=torch.float64):
    """Ψ = U diag(σ) Vᵀ with log-spaced singular values, and targets ỹ = Ψ w + noise."""
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(c, c, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, min(c, d), generator=gen, dtype=torch.float64))
    sv = torch.logspace(log_top, log_bottom, min(c, d), dtype=torch.float64)
    Psi = U[:, : min(c, d)] @ torch.diag(sv) @ V.T
    y = Psi @ (0.3 * torch.randn(d, generator=gen, dtype=torch.float64)) + noise * torch.randn(
        c, generator=gen, dtype=torch.float64
    )
    return Psi.to(dtype), y.to(dtype)


def _problem_with_spectrum(eigs, d, seed=0):
    """Ψ (c × d) whose kernel K̄ = ΨΨᵀ has exactly the eigenvalues ``eigs``."""
    c = len(eigs)
    gen = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(c, c, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, c, generator=gen, dtype=torch.float64))
    return U @ torch.diag(torch.as_tensor(eigs, dtype=torch.float64).sqrt()) @ V.T


# ----------------------------------------------------------------------------------------------- features
@pytest.fixture(scope="module")
def unet_features():
    """Ψ = L Φ diag(s) (ScaledFeatures of LinearizedFeatures) for a float64 tiny U-Net (8×8, d = 5008), L random
    24 × 64, exact g-prior s."""
    from ctuq.inference.priors import gprior_scales
    from ctuq.linearize import LinearizedNetwork
    from ctuq.models import build_unet, make_net_input

    torch.manual_seed(0)
    net = LinearizedNetwork(build_unet("tiny").double(), make_net_input((8, 8), seed=1).double(), mode="recompute")
    L = torch.randn(24, net.d_out, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    s = gprior_scales(lambda R: net.vjp(R @ L), 24, dtype=torch.float64)
    J = net.vjp(torch.eye(net.d_out, dtype=torch.float64))
    feats = ScaledFeatures(LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L), s)
    return net, feats, L, J, s


def test_linearized_features_match_dense(unet_features):
    net, feats, L, J, s = unet_features
    Psi = (L @ J) * s
    assert (feats.n_outputs, feats.n_features) == (24, 5008)
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(3, feats.n_features, generator=gen, dtype=torch.float64)
    R = torch.randn(2, 24, generator=gen, dtype=torch.float64)
    feats.reset_counters()
    net.reset_counters()
    torch.testing.assert_close(feats.matvec(W), W @ Psi.T, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(feats.rmatvec(R), R @ Psi, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(feats.base.network_matvec(W * s), (W * s) @ J.T, rtol=1e-10, atol=1e-12)
    assert feats.counters() == {"matvec": 3, "rmatvec": 2}
    assert net.counters() == {"jvp": 6, "vjp": 2}  # network_matvec counts on the network only
    # g-prior: unit column norms of Ψ.
    torch.testing.assert_close(Psi.norm(dim=0), torch.ones(feats.n_features, dtype=torch.float64))
    torch.testing.assert_close(feats.to_dense(chunk_size=5), Psi, rtol=1e-10, atol=1e-12)


def test_linearized_features_errors(unet_features):
    net, _, L, _, s = unet_features
    with pytest.raises(ValueError, match="both output_map"):
        LinearizedFeatures(net, lambda X: X @ L.T)
    # the prior scales have one owner: ScaledFeatures
    with pytest.raises(TypeError, match="takes no prior scales"):
        LinearizedFeatures(net, s, lambda X: X @ L.T, lambda R: R @ L)
    with pytest.raises(ValueError, match=r"scales must have shape \(5008,\)"):
        ScaledFeatures(LinearizedFeatures(net), s[:10])
    with pytest.raises(ValueError, match="NaN or Inf"):
        ScaledFeatures(LinearizedFeatures(net), torch.full_like(s, math.inf))
    bad = LinearizedFeatures(net, lambda X: X[:, :5], lambda R: R @ L, n_outputs=24)
    with pytest.raises(ValueError, match=r"output_map returned \(1, 5\).*expected \(1, 24\)"):
        bad.matvec(torch.zeros(1, net.d, dtype=torch.float64))
    feats = LinearizedFeatures(net)
    assert feats.n_outputs == net.d_out
    with pytest.raises(ValueError, match=r"W has shape \(2, 3\); expected \(batch, 5008\)"):
        feats.matvec(torch.zeros(2, 3))


# ----------------------------------------------------------------------------------------------- kernel
def test_kernel_operator_and_covariance():
    Psi, _ = _problem(c=12, d=20)
    feats = DenseFeatures(Psi)
    K = KernelOperator(features=feats)
    Kd = Psi @ Psi.T
    assert K.shape == (12, 12) and K.dtype == torch.float64
    torch.testing.assert_close(K.to_dense(), Kd)
    feats.reset_counters()
    X = torch.randn(12, 3, dtype=torch.float64)
    torch.testing.assert_close(K.matmul(X), Kd @ X)
    assert feats.counters() == {"matvec": 3, "rmatvec": 3}  # one VJP + one JVP per column
    # Blocking the rows (to bound the (rows, d) intermediate) changes nothing.
    K.max_block_bytes = 2 * 20 * 8  # two rows of Ψᵀx per block
    torch.testing.assert_close(K.matmul_rows(X.T), (Kd @ X).T)
    K.max_block_bytes = KernelOperator.max_block_bytes
    C = measurement_covariance(K, 0.5, 2.0)
    torch.testing.assert_close(C.to_dense(), Kd / 0.5 + 2.0 * torch.eye(12, dtype=torch.float64))
    torch.testing.assert_close(C.matmul(X), (Kd / 0.5 + 2.0 * torch.eye(12, dtype=torch.float64)) @ X)
    # Row access for pivoted Cholesky costs one product per distinct row.
    feats.reset_counters()
    torch.testing.assert_close(K[torch.tensor([3, 3, 5]), torch.tensor([1, 2, 5])], Kd[[3, 3, 5], [1, 2, 5]])
    assert feats.counters()["rmatvec"] == 2
    with pytest.raises(ValueError, match="prior precision a must be positive"):
        measurement_covariance(K, 0.0, 1.0)
    with pytest.raises(ValueError, match="noise variance sigma2"):
        measurement_covariance(K, 1.0, -1.0)


@pytest.mark.parametrize("strategy,jvps", [("gram", 0), ("products", 12)])
def test_assemble_kernel_strategies(strategy, jvps):
    Psi, _ = _problem(c=12, d=20)
    feats = DenseFeatures(Psi)
    K = assemble_kernel(feats, chunk_size=5, strategy=strategy)
    torch.testing.assert_close(K, Psi @ Psi.T)
    assert feats.counters() == {"matvec": jvps, "rmatvec": 12}
    assert assemble_kernel(DenseFeatures(Psi), memory_budget=1).shape == (12, 12)  # auto → products


# ----------------------------------------------------------------------------------------------- exact solver
def test_exact_eig_matches_dense_reference():
    Psi, y = _problem(c=30, d=60)
    ref = DenseLinearGaussian(Psi, y)
    feats = DenseFeatures(Psi)
    ex = ExactEigSolver(feats, chunk_size=7)
    for a, s2 in ((2.0, 0.25), (1e-3, 4.0), (50.0, 1e-2)):
        assert ex.gamma(a, s2) == pytest.approx(ref.effective_dimension(a, s2), rel=1e-9)
        assert ex.log_evidence(y, a, s2) == pytest.approx(ref.log_evidence(a, s2), rel=1e-11)
        assert ex.weight_norm_sq(y, a, s2) == pytest.approx(ref.weight_norm_sq(a, s2), rel=1e-9)
        assert ex.residual_norm_sq(y, a, s2) == pytest.approx(ref.residual_norm_sq(a, s2), rel=1e-9)
        X, stats = ex.solve(torch.stack([y, 2 * y]), a, s2)
        expected = np.linalg.solve(ref.measurement_covariance(a, s2), np.stack([y.numpy(), 2 * y.numpy()]).T).T
        # float64 with cond(C) up to 2.4e6 (a = 1e-3): the solution is exact to about cond·eps ≈ 5e-10 relative to
        # its largest entry, so its small entries may differ by more than 1e-9 of themselves (1.2e-9 on one CPU type)
        np.testing.assert_allclose(X.numpy(), expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())
        # residuals of a few 1e-9 are round-off too
        assert stats.method == "eig" and stats.all_converged and float(stats.relative_residual.max()) < 1e-8
    # Everything after the one decomposition is free of Jacobian products.
    assert feats.counters() == {"matvec": 0, "rmatvec": 30}
    assert ex.n_setup_products == 30
    # A restored decomposition gives the same answers without assembling K̄.
    ex2 = ExactEigSolver(DenseFeatures(Psi))
    sd = ex.state_dict()
    ex2.load_decomposition(sd["eigenvalues"], sd["eigenvectors"])
    assert ex2.gamma(2.0, 0.25) == pytest.approx(ex.gamma(2.0, 0.25), rel=1e-14)
    assert ex2.features.counters() == {"matvec": 0, "rmatvec": 0}


@pytest.mark.parametrize("c, d", [(60, 25), (25, 60)])
def test_primal_and_dual_exact_decompositions_agree(c, d):
    # The primal route eigendecomposes the d×d Gram ΨᵀΨ and maps Q = ΨVΛ^(-1/2): for d < c it sees only
    # range(Ψ) (r = d directions) plus the σ²-only complement; both routes must give the same exact answers.
    Psi, y = _problem(c=c, d=d)
    ref = DenseLinearGaussian(Psi, y)
    primal = ExactEigSolver(DenseFeatures(Psi), side="primal", chunk_size=9)
    dual = ExactEigSolver(DenseFeatures(Psi), side="dual")
    lam_p, Q_p = primal.decompose()
    assert Q_p.shape == (c, min(c, d))
    # Q = ΨVΛ^(-1/2) is orthonormal up to round-off of order eps·λ_max/λ_min (2e-8 here: λ in [1e-4, 1e4]);
    # measured 0.8e-9 … 1.6e-9 on two CPU types
    np.testing.assert_allclose((Q_p.T @ Q_p).numpy(), np.eye(min(c, d)), atol=2e-8)
    # DenseFeatures hands its matrix to the primal route (no products); the dual route assembles K̄ by products.
    assert primal.n_setup_products == 0
    dual.decompose()
    assert dual.n_setup_products > 0
    for a, s2 in ((2.0, 0.25), (1e-3, 4.0), (50.0, 1e-2)):
        for ex in (primal, dual):
            assert ex.gamma(a, s2) == pytest.approx(ref.effective_dimension(a, s2), rel=1e-8)
            assert ex.log_evidence(y, a, s2) == pytest.approx(ref.log_evidence(a, s2), rel=1e-10)
            assert ex.weight_norm_sq(y, a, s2) == pytest.approx(ref.weight_norm_sq(a, s2), rel=1e-8)
            assert ex.residual_norm_sq(y, a, s2) == pytest.approx(ref.residual_norm_sq(a, s2), rel=1e-8)
        rhs = torch.stack([y, torch.randn(c, dtype=torch.float64, generator=torch.Generator().manual_seed(3))])
        expected = np.linalg.solve(ref.measurement_covariance(a, s2), rhs.numpy().T).T
        np.testing.assert_allclose(primal.solve(rhs, a, s2)[0].numpy(), expected, rtol=1e-8, atol=1e-11)
    # A restored primal (c × r) decomposition is accepted.
    restored = ExactEigSolver(DenseFeatures(Psi))
    restored.load_decomposition(lam_p, Q_p)
    assert restored.gamma(2.0, 0.25) == pytest.approx(primal.gamma(2.0, 0.25), rel=1e-14)


# ----------------------------------------------------------------------------------------------- CG
def test_pcg_matches_direct_solve():
    Psi, y = _problem(c=40, d=80)
    feats = DenseFeatures(Psi)
    ex = ExactEigSolver(feats)
    rhs = torch.stack(
        [
            y,
            torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
            torch.zeros(40, dtype=torch.float64),
        ]
    )
    direct, _ = ex.solve(rhs, 2.0, 0.5)
    for pre in ("none", "nystrom", "halko", "pivoted_cholesky"):
        cg = CGSolver(feats, preconditioner=pre, rank=10, rtol=1e-9, max_iter=500)
        X, stats = cg.solve(rhs, 2.0, 0.5)
        # Residual 1e-9 and cond(C) ≈ 1e4 bound the solution's relative error by ~1e-5.
        assert float((X - direct).norm() / direct.norm()) < 1e-5
        assert stats.all_converged and stats.max_iterations > 0
        assert float(stats.relative_residual[2]) == 0.0 and int(stats.iterations[2]) == 0  # zero rhs: x = 0
        true_res = (rhs[:2] - cg.covariance(2.0, 0.5).matmul(X[:2].T).T).norm(dim=1) / rhs[:2].norm(dim=1)
        assert float(true_res.max()) < 1e-8
    with pytest.raises(ValueError, match=r"rhs has shape \(2, 39\); expected \(k, 40\)"):
        cg.solve(torch.zeros(2, 39, dtype=torch.float64), 1.0, 1.0)


def test_pcg_deflation_and_statistics():
    # A = diag(1..50): CG converges in at most 50 iterations; an eigenvector rhs in exactly 1.
    A = torch.diag(torch.arange(1.0, 51.0, dtype=torch.float64))
    calls = []

    def matmul(X):
        calls.append(X.shape[0])
        return X @ A

    rhs = torch.stack([torch.eye(50, dtype=torch.float64)[7], torch.ones(50, dtype=torch.float64)])
    X, stats = pcg(matmul, rhs, rtol=1e-10, max_iter=100)
    torch.testing.assert_close(X, rhs / torch.arange(1.0, 51.0, dtype=torch.float64), rtol=1e-8, atol=1e-10)
    assert int(stats.iterations[0]) == 1 and int(stats.iterations[1]) > 10
    # After the first iteration the converged column is no longer multiplied.
    assert calls[0] == 2 and all(n == 1 for n in calls[1:])
    assert stats.n_products == sum(calls)


def test_lowrank_preconditioner_cuts_iterations():
    # Kernel eigenvalues from 1e6 down to 1e-4 (c = 150), a σ² = 1: cond(C) ≈ 1e6.
    eigs = torch.logspace(6, -4, 150, dtype=torch.float64)
    Psi = _problem_with_spectrum(eigs, 300)
    feats = DenseFeatures(Psi)
    rhs = torch.randn(4, 150, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain = CGSolver(feats, preconditioner="none", rtol=1e-3, max_iter=1000)
    _, s_plain = plain.solve(rhs, 1.0, 1.0)
    pre = CGSolver(feats, preconditioner="nystrom", rank=90, oversampling=10, rtol=1e-3)
    _, s_pre = pre.solve(rhs, 1.0, 1.0)
    assert s_plain.all_converged and s_pre.all_converged
    # A clear reduction: at least 4× fewer iterations (and kernel products) with the rank-90 preconditioner.
    assert s_pre.max_iterations * 4 <= s_plain.max_iterations, (s_pre.max_iterations, s_plain.max_iterations)
    assert s_pre.n_products + pre.low_rank.n_products < s_plain.n_products


def test_nonconvergence_warns_loudly():
    eigs = torch.logspace(6, -4, 60, dtype=torch.float64)
    feats = DenseFeatures(_problem_with_spectrum(eigs, 100))
    cg = CGSolver(feats, preconditioner="none", rtol=1e-6, max_iter=3)
    with pytest.warns(
        ConvergenceWarning,
        match=r"did not converge for 2 of 2 .* within 3 iterations: largest "
        r"relative residual \d\.\d+e[+-]\d+ > rtol 1\.0e-06",
    ):
        _, stats = cg.solve(torch.ones(2, 60, dtype=torch.float64), 1.0, 1.0)
    assert not stats.converged.any() and int(stats.iterations.max()) == 3
    assert float(stats.relative_residual.min()) > 1e-6


def _cg_iterations(feats, pre, rank, rhs):
    solver = CGSolver(feats, preconditioner=pre, rank=rank, oversampling=10, rtol=1e-3, max_iter=1000, seed=0)
    _, stats = solver.solve(rhs, 1.0, 1.0)
    return stats.max_iterations, solver.low_rank


@pytest.mark.parametrize("spectrum", ["polynomial", "exponential"])
def test_single_pass_nystrom_against_halko(spectrum):
    c = 300
    i = torch.arange(1, c + 1, dtype=torch.float64)
    eigs = 1e5 * i**-2.0 if spectrum == "polynomial" else torch.logspace(5, -5, c, dtype=torch.float64)
    feats = DenseFeatures(_problem_with_spectrum(eigs, 2 * c))
    rhs = torch.randn(8, c, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    it_ha, eig_ha = _cg_iterations(feats, "halko", 60, rhs)
    it_ny, eig_ny = _cg_iterations(feats, "nystrom", 60, rhs)
    it_ny2, eig_ny2 = _cg_iterations(feats, "nystrom", 130, rhs)
    it_pc, eig_pc = _cg_iterations(feats, "pivoted_cholesky", 60, rhs)
    _, s_none = CGSolver(feats, preconditioner="none", rtol=1e-3, max_iter=1000).solve(rhs, 1.0, 1.0)
    assert eig_ha.n_products == 2 * eig_ny.n_products == eig_ny2.n_products == 140
    assert eig_pc.n_products == 60 and eig_pc.n_diag_products == c
    # Equal kernel products (the preconditioner's cost): the single pass at rank 2r + p is clearly better.
    assert it_ny2 * 1.5 <= it_ha, (it_ny2, it_ha)
    # Equal rank, half the products: at most ~30 % more iterations than Halko's alg. 5.6.
    assert it_ny <= 1.3 * it_ha + 2, (it_ny, it_ha)
    assert max(it_ny, it_ha, it_pc) < s_none.max_iterations


def test_pcg_uses_fewer_products_than_linear_cg():
    eigs = torch.logspace(4, -4, 200, dtype=torch.float64)
    feats = DenseFeatures(_problem_with_spectrum(eigs, 300))
    rhs = torch.randn(5, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    eig = randomized_eig(KernelOperator(features=feats), 110, oversampling=10, seed=0)
    ours = CGSolver(feats, preconditioner=eig, rtol=1e-3)
    theirs = CGSolver(feats, preconditioner=eig, rtol=1e-3, backend="linear_cg")
    X1, s1 = ours.solve(rhs, 1.0, 1.0)
    X2, s2 = theirs.solve(rhs, 1.0, 1.0)
    assert s1.all_converged and s1.max_iterations < 10
    # linear_cg always iterates at least 11 times, on every column.
    assert s2.max_iterations >= 11
    assert s1.n_products < s2.n_products / 2, (s1.n_products, s2.n_products)
    # Both at rtol 1e-3 of the residual; the preconditioned C is well conditioned.
    assert float((X1 - X2).norm() / X2.norm()) < 1e-2


def test_preconditioner_is_built_once_for_all_a_and_sigma2():
    Psi, y = _problem(c=40, d=80)
    feats = DenseFeatures(Psi)
    cg = CGSolver(feats, preconditioner="nystrom", rank=15, oversampling=5, rtol=1e-6)
    _, st = cg.solve(y[None], 1.0, 1.0)
    eig = cg.low_rank
    assert eig.n_products == 20
    assert feats.n_rmatvec == 20 + st.n_products
    for a, s2 in ((10.0, 1.0), (0.1, 3.0), (1e3, 1e-2)):
        before = feats.n_rmatvec
        _, st = cg.solve(y[None], a, s2)
        assert cg.low_rank is eig
        assert feats.n_rmatvec - before == st.n_products  # only CG's own kernel products
    # The low-rank decomposition round-trips through a weights_only checkpoint.
    restored = LowRankEig.from_state_dict(eig.state_dict())
    cg2 = CGSolver(DenseFeatures(Psi), preconditioner=restored, rtol=1e-6)
    X1, _ = cg.solve(y[None], 0.1, 3.0)
    X2, st2 = cg2.solve(y[None], 0.1, 3.0)
    torch.testing.assert_close(X1, X2)
    assert cg2.features.n_rmatvec == st2.n_products  # no products spent on the preconditioner


# ----------------------------------------------------------------------------------------------- sampler
def test_em_identities_hold():
    Psi, y = _problem(c=30, d=60)
    feats = DenseFeatures(Psi)
    a, s2 = 2.0, 0.25
    # The identities are exact algebra; with the exact solver they hold to float64 round-off.
    cg = ExactEigSolver(feats)
    gen = torch.Generator().manual_seed(0)
    ps = sample_posterior(feats, cg, a, s2, 6, generator=gen, y_tilde=y)
    u = ps.u
    # Ψζ_j = ε_j − σ² C⁻¹(ε_j − Ψw₀_j) (returned without products) equals Ψ applied to ζ_j.
    torch.testing.assert_close(ps.measurement, ps.weights @ Psi.T, rtol=1e-8, atol=1e-9)
    # Ψw* = ỹ − σ² C⁻¹ỹ.
    torch.testing.assert_close(ps.mean_measurement, Psi @ ps.mean, rtol=1e-8, atol=1e-9)
    # ‖w*‖² = a⁻¹(uᵀỹ − σ²‖u‖²).
    assert float(ps.mean @ ps.mean) == pytest.approx(float(u @ y - s2 * u @ u) / a, rel=1e-8)
    ref = DenseLinearGaussian(Psi, y)
    np.testing.assert_allclose(ps.mean.numpy(), ref.posterior_mean(a, s2), rtol=1e-7, atol=1e-10)
    # The mean alone: one solve and one VJP.
    feats.reset_counters()
    w, u2, _ = posterior_mean(feats, cg, y, a, s2)
    torch.testing.assert_close(w, ps.mean, rtol=1e-8, atol=1e-10)
    assert feats.n_rmatvec - feats.n_matvec == 1


def test_sampled_em_step_spends_no_vjps():
    Psi, y = _problem(c=30, d=60)
    feats = DenseFeatures(Psi)
    cg = CGSolver(feats, preconditioner="nystrom", rank=10, rtol=1e-6)
    cg.build_preconditioner()
    feats.reset_counters()
    em = SampledEM(feats, cg, y, a=1.0, sigma2=0.25, n_samples=8, max_steps=1)
    rec = em.step()
    cg_products = rec["solver"]["n_products"]
    assert rec["vjp"] == cg_products  # only the ones inside the kernel products of CG
    assert rec["jvp"] == 8 + cg_products  # plus k JVPs for Ψw₀
    assert rec["gamma_method"] == "sampled" and rec["log_evidence"] is None


@pytest.mark.parametrize("solver_kind", ["exact", "cg"])
def test_sampler_matches_exact_posterior(solver_kind):
    Psi, y = _problem(c=6, d=8, log_top=1.0, log_bottom=-1.0, seed=3)
    feats = DenseFeatures(Psi)
    a, s2 = 1.5, 0.5
    solver = (
        ExactEigSolver(feats)
        if solver_kind == "exact"
        else CGSolver(feats, preconditioner="none", rtol=1e-10, max_iter=200)
    )
    n = 20_000
    gen = torch.Generator().manual_seed(123)  # fixed seed
    ps = sample_posterior(feats, solver, a, s2, n, generator=gen, y_tilde=y)
    ref = DenseLinearGaussian(Psi, y)
    Sigma = torch.from_numpy(ref.posterior_covariance(a, s2))
    np.testing.assert_allclose(ps.mean.numpy(), ref.posterior_mean(a, s2), rtol=1e-8, atol=1e-10)
    Z = ps.weights
    # Mean of n zero-mean samples: each coordinate has standard error sqrt(Σ_ii/n); allow 5 of them.
    se_mean = (torch.diagonal(Sigma) / n).sqrt()
    assert float((Z.mean(0).abs() / se_mean).max()) < 5.0
    # Covariance estimate ZᵀZ/n (known zero mean): entry (i, j) has variance (Σ_iiΣ_jj + Σ_ij²)/n for a
    # Gaussian; allow 5 standard errors on each of the 36 distinct entries.
    S_hat = Z.T @ Z / n
    dg = torch.diagonal(Sigma)
    se_cov = ((dg[:, None] * dg[None, :] + Sigma**2) / n).sqrt()
    assert float(((S_hat - Sigma).abs() / se_cov).max()) < 5.0
    # And the estimate is not trivially loose: relative Frobenius error ~ sqrt(2/n)-ish.
    assert float((S_hat - Sigma).norm() / Sigma.norm()) < 0.05


def test_sample_chunks_are_resumable():
    Psi, _ = _problem(c=10, d=15)
    feats = DenseFeatures(Psi)
    ex = ExactEigSolver(feats)
    full = list(sample_chunks(feats, ex, 1.0, 0.5, 10, chunk_size=4, seed=7))
    assert [i for i, _ in full] == [0, 1, 2] and [s.weights.shape[0] for _, s in full] == [4, 4, 2]
    resumed = list(sample_chunks(feats, ex, 1.0, 0.5, 10, chunk_size=4, seed=7, start_chunk=1))
    for (i, a), (j, b) in zip(full[1:], resumed):
        assert i == j
        torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=0)
    assert not torch.allclose(full[0][1].weights, full[1][1].weights[:4])
    g1, g2 = chunk_generator(7, 3), chunk_generator(7, 3)
    assert torch.equal(torch.randn(5, generator=g1), torch.randn(5, generator=g2))
    draws = [torch.randn(5, generator=chunk_generator(s, i)) for s, i in ((7, 3), (7, 4), (8, 3))]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    with pytest.raises(ValueError, match="start_chunk 4 outside 0..3"):
        next(sample_chunks(feats, ex, 1.0, 0.5, 10, chunk_size=4, seed=7, start_chunk=4))


# ----------------------------------------------------------------------------------------------- EM
@pytest.mark.parametrize("learn_noise", [False, True])
def test_exact_em_reaches_the_exact_fixed_point(learn_noise):
    Psi, y = _problem(c=30, d=60)
    ref = DenseLinearGaussian(Psi, y)
    feats = DenseFeatures(Psi)
    ex = ExactEigSolver(feats)
    ex.decompose()
    feats.reset_counters()
    em = SampledEM(feats, ex, y, a=1.0, sigma2=0.25, learn_noise=learn_noise, max_steps=1000, tol=1e-13)
    res = em.run()
    assert res.converged and feats.counters() == {"matvec": 0, "rmatvec": 0}  # EM costs no products
    a_ref, s2_ref, _ = ref.em_fixed_point(1.0, 0.25, learn_noise=learn_noise)
    assert res.a == pytest.approx(a_ref, rel=1e-8)
    assert res.sigma2 == pytest.approx(s2_ref, rel=1e-8)
    for rec in res.trace[:3]:
        assert rec["log_evidence"] == pytest.approx(ref.log_evidence(rec["a"], rec["sigma2"]), rel=1e-11)
        assert rec["gamma"] == pytest.approx(ref.effective_dimension(rec["a"], rec["sigma2"]), rel=1e-9)
    # MacKay's fixed point is a stationary point of the evidence (central differences in log a, log σ²).
    h = 1e-4
    d_loga = (ref.log_evidence(a_ref * math.exp(h), s2_ref) - ref.log_evidence(a_ref * math.exp(-h), s2_ref)) / (2 * h)
    assert abs(d_loga) < 1e-5
    if learn_noise:
        up, down = ref.log_evidence(a_ref, s2_ref * math.exp(h)), ref.log_evidence(a_ref, s2_ref * math.exp(-h))
        d_logs = (up - down) / (2 * h)
        assert abs(d_logs) < 1e-5
    # Evidence increases along the EM path (EM is monotone in the evidence).
    evs = [r["log_evidence"] for r in res.trace]
    assert all(b >= a - 1e-9 for a, b in zip(evs, evs[1:]))


def test_damped_em_update_takes_the_secant_root_and_keeps_the_fixed_point():
    """``update="damped"``: for an oscillating map that is affine in ``log a`` (slope ``κ = −0.6``) the secant step
    from two MacKay evaluations lands on the fixed point exactly; a monotone map (``κ > 0``) gets MacKay's step; and
    exact-γ EM reaches the same fixed point as MacKay's update (to 1e-9), with both values in each record."""
    Psi, y = _problem(c=30, d=60)
    feats = DenseFeatures(Psi)
    ex = ExactEigSolver(feats)
    em = SampledEM(feats, ex, y, a=1.0, sigma2=0.25, update="damped")
    for kappa in (-0.6, 0.4):
        T = lambda x: 5.0 + kappa * (x - 5.0)  # noqa: E731 - the map x = log a ↦ log(γ/‖w*‖²)
        em.trace = [{"a": math.exp(0.0), "a_mackay": math.exp(T(0.0))}]
        x1 = T(0.0)
        a_new, omega = em._damped(math.exp(x1), math.exp(T(x1)))
        if kappa < 0:
            assert math.log(a_new) == pytest.approx(5.0, abs=1e-12) and omega == pytest.approx(1 / 1.6)
        else:
            assert (a_new, omega) == (pytest.approx(math.exp(T(x1))), 1.0)
    results = {}
    for update in ("mackay", "damped"):
        em = SampledEM(feats, ex, y, a=1.0, sigma2=0.25, max_steps=1000, tol=1e-12, update=update)
        results[update] = em.run()
        assert all(r["a_mackay"] == pytest.approx(r["gamma"] / r["weight_norm_sq"], rel=1e-12) for r in em.trace)
    assert results["damped"].a == pytest.approx(results["mackay"].a, rel=1e-9)
    assert results["damped"].converged and len(results["damped"].trace) <= len(results["mackay"].trace)
    with pytest.raises(ValueError, match=r"update must be one of \['mackay', 'damped'\]"):
        SampledEM(feats, ex, y, update="newton")


def test_sampled_em_converges_to_exact_fixed_point():
    Psi, y = _problem(c=30, d=60)
    ref = DenseLinearGaussian(Psi, y)
    s2 = 0.25
    a_star, _, _ = ref.em_fixed_point(1.0, s2)
    feats = DenseFeatures(Psi)
    cg = CGSolver(feats, preconditioner="nystrom", rank=10, rtol=1e-8, max_iter=500)
    k, steps, tail = 64, 40, 20
    em = SampledEM(feats, cg, y, a=1.0, sigma2=s2, n_samples=k, max_steps=steps, tol=0.0, seed=0)  # fixed seed
    res = em.run()
    assert res.steps == steps and not res.converged
    # Tolerance from the estimator: at a*, Ψζ ~ N(0, S) with S = ΨΣΨᵀ, so Var(γ̂) = 2 tr(S²)/(k σ⁴), a relative
    # error r that one step maps into log a. Near a* the exact map multiplies log-errors by ρ (measured below),
    # so log a_t is an AR(1) process; the mean of its last m values has std ≈ r/((1 − ρ)√m). Allow 5 of those.
    S = Psi.numpy() @ ref.posterior_covariance(a_star, s2) @ Psi.numpy().T
    gamma = ref.effective_dimension(a_star, s2)
    r = math.sqrt(2 * np.trace(S @ S) / k) / (s2 * gamma)
    h = 1e-3
    up, down = ref.mackay_update(a_star * math.exp(h), s2)[0], ref.mackay_update(a_star * math.exp(-h), s2)[0]
    rho = abs(math.log(up / down) / (2 * h))
    assert rho < 0.9
    tol = 5 * r / ((1 - rho) * math.sqrt(tail))
    log_mean = np.mean([math.log(t["a_new"]) for t in res.trace[-tail:]])
    assert abs(log_mean - math.log(a_star)) < tol, (math.exp(log_mean), a_star, tol)
    assert tol < 0.12  # the check is meaningful: a within ~12 %


def test_em_checkpoint_resume_reproduces_uninterrupted_run(tmp_path):
    Psi, y = _problem(c=30, d=60)

    def make():
        feats = DenseFeatures(Psi)
        cg = CGSolver(feats, preconditioner="nystrom", rank=10, rtol=1e-6)
        return feats, cg

    feats, cg = make()
    full = SampledEM(feats, cg, y, a=1.0, sigma2=0.25, learn_noise=True, n_samples=4, max_steps=4, tol=0, seed=3).run()

    feats, cg = make()
    em = SampledEM(feats, cg, y, a=1.0, sigma2=0.25, learn_noise=True, n_samples=4, max_steps=4, tol=0, seed=3)
    path = tmp_path / "em_state.pt"
    em.step()
    em.step()
    atomic_torch_save(path, em.state_dict())

    feats, cg = make()
    resumed = SampledEM(feats, cg, y, a=1.0, sigma2=0.25, learn_noise=True, n_samples=4, max_steps=4, tol=0, seed=3)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.step_count == 2
    out = resumed.run()
    assert [t["a_new"] for t in out.trace] == [t["a_new"] for t in full.trace]
    assert [t["sigma2_new"] for t in out.trace] == [t["sigma2_new"] for t in full.trace]
    assert out.a == full.a and out.sigma2 == full.sigma2

    other = SampledEM(feats, cg, y, a=1.0, sigma2=0.25, learn_noise=True, n_samples=8, max_steps=4, seed=3)
    with pytest.raises(CheckpointMismatch, match="n_samples is 4 but this run has 8"):
        other.load_state_dict(torch.load(path, weights_only=True))
    with pytest.raises(CheckpointMismatch, match="not a SampledEM state"):
        other.load_state_dict({"version": 99})


def test_em_and_sampler_input_errors():
    Psi, y = _problem(c=10, d=15)
    feats = DenseFeatures(Psi)
    cg = CGSolver(feats, preconditioner="none")
    with pytest.raises(ValueError, match="gamma='exact' needs an exact solver"):
        SampledEM(feats, cg, y, gamma="exact")
    with pytest.raises(ValueError, match=r"y_tilde must have shape \(10,\)"):
        SampledEM(feats, cg, y[:5])
    with pytest.raises(ValueError, match="prior precision a must be positive"):
        SampledEM(feats, cg, y, a=-1.0)
    with pytest.raises(ValueError, match="different feature operator"):
        sample_posterior(DenseFeatures(Psi), cg, 1.0, 1.0, 2, generator=torch.Generator())
    with pytest.raises(TypeError, match="torch.Generator is required"):
        sample_posterior(feats, cg, 1.0, 1.0, 2, generator=0)
    with pytest.raises(ValueError, match="y_tilde contains NaN"):
        posterior_mean(feats, cg, torch.full((10,), math.nan, dtype=torch.float64), 1.0, 1.0)
    with pytest.raises(FloatingPointError, match="‖w\\*‖²"):
        SampledEM(feats, ExactEigSolver(feats), torch.zeros(10, dtype=torch.float64)).step()


# ----------------------------------------------------------------------------------------------- choice
def test_solver_choice_by_cost():
    # Small c: one eigendecomposition beats CG iterations for prediction samples.
    est = estimate_solver_costs(500, 100_000, Workload(), t_jvp=0.014, t_vjp=0.014, flop_rate=5e10)
    assert est["exact"].seconds < est["cg"].seconds
    # Walnut-sized c = 7680 with only EM (no prediction): assembling K̄ (7680 VJPs + eigh) is not worth it.
    wl = Workload(prediction_samples=0)
    est = estimate_solver_costs(7680, 100_000, wl, t_jvp=0.014, t_vjp=0.014, flop_rate=5e10)
    assert est["cg"].seconds < est["exact"].seconds
    assert est["exact"].vjp == 7680 + 1 and est["cg"].jvp == 410 + 5 * 17 * 10 + 5 * 16 + 10
    # The exact solver is infeasible when K̄ does not fit.
    est = estimate_solver_costs(50_000, 10**6, Workload(), memory_budget=4 * 1024**3)
    assert not est["exact"].feasible and est["cg"].feasible

    Psi, y = _problem(c=20, d=40)
    feats = DenseFeatures(Psi)
    kind, est = choose_solver(feats, Workload(em_steps=2, prediction_samples=8))
    assert kind == "exact"  # c = 20: assembling K̄ is cheaper than a single CG run
    solver = make_solver(feats, "auto", Workload(em_steps=2, prediction_samples=8), rank=5, rtol=1e-4)
    assert isinstance(solver, ExactEigSolver)
    assert isinstance(make_solver(feats, "cg", rank=5), CGSolver)
    with pytest.raises(ValueError, match=r"make_solver: unknown solver option 'rnak'"):
        make_solver(feats, "cg", rnak=5)
    with pytest.raises(ValueError, match="kind must be"):
        make_solver(feats, "direct")


# ----------------------------------------------------------------------------------------------- float32 network
@pytest.mark.slow
def test_float32_network_pipeline_cg_matches_exact():
    from ctuq.inference.priors import gprior_scales
    from ctuq.linearize import LinearizedNetwork
    from ctuq.models import build_unet, make_net_input

    torch.manual_seed(0)
    # The production set-up: mode "linearize", float32, the first JVP traced inside linear_operator's matmul.
    net = LinearizedNetwork(build_unet("tiny"), make_net_input((8, 8), seed=1))
    gen = torch.Generator().manual_seed(0)
    # A sparse random "projection" L (40 × 64) standing in for a ray transform.
    L = (torch.rand(40, 64, generator=gen) < 0.2).float() * torch.rand(40, 64, generator=gen)
    s = gprior_scales(lambda R: net.vjp(R @ L), 40, method="stochastic", n_probes=64, seed=0)
    lin = LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L)
    feats = ScaledFeatures(lin, s)
    y = feats.matvec(torch.randn(1, feats.n_features, generator=gen) * 0.1)[0] + 0.05 * torch.randn(40, generator=gen)
    cg = CGSolver(feats, preconditioner="nystrom", rank=30, oversampling=5)  # default rtol 1e-3
    ex = ExactEigSolver(feats)
    a, s2 = 5.0, 0.05**2
    w_cg, _, st = posterior_mean(feats, cg, y, a, s2)
    w_ex, _, _ = posterior_mean(feats, ex, y, a, s2)
    assert w_cg.dtype == torch.float32 and st.all_converged and net.jvp_impl == "linearize"
    # rtol 1e-3 on the residual; with the preconditioner C is well conditioned, so the solution error is similar.
    assert float((w_cg - w_ex).norm() / w_ex.norm()) < 1e-2
    ps = sample_posterior(feats, cg, a, s2, 3, generator=torch.Generator().manual_seed(1))
    x = lin.network_matvec(ps.weights * s)  # image-space samples Φ(s ⊙ ζ)
    assert x.shape == (3, 64) and torch.isfinite(x).all()


# ----------------------------------------------------------------------------------------------- isolation
def test_core_imports_nothing_ct_specific():
    code = (
        "import sys\n"
        "import ctuq.inference, ctuq.linearize, ctuq.inference.priors\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('astra', 'odl') "
        "or m.startswith('ctuq.operators') or m.startswith('ctuq.data') or m.startswith('ctuq.reconstruct'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the inference core imported CT-specific modules: {out.stdout.strip()}"
