"""Experimental design (``ctuq.design``) against dense references on problems small enough to assemble.

Sizes: 8×8 images, 12 parallel-beam candidate angles × 11 detector pixels (c̄ = 132), float64 unless stated.
"""

import math

import numpy as np
import pytest
import torch

from ctuq.design import factors
from ctuq.design.bordered import lower_gram
from ctuq.design.candidates import (
    DesignError,
    check_design_sizes,
    equidistant_angles,
    equidistant_indices,
    golden_indices,
    match_angles,
    random_indices,
    spread_mask,
)
from ctuq.design.criteria import (
    criteria_from_blocks,
    criteria_from_samples,
    dense_posterior_blocks,
    information_gain_bruteforce,
)
from ctuq.design.engine import BorderedCholesky, DesignEngine, auto_route
from ctuq.design.factors import DenseFactor, IdentityFactor, MaternFactor, matern_matrix
from ctuq.design.greedy import baseline_design, greedy_design
from ctuq.design.model import DesignModel
from ctuq.errors import CheckpointMismatch
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.inference import ExactEigSolver, draw_prior_and_noise, sample_posterior
from ctuq.operators import SparseRayTransform

H, N_ANG, K = 8, 12, 11


@pytest.fixture(scope="module")
def op():
    vol = VolumeGeometry((H, H), 1.0)
    geo = ProjectionGeometry("parallel", (K,), angles=np.arange(N_ANG) * math.pi / N_ANG, det_spacing=1.0)
    return SparseRayTransform(vol, geo, dtype=torch.float64)


def dense_model(op, d=20, seed=0, a=2.0, sigma2=0.3):
    g = torch.Generator().manual_seed(seed)
    Phi = torch.randn(H * H, d, generator=g, dtype=torch.float64)
    scales = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    return DesignModel(op, DenseFactor(Phi, (H, H)), scales, a, sigma2, image_prior="dense")


def dense_K(model):
    """The image prior covariance K = L diag(s)² Lᵀ / a of a model, dense."""
    f = model.factor
    if hasattr(f, "params"):  # a LinearizedNetwork: assemble Φ with d JVPs
        Phi = f.jvp(torch.eye(f.d, dtype=torch.float64)).T
        return (Phi * model.scales.pow(2)) @ Phi.T / model.a
    if isinstance(f, DenseFactor):
        return (f.matrix * model.scales.pow(2)) @ f.matrix.T / model.a
    if isinstance(f, MaternFactor):
        return torch.from_numpy(matern_matrix((H, H), f.lengthscale)) / model.a
    return torch.eye(H * H, dtype=torch.float64) / model.a


