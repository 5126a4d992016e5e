"""CT glue of the linearised inference (ctuq.pipeline.uq) against a dense float64 reference on a problem small enough to
assemble Φ: offset, g-prior, posterior std of every route (dense exact, dual exact, CG), EM fixed point,
checkpoint/resume."""

import copy

import numpy as np
import pytest
import torch

from ctuq.errors import CheckpointMismatch
from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.inference import DenseLinearGaussian
from ctuq.models import UNet, make_net_input
from ctuq.operators import SparseRayTransform
from ctuq.pipeline import checkpoints, ct_model
from ctuq.pipeline.run_folder import UQ_MOMENTS_NAME as MOMENTS_NAME
from ctuq.pipeline.run_folder import UQ_STATE_NAME as STATE_NAME
from ctuq.pipeline.uq import UQRun, UQSettings

SCALE = 3.0


@pytest.fixture(scope="module")
def problem():
    """16² image, 30 parallel angles × 32 detector pixels (c = 960), a U-Net with d = 676 conv weights (d < c)."""
    torch.manual_seed(0)
    vol = VolumeGeometry((16, 16), 1.0)
    geom = ProjectionGeometry("parallel", (32,), angles=np.linspace(0, np.pi, 30, endpoint=False), det_spacing=0.6)
    op = SparseRayTransform(vol, geom)
    model = UNet(channels=(4, 4), skip_channels=(0, 2), norm_groups=2)
    # Perturb the GroupNorm affine parameters so the held-fixed ones matter in the reference.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "weight" in name and p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    net_input = make_net_input((16, 16), seed=1, std=1.0)
    yy, xx = np.mgrid[:16, :16] / 16 - 0.5
    x_true = torch.as_tensor(0.3 * ((xx**2 + yy**2) < 0.12), dtype=torch.float32)
    y = op(x_true) + 0.02 * torch.randn(geom.measurement_shape, generator=torch.Generator().manual_seed(2))
    return op, model, net_input, y


def _reference(op, model, net_input, y):
    """Dense Φ (d_x × d) of the conv weights, A = TΦ, g-prior s, Ψ = A diag(s), ỹ = s·y + T(Φṽ − g(ṽ))."""
    ref_model = copy.deepcopy(model).double().eval()
    names = [n for n, p in ref_model.named_parameters() if p.ndim > 1]
    params = {n: p.detach() for n, p in ref_model.named_parameters()}
    x_in = net_input.double()

    def g(*vs):
        full = dict(params)
        full.update(dict(zip(names, vs)))
        return torch.func.functional_call(ref_model, full, (x_in,)).reshape(-1)

    v = [params[n] for n in names]
    jac = torch.autograd.functional.jacobian(g, tuple(v))
    Phi = torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)  # (d_x, d)
    v_flat = torch.cat([t.reshape(-1) for t in v])
    T = torch.as_tensor(op.matrix.toarray())
    A = T @ Phi
    s = 1.0 / A.norm(dim=0)
    Psi = A * s
    y_t = SCALE * y.double().reshape(-1) + T @ (Phi @ v_flat - g(*v).detach())
    return Phi, s, Psi, y_t


def _std_reference(Phi, s, Psi, a, sigma2):
    ref = DenseLinearGaussian(Psi, torch.zeros(Psi.shape[0], dtype=torch.float64))
    cov_w = torch.as_tensor(ref.posterior_covariance(a, sigma2))
    B = Phi * s
    return torch.sqrt(torch.einsum("ij,jk,ik->i", B, cov_w, B)) / SCALE


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["exact", "cg"])
def test_posterior_std_matches_the_dense_posterior(problem, solver):
    op, model, net_input, y = problem
    Phi, s, Psi, _ = _reference(op, model, net_input, y)
    a, sigma2 = 0.5, 0.05
    k = 2000 if solver == "exact" else 600  # CG pays ~2 products per sample and iteration
    settings = UQSettings(
        solver=solver,
        em_steps=0,
        prior_precision=a,
        noise_variance=sigma2,
        samples=k,
        sample_chunk=k,
        gprior={"method": "exact"},
        cg={"rank": 300, "rtol": 1e-5},
    )
    res = UQRun(model, net_input, op, y, scale=SCALE, settings=settings, seed=0, progress=False).run()
    assert res.stats["route"] == ("exact_primal" if solver == "exact" else "cg")
    expected = _std_reference(Phi, s, Psi, a, sigma2).reshape(16, 16).float()
    # A std estimated from k zero-mean Gaussian samples has relative sd ≈ 1/sqrt(2k) (1.6 % for k = 2000, 2.9 %
    # for 600): the median pixel must lie within 1.5 sd, every one of the 256 pixels within 4.5 sd (seed 0).
    sd = 1 / (2 * k) ** 0.5
    rel = (res.std / expected - 1).abs()
    assert float(rel.median()) < 1.5 * sd and float(rel.max()) < 4.5 * sd, (float(rel.median()), float(rel.max()))
    assert res.n_samples == k and res.moments.n_samples == k and res.std.shape == (16, 16)
    assert res.samples is None  # statistics stream: no samples are kept unless asked
    assert res.a == a and res.sigma2 == sigma2
    # the predictive mean is the DIP output (in image units)
    with torch.no_grad():
        assert torch.allclose(res.mean, model(net_input)[0, 0] / SCALE, atol=1e-6)


