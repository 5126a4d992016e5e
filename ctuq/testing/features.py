"""The feature-operator contract (:class:`FeatureContract`).

:class:`FeatureContract` checks adjointness ``⟨Ψu, v⟩ = ⟨u, Ψᵀv⟩`` within round-off, agreement with the dense
matrix, columns, row restriction, stacking, product counters and bad shapes.
"""

from __future__ import annotations

import pytest
import torch

from ctuq.inference.features import FeatureOperator, stack_features

__all__ = ["FeatureContract"]


class FeatureContract:
    """The feature-operator contract (module docstring). Subclass and give :meth:`make_features`, returning the
    operator and its dense float64 matrix ``(c, d)``; :attr:`rtol` bounds round-off (float64 default)."""

    rtol: float = 1e-10

    def make_features(self) -> tuple[FeatureOperator, torch.Tensor]:
        raise NotImplementedError

    @pytest.fixture
    def features(self):
        return self.make_features()

    @staticmethod
    def _draws(features: FeatureOperator, B: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        U = torch.randn(B, features.n_features, generator=g, dtype=torch.float64).to(features.dtype)
        V = torch.randn(B, features.n_outputs, generator=g, dtype=torch.float64).to(features.dtype)
        return U, V

    def _close(self, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.double().cpu(), want.double().cpu()
        scale = float(torch.linalg.matrix_norm(want)) if want.ndim == 2 else float(want.norm())
        assert float((got - want).norm()) <= self.rtol * max(scale, 1e-300), (got - want).abs().max()

    def test_adjointness(self, features):
        F, _ = features
        U, V = self._draws(F)
        lhs = (F.matvec(U).double() * V.double()).sum(1)
        rhs = (U.double() * F.rmatvec(V).double()).sum(1)
        scale = F.matvec(U).double().norm(dim=1) * V.double().norm(dim=1)
        assert torch.all((lhs - rhs).abs() <= self.rtol * scale), (lhs - rhs).abs().max()

    def test_matches_the_dense_matrix(self, features):
        F, M = features
        assert (F.n_outputs, F.n_features) == tuple(M.shape)
        U, V = self._draws(F)
        self._close(F.matvec(U), U.double() @ M.T)
        self._close(F.rmatvec(V), V.double() @ M)
        self._close(F.to_dense(chunk_size=5), M)

    def test_columns(self, features):
        F, M = features
        d = F.n_features
        lo, hi = d // 4, min(d, d // 4 + 5)
        self._close(F.columns(lo, hi), M[:, lo:hi].T)
        vals = torch.linspace(0.5, 2.0, hi - lo, dtype=torch.float64).to(F.dtype)
        self._close(F.columns(lo, hi, vals), (M[:, lo:hi] * vals.double()).T)
        self._close(F.row_range(1, 3), M[1:3])

    def test_row_restriction(self, features):
        F, M = features
        c = F.n_outputs
        rows = torch.tensor([c - 1, 0, c // 2])
        mask = torch.zeros(c, dtype=torch.bool)
        mask[rows] = True
        for sel, want in ((rows, M[rows]), (mask, M[mask])):
            sub = F.restrict(sel)
            assert (sub.n_outputs, sub.n_features) == tuple(want.shape)
            U, V = self._draws(sub)
            self._close(sub.matvec(U), U.double() @ want.T)
            self._close(sub.rmatvec(V), V.double() @ want)
        for bad in (torch.tensor([0, 0]), torch.tensor([c]), torch.tensor([], dtype=torch.long)):
            with pytest.raises(ValueError, match="row"):
                F.restrict(bad)

    def test_stacking(self, features):
        F, M = features
        rows = torch.tensor([1, 3])
        stacked = stack_features([F, F.restrict(rows)])
        want = torch.cat([M, M[rows]])
        U, V = self._draws(stacked)
        self._close(stacked.matvec(U), U.double() @ want.T)
        self._close(stacked.rmatvec(V), V.double() @ want)

    def test_counters_count_rows(self, features):
        F, _ = features
        F.reset_counters()
        U, V = self._draws(F, B=4)
        F.matvec(U)
        F.rmatvec(V[:3])
        assert F.counters() == {"matvec": 4, "rmatvec": 3}
        F.columns(0, 2)
        F.row_range(0, 3)
        assert (F.n_matvec, F.n_rmatvec) == (6, 6)
        F.reset_counters()
        assert F.counters() == {"matvec": 0, "rmatvec": 0}

    def test_bad_shapes_name_the_shape(self, features):
        F, _ = features
        with pytest.raises(ValueError, match=rf"shape \(2, {F.n_features + 1}\)"):
            F.matvec(torch.zeros(2, F.n_features + 1, dtype=F.dtype))
        with pytest.raises(ValueError, match=rf"expected \(batch, {F.n_outputs}\)"):
            F.rmatvec(torch.zeros(2, F.n_outputs + 2, dtype=F.dtype))
