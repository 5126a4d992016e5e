"""Scale issue, part 1: the first-order solvers (sdd, sgd), the adaptive-rank preconditioner, the cost-based choice
among exact / cg / sdd / sgd, fixed-probe EM with warm starts and the memory budget of Jacobian products, on
problems small enough to solve exactly."""

import warnings

import pytest
import torch

from ctuq.inference import (
    CGSolver,
    ConvergenceWarning,
    DenseFeatures,
    DenseLinearGaussian,
    ExactEigSolver,
    GaussianLikelihood,
    KernelOperator,
    LinearizedPosterior,
    SampledEM,
    SDDSolver,
    SGDSolver,
    Workload,
    adaptive_nystrom_eig,
    estimate_solver_costs,
    lanczos_top_eigenvalue,
    make_solver,
    randomized_eig,
)


def _features(c=120, d=300, top=1e4, power=2.0, seed=0):
    """Ψ (c × d) whose kernel K̄ = ΨΨᵀ has eigenvalues top·i^(−power), i = 1..c."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(c, c, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, c, generator=g, dtype=torch.float64))
    lam = top * torch.arange(1, c + 1, dtype=torch.float64) ** -power
    return DenseFeatures(U @ torch.diag(lam.sqrt()) @ V.T), lam


def _rhs(k, c, seed=1):
    return torch.randn(k, c, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _true_rel_residual(Psi, X, R, a, s2):
    return (X @ (Psi @ Psi.T) / a + s2 * X - R).norm(dim=1) / R.norm(dim=1)


# ----------------------------------------------------------------------------------------------- solvers
@pytest.mark.parametrize("cls", [SDDSolver, SGDSolver])
def test_first_order_solvers_reach_the_exact_solution_and_report_true_residuals(cls):
    f, _ = _features()
    R = _rhs(3, f.n_outputs)
    a, s2 = 1.0, 10.0
    X_ref, _ = ExactEigSolver(f).solve(R, a, s2)
    solver = cls(f, rtol=1e-8, max_iter=3000)
    X, st = solver.solve(R, a, s2)
    assert st.all_converged and st.max_iterations < 3000
    assert float((X - X_ref).norm() / X_ref.norm()) < 1e-6
    # reported residuals are the true ‖Cx − b‖/‖b‖ of what is returned, as for CG
    torch.testing.assert_close(st.relative_residual, _true_rel_residual(f.matrix, X, R, a, s2), rtol=1e-6, atol=0)
    # λ_max(K̄) by Lanczos (20 products) within 1e-6 of the true 1e4
    assert solver.lambda_max == pytest.approx(1e4, rel=1e-6) and solver.n_setup_products <= 20


def test_full_batch_sdd_is_primal_sgd_in_dual_coordinates():
    """From u₀ = b/σ² (the dual image of z = 0), full-batch SDD with step η/λ_max(C) and primal SGD with
    lr η/λ_max(H) produce the same iterates mapped by u = (b − Ψz)/σ²: equal residuals after any budget."""
    f, _ = _features(c=80, d=160, top=1e3)
    R = _rhs(2, 80, seed=3)
    for T in (7, 40):
        sdd = SDDSolver(f, max_iter=T, rtol=1e-14, averaging=1.0, step_size=0.8)
        sgd = SGDSolver(f, max_iter=T, rtol=1e-14, lr=0.8, check_every=10**6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            Xd, _ = sdd.solve(R, 2.0, 0.5)
            Xp, _ = sgd.solve(R, 2.0, 0.5)
        # SDD returns its last look-ahead point, SGD the dual image of its last look-ahead point
        torch.testing.assert_close(Xd, Xp, rtol=1e-9, atol=1e-9)


def test_coordinate_blocks_are_unbiased_but_cost_full_products():
    """Block SDD converges (slower) and is reproducible; every step still costs one kernel product per row."""
    f, _ = _features(c=100, d=200, top=1e3)
    R = _rhs(2, 100)
    a, s2 = 1.0, 5.0
    X_ref, _ = ExactEigSolver(f).solve(R, a, s2)
    block = SDDSolver(f, batch_size=25, step_size=0.2, max_iter=4000, rtol=1e-4)
    block.build()  # λ_max(K̄): 20 Lanczos products, once
    before = f.n_rmatvec
    X1, st = block.solve(R, a, s2)
    assert st.all_converged
    assert f.n_rmatvec - before == st.n_products  # one VJP (and one JVP) per row and step, blocks or not
    assert float((X1 - X_ref).norm() / X_ref.norm()) < 1e-3
    X2, _ = SDDSolver(f, batch_size=25, step_size=0.2, max_iter=4000, rtol=1e-4).solve(R, a, s2)
    assert torch.equal(X1, X2)  # blocks are seeded by the solver seed and the right-hand sides
    full = SDDSolver(f, max_iter=4000, rtol=1e-4).solve(R, a, s2)[1]
    assert full.n_products < st.n_products


def test_warm_start_and_stopping_short():
    f, _ = _features()
    R = _rhs(4, f.n_outputs)
    solver = SGDSolver(f, rtol=1e-6, max_iter=5000, momentum=0.9)  # the warm-start gain is clearest at ρ = 0.9
    X, cold = solver.solve(R, 1.0, 10.0)
    _, warm = solver.solve(R, 1.1, 10.0, x0=X)  # a moved by 10 %: the old solution is a good start
    assert warm.all_converged and warm.n_products < 0.7 * cold.n_products
    with pytest.warns(ConvergenceWarning, match=r"SDD stopped short for 4 of 4 .*Raise max_iter"):
        _, st = SDDSolver(f, rtol=1e-6, max_iter=5).solve(R, 1.0, 10.0)
    assert not st.converged.any() and st.max_iterations == 5
    with pytest.raises(ValueError, match=r"x0 has shape \(2, 120\); rhs has \(4, 120\)"):
        solver.solve(R, 1.0, 10.0, x0=X[:2])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step_size": 0.0}, "step_size must be positive"),
        ({"momentum": 1.0}, r"momentum must lie in \[0, 1\)"),
        ({"batch_size": 0}, "batch_size must be a positive int or None"),
        ({"averaging": 1.5}, r"averaging \(χ\) must lie in \(0, 1\]"),
        ({"max_iter": 0}, "max_iter must be a positive int"),
    ],
)
def test_sdd_bad_settings_are_named(kwargs, match):
    f, _ = _features(c=10, d=20)
    with pytest.raises(ValueError, match=match):
        SDDSolver(f, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": -1.0}, "lr must be positive"),
        ({"lr_decay": "cosine"}, r"lr_decay must be one of \['linear', 'none'\]"),
        ({"clip": 0.0}, "clip must be positive or None"),
        ({"rtol": 0.0}, "rtol must be positive"),
    ],
)
def test_sgd_bad_settings_are_named(kwargs, match):
    f, _ = _features(c=10, d=20)
    with pytest.raises(ValueError, match=match):
        SGDSolver(f, **kwargs)


def test_lanczos_estimates_the_top_eigenvalue():
    f, lam = _features(c=200, d=300, top=50.0, power=0.5)  # slowly decaying spectrum: the hard case
    est, n = lanczos_top_eigenvalue(KernelOperator(features=f), 20, seed=0)
    assert n == 20 and lam[0] <= est * (1 + 1e-9) and est < 1.1 * lam[0]


# ----------------------------------------------------------------------------------------------- adaptive rank
def test_adaptive_rank_stops_where_the_spectrum_falls_below_the_threshold():
    f, lam = _features(c=300, d=400, top=1e4, power=2.0)  # λ_i/a < σ² = 1 from i = 101 on
    K = KernelOperator(features=f)
    eig = adaptive_nystrom_eig(K, 250, a=1.0, sigma2=1.0, threshold=1.0, initial_rank=20, oversampling=5)
    assert 100 <= eig.rank <= 200 and float(eig.eigenvalues[-1]) < 1.0
    assert eig.n_products == eig.rank + 5 and eig.method == "nystrom_adaptive"
    # a larger threshold or a larger aσ² stops earlier; the cap always holds
    assert adaptive_nystrom_eig(K, 250, a=1.0, sigma2=1.0, threshold=25.0, initial_rank=10).rank < eig.rank
    assert adaptive_nystrom_eig(K, 30, a=1.0, sigma2=1e-6, initial_rank=10).rank == 30
    # one round is the fixed-rank single-pass Nyström (same test matrix; equal to round-off)
    one = adaptive_nystrom_eig(K, 50, a=1.0, sigma2=1.0, initial_rank=50, oversampling=5, seed=3)
    fixed = randomized_eig(K, 50, oversampling=5, seed=3)
    torch.testing.assert_close(one.eigenvalues, fixed.eigenvalues, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="threshold must be positive"):
        adaptive_nystrom_eig(K, 10, a=1.0, sigma2=1.0, threshold=0.0)


def test_adaptive_rank_cg_needs_fewer_products_than_fixed_rank():
    f, _ = _features(c=300, d=400, top=1e5, power=1.5)
    R = _rhs(17, 300)
    a, s2 = 1.0, 0.5
    fixed = CGSolver(f, rank=40, oversampling=5, rtol=1e-3)
    adaptive = CGSolver(f, rank=250, oversampling=5, rtol=1e-3, adaptive_rank=True, initial_rank=40)
    _, st_f = fixed.solve(R, a, s2)
    _, st_a = adaptive.solve(R, a, s2)
    total_f = fixed.low_rank.n_products + st_f.n_products
    total_a = adaptive.low_rank.n_products + st_a.n_products
    assert st_a.all_converged and adaptive.low_rank.rank > 40 and total_a < total_f
    with pytest.raises(ValueError, match="needs the \\(a, σ²\\)"):
        CGSolver(f, adaptive_rank=True).build_preconditioner()
    with pytest.raises(ValueError, match="does not apply to preconditioner 'halko'"):
        CGSolver(f, preconditioner="halko", adaptive_rank=True)


# ----------------------------------------------------------------------------------------------- choice
def test_auto_chooses_among_four_by_cost_and_memory():
    wl = Workload()
    # small c: the exact route, as before
    est = estimate_solver_costs(500, 100_000, wl, t_jvp=0.014, t_vjp=0.014, flop_rate=5e10)
    assert min(est.values(), key=lambda e: e.seconds).solver == "exact"
    # the published 3D walnut: c = 1,658,880, d ≈ 3M. Neither the exact route nor a rank-400 preconditioner
    # (2·c·410 float64 = 10.9 GB) fits a 4 GiB budget; SDD (5 chunk × c buffers) does.
    est = estimate_solver_costs(1_658_880, 3_000_000, wl, memory_budget=4 * 1024**3)
    assert not est["exact"].feasible and not est["cg"].feasible and est["sdd"].feasible
    assert est["cg"].memory_bytes == pytest.approx(2 * 1_658_880 * 410 * 8)
    assert est["sdd"].vjp == 20 + (5 * 17 + 1025) * 1001 + 1025
    f, _ = _features(c=40, d=80)
    for kind, cls in (("sdd", SDDSolver), ("sgd", SGDSolver)):
        assert isinstance(make_solver(f, kind, max_iter=10), cls)
    with pytest.raises(ValueError, match=r"unknown solver option 'stepsize'"):
        make_solver(f, "sdd", stepsize=1.0)
    with pytest.raises(ValueError, match=r"unknown sdd option\(s\) \['stepsize'\]; valid: \['averaging'"):
        make_solver(f, "sdd", sdd={"stepsize": 1.0})


# ----------------------------------------------------------------------------------------------- EM
def _em_problem(c=60, d=120, seed=5):
    f, _ = _features(c=c, d=d, top=100.0, power=1.0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    y = f.matrix @ (torch.randn(d, generator=g, dtype=torch.float64) / 2.0) + 0.5 * torch.randn(
        c, generator=g, dtype=torch.float64
    )
    return f, y


@pytest.mark.parametrize("solver", ["sdd", "sgd"])
def test_fixed_probe_em_with_first_order_solvers_reaches_the_fixed_point(solver):
    """Sampled EM with fixed probes and warm starts converges (a and σ² both below tol) to within the Monte Carlo
    error of its 32 probes of the exact MacKay fixed point, and warm starts make later steps cheap."""
    f, y = _em_problem()
    a_ref, s2_ref, _ = DenseLinearGaussian(f.matrix, y).em_fixed_point(1.0, 1.0, learn_noise=True, rtol=1e-12)
    options = {solver: {"max_iter": 1000, "rtol": 1e-5}}
    post = LinearizedPosterior(
        f,
        y,
        prior=torch.ones(f.n_features, dtype=torch.float64),
        likelihood=GaussianLikelihood(1.0, True),
        a=1.0,
        solver=solver,
        solver_options=options,
        seed=0,
    ).setup()
    res = post.fit(max_steps=40, n_samples=32, tol=1e-3, stop_on="a_and_sigma2")
    assert res.converged and post.em.fixed_probes and post.em.solver.warm_starts
    assert res.trace[-1]["rel_change_sigma2"] < 1e-3 and res.trace[-1]["rel_change_a"] < 1e-3
    # γ̂ from 32 probes of γ ≈ 20: relative sd ≈ (2/(32γ))^½ ≈ 6 %; a within 20 %, σ² within 10 %
    assert res.a == pytest.approx(a_ref, rel=0.2) and post.sigma2 == pytest.approx(s2_ref, rel=0.1)
    first, last = res.trace[0], res.trace[-1]
    assert last["solver"]["n_products"] < 0.5 * first["solver"]["n_products"]  # warm starts
    if solver == "sdd":  # fixed probes: Ψξ once (32 JVPs), then right-hand sides rescaled in closed form
        assert first["jvp"] - first["vjp"] == 32 and last["jvp"] == last["vjp"]


@pytest.mark.filterwarnings("ignore::ctuq.inference.ConvergenceWarning")  # resume exactness, not convergence, is tested
def test_fixed_probe_em_resumes_exactly_with_its_warm_starts(tmp_path):
    f, y = _em_problem(c=40, d=80)

    def make():
        solver = SDDSolver(f, max_iter=500, rtol=1e-5, lambda_max=100.0)
        return SampledEM(
            f,
            solver,
            y,
            a=1.0,
            sigma2=0.5,
            learn_noise=True,
            n_samples=8,
            max_steps=6,
            tol=0.0,
            fixed_probes=True,
            seed=3,
        )

    full = make()
    full.run()
    part = make()
    part.max_steps = 3
    part.run()
    torch.save(part.state_dict(), tmp_path / "em.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "em.pt", weights_only=True))
    resumed.run()
    assert [r["a_new"] for r in resumed.trace] == [r["a_new"] for r in full.trace]
    assert resumed.sigma2 == full.sigma2


def test_fixed_probes_first_step_equals_the_fresh_probe_step():
    """The probes of a fixed-probe EM are the numbers its first fresh-probe step would draw."""
    f, _ = _features(c=40, d=70)
    y = _rhs(1, 40)[0]
    steps = []
    for fixed in (False, True):
        em = SampledEM(
            f, ExactEigSolver(f), y, a=2.0, sigma2=0.7, n_samples=5, gamma="sampled", seed=11, fixed_probes=fixed
        )
        steps.append(em.step())
    assert steps[0]["gamma"] == pytest.approx(steps[1]["gamma"], rel=1e-12)


# ----------------------------------------------------------------------------------------------- memory budget
def test_jacobian_memory_budget_error_names_the_sizes():
    from ctuq.linearize import LinearizedNetwork, MemoryBudgetError
    from ctuq.models import build_unet, make_net_input

    torch.manual_seed(0)
    net = LinearizedNetwork(
        build_unet("tiny", ndim=3), make_net_input((8, 8, 8), seed=0), memory_budget=10_000, mode="recompute"
    )
    with pytest.raises(
        MemoryBudgetError,
        match=r"memory budget: one JVP of this network \(output \(1, 1, 8, 8, 8\), "
        r"[\d,]+ weights\) needs .* GiB fixed .* but the budget is 0.00 GiB",
    ):
        net.jvp(torch.zeros(1, net.d))
    ok = LinearizedNetwork(
        build_unet("tiny", ndim=3), make_net_input((8, 8, 8), seed=0), memory_budget=2**30, mode="recompute"
    )
    assert ok.jvp(torch.zeros(2, ok.d)).shape == (2, 512)
