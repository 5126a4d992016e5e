"""LinearizedPosterior — the one posterior object of the core — on non-CT problems, against dense float64
references: a small MLP regression front end end to end, the solver registry, restricting and extending rows,
checkpoint/resume, and streaming prediction memory."""

import numpy as np
import pytest
import torch
from memory_utils import peak_cpu_bytes
from torch import nn

from ctuq.config import UQConfig
from ctuq.errors import CheckpointMismatch
from ctuq.inference import (
    SOLVERS,
    CGSolver,
    DenseFeatures,
    DenseLinearGaussian,
    ExactEigSolver,
    GaussianLikelihood,
    LinearizedFeatures,
    LinearizedPosterior,
    SDDSolver,
    SGDSolver,
    make_solver,
    resolve_solver,
    solver_choices,
)
from ctuq.linearize import LinearizedNetwork
from ctuq.metrics import SampleMoments


# ------------------------------------------------------------------------------------------ a regression front end
@pytest.fixture(scope="module")
def regression():
    """1-D regression with a 1-16-16-1 tanh MLP (d = 288 linear weights) on n = 40 points; the front end is what
    any user of the core writes: linearise, offset, posterior."""
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 40, dtype=torch.float64)[:, None]
    y = torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(40, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        loss = (model(x)[:, 0] - y).pow(2).mean()
        loss.backward()
        opt.step()
    net = LinearizedNetwork(model, x)
    base = LinearizedFeatures(net)
    with torch.no_grad():
        y_t = y + net.jvp(net.params()[None])[0] - net.output()  # ỹ = y + Φṽ − g(ṽ) (biases held fixed)

    # Independent dense reference: Φ by torch.func.jacrev of the functional model, g-prior from its columns.
    names = net.param_names
    params = {k: v.detach() for k, v in model.named_parameters()}

    def g(*vs):
        return torch.func.functional_call(model, {**params, **dict(zip(names, vs))}, (x,))[:, 0]

    jac = torch.func.jacrev(g, argnums=tuple(range(len(names))))(*[params[n] for n in names])
    Phi = torch.cat([j.reshape(40, -1) for j in jac], dim=1)
    s = 1.0 / Phi.norm(dim=0)
    return {"base": base, "y_t": y_t, "Phi": Phi, "s": s, "Psi": Phi * s, "net": net}


@pytest.mark.parametrize("solver", ["exact_dual", "exact_primal", "cg"])
def test_regression_front_end_reaches_the_exact_em_fixed_point(regression, solver):
    r = regression
    post = LinearizedPosterior(
        r["base"],
        r["y_t"],
        prior="gprior",
        likelihood=GaussianLikelihood(0.05, True),
        a=1.0,
        solver=solver,
        solver_options={"rank": 30, "rtol": 1e-8},
        seed=0,
    )
    post.setup()
    assert post.solver_name == solver
    torch.testing.assert_close(post.scales, r["s"], rtol=1e-8, atol=0)
    exact = solver != "cg"
    res = post.fit(max_steps=200 if exact else 40, n_samples=64, tol=1e-10 if exact else 0.0)
    a_ref, s2_ref, _ = DenseLinearGaussian(r["Psi"], r["y_t"]).em_fixed_point(1.0, 0.05, learn_noise=True, rtol=1e-12)
    if exact:
        assert res.a == pytest.approx(a_ref, rel=1e-6) and post.sigma2 == pytest.approx(s2_ref, rel=1e-6)
        assert post.log_evidence() == pytest.approx(
            DenseLinearGaussian(r["Psi"], r["y_t"]).log_evidence(post.a, post.sigma2), rel=1e-8
        )
    else:
        # Sampled EM with 64 samples per step fluctuates around the fixed point: the mean of the last 20 steps'
        # a lies within 10 % of it (γ̂'s relative sd is ≈ 1/sqrt(64·γ); seed 0).
        tail = np.mean([t["a_new"] for t in res.trace[-20:]])
        assert tail == pytest.approx(a_ref, rel=0.1)
        with pytest.raises(ValueError, match="log_evidence needs an exact solver"):
            post.log_evidence()


def test_regression_predictive_variance_matches_the_dense_posterior(regression):
    r = regression
    a, s2 = 2.0, 0.02
    post = LinearizedPosterior(r["base"], r["y_t"], likelihood=GaussianLikelihood(s2), a=a, solver="exact_dual")
    post.setup()
    k = 4000
    acc = SampleMoments((40, 1), patch_sizes=[1])
    for _, out, _ in post.sample_outputs(k, chunk_size=500, seed=7):
        acc.update(out.reshape(-1, 40, 1))
    cov_w = torch.as_tensor(DenseLinearGaussian(r["Psi"], r["y_t"]).posterior_covariance(a, s2))
    B = r["Phi"] * r["s"]
    expected = torch.einsum("ij,jk,ik->i", B, cov_w, B)
    rel = (acc.variance()[:, 0] / expected - 1).abs()
    # A variance from k Gaussian samples has relative sd sqrt(2/k) = 2.2 %: every one of 40 points within 4 sd.
    assert float(rel.max()) < 4 * (2 / k) ** 0.5, float(rel.max())
    w_ref = torch.as_tensor(DenseLinearGaussian(r["Psi"], r["y_t"]).posterior_mean(a, s2))
    torch.testing.assert_close(post.mean(), w_ref, rtol=1e-7, atol=1e-9)


# ------------------------------------------------------------------------------------------ rows
def test_restrict_and_extend_condition_on_the_right_rows(regression):
    r = regression
    a, s2 = 1.5, 0.03
    full = LinearizedPosterior(r["base"], r["y_t"], likelihood=GaussianLikelihood(s2), a=a, solver="exact_dual")
    rows = torch.arange(0, 40, 3)
    rest = torch.tensor([i for i in range(40) if i % 3])
    # before set-up there are no scales yet: the restricted posterior computes its g-prior on its own rows
    own = full.restrict(rows).setup()
    torch.testing.assert_close(own.scales, 1.0 / r["Phi"][rows].norm(dim=0), rtol=1e-8, atol=0)
    full.setup()
    sub = full.restrict(rows).setup()
    ref = DenseLinearGaussian(r["Psi"][rows], r["y_t"][rows])
    # after set-up, the restricted posterior keeps the full problem's g-prior scales (computed on all rows)
    assert sub.log_evidence() == pytest.approx(ref.log_evidence(a, s2), rel=1e-9)
    torch.testing.assert_close(sub.mean(), torch.as_tensor(ref.posterior_mean(a, s2)), rtol=1e-7, atol=1e-9)
    # adding the other rows back gives the full posterior (rows in another order: same evidence and mean)
    both = sub.extend(r["base"].restrict(rest), r["y_t"][rest]).setup()
    assert both.log_evidence() == pytest.approx(full.log_evidence(), rel=1e-9)
    torch.testing.assert_close(both.mean(), full.mean(), rtol=1e-7, atol=1e-9)
    # boolean masks work like index lists; bad rows are named
    mask = torch.zeros(40, dtype=torch.bool)
    mask[rows] = True
    assert full.restrict(mask).setup().log_evidence() == pytest.approx(sub.log_evidence(), rel=1e-12)
    with pytest.raises(ValueError, match="row indices must lie in 0..39"):
        full.restrict([0, 40])
    with pytest.raises(ValueError, match="duplicates"):
        full.restrict([1, 1])


def test_restrict_of_the_assembling_solver_slices_instead_of_recomputing(regression):
    r = regression
    dense = DenseFeatures(r["Phi"][:, :30].contiguous())  # d = 30 < c = 40: exact → exact_primal
    post = LinearizedPosterior(dense, r["y_t"], likelihood=GaussianLikelihood(0.1), a=1.0, solver="exact").setup()
    assert post.solver_name == "exact_primal"
    before = dense.n_matvec + dense.n_rmatvec
    sub = post.restrict(torch.arange(20)).setup()
    assert dense.n_matvec + dense.n_rmatvec == before  # no products: Ψ₀ was sliced
    ref = DenseLinearGaussian(r["Phi"][:20, :30] * post.scales, r["y_t"][:20])
    assert sub.log_evidence() == pytest.approx(ref.log_evidence(1.0, 0.1), rel=1e-9)


# ------------------------------------------------------------------------------------------ registry and state
def test_solver_registry_is_the_one_vocabulary():
    feats = DenseFeatures(torch.randn(50, 10, dtype=torch.float64))
    assert resolve_solver("exact", feats)[0] == "exact_primal"
    assert resolve_solver("exact", DenseFeatures(torch.randn(10, 50, dtype=torch.float64)))[0] == "exact_dual"
    assert resolve_solver("cg", feats)[0] == "cg"
    name, estimates = resolve_solver("auto", feats)
    assert name in ("exact_primal", "cg") and set(estimates) == {"exact", "cg", "sdd", "sgd"}
    assert resolve_solver("sdd", feats)[0] == "sdd" and resolve_solver("sgd", feats)[0] == "sgd"
    assert solver_choices()[:7] == ("auto", "exact", "exact_primal", "exact_dual", "cg", "sdd", "sgd")
    with pytest.raises(ValueError, match=r"solver must be one of \['auto', 'exact', 'exact_primal'"):
        resolve_solver("magic", feats)
    # the core names no config key: its own messages
    with pytest.raises(ValueError, match=r"^LinearizedPosterior: solver must be one of \['auto', 'exact'"):
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64), solver="magic")
    with pytest.raises(
        ValueError, match=r"^LinearizedPosterior: prior must be one of \['gprior', 'isotropic', 'tv_predcp'\]"
    ):
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64), prior="flat")
    with pytest.raises(ValueError, match=r"^GPrior: method must be one of"):  # the prior's own options
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64), prior_options={"method": "guess"})
    with pytest.raises(TypeError, match="gprior_method"):  # no g-prior arguments of the posterior's own
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64), gprior_method="exact")
    # the config reads its choices from the registry when it checks a value
    field = next(f for f in __import__("dataclasses").fields(UQConfig) if f.name == "solver")
    assert field.metadata["choices"]() == solver_choices()
    # every name builds through the registry; each solver gets the options it takes
    built = {n: make_solver(feats, n, rank=5, max_iter=7, seed=3) for n in SOLVERS}
    assert [type(built[n]) for n in ("exact_primal", "exact_dual", "cg", "sdd", "sgd")] == [
        SOLVERS["exact_primal"],
        SOLVERS["exact_dual"],
        CGSolver,
        SDDSolver,
        SGDSolver,
    ]
    assert isinstance(built["exact_primal"], ExactEigSolver) and built["exact_primal"].side == "primal"
    assert built["cg"].rank == 5 and built["sdd"].max_iter == built["sgd"].max_iter == 7
    # one rule for options: flat keys go to the chosen solver if it takes them, a mapping under its name wins
    post = LinearizedPosterior(
        feats,
        torch.zeros(50, dtype=torch.float64),
        solver="sdd",
        solver_options={"rank": 5, "max_iter": 11, "sdd": {"max_iter": 9}},
    ).setup()
    assert isinstance(post.solver, SDDSolver) and post.solver.max_iter == 9
    post = LinearizedPosterior(
        feats,
        torch.zeros(50, dtype=torch.float64),
        solver="sgd",
        solver_options={"rank": 5, "max_iter": 11, "sdd": {"max_iter": 9}},
    ).setup()
    assert isinstance(post.solver, SGDSolver) and post.solver.max_iter == 11
    # a misspelt option is refused by name, not silently ignored
    with pytest.raises(ValueError, match=r"unknown solver option 'rnak'"):
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64), solver_options={"rnak": 5})
    with pytest.raises(ValueError, match=r"unknown sgd option\(s\) \['learning_rate'\]"):
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64), solver_options={"sgd": {"learning_rate": 1}})
    # the EM's update vocabulary, checked before any set-up work
    with pytest.raises(ValueError, match=r"LinearizedPosterior.fit: update must be one of \['mackay', 'damped'\]"):
        LinearizedPosterior(feats, torch.zeros(50, dtype=torch.float64)).fit(update="newton")
    field = next(f for f in __import__("dataclasses").fields(UQConfig) if f.name == "em_update")
    assert tuple(field.metadata["choices"]) == ("mackay", "damped")


