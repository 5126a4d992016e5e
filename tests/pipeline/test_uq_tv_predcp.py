"""The CT front end with ``uq.prior = tv_predcp`` (ctuq.pipeline.uq): the rate is uq.tv_predcp.scale per TV of the
reconstruction, the fitted block prior reaches the report and the run folder (trace figure), and the posterior std is
that of the dense float64 model with Ψ = TΦL at the fitted hyperparameters and the final a, σ²."""

import copy

import numpy as np
import pytest
import torch

from ctuq.geometry import ProjectionGeometry, VolumeGeometry
from ctuq.inference import DenseLinearGaussian
from ctuq.inference.priors import TVPredCPPrior
from ctuq.inference.priors.tv_predcp import anisotropic_tv
from ctuq.models import UNet, make_net_input
from ctuq.operators import SparseRayTransform
from ctuq.pipeline.uq import UQRun, UQSettings

SCALE = 3.0


@pytest.fixture(scope="module")
def problem():
    """16² image, 20 parallel angles × 24 detector pixels (c = 480), a U-Net with 3×3 and 1×1 convolutions."""
    torch.manual_seed(0)
    vol = VolumeGeometry((16, 16), 1.0)
    geom = ProjectionGeometry("parallel", (24,), angles=np.linspace(0, np.pi, 20, endpoint=False), det_spacing=0.8)
    op = SparseRayTransform(vol, geom)
    model = UNet(channels=(4, 4), skip_channels=(0, 2), norm_groups=2)
    net_input = make_net_input((16, 16), seed=1, std=1.0)
    yy, xx = np.mgrid[:16, :16] / 16 - 0.5
    x_true = torch.as_tensor(0.3 * ((xx**2 + yy**2) < 0.12), dtype=torch.float32)
    y = op(x_true) + 0.02 * torch.randn(geom.measurement_shape, generator=torch.Generator().manual_seed(2))
    return op, model, net_input, y


@pytest.mark.slow
def test_tv_predcp_run_matches_the_dense_block_prior_posterior(problem, tmp_path):
    op, model, net_input, y = problem
    settings = UQSettings(
        prior="tv_predcp",
        tv_predcp=TVPredCPPrior.Options(steps=5, probes=4, tv_samples=8, precond_rank=20),
        solver="exact",
        em_steps=2,
        samples=1024,
        sample_chunk=512,
        roi="full",
        patch_sizes=[1],
    )
    res = UQRun(
        model, net_input, op, y, scale=SCALE, settings=settings, work_dir=tmp_path, progress=False, keep_samples=True
    ).run()
    post = res.posterior
    prior = post.weight_prior
    assert isinstance(prior, TVPredCPPrior)
    assert prior.fitted and len(prior.trace) == 5 and (tmp_path / TVPredCPPrior.TRACE_FIGURE).is_file()
    assert res.stats["prior"]["prior"] == "tv_predcp" and len(res.stats["prior"]["trace"]) == 5
    conv = res.stats["prior"]["convergence"]  # the fit's convergence check reaches metrics.json
    assert conv["steps"] == 5 and conv["optimizer"] == "lbfgs" and isinstance(conv["converged"], bool)
    assert "gprior" not in res.stats
    with torch.no_grad():
        g0 = model(net_input).reshape(1, -1).double()
    tv = float(anisotropic_tv(g0, (16, 16)).abs().sum())
    assert prior.rate == pytest.approx(settings.tv_predcp.scale / tv, rel=1e-6)
    assert res.stats["prior"]["tv_reconstruction"] == pytest.approx(tv, rel=1e-6)
    # dense reference: Φ by autograd, Ψ = T Φ L, std = sqrt(diag(Φ L Σ Lᵀ Φᵀ)) / scale
    ref_model = copy.deepcopy(model).double().eval()
    names = [n for n, p in ref_model.named_parameters() if p.ndim > 1]
    params = {n: p.detach() for n, p in ref_model.named_parameters()}

    def g(*vs):
        return torch.func.functional_call(ref_model, {**params, **dict(zip(names, vs))}, (net_input.double(),)).reshape(
            -1
        )

    jac = torch.autograd.functional.jacobian(g, tuple(params[n] for n in names))
    Phi = torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)
    L = prior.apply(torch.eye(prior.d, dtype=torch.float64)).T
    T = torch.as_tensor(op.matrix.toarray())
    B = Phi @ L
    ref = DenseLinearGaussian(T @ B, torch.zeros(op.c, dtype=torch.float64))
    cov = torch.as_tensor(ref.posterior_covariance(post.a, post.sigma2))
    std_ref = torch.sqrt(torch.einsum("ij,jk,ik->i", B, cov, B)).reshape(16, 16) / SCALE
    # 1024 samples (seed 1): the std's relative sd is 1/√(2·1024) ≈ 2.2 % per pixel; the max over 256 pixels within 9 %
    rel = (res.std.double() - std_ref).abs() / std_ref
    assert float(rel.max()) < 0.09, float(rel.max())
