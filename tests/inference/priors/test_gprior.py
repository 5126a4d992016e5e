"""ctuq.inference.priors.gprior: g-prior scales (exact, stochastic, isotropic) against a dense Jacobian; kernel
diagonal."""

import math

import pytest
import torch

from ctuq.inference import DenseFeatures, LinearizedFeatures, ScaledFeatures, kernel_diagonal
from ctuq.inference.priors import column_sq_norms, gprior_scales, isotropic_scales, scales_from_sq_norms
from ctuq.linearize import LinearizedNetwork
from ctuq.models import build_unet, make_net_input


@pytest.fixture(scope="module")
def jac_case():
    """A = L Φ for a float64 tiny U-Net at 8×8 (Φ: 64 × 5008) and a random L (20 × 64)."""
    torch.manual_seed(0)
    model = build_unet("tiny").double()
    net = LinearizedNetwork(model, make_net_input((8, 8), seed=1).double(), mode="recompute")
    J = net.vjp(torch.eye(net.d_out, dtype=torch.float64))  # rows Φᵀe_j: the dense Jacobian (d_out × d)
    L = torch.randn(20, net.d_out, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    return net, J, L


def test_exact_gprior_scales_match_dense(jac_case):
    net, J, L = jac_case
    A = L @ J
    net.reset_counters()
    s = gprior_scales(lambda R: net.vjp(R @ L), 20, method="exact", chunk_size=7, dtype=torch.float64)
    assert net.n_vjp == 20  # exactly c VJPs, chunking included
    expected = 1.0 / A.norm(dim=0)
    assert s.shape == (net.d,) and s.dtype == torch.float64
    torch.testing.assert_close(s, expected, rtol=1e-10, atol=0)
    # With these scales every column of Ψ = A diag(s) has unit norm.
    torch.testing.assert_close((A * s).norm(dim=0), torch.ones(net.d, dtype=torch.float64), rtol=1e-10, atol=0)


def test_stochastic_gprior_scales_within_stated_tolerance(jac_case):
    net, J, L = jac_case
    A = L @ J
    m = 400
    gen = torch.Generator().manual_seed(0)  # fixed seed
    net.reset_counters()
    s = gprior_scales(
        lambda R: net.vjp(R @ L),
        20,
        method="stochastic",
        n_probes=m,
        generator=gen,
        chunk_size=100,
        dtype=torch.float64,
    )
    assert net.n_vjp == m
    exact = 1.0 / A.norm(dim=0)
    rel = (s / exact - 1).abs()
    # Relative std of ŝ_i is at most sqrt(1/(2m)) = 0.035 for m = 400 (module docstring); 5 standard deviations
    # bound every one of the 5008 columns.
    assert float(rel.max()) < 5 * math.sqrt(1 / (2 * m)), float(rel.max())
    # Unbiased norms: averaged over columns the squared-norm ratio is 1 to within the shared-probe noise.
    sq = column_sq_norms(lambda R: R @ A, 20, method="stochastic", n_probes=m, seed=1, dtype=torch.float64)
    assert abs(float((sq / A.pow(2).sum(0)).mean()) - 1) < 5 * math.sqrt(2 / m)


def test_stochastic_is_reproducible_and_seeded(jac_case):
    _, J, L = jac_case
    A = (L @ J)[:, :50]
    f = lambda R: R @ A  # noqa: E731
    s1 = gprior_scales(f, 20, method="stochastic", n_probes=16, seed=3, dtype=torch.float64)
    s2 = gprior_scales(
        f, 20, method="stochastic", n_probes=16, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    s3 = gprior_scales(f, 20, method="stochastic", n_probes=16, seed=4, dtype=torch.float64)
    torch.testing.assert_close(s1, s2, rtol=0, atol=0)
    assert not torch.equal(s1, s3)


def test_zero_norm_columns_give_finite_scales():
    A = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 2.0]], dtype=torch.float64)
    f = lambda R: R @ A  # noqa: E731
    for method in ("exact", "stochastic"):
        s = gprior_scales(f, 2, method=method, n_probes=64, seed=0, dtype=torch.float64)
        assert torch.isfinite(s).all()
        assert float(s[1]) == 0.0  # no influence: removed from the model
    s = gprior_scales(f, 2, method="exact", zero_norm_value=7.0, dtype=torch.float64)
    torch.testing.assert_close(s, torch.tensor([1.0, 7.0, 1 / math.sqrt(8)], dtype=torch.float64))
    # zero_tol treats numerically negligible columns as zero too.
    s = scales_from_sq_norms(torch.tensor([1.0, 1e-20, 4.0], dtype=torch.float64), zero_tol=1e-12)
    torch.testing.assert_close(s, torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64))
    # The choice cannot affect inference: the column of Ψ = A diag(s) is zero either way.
    assert float((A * s[None].expand(2, 3))[:, 1].abs().max()) == 0.0


