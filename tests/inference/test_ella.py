"""ELLA's Nyström subspace (:mod:`ctuq.inference.ella`): the feature contract on ``Ψ V``, the exact posterior when
``V`` spans weight space, the approximation error falling with ``K`` and ``M`` against a dense reference, and the
one-line errors."""

import pytest
import torch
from torch import nn

from ctuq.inference import DenseFeatures, LinearizedFeatures, LinearizedPosterior
from ctuq.inference.ella import NystromBasis, ProjectedFeatures, ella_features, nystrom_basis
from ctuq.linearize import LinearizedNetwork
from ctuq.testing import FeatureContract


def _matrix(c, d, seed=0, decay=None):
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(c, d, generator=g, dtype=torch.float64)
    if decay is not None:  # columns of decaying scale: a spectrum like a network's tangent kernel
        M = M * decay ** torch.arange(d, dtype=torch.float64)
    return M


class TestProjectedDenseFeatures(FeatureContract):
    def make_features(self):
        Psi, V = _matrix(9, 7), _matrix(7, 3, seed=1)
        return ProjectedFeatures(DenseFeatures(Psi), V), Psi @ V


class TestProjectedLinearizedFeatures(FeatureContract):
    def make_features(self):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
        net = LinearizedNetwork(model, torch.randn(6, 3, dtype=torch.float64))
        F = LinearizedFeatures(net)
        basis = nystrom_basis(F, landmarks=10, rank=4, seed=3)
        return ProjectedFeatures(F, basis), F.to_dense() @ basis.V


def _exact_cov(Psi, a):
    return torch.linalg.inv(Psi.T @ Psi + a * torch.eye(Psi.shape[1], dtype=Psi.dtype))


def test_basis_is_orthonormal_and_spans_the_landmark_rows():
    Psi = _matrix(40, 12)
    b = nystrom_basis(DenseFeatures(Psi), landmarks=20, rank=12, seed=0)
    torch.testing.assert_close(b.V.T @ b.V, torch.eye(12, dtype=torch.float64), rtol=0, atol=1e-10)
    rows = Psi[b.rows]
    torch.testing.assert_close(rows @ b.V @ b.V.T, rows, rtol=0, atol=1e-9)  # the landmark rows lie in span(V)
    assert b.rank_found == 12 and torch.all(b.eigenvalues[:-1] >= b.eigenvalues[1:])
    assert b.rows.tolist() == nystrom_basis(DenseFeatures(Psi), 20, 12, seed=0).rows.tolist()  # seeded
    U = torch.randn(3, 12, dtype=torch.float64)
    torch.testing.assert_close(b.project(b.lift(U)), U)


def test_full_rank_subspace_gives_the_exact_posterior_through_the_core():
    """K = d (c ≥ d): ELLA's predictive covariance of new rows and the core's exact evidence equal the full model's
    to solver tolerance."""
    Psi, Psi_new, a = _matrix(40, 12), _matrix(5, 12, seed=7), 2.5
    y = _matrix(40, 1, seed=9).reshape(-1)
    b = nystrom_basis(DenseFeatures(Psi), landmarks=30, rank=12, seed=1)
    Phi = ella_features(DenseFeatures(Psi), b)
    torch.testing.assert_close(Phi.matrix, Psi @ b.V)
    post = LinearizedPosterior(Phi, y, prior="isotropic", a=a, solver="exact").setup()
    full = LinearizedPosterior(DenseFeatures(Psi), y, prior="isotropic", a=a, solver="exact").setup()
    assert post.log_evidence() == pytest.approx(full.log_evidence(), rel=1e-10)
    ella_cov = (Psi_new @ b.V) @ _exact_cov(Phi.matrix, a) @ (Psi_new @ b.V).T
    torch.testing.assert_close(ella_cov, Psi_new @ _exact_cov(Psi, a) @ Psi_new.T, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(b.lift(post.mean().reshape(1, -1)).reshape(-1), full.mean(), rtol=1e-8, atol=1e-10)


def test_the_approximation_error_falls_as_k_and_m_grow():
    """Relative error of the predictive variances of new rows against the exact linearised predictive (dense
    reference), on a decaying spectrum (seed 0): it falls as K grows at fixed M (to round-off at K = d) and as M
    grows at fixed K (better eigenvectors; what is left at M = c is the prior variance outside the K directions,
    which ELLA drops)."""
    Psi, Psi_new, a = _matrix(300, 60, decay=0.9), _matrix(50, 60, seed=5, decay=0.9), 1.0
    exact = (Psi_new @ _exact_cov(Psi, a) * Psi_new).sum(1)

    def error(m, k):
        b = nystrom_basis(DenseFeatures(Psi), landmarks=m, rank=k, seed=2)
        Phi = Psi @ b.V
        var = (Psi_new @ b.V @ _exact_cov(Phi, a) * (Psi_new @ b.V)).sum(1)
        return float(((var - exact).abs() / exact).mean())

    by_k = [error(60, k) for k in (5, 15, 30, 60)]
    by_m = [error(m, 30) for m in (30, 60, 150)]  # 0.13, 0.082, 0.078 on this machine
    assert all(x > y for x, y in zip(by_k, by_k[1:])) and by_k[-1] < 1e-8, by_k
    assert by_m[0] > by_m[1] > by_m[2], by_m


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(landmarks=3, rank=5), r"landmarks M = 3 must lie between the rank K = 5 and the 20 outputs"),
        (dict(landmarks=30, rank=5), r"landmarks M = 30 must lie between"),
        (dict(landmarks=10, rank=0), "rank K must be >= 1"),
        (dict(landmarks=15, rank=9), r"rank K = 9 exceeds the rank 8 of the 15 landmark rows"),
        (dict(landmarks=0, rank=2, rows=[1, 1, 2]), "rows must be at least K = 2 distinct indices in"),
    ],
)
def test_bad_sizes_are_one_line_errors(kwargs, message):
    Psi = _matrix(20, 8)  # rank 8
    with pytest.raises(ValueError, match=message):
        nystrom_basis(DenseFeatures(Psi), **kwargs)
    with pytest.raises(ValueError, match=r"NystromBasis.lift: U must be \(B, 8\)"):
        NystromBasis(torch.eye(8, dtype=torch.float64), torch.ones(8), torch.arange(8), 8).lift(torch.ones(2, 3))


def test_all_found_eigenpairs_and_their_leading_subsets():
    """``rank=None`` keeps every eigenpair the landmark rows span; :meth:`NystromBasis.leading` of it is the basis
    that ``rank=K`` builds on the same rows (the QR is nested in its columns), so a K sweep forms the rows once."""
    Psi = _matrix(40, 12, decay=0.7)
    F = DenseFeatures(Psi)
    full = nystrom_basis(F, landmarks=9, rank=None, seed=4)
    assert full.rank == full.rank_found == 9  # 9 rows of a rank-12 matrix span 9 directions
    for k in (1, 4, 9):
        direct = nystrom_basis(F, landmarks=9, rank=k, seed=4)
        sub = full.leading(k)
        assert sub.rank == k and sub.rows.tolist() == direct.rows.tolist()
        torch.testing.assert_close(sub.V, direct.V, rtol=0, atol=1e-10)
        torch.testing.assert_close(sub.eigenvalues, direct.eigenvalues)
    with pytest.raises(ValueError, match=r"NystromBasis.leading: rank must lie in \[1, 9\], got 10"):
        full.leading(10)
    with pytest.raises(ValueError, match="landmark rows of Ψ are all zero"):
        nystrom_basis(DenseFeatures(torch.zeros(6, 3, dtype=torch.float64)), landmarks=4, rank=None)