def test_reset_em_starts_a_new_em_at_the_current_hyperparameters(regression):
    r = regression
    post = LinearizedPosterior(r["base"], r["y_t"], likelihood=GaussianLikelihood(0.05), a=1.0, solver="exact_dual")
    post.fit(max_steps=2, n_samples=4)
    a_after = post.a
    post.reset_em()
    assert post.em is None and post.em_trace == []
    res = post.fit(max_steps=1, n_samples=4)
    assert res.steps == 1 and res.trace[0]["a"] == a_after


def test_state_dict_resumes_the_em_exactly(regression, tmp_path):
    r = regression

    def make():
        return LinearizedPosterior(
            r["base"],
            r["y_t"],
            likelihood=GaussianLikelihood(0.05, True),
            a=1.0,
            solver="cg",
            solver_options={"rank": 20},
            prior="gprior",
            prior_options={"method": "stochastic", "probes": 32},
            seed=4,
        )

    full = make()
    full.fit(max_steps=4, n_samples=8, tol=0.0)
    part = make()
    part.fit(max_steps=2, n_samples=8, tol=0.0)
    torch.save(part.state_dict(), tmp_path / "post.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "post.pt", weights_only=True))
    before = r["net"].n_vjp
    resumed.setup()
    assert r["net"].n_vjp == before  # scales and preconditioner came from the state: no products
    out = resumed.fit(max_steps=4, n_samples=8, tol=0.0)
    assert [t["a_new"] for t in out.trace] == [t["a_new"] for t in full.em_trace]
    assert resumed.a == full.a and resumed.sigma2 == full.sigma2
    with pytest.raises(CheckpointMismatch, match="version 1"):
        make().load_state_dict({"version": 0})
    # fit() called again continues the same EM: 2 + 2 steps equal 4 steps
    again = make()
    again.fit(max_steps=2, n_samples=8, tol=0.0)
    again.fit(max_steps=4, n_samples=8, tol=0.0)
    assert [t["a_new"] for t in again.em_trace] == [t["a_new"] for t in full.em_trace]


# ------------------------------------------------------------------------------------------ memory
def test_streaming_prediction_memory_does_not_grow_with_the_sample_count():
    """1024 samples of a 64² image: prediction through the posterior and SampleMoments allocates O(pixels × patch
    size) (chunks of 64 samples plus the running sums), not O(pixels × samples)."""
    g = torch.Generator().manual_seed(0)
    c, d, shape = 120, 24, (64, 64)
    feats = DenseFeatures(torch.randn(c, d, generator=g, dtype=torch.float64))
    to_image = torch.randn(d, shape[0] * shape[1], generator=g, dtype=torch.float64) / d**0.5
    post = LinearizedPosterior(
        feats,
        torch.randn(c, generator=g, dtype=torch.float64),
        prior="isotropic",
        likelihood=GaussianLikelihood(0.5),
        a=1.0,
        solver="exact_dual",
        output_map=lambda W: W @ to_image,
    ).setup()
    k, chunk, sizes = 1024, 64, (1, 2, 4)
    all_samples_bytes = k * shape[0] * shape[1] * 8

    def stream():
        acc = SampleMoments(shape, patch_sizes=sizes)
        for _, out, _ in post.sample_outputs(k, chunk_size=chunk, seed=0):
            acc.update(out.reshape(-1, *shape))
        return acc

    def keep_all():
        return torch.cat([out for _, out, _ in post.sample_outputs(k, chunk_size=chunk, seed=0)])

    acc = stream()
    assert acc.n_samples == k
    streamed, kept = peak_cpu_bytes(stream), peak_cpu_bytes(keep_all)
    sums_bytes = 8 * shape[0] * shape[1] * (1 + sum(p * p for p in sizes))
    # The streaming peak is the running sums plus a few chunk-sized temporaries; keeping every sample costs k/chunk
    # chunks. Bounds: below the sums + 8 chunks, and below a quarter of all samples; the control path exceeds all.
    assert streamed < sums_bytes + 8 * chunk * shape[0] * shape[1] * 8, (streamed, sums_bytes)
    assert streamed < all_samples_bytes / 4 < kept, (streamed, kept, all_samples_bytes)