def test_floor_is_a_ridge_on_the_nonzero_squared_norms():
    n = torch.tensor([1e-8, 0.0, 1.0, 4.0, 9.0], dtype=torch.float64)  # non-zero median: 1.0 (the lower middle)
    s = scales_from_sq_norms(n, floor=0.5)
    expected = torch.tensor([(1e-8 + 0.5) ** -0.5, 0.0, 1.5**-0.5, 4.5**-0.5, 9.5**-0.5], dtype=torch.float64)
    torch.testing.assert_close(s, expected, rtol=1e-15, atol=0)
    # a barely reached column no longer gets a scale 10⁴ times the others: at most 1/√(δ·median)
    assert float(scales_from_sq_norms(n)[0]) == pytest.approx(1e4)
    assert float(s.max()) <= 0.5**-0.5
    torch.testing.assert_close(scales_from_sq_norms(n, floor=0.0), scales_from_sq_norms(n), rtol=0, atol=0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="floor must be finite and >= 0"):
            scales_from_sq_norms(n, floor=bad)
    # gprior_scales passes the ridge through, on either route (the probes' estimate is floored, not its scales)
    A = torch.tensor([[1.0, 0.0, 2.0, 1e-3], [0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    f = lambda R: R @ A  # noqa: E731
    for method in ("exact", "stochastic"):
        kw = {"method": method, "n_probes": 16, "seed": 0, "dtype": torch.float64}
        torch.testing.assert_close(
            gprior_scales(f, 2, floor=0.5, **kw), scales_from_sq_norms(column_sq_norms(f, 2, **kw), floor=0.5)
        )


def test_isotropic_and_errors():
    s = gprior_scales(None, method="isotropic", n_features=5, dtype=torch.float64)
    torch.testing.assert_close(s, torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(isotropic_scales(3), torch.ones(3))
    with pytest.raises(ValueError, match="method"):
        column_sq_norms(lambda R: R, 3, method="hutchinson")
    with pytest.raises(ValueError, match="n_rows"):
        column_sq_norms(lambda R: R, 0)
    with pytest.raises(ValueError, match=r"A_rmatvec must map \(B, 3\) to \(B, d\)"):
        column_sq_norms(lambda R: R.sum(1), 3)
    with pytest.raises(ValueError, match="n_features=4"):
        gprior_scales(lambda R: R, 3, n_features=4)
    with pytest.raises(ValueError, match="needs A_rmatvec"):
        gprior_scales(None, 3, method="exact")
    with pytest.raises(ValueError, match="finite and >= 0"):
        scales_from_sq_norms(torch.tensor([1.0, float("nan")]))


def test_kernel_diagonal_exact_and_stochastic(jac_case):
    net, J, L = jac_case
    s = gprior_scales(lambda R: net.vjp(R @ L), 20, method="exact", dtype=torch.float64)
    feats = ScaledFeatures(LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L), s)
    Psi = (L @ J) * s
    expected = (Psi**2).sum(1)
    torch.testing.assert_close(kernel_diagonal(feats, method="exact", chunk_size=6), expected, rtol=1e-10, atol=0)
    m = 400
    est = kernel_diagonal(DenseFeatures(Psi), method="stochastic", n_probes=m, seed=0)  # fixed seed
    # Relative std <= sqrt(2/m) = 0.071 per entry; 5 standard deviations over 20 entries.
    assert float((est / expected - 1).abs().max()) < 5 * math.sqrt(2 / m)
