"""scripts/benchmark_ella_ct.py's ELLA variances of a CT posterior against a dense reference: with every direction
the landmark rows span (float64 ``Ψ``, all rows, ``K`` = the rank found) they are the exact posterior's pixel and
held-out row variances; with fewer directions they keep less. A 12² image, 8 parallel-beam angles × 18 detector pixels
(144 rows), a two-layer conv net of d = 54 weights (the script is network-agnostic)."""

import math

import numpy as np
import pytest
import torch
from tiny import load_script

from ctuq.data.rectangles import parallel_geometry, rectangles_image
from ctuq.inference import GaussianLikelihood, LinearizedFeatures, LinearizedPosterior, nystrom_basis
from ctuq.linearize import LinearizedNetwork
from ctuq.models import make_net_input
from ctuq.operators import SparseRayTransform

S, SCALE = 12, 14.0


@pytest.fixture(scope="module")
def problem():
    img, _ = rectangles_image(np.random.default_rng(0), S, supersampling=2)
    op = SparseRayTransform(*parallel_geometry(S, np.arange(8) * math.pi / 8))
    held = SparseRayTransform(*parallel_geometry(S, (np.arange(3) + 0.5) * math.pi / 3))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.LeakyReLU(0.2), torch.nn.Conv2d(3, 1, 3, padding=1)
    )
    net = LinearizedNetwork(model, make_net_input((S, S), seed=0))
    y = op(torch.from_numpy(img)).reshape(-1) * SCALE
    posterior = LinearizedPosterior(
        LinearizedFeatures(net, op.forward_flat, op.adjoint_flat, n_outputs=op.c),
        y,
        likelihood=GaussianLikelihood(0.05),
        a=3.0,
        solver="exact_primal",
    ).setup()
    # the dense reference: Φ (d_x × d) by JVPs of the identity, Σ = (ΨᵀΨ/σ² + a I)⁻¹ over the scaled weights
    with torch.no_grad():
        Phi = net.jvp(torch.eye(net.d, dtype=net.dtype)).double().T / SCALE
    Psi = posterior.features.matrix.double()
    cov = torch.linalg.inv(Psi.T @ Psi / 0.05 + 3.0 * torch.eye(net.d, dtype=torch.float64))
    B = Phi * posterior.scales.double()[None]
    pixel = ((B @ cov) * B).sum(1)
    return posterior, held, pixel, cov, B


def test_every_direction_gives_the_exact_variances_and_fewer_keep_less(problem):
    script = load_script("benchmark_ella_ct")
    posterior, held, pixel, cov, B = problem
    full = nystrom_basis(posterior.features, posterior.n_outputs, None, seed=0)
    # every direction Ψ has above round-off (eigenvalues of ΨΨᵀ above 1e-12 × the largest: singular values above 1e-6
    # × the largest); the rest of weight space is the LeakyReLU's rescaling symmetries, which move no pixel
    assert full.rank == torch.linalg.matrix_rank(posterior.features.matrix, rtol=1e-6) >= posterior.n_features - 3
    ella, rows, times = script.ella_variances(posterior, posterior.features, full, held, SCALE)
    # float32 network products: agreement to ~1e-4 relative
    np.testing.assert_allclose(ella, pixel.numpy(), rtol=2e-4, atol=1e-12 * float(pixel.max()))
    with torch.no_grad():
        TB = held.forward_flat(B.T.float()).double()  # (d, c_h): the held-out rays of each weight's image
    row_ref = ((cov @ TB) * TB).sum(0)
    np.testing.assert_allclose(rows, row_ref.numpy(), rtol=2e-4)
    assert set(times) == {"features", "images"}
    kept = [
        script.ella_variances(posterior, posterior.features, full.leading(k), held, SCALE)[0].sum() for k in (5, 20)
    ]
    assert kept[0] < kept[1] < ella.sum()


def test_matrix_free_features_are_the_posteriors(problem):
    """The products the script times are the assembled Ψ's (whitened, scaled), so its timing measures the same
    model."""
    script = load_script("benchmark_ella_ct")
    posterior = problem[0]
    _white, features = script.matrix_free(posterior)
    W = torch.randn(4, posterior.n_features, generator=torch.Generator().manual_seed(1), dtype=features.dtype)
    torch.testing.assert_close(
        features.matvec(W).double(), W.double() @ posterior.features.matrix.double().T, rtol=1e-4, atol=1e-5
    )