def network_model(op):
    """A small conv net through JVPs/VJPs (LinearizedNetwork as the factor; weight-space rows by VJPs)."""
    from ctuq.linearize import LinearizedNetwork

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv2d(3, 1, 3, padding=1))
    lin = LinearizedNetwork(net.double(), torch.randn(1, 1, H, H, dtype=torch.float64))
    scales = torch.rand(lin.d, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    return DesignModel(op, lin, scales, 1.5, 0.25, image_prior="network")


def image_space(model):
    """The same model forced onto the image-space (kernel-product) route."""
    model.weight_space = lambda *a, **k: False
    return model


MODELS = {
    "isotropic": lambda op: DesignModel(op, IdentityFactor((H, H), torch.float64), torch.ones(H * H), 2.0, 0.3),
    "matern": lambda op: DesignModel(op, MaternFactor((H, H), 3.0, torch.float64), torch.ones(4 * H * H), 0.5, 0.2),
    "dense": dense_model,
    "dense_image_space": lambda op: image_space(dense_model(op)),
    "network": network_model,
}


# ------------------------------------------------------------------------------------------------ factors
@pytest.mark.parametrize("ell", [1.0, 3.0, 8.0])
def test_matern_factor_reproduces_the_matern_matrix(ell):
    """Exact while the doubled-torus embedding is PSD (ℓ ≲ side/3); beyond, the nearest PSD circulant (clipped
    negative eigenvalues, reported) stays within a few % of the Matérn matrix."""
    f = MaternFactor((H, H), ell, dtype=torch.float64)
    L = f.jvp(torch.eye(f.d, dtype=torch.float64)).T  # (d_x, d)
    if ell < H / 2:
        assert f.clipped == 0.0
        np.testing.assert_allclose((L @ L.T).numpy(), matern_matrix((H, H), ell), atol=1e-10)
    else:
        assert 0 < f.clipped < 0.05
        np.testing.assert_allclose((L @ L.T).numpy(), matern_matrix((H, H), ell), atol=0.05)
    R = torch.randn(3, H * H, dtype=torch.float64)  # vjp is the exact adjoint
    W = torch.randn(3, f.d, dtype=torch.float64)
    assert torch.allclose((f.jvp(W) * R).sum(), (W * f.vjp(R)).sum())


# ------------------------------------------------------------------------------------------------ bordered update
def test_bordered_cholesky_equals_recomputation_and_serves_the_core_sampler(op):
    model = dense_model(op)
    blocks = [0, 4, 9]
    C = model.block_kernel(blocks, blocks) + model.sigma2 * torch.eye(len(blocks) * K, dtype=torch.float64)
    chol = BorderedCholesky(model.a, model.sigma2)
    for i in range(len(blocks)):  # grow block by block
        rows = slice(0, i * K)
        new = slice(i * K, (i + 1) * K)
        chol.append(C[rows, new], C[new, new])
    np.testing.assert_allclose(chol.L.numpy(), torch.linalg.cholesky(C).numpy(), atol=1e-10)
    # a reset from the lower triangle of the Gram of the rows, blockwise (the upper triangle is never read)
    G = lower_gram(model.weight_rows(blocks).double(), model.a, model.sigma2, rows=7)
    iu = torch.triu_indices(len(C), len(C), 1)
    G[iu[0], iu[1]] = float("nan")
    again = BorderedCholesky(model.a, model.sigma2)
    again.reset(G, block=K, lower=True)
    np.testing.assert_allclose(again.L.numpy(), chol.L.numpy(), atol=1e-10)
    rhs = torch.randn(5, C.shape[0], dtype=torch.float64)
    np.testing.assert_allclose(chol.solve_rows(rhs).numpy(), torch.linalg.solve(C, rhs.T).T.numpy(), atol=1e-10)
    # the core Matheron sampler gives the same samples with it as with its own exact solver
    feats = model.features(blocks)
    chol.bind(feats)
    a = sample_posterior(feats, chol, model.a, model.sigma2, 6, generator=torch.Generator().manual_seed(3))
    b = sample_posterior(
        feats, ExactEigSolver(feats), model.a, model.sigma2, 6, generator=torch.Generator().manual_seed(3)
    )
    assert torch.allclose(a.weights, b.weights, atol=1e-9)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_exact_route_equals_the_dense_reference(op, kind):
    model = MODELS[kind](op)
    eng = DesignEngine(model, route="exact")
    eng.reset([0, 6])
    eng.acquire(3, 1)
    eng.acquire(10, 2)
    T = op.matrix.toarray()
    ref = dense_posterior_blocks(dense_K(model).numpy(), T, model.rows([0, 6, 3, 10]).numpy(), model.sigma2, K)
    assert eng.weight_space == (kind in ("dense", "network"))
    assert np.abs(eng.M.numpy() - ref).max() <= 1e-9 * np.abs(ref).max()
    # the bordered factor is the Cholesky factor of the measurement covariance of the chosen rows
    C = model.block_kernel([0, 6, 3, 10], [0, 6, 3, 10]) + model.sigma2 * torch.eye(4 * K, dtype=torch.float64)
    np.testing.assert_allclose(eng.chol.L.numpy(), torch.linalg.cholesky(C).numpy(), atol=1e-9)


def test_dense_factor_projects_each_block_once(op, monkeypatch):
    """An assembled Jacobian projects a candidate block on first request and keeps it (T^β Φ on the factor): the
    rows of any candidate set, the g-prior column norms and the prior blocks equal the per-call sparse products
    (the fallback when T Φ does not fit in memory), and a block asked for again is not projected again."""
    from ctuq.design.factors import project_rows

    model = dense_model(op)
    blocks = [7, 2, 9, 2]
    ref = project_rows(model.factor, op.subset(blocks))
    torch.testing.assert_close(model.projected_rows(blocks), ref, rtol=1e-12, atol=1e-12)
    store = model.factor._projection[1]
    assert sorted(store.slots) == [2, 7, 9] and store.n_projected == 3  # only the blocks asked for, each once
    assert store.capacity == op.n_angles  # room for every candidate
    store.buf[:K] = 0.0  # block 7, the first kept: read back, not projected again
    assert float(model.projected_rows([7]).abs().max()) == 0.0 and store.n_projected == 3
    model = dense_model(op)
    torch.testing.assert_close(model.column_sq_norms(blocks), ref.pow(2).sum(0), rtol=1e-12, atol=1e-12)
    # no room for T Φ: nothing kept, the same numbers from sparse products
    small = dense_model(op)
    with monkeypatch.context() as m:
        m.setattr(factors, "memory_budget", lambda purpose, device: 0)
        assert small.factor.projected_blocks(op, [0]) is None
    torch.testing.assert_close(small.projected_rows(blocks), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(small.prior_blocks(), model.prior_blocks(), rtol=1e-12, atol=1e-12)


def test_column_sq_norms_cache_projects_only_new_blocks(op, monkeypatch):
    """A g-prior refresh with the block cache projects only the blocks not seen before (a network through VJPs:
    one VJP per row) and gives the sums of projecting all chosen blocks anew, to rounding (float64, rtol 1e-12)."""
    model = network_model(op)
    ref_model = model.with_updates()  # the same Φ, no cache, not watched
    asked = []
    project = model.projected_rows
    monkeypatch.setattr(model, "projected_rows", lambda blocks: asked.append(list(blocks)) or project(blocks))
    cache = {}
    first = model.column_sq_norms([0, 6, 3], cache=cache)
    assert asked == [[0, 6, 3]] and sorted(cache) == [0, 3, 6]
    asked.clear()
    grown = model.column_sq_norms([0, 6, 3, 10, 1], cache=cache)
    assert asked == [[10, 1]]
    torch.testing.assert_close(first, ref_model.column_sq_norms([0, 6, 3]), rtol=1e-12, atol=0.0)
    torch.testing.assert_close(grown, ref_model.column_sq_norms([0, 6, 3, 10, 1]), rtol=1e-12, atol=0.0)
    assert float(grown.sub(first).min()) >= 0.0 and float(grown.sub(first).max()) > 0.0


def test_block_row_store_projects_each_block_once(op, monkeypatch):
    """A network's rows T^β L are projected (one VJP per row) the first time a block is asked for and read back
    after; the chosen blocks in order come back as a view of the first slots; a request that does not fit is
    answered without keeping anything; the numbers are those of projecting anew (float64 network, rtol 1e-12)."""
    from ctuq.design.factors import BlockRowStore, project_rows

    model = network_model(op)
    ref = lambda blocks: project_rows(model.factor, op.subset(blocks))  # noqa: E731
    store = BlockRowStore(4, K, model.d, torch.float64)
    kept = model.with_updates(row_store=store)
    torch.testing.assert_close(kept.projected_rows([0, 6, 3]), ref([0, 6, 3]), rtol=1e-12, atol=1e-12)
    assert store.n_projected == 3 and kept.with_updates(a=9.0).row_store is store
    got = kept.projected_rows([0, 6, 3, 10])
    assert store.n_projected == 4 and got.data_ptr() == store.buf.data_ptr()  # a view, no copy
    torch.testing.assert_close(kept.projected_rows([10, 0, 10]), ref([10, 0, 10]), rtol=1e-12, atol=1e-12)
    assert store.n_projected == 4
    torch.testing.assert_close(kept.projected_rows([1, 6, 2]), ref([1, 6, 2]), rtol=1e-12, atol=1e-12)
    assert store.n_projected == 6 and sorted(store.slots) == [0, 3, 6, 10]  # full: 1 and 2 not kept
    with pytest.raises(ValueError, match="capacity"):
        BlockRowStore(0, K, model.d)
    # an image-space design with kept rows factorises C_τ from them: the Cholesky factor of T^τ K T^τᵀ + σ²I
    eng = DesignEngine(image_space(kept), route="sampled", n_samples=4)
    with monkeypatch.context() as mp:  # not through block_kernel's float64 product
        mp.setattr(DesignModel, "block_kernel", lambda *a, **k: pytest.fail("block_kernel called"))
        eng.reset([0, 6, 3, 10])
    C = model.block_kernel([0, 6, 3, 10], [0, 6, 3, 10]) + model.sigma2 * torch.eye(4 * K, dtype=torch.float64)
    np.testing.assert_allclose(eng.chol.L.numpy(), torch.linalg.cholesky(C).numpy(), atol=1e-9)
    assert store.n_projected == 6


def test_sequential_sample_update_equals_conditioning_on_all_rows_at_once(op):
    """Pathwise conditioning block by block (engine) == the core sampler's formula on all rows, same draws."""
    model = dense_model(op)
    m = 16
    eng = DesignEngine(model, route="sampled", n_samples=m, seed=5, sample_chunk=m)
    eng.reset([0, 6])
    eng.acquire(3, 1)
    # the same w₀ and ε the engine drew: chunk 0 of the reset's stream, then the step's noise stream
    from ctuq.inference.sampler import chunk_generator

    feats = model.features([0, 6])
    w0, eps_p = draw_prior_and_noise(m, feats, model.a, model.sigma2, chunk_generator(eng.chunk_seed() - 1, 0))
    eps_b = torch.randn((m, K), generator=chunk_generator(5 + 7919, 1), dtype=torch.float64) * model.sigma2**0.5
    Psi = model.factor.matrix * model.scales  # image-space features L diag(s)
    T = torch.from_numpy(op.matrix.toarray())
    P_all = T @ Psi
    rows = model.rows([0, 6, 3])
    Pt = P_all[rows]
    C = Pt @ Pt.T / model.a + model.sigma2 * torch.eye(len(rows), dtype=torch.float64)
    eps = torch.cat([eps_p, eps_b], dim=1)
    zeta = w0 + torch.linalg.solve(C, (eps - w0 @ Pt.T).T).T @ Pt / model.a
    expected = (zeta @ P_all.T).reshape(m, N_ANG, K)
    assert torch.allclose(eng.Y.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


# ------------------------------------------------------------------------------------------------ criteria
def test_sampled_criteria_match_the_exact_ones(op):
    """m = 4000 samples (seed 0): ESE within 5·√(2/m) relative, EIG within 3 % relative, same argmax."""
    model = dense_model(op)
    ex = DesignEngine(model, route="exact")
    sa = DesignEngine(model, route="sampled", n_samples=4000, seed=0, sample_chunk=1000)
    for eng in (ex, sa):
        eng.reset([0, 6])
    for crit, tol in (("ese", 5 * math.sqrt(2 / 4000)), ("eig", 0.03), ("diag_eig", 0.03)):
        v_ex, _ = ex.criteria(crit, jitter=0.0)
        v_sa, _ = sa.criteria(crit, jitter=0.0)
        left = torch.isfinite(v_ex)
        rel = ((v_sa[left] - v_ex[left]).abs() / v_ex[left].abs()).max()
        assert rel <= tol, (crit, float(rel))
        assert int(v_sa.argmax()) == int(v_ex.argmax())


def test_first_greedy_pick_is_the_brute_force_argmax(op):
    """EIG (no jitter) = the information gain by entropy difference in weight space, for every candidate."""
    model = dense_model(op)
    eng = DesignEngine(model, route="exact")
    res = greedy_design(eng, [0, 6], 1, criterion="eig", angles_deg=np.arange(N_ANG) * 15.0, jitter=0.0, progress=False)
    Psi = torch.from_numpy(op.matrix.toarray()) @ (model.factor.matrix * model.scales)
    pilot_rows = model.rows([0, 6]).numpy()
    gains = [
        information_gain_bruteforce(Psi.numpy(), pilot_rows, model.rows([b]).numpy(), model.a, model.sigma2)
        if b not in (0, 6)
        else -np.inf
        for b in range(N_ANG)
    ]
    assert res.acquired[0] == int(np.argmax(gains))
    values = np.array([-np.inf if v is None else v for v in res.steps[0]["values"]])
    np.testing.assert_allclose(values[np.isfinite(values)], np.array(gains)[np.isfinite(gains)], rtol=1e-9)


def test_ranking_invariances(op):
    """Prior × c and σ² × c together: EIG values unchanged, ESE × c. Prior scale alone: ESE ranking unchanged when
    σ² is negligible (K_{x|y} linear in K); with noise it depends on σ²/c (not asserted)."""
    base = dense_model(op)
    c = 7.3
    scaled = base.with_updates(a=base.a / c, sigma2=base.sigma2 * c)
    for crit in ("eig", "ese", "diag_eig"):
        e1, e2 = DesignEngine(base, route="exact"), DesignEngine(scaled, route="exact")
        e1.reset([0, 6])
        e2.reset([0, 6])
        v1, v2 = e1.criteria(crit, 0.01)[0], e2.criteria(crit, 0.01)[0]
        f = torch.isfinite(v1)
        if crit == "ese":
            assert torch.allclose(v2[f], c * v1[f], rtol=1e-9)
        else:
            assert torch.allclose(v2[f], v1[f], rtol=1e-9)
        assert torch.equal(torch.argsort(v1[f]), torch.argsort(v2[f]))
    quiet = base.with_updates(sigma2=1e-10)
    louder_prior = quiet.with_updates(a=quiet.a / 50.0)
    e1, e2 = DesignEngine(quiet, route="exact"), DesignEngine(louder_prior, route="exact")
    e1.reset([0, 6])
    e2.reset([0, 6])
    v1, v2 = e1.criteria("ese", 0.0)[0], e2.criteria("ese", 0.0)[0]
    f = torch.isfinite(v1)
    assert torch.equal(torch.argsort(v1[f]), torch.argsort(v2[f]))
    assert torch.allclose(v2[f], 50.0 * v1[f], rtol=1e-5)


def test_criteria_from_samples_small_m_uses_the_gram_matrix():
    Y = torch.randn(3, 5, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # m = 3 < k = 9
    M = torch.einsum("mnk,mnl->nkl", Y, Y) / 3
    for crit in ("eig", "ese", "diag_eig"):
        a, _ = criteria_from_samples(Y, 0.5, crit, jitter=0.0)
        b, _ = criteria_from_blocks(M, 0.5, crit, jitter=0.0)
        assert torch.allclose(a, b, rtol=1e-10)


# ------------------------------------------------------------------------------------------------ loop, resume
def test_greedy_resume_replays_and_continues_like_an_uninterrupted_design(op, tmp_path):
    model = dense_model(op)
    kw = dict(
        criterion="eig",
        angles_deg=np.arange(N_ANG) * 15.0,
        jitter=0.01,
        progress=False,
        fingerprint={"problem": "test"},
    )
    full = greedy_design(DesignEngine(model, "sampled", n_samples=64, seed=2), [0, 6], 5, **kw)
    ck = tmp_path / "state.pt"
    greedy_design(DesignEngine(model, "sampled", n_samples=64, seed=2), [0, 6], 3, checkpoint=ck, **kw)
    resumed = greedy_design(DesignEngine(model, "sampled", n_samples=64, seed=2), [0, 6], 5, checkpoint=ck, **kw)
    assert resumed.resumed_steps == 3
    assert resumed.acquired == full.acquired
    np.testing.assert_allclose([s["criterion"] for s in resumed.steps], [s["criterion"] for s in full.steps], rtol=1e-5)
    with pytest.raises(CheckpointMismatch, match="pilot"):
        greedy_design(DesignEngine(model, "sampled", n_samples=64, seed=2), [0, 5], 5, checkpoint=ck, **kw)


def test_refreshing_updater_resets_the_engine(op):
    model = dense_model(op)
    calls = []

    def updater(engine, n, chosen, replay):
        calls.append((n, list(chosen)))
        return engine.model.with_updates(a=engine.model.a * 2) if n == 2 else None

    kw = dict(criterion="ese", angles_deg=np.arange(N_ANG), jitter=0.0, updater=updater, progress=False)
    eng = DesignEngine(model, "sampled", n_samples=32, seed=0)
    greedy_design(eng, [0], 3, **kw)
    assert [n for n, _ in calls] == [1, 2] and eng.model.a == pytest.approx(2 * model.a)
    assert eng.n_resets == 2 and eng.chol.size == 4 * K
    # after the last acquisition only on request: it changes no choice of this design
    calls.clear()
    eng = DesignEngine(model, "sampled", n_samples=32, seed=0)
    first = greedy_design(eng, [0], 2, **kw)
    assert [n for n, _ in calls] == [1] and eng.n_resets == 1 and eng.model.a == model.a
    calls.clear()
    eng = DesignEngine(model, "sampled", n_samples=32, seed=0)
    again = greedy_design(eng, [0], 2, update_last=True, **kw)
    assert [n for n, _ in calls] == [1, 2] and again.chosen == first.chosen
    # the samples of the refresh after the last step are drawn only when needed (a std map does not need them)
    assert eng.Y is None and eng.posterior_std(8).shape == (model.d_x,) and eng.Y is None
    lazy, eager = (
        DesignEngine(model, "sampled", n_samples=32, seed=0),
        DesignEngine(model, "sampled", n_samples=32, seed=0),
    )
    lazy.reset([0, 3])
    eager.reset([0, 3])
    eager.prepare()
    torch.testing.assert_close(lazy.criteria("eig", 0.01)[0], eager.criteria("eig", 0.01)[0], rtol=0, atol=0)
    lazy2 = DesignEngine(model, "sampled", n_samples=32, seed=0)
    lazy2.reset([0, 3])
    lazy2.acquire(5, 1)  # drawn before β joins the kept rows and the factor
    eager.acquire(5, 1)
    torch.testing.assert_close(lazy2.Y, eager.Y, rtol=0, atol=0)
    assert auto_route(model, refreshed=True) == "sampled" and auto_route(model, refreshed=False) == "exact"


# ------------------------------------------------------------------------------------------------ baselines, input
def test_equidistant_and_random_baselines():
    assert equidistant_indices(200, 5).tolist() == [0, 40, 80, 120, 160]
    assert equidistant_indices(200, 40).tolist() == list(range(0, 200, 5))
    assert len(set(equidistant_indices(200, 35).tolist())) == 35
    np.testing.assert_allclose(np.degrees(equidistant_angles(4)), [0, 45, 90, 135])
    res = baseline_design("equidistant", 200, [0, 40, 80, 120, 160], 5, angles_deg=np.arange(200) * 0.9)
    assert res.acquired == [20, 60, 100, 140, 180]  # halfway between the pilot angles
    r1 = random_indices(200, 35, exclude=[0, 40], seed=1)
    assert len(set(r1.tolist())) == 35 and not set(r1.tolist()) & {0, 40}
    assert r1.tolist() == random_indices(200, 35, exclude=[0, 40], seed=1).tolist()
    assert r1.tolist() != random_indices(200, 35, exclude=[0, 40], seed=2).tolist()
    counts = np.bincount(np.concatenate([random_indices(10, 3, seed=s) for s in range(3000)]), minlength=10)
    assert counts.min() > 0.8 * counts.mean()  # uniform: each index ≈ 900 times (seeds 0…2999)


def test_golden_angle_baseline_spreads_every_prefix():
    """The golden-angle sequence: distinct candidates, every prefix's largest gap within 2.6× the equidistant spacing
    (the three-gap theorem bounds it by 1/0.618² = 2.62× before snapping to the grid), the baseline continuing it
    after a pilot without repeating a pilot angle."""
    n = 120
    g = golden_indices(n, n)
    assert sorted(g.tolist()) == list(range(n)) and g[:4].tolist() == [0, 74, 28, 102]
    for k in range(3, 81):
        s = np.sort(g[:k])
        widest = np.diff(np.r_[s, s[0] + n]).max()
        assert widest <= 2.62 * n / k + 1, k
    res = baseline_design("golden", n, [0, 60], 5, angles_deg=np.arange(n) * 1.5)
    assert res.acquired == [74, 28, 102, 57, 11] and not {0, 60} & set(res.acquired)
    with pytest.raises(DesignError, match="golden: cannot take 0 of 120"):
        golden_indices(n, 0)


def test_spread_mask_allows_only_the_wide_gaps():
    free = spread_mask([0, 10, 60], 120, 0.0)
    assert free.sum() == 117 and not free[[0, 10, 60]].any()
    # gaps 10, 50 and 60 wide: spread 0.5 keeps the last two (≥ 30), spread 1 only the widest (60 → 119)
    assert np.flatnonzero(spread_mask([0, 10, 60], 120, 0.5)).tolist() == [*range(11, 60), *range(61, 120)]
    assert np.flatnonzero(spread_mask([0, 10, 60], 120, 1.0)).tolist() == list(range(61, 120))
    assert spread_mask([5], 12, 1.0).sum() == 11  # one angle: the whole circle is one gap
    with pytest.raises(DesignError, match=r"design.spread must be in \[0, 1\], got 1.5"):
        spread_mask([0], 12, 1.5)


def test_greedy_design_with_spread_takes_its_angles_in_the_widest_gaps(op):
    """``spread = 1``: every acquisition lies in a widest gap of the angles before it, so no gap of the design is
    ever wider than the widest after the pilot; the criterion still chooses within the gap (the first pick is the
    argmax over that gap), and the fingerprint keeps a plain design from resuming a spread one."""
    model = dense_model(op)
    kw = dict(criterion="eig", angles_deg=np.arange(N_ANG) * 15.0, jitter=0.0, progress=False)
    res = greedy_design(DesignEngine(model, "exact"), [0, 3], 5, spread=1.0, **kw)
    chosen = [0, 3]
    for step in res.steps:
        assert spread_mask(chosen, N_ANG, 1.0)[step["candidate"]], (chosen, step["candidate"])
        assert step["allowed"] == int(spread_mask(chosen, N_ANG, 1.0).sum())
        chosen.append(step["candidate"])
    first = np.array([-np.inf if v is None else v for v in res.steps[0]["values"]])
    allowed = spread_mask([0, 3], N_ANG, 1.0)
    assert res.acquired[0] == int(np.flatnonzero(allowed)[np.argmax(first[allowed])])
    plain = greedy_design(DesignEngine(model, "exact"), [0, 3], 5, **kw)
    assert "allowed" not in plain.steps[0] and plain.acquired != res.acquired
    with pytest.raises(DesignError, match="design.spread must be in"):
        greedy_design(DesignEngine(model, "exact"), [0, 3], 1, spread=-0.1, **kw)


def test_bad_design_inputs_name_the_option():
    with pytest.raises(DesignError, match="--pilot: 30 pilot angles but only 24 candidate"):
        check_design_sizes(24, 30, 2)
    with pytest.raises(DesignError, match="--acquire: must be at least 1"):
        check_design_sizes(24, 4, 0)
    with pytest.raises(DesignError, match="--acquire: 30 angles after a 4-angle pilot exceed"):
        check_design_sizes(24, 4, 30)
    cand = np.radians(np.arange(0, 180, 15.0))
    assert match_angles([15.0, 225.0], cand, math.pi, what="x").tolist() == [1, 3]  # modulo the period
    with pytest.raises(DesignError, match="pilot's geometry must be part of the candidate set"):
        match_angles([7.0], cand, math.pi, what="--pilot-angles")
    with pytest.raises(DesignError, match="given twice"):
        match_angles([15.0, 15.0], cand, math.pi, what="--pilot-angles")