@pytest.mark.slow
def test_dual_exact_route_and_gprior_scales_match_reference(problem):
    op, model, net_input, y = problem
    Phi, s, Psi, y_t = _reference(op, model, net_input, y)
    # EM to convergence with the exact solver: the result is the exact MacKay fixed point of the dense model.
    settings = UQSettings(
        solver="exact",
        em_steps=200,
        em_tol=1e-9,
        prior_precision=1.0,
        noise_variance=0.1,
        learn_noise=True,
        samples=2,
        gprior={"method": "exact"},
    )
    res = UQRun(model, net_input, op, y, scale=SCALE, settings=settings, seed=0, progress=False).run()
    a_ref, s2_ref, _ = DenseLinearGaussian(Psi, y_t).em_fixed_point(1.0, 0.1, learn_noise=True, rtol=1e-11)
    assert res.a == pytest.approx(a_ref, rel=1e-4) and res.sigma2 == pytest.approx(s2_ref, rel=1e-4)
    assert res.stats["gprior"]["method"] == "exact" and res.em_trace[-1]["log_evidence"] is not None
    # The exact evidence increases monotonically along the MacKay/EM path.
    ev = [r["log_evidence"] for r in res.em_trace]
    assert all(b >= a - 1e-6 * abs(a) for a, b in zip(ev, ev[1:]))
    # Dual route (CG-free, c × c eigendecomposition) and sampled g-prior give the same fixed point.
    from ctuq.inference import ExactEigSolver, ScaledFeatures

    net, base = ct_model.ct_features(model, net_input, op)
    feats = ScaledFeatures(base, s.float())
    ex = ExactEigSolver(feats, side="dual")
    assert ex.gamma(a_ref, s2_ref) == pytest.approx(
        DenseLinearGaussian(Psi, y_t).effective_dimension(a_ref, s2_ref), rel=1e-3
    )
    stoch = UQRun(
        model,
        net_input,
        op,
        y,
        scale=SCALE,
        seed=0,
        progress=False,
        settings=UQSettings(
            solver="cg", gprior={"method": "stochastic", "probes": 16}, em_steps=0, samples=2, cg={"rank": 50}
        ),
    ).run()
    assert stoch.stats["gprior"]["method"] == "stochastic"


def test_offset_makes_the_linear_model_exact_at_the_dip_weights(problem):
    # At w = 0 the linear model predicts T g(ṽ): ỹ − Ψ·0 − δ = s·y, i.e. δ = T(Φṽ − g(ṽ)) (checked via the EM's
    # posterior-mean residual with a huge prior precision: w* → 0 and ‖ỹ − Ψw*‖² → ‖ỹ‖²).
    op, model, net_input, y = problem
    Phi, s, Psi, y_t = _reference(op, model, net_input, y)
    settings = UQSettings(
        solver="exact",
        em_steps=1,
        prior_precision=1e12,
        noise_variance=1.0,
        learn_noise=True,
        samples=2,
        gprior={"method": "exact"},
    )
    res = UQRun(model, net_input, op, y, scale=SCALE, settings=settings, seed=0, progress=False).run()
    c = op.c
    # σ²_new = ‖ỹ − Ψw*‖²/(c − γ) with γ ≈ 0, w* ≈ 0  ⇒  ‖ỹ‖²/c
    assert res.em_trace[0]["sigma2_new"] == pytest.approx(float(y_t @ y_t) / c, rel=1e-6)


class Stop(Exception):
    pass


