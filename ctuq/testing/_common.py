"""Helpers shared by the contracts of :mod:`ctuq.testing` (private): the seeded dense problem
(:func:`contract_problem`, public through :mod:`ctuq.testing`), a checkpoint round trip, the whitened
sample-covariance check and a bitwise comparison of states."""

from __future__ import annotations

import io

import numpy as np
import torch

from ctuq.inference.features import DenseFeatures


def contract_problem(
    c: int = 24,
    d: int = 36,
    *,
    seed: int = 0,
    top: float = 10.0,
    bottom: float = 0.01,
    dtype: torch.dtype = torch.float64,
) -> tuple[DenseFeatures, torch.Tensor, torch.Tensor]:
    """A seeded dense problem: ``(features, Ψ (c, d) float64, targets ỹ (c,))`` with the singular values of ``Ψ``
    log-spaced from ``√top`` to ``√bottom`` (so ``K̄`` has eigenvalues ``top … bottom``)."""
    g = torch.Generator().manual_seed(seed)
    r = min(c, d)
    U, _ = torch.linalg.qr(torch.randn(c, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))
    sv = torch.logspace(np.log10(top) / 2, np.log10(bottom) / 2, r, dtype=torch.float64)
    Psi = (U * sv) @ V.T
    y = Psi @ torch.randn(d, generator=g, dtype=torch.float64) + 0.3 * torch.randn(c, generator=g, dtype=torch.float64)
    return DenseFeatures(Psi.to(dtype)), Psi, y.to(dtype)


def _saved(state):
    """``state`` after ``torch.save`` and ``torch.load(weights_only=True)`` (what a checkpoint file gives back)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _check_sample_covariance(zeta: np.ndarray, cov: np.ndarray, tol: float) -> None:
    """Samples ``zeta`` ``(n, d)`` whitened by the covariance ``cov`` ``(d, d)`` have every entry of their second
    moment within ``tol · √(2/n)`` of the identity."""
    w, V = np.linalg.eigh(cov)
    white = zeta @ (V / np.sqrt(w))  # Σ^(−1/2) ζ in the eigenbasis: N(0, I)
    dev = np.abs(white.T @ white / len(zeta) - np.eye(cov.shape[0])).max()
    assert dev <= tol * np.sqrt(2.0 / len(zeta)), dev


def _same_state(got, want, where: str = "state") -> None:
    """``got`` equals ``want`` bitwise: tensors by ``torch.equal`` (and dtype), containers item by item."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, sorted(got), sorted(want))
        for k in want:
            _same_state(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)
