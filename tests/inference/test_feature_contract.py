"""The feature-operator contract (:class:`ctuq.testing.FeatureContract`) over every implementation in
:mod:`ctuq.inference.features`, including a linearised tiny network."""

import pytest
import torch
from torch import nn

from ctuq.inference import (
    DenseFeatures,
    LinearizedFeatures,
    RowSubsetFeatures,
    ScaledFeatures,
    StackedFeatures,
    stack_features,
)
from ctuq.inference.features import RowScaledFeatures
from ctuq.linearize import LinearizedNetwork
from ctuq.testing import FeatureContract


def _matrix(c=9, d=7, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(c, d, generator=g, dtype=torch.float64).to(dtype)


def _scales(d, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(d, generator=g, dtype=torch.float64) + 0.5


def _tiny_network():
    """A 3-5-2 tanh MLP on 4 inputs (d = 25 linearised weights, d_out = 8), an output map L (6 × 8), and the
    dense L Φ by torch.func.jacrev."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    net = LinearizedNetwork(model, X)
    L = torch.randn(6, net.d_out, dtype=torch.float64)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def g(*vs):
        return torch.func.functional_call(model, {**params, **dict(zip(net.param_names, vs))}, (X,)).reshape(-1)

    jac = torch.func.jacrev(g, argnums=tuple(range(len(net.param_names))))(*[params[n] for n in net.param_names])
    Phi = torch.cat([j.reshape(net.d_out, -1) for j in jac], dim=1)
    return net, L, L @ Phi


class TestDenseFeatures(FeatureContract):
    def make_features(self):
        M = _matrix()
        return DenseFeatures(M), M


class TestDenseFeaturesFloat32(FeatureContract):
    rtol = 1e-5

    def make_features(self):
        M = _matrix(dtype=torch.float32)
        return DenseFeatures(M), M.double()


class TestLinearizedFeatures(FeatureContract):
    def make_features(self):
        net, L, M = _tiny_network()
        return LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L), M


class TestLinearizedFeaturesWithoutMap(FeatureContract):
    def make_features(self):
        net, _, _ = _tiny_network()
        Phi = LinearizedFeatures(net).to_dense()  # L = I: Φ itself, checked against jacrev through L Φ above
        return LinearizedFeatures(net), Phi.double()


class TestRowScaledDenseFeatures(FeatureContract):
    def make_features(self):
        M, r = _matrix(), _scales(9, seed=2)
        return RowScaledFeatures(DenseFeatures(M), r), r[:, None] * M


class TestRowScaledLinearizedFeatures(FeatureContract):
    """The whitening of a network's features keeps its cheaper column route (``columns``)."""

    def make_features(self):
        net, L, M = _tiny_network()
        r = _scales(6, seed=3)
        return RowScaledFeatures(LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L), r), r[:, None] * M


class TestScaledDenseFeatures(FeatureContract):
    def make_features(self):
        M, s = _matrix(), _scales(7)
        return ScaledFeatures(DenseFeatures(M), s), M * s


class TestScaledLinearizedFeatures(FeatureContract):
    def make_features(self):
        net, L, M = _tiny_network()
        s = _scales(net.d)
        return ScaledFeatures(LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L), s), M * s


class TestRowSubsetFeatures(FeatureContract):
    def make_features(self):
        net, L, M = _tiny_network()
        rows = torch.tensor([5, 0, 2, 3])
        feats = LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L).restrict(rows)
        assert isinstance(feats, RowSubsetFeatures)
        return feats, M[rows]


class TestStackedFeatures(FeatureContract):
    def make_features(self):
        net, L, M = _tiny_network()
        lin = LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L)
        dense = DenseFeatures(_matrix(3, net.d, seed=4))
        feats = stack_features([lin, dense])
        assert isinstance(feats, StackedFeatures)
        return feats, torch.cat([M, dense.matrix])


def test_scaled_columns_take_the_base_column_route():
    """Columns of Ψ₀ diag(s) come from the base's own column route (the network's per-tensor JVP basis), so a
    scaled linearised operator assembles Ψ as cheaply as an unscaled one."""
    net, L, M = _tiny_network()
    s = _scales(net.d)
    base = LinearizedFeatures(net, lambda X: X @ L.T, lambda R: R @ L)
    scaled = ScaledFeatures(base, s)
    torch.testing.assert_close(scaled.columns(3, 11), base.columns(3, 11, s[3:11]), rtol=0, atol=0)
    with pytest.raises(TypeError, match="takes no prior scales"):
        LinearizedFeatures(net, torch.ones(net.d, dtype=torch.float64))