def _interrupting_log(after: str):
    def log(msg):
        if msg.startswith(after):
            raise Stop(msg)

    return log


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["exact", "cg"])
def test_interrupted_inference_resumes_to_the_same_result(problem, tmp_path, monkeypatch, solver):
    op, model, net_input, y = problem
    settings = UQSettings(
        solver=solver,
        em_steps=3,
        em_tol=0.0,
        samples=40,
        sample_chunk=10,
        cg={"rank": 60},
        gprior={"method": "stochastic", "probes": 64},
    )

    def run(work_dir, settings=settings, **kwargs):
        return UQRun(
            model, net_input, op, y, scale=SCALE, settings=settings, seed=3, work_dir=work_dir, progress=False, **kwargs
        ).run()

    full = run(tmp_path / "full")
    work = tmp_path / "run"
    with pytest.raises(Stop):  # killed right after EM step 2 was checkpointed
        run(work, log=_interrupting_log("EM step 2"))
    assert (work / STATE_NAME).is_file()
    # Killed again during prediction, right after the running sums of the second chunk reached the disk.
    save = checkpoints.atomic_torch_save

    def save_then_stop(path, obj):
        save(path, obj)
        if str(path).endswith(MOMENTS_NAME) and obj["next_chunk"] == 2:
            raise Stop("after chunk 1")

    monkeypatch.setattr(checkpoints, "atomic_torch_save", save_then_stop)
    with pytest.raises(Stop):
        run(work, resume=True, moments_checkpoint_seconds=0)
    monkeypatch.setattr(checkpoints, "atomic_torch_save", save)
    messages = []
    resumed = run(work, resume=True, log=messages.append)
    assert any("reusing 2 of 4 sample chunks" in m for m in messages)
    assert resumed.a == full.a and resumed.sigma2 == full.sigma2
    assert [r["a_new"] for r in resumed.em_trace] == [r["a_new"] for r in full.em_trace]
    # Each chunk draws from its own generator and the sums run in chunk order: the resumed run is bitwise the same.
    assert torch.equal(resumed.std, full.std) and resumed.n_samples == full.n_samples == 40
    for key, value in full.moments.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed.moments.state_dict()[key], value), key
    # Resuming with other settings is refused, naming the setting.
    with pytest.raises(CheckpointMismatch, match="samples"):
        run(work, UQSettings(**{**settings.__dict__, "samples": 50}), resume=True)


def test_bad_settings_and_shapes_are_clear(problem):
    op, model, net_input, y = problem
    with pytest.raises(ValueError, match="uq.solver must be one of"):
        UQRun(model, net_input, op, y, settings=UQSettings(solver="magic")).run()
    with pytest.raises(ValueError, match="y has shape"):
        UQRun(model, net_input, op, y[:3]).run()
    with pytest.raises(ValueError, match="resume=True needs a work_dir"):
        UQRun(model, net_input, op, y, resume=True).run()
    with pytest.raises(ValueError, match="uq.samples must be >= 2"):
        UQRun(model, net_input, op, y, settings=UQSettings(samples=1)).run()


def test_checkpoint_of_another_version_is_refused_naming_it(problem, tmp_path):
    """A uq_state.pt of ctuq 0.1 (version 1, samples kept per chunk) cannot be resumed: the message names both
    versions and how to start afresh."""
    from ctuq.utils import atomic_torch_save

    op, model, net_input, y = problem
    atomic_torch_save(tmp_path / STATE_NAME, {"version": 1, "fingerprint": {}, "stage": "em", "em": {}})
    with pytest.raises(CheckpointMismatch, match=r"version 1.*reads version 2.*delete"):
        UQRun(
            model,
            net_input,
            op,
            y,
            scale=SCALE,
            seed=0,
            work_dir=tmp_path,
            resume=True,
            progress=False,
            settings=UQSettings(solver="exact", em_steps=0, samples=2),
        ).run()


# ------------------------------------------------------------------------------------------ per-ray noise
def _ray_variances(shape, seed=4):
    """Per-measurement variances (data units²) spread over a factor ≈ 12, like counts through thin and thick paths."""
    g = torch.Generator().manual_seed(seed)
    return 1e-4 * torch.exp(2.5 * torch.rand(shape, generator=g, dtype=torch.float64)).float()


@pytest.mark.slow
def test_per_ray_noise_reaches_the_diagonal_reference_fixed_point(problem):
    """uq.noise = per_ray: exact EM to convergence is MacKay's fixed point of the dense model with noise σ² D, D the
    variances normalised to mean 1 and the g-prior of the whitened features D^(−1/2) T Φ."""
    op, model, net_input, y = problem
    Phi, _, _, y_t = _reference(op, model, net_input, y)
    var = _ray_variances(tuple(op.measurement_shape))
    d = var.double().reshape(-1) / var.double().mean()
    A = torch.as_tensor(op.matrix.toarray()) @ Phi
    s_w = 1.0 / (A / d.sqrt()[:, None]).norm(dim=0)
    settings = UQSettings(
        solver="exact", em_steps=200, em_tol=1e-9, prior_precision=1.0, noise_variance=0.1, samples=2, noise="per_ray"
    )
    res = UQRun(model, net_input, op, y, scale=SCALE, settings=settings, seed=0, progress=False, variances=var).run()
    ref = DenseLinearGaussian(A * s_w, y_t, noise_variances=d)
    a_ref, s2_ref, _ = ref.em_fixed_point(1.0, 0.1, learn_noise=True, rtol=1e-11)
    assert res.a == pytest.approx(a_ref, rel=1e-4) and res.sigma2 == pytest.approx(s2_ref, rel=1e-4)
    assert res.em_trace[-1]["log_evidence"] == pytest.approx(
        ref.log_evidence(res.em_trace[-1]["a"], res.em_trace[-1]["sigma2"]), rel=2e-5
    )  # the run's Jacobians are float32: ~3e-6 relative of 178 nats (a, σ² above: 1e-4 as in the white case)
    torch.testing.assert_close(res.posterior.likelihood.variances, d, rtol=1e-12, atol=0)
    per_ray = res.stats["per_ray"]
    assert per_ray["implied_gain"] == pytest.approx(res.sigma2 / (SCALE**2 * float(var.double().mean())), rel=1e-12)
    assert per_ray["relative_variance_max"] / per_ray["relative_variance_min"] == pytest.approx(
        float(var.max() / var.min()), rel=1e-5
    )


def _noise_run(problem, noise, variances):
    """A short exact run with ``uq.noise = noise`` and the given per-measurement variances (or ``None``)."""
    op, model, net_input, y = problem
    settings = UQSettings(solver="exact", em_steps=3, samples=4, sample_chunk=4, noise=noise)
    return UQRun(model, net_input, op, y, scale=SCALE, settings=settings, progress=False, variances=variances).run()


@pytest.fixture(scope="module")
def plain(problem):
    """The homoscedastic run without variances: what every fallback must equal."""
    return _noise_run(problem, "homoscedastic", None)


@pytest.mark.slow
def test_homoscedastic_ignores_given_variances(problem, plain):
    given = _noise_run(problem, "homoscedastic", _ray_variances(problem[3].shape))
    assert plain.a == given.a and plain.sigma2 == given.sigma2 and torch.equal(plain.std, given.std)
    assert "per_ray" not in given.stats  # metrics.json of a homoscedastic run: the keys from before uq.noise existed
    noise = {"setting": "homoscedastic", "model": "homoscedastic", "reason": "uq.noise = homoscedastic"}
    assert given.stats["noise"] == noise


@pytest.mark.slow
def test_auto_noise_is_per_ray_with_usable_variances_and_homoscedastic_otherwise(problem, plain):
    """uq.noise = auto (the default) gives bit for bit the run of the model it resolves to: per_ray with the scan's
    variances, homoscedastic without them or when one of them is unusable (a fallback, named in the stats)."""
    var = _ray_variances(tuple(problem[0].measurement_shape))

    assert UQSettings().noise == "auto"
    auto, per_ray = _noise_run(problem, "auto", var), _noise_run(problem, "per_ray", var)
    assert auto.a == per_ray.a and auto.sigma2 == per_ray.sigma2 and torch.equal(auto.std, per_ray.std)
    assert auto.stats["noise"]["setting"] == "auto" and auto.stats["noise"]["model"] == "per_ray"
    assert "per_ray" in auto.stats
    bare = _noise_run(problem, "auto", None)
    assert bare.a == plain.a and bare.sigma2 == plain.sigma2 and torch.equal(bare.std, plain.std)
    assert (
        bare.stats["noise"]["model"] == "homoscedastic"
        and "no per-measurement variances" in bare.stats["noise"]["reason"]
    )
    broken = var.clone()
    broken[2, 5] = 0.0
    fallback = _noise_run(problem, "auto", broken)
    assert fallback.a == plain.a and torch.equal(fallback.std, plain.std)
    assert "not finite and positive" in fallback.stats["noise"]["reason"]


def test_bad_per_ray_settings_are_clear(problem):
    op, model, net_input, y = problem
    per_ray = UQSettings(noise="per_ray", samples=2)
    with pytest.raises(ValueError, match=r"uq.noise must be one of \['homoscedastic', 'per_ray', 'auto'\]"):
        UQRun(model, net_input, op, y, settings=UQSettings(noise="poisson")).run()
    with pytest.raises(ValueError, match=r"uq.noise = 'per_ray' needs the scan's per-measurement variances"):
        UQRun(model, net_input, op, y, settings=per_ray).run()
    with pytest.raises(ValueError, match=r"the variances have shape \(30, 31\), the sinogram \(30, 32\)"):
        UQRun(model, net_input, op, y, settings=per_ray, variances=torch.ones(30, 31)).run()
    bad = torch.ones(30, 32)
    bad[2, 5] = 0.0
    with pytest.raises(
        ValueError, match=r"1 measurement variances are not finite and positive \(first at flat index 69"
    ):
        UQRun(model, net_input, op, y, settings=per_ray, variances=bad).run()
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"first at flat index 69 of the \(30, 32\) sinogram: nan\)"):
        UQRun(model, net_input, op, y, settings=per_ray, variances=bad).run()
