"""Acquisition criteria for a candidate angle ``β`` given the angles chosen so far, and the dense reference.

With the prior ``x ~ N(0, K)``, noise ``N(0, σ² I)`` and the chosen angles' operator ``T^(t)``, the posterior
image covariance is ``K_{x|y} = K − K T^(t)ᵀ (T^(t) K T^(t)ᵀ + σ² I)⁻¹ T^(t) K`` and a candidate's *block*
``M_β = T^β K_{x|y} T^βᵀ`` (``k × k``, one row per detector pixel) is the posterior covariance of its noise-free
measurements. The criteria (in nats or squared data units, larger is better):

* ``eig`` (D-optimal): the expected information gain ``I(x; y_β | y^(t)) = ½ log det(I + M_β / σ̃²)``;
* ``ese`` (A-optimal in measurement space): the expected squared error ``tr(M_β)`` of predicting ``y_β``;
* ``diag_eig``: ``½ Σ_i log(1 + [M_β]_ii / σ̃²)`` — the EIG of independent detector pixels (ignores their
  correlations; cheap, between the two);

with ``σ̃² = σ² + η`` and a stabilising jitter ``η = jitter · mean_β mean_i [M_β]_ii`` (relative to the mean
diagonal of the current blocks, so it scales with the prior; :data:`DEFAULT_JITTER`).

Scale laws (derived in ``docs/experimental_design.md``, tested in ``tests/design/test_design.py``): scaling the
prior by ``c`` and ``σ²`` by ``c`` together multiplies every ``M_β`` by ``c``, so ESE values scale by ``c`` and the
EIG values do not change — both rankings are invariant. Scaling only the prior (or only ``σ²``) leaves the ESE
ranking invariant exactly when ``σ²`` is negligible against the prior (then ``K_{x|y}`` is linear in ``K`` and free
of ``σ²``), and in general changes both criteria through the ratio ``σ²/c``.

Blocks come either exactly (``(n, k, k)``) or from ``m`` zero-mean samples of the candidates' pseudo-measurements
(``(m, n, k)``: ``M̂_β = (1/m) Σ_j y_jβ y_jβᵀ``, unbiased). For ``m < k`` the log-determinant uses the ``m × m``
Gram matrix (``det(I_k + Y Yᵀ/(m σ̃²)) = det(I_m + YᵀY/(m σ̃²))``).
"""

from __future__ import annotations

import numpy as np
import torch

from ctuq.options import Criterion

__all__ = [
    "DEFAULT_JITTER",
    "criteria_from_blocks",
    "criteria_from_samples",
    "jitter_value",
    "dense_posterior_blocks",
    "information_gain_bruteforce",
]

DEFAULT_JITTER = 0.01
"""Default ``η / mean diag M``: 1 % of the mean diagonal of the candidate blocks (the authors searched 1–10 %)."""


def _check(criterion: str) -> None:
    Criterion.parse(criterion, "design.criterion")


def jitter_value(mean_diagonal: float, jitter: float) -> float:
    """``η = jitter · mean_diagonal`` (``≥ 0``)."""
    if not jitter >= 0:
        raise ValueError(f"design.jitter must be >= 0, got {jitter}")
    return float(jitter) * max(float(mean_diagonal), 0.0)


def _logdet_plus_identity(G: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``log det(I + scale·G)`` for a batch of PSD matrices ``(n, p, p)`` (float64 Cholesky; eigenvalues if it
    fails). Only the lower triangle is read, as LAPACK does: a Gram of samples is symmetric up to round-off, and
    symmetrising ``n·p²`` numbers first took as long as the Cholesky factorisations (``n = 200, p = 183``)."""
    A = G.to(torch.float64, copy=True).mul_(float(scale))
    A.diagonal(dim1=-2, dim2=-1).add_(1.0)
    L, info = torch.linalg.cholesky_ex(A)
    out = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
    bad = info != 0
    if bool(bad.any()):
        Gb = G[bad].double() * float(scale)
        lam = torch.linalg.eigvalsh(0.5 * (Gb + Gb.mT)).clamp_min(0.0)
        out[bad] = torch.log1p(lam).sum(-1)
    return out


def criteria_from_blocks(
    M: torch.Tensor,
    sigma2: float,
    criterion: str,
    jitter: float = DEFAULT_JITTER,
) -> tuple[torch.Tensor, float]:
    """Criterion values ``(n,)`` (float64) of candidate blocks ``M`` ``(n, k, k)``, and the jitter ``η`` used."""
    _check(criterion)
    M = M.double()
    diag = torch.diagonal(M, dim1=-2, dim2=-1)
    eta = jitter_value(float(diag.mean()), jitter)
    s2 = float(sigma2) + eta
    if criterion == Criterion.ESE:
        return diag.sum(-1), eta
    if criterion == Criterion.DIAG_EIG:
        return 0.5 * torch.log1p(diag.clamp_min(0.0) / s2).sum(-1), eta
    return 0.5 * _logdet_plus_identity(M, 1.0 / s2), eta


def criteria_from_samples(
    Y: torch.Tensor,
    sigma2: float,
    criterion: str,
    jitter: float = DEFAULT_JITTER,
    chunk: int = 32,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, float]:
    """Criterion values from zero-mean pseudo-measurement samples ``Y`` ``(m, n, k)``.

    ``M̂_β = Y_βᵀ Y_β / m`` per candidate (``k × k``; the ``m × m`` Gram ``Y_β Y_βᵀ`` when ``m < k``, same non-zero
    spectrum), one pass over ``Y`` in chunks of candidates (Grams in ``Y``'s dtype, log-determinants in float64).
    ``index`` (1-D, optional) restricts the candidates scored (and the jitter's mean diagonal) without copying
    ``Y``. Returns the values (float64, one per scored candidate) and the jitter ``η``.
    ``chunk`` candidates are copied at a time: at m = 1000, k = 183, float32, 32 of them take 23 MB, which glibc
    keeps on its heap (:func:`ctuq.utils.tune_malloc`); 64 took 47 MB, mapped and page-faulted in on every chunk.
    """
    _check(criterion)
    m, _, k = Y.shape
    index = torch.arange(Y.shape[1]) if index is None else torch.as_tensor(index).reshape(-1)
    n = int(index.numel())
    diag = torch.empty((n, k), dtype=torch.float64)
    grams = []
    for lo in range(0, n, chunk):
        Yc = Y[:, index[lo : lo + chunk]].permute(1, 0, 2)  # (c, m, k), a copy of this chunk only
        if criterion == Criterion.EIG:
            G = Yc.mT @ Yc if m >= k else Yc @ Yc.mT  # (c, k, k) or (c, m, m)
            grams.append(G)
            d = torch.diagonal(G, dim1=-2, dim2=-1) if m >= k else (Yc * Yc).sum(1)
        else:
            d = (Yc * Yc).sum(1)
        diag[lo : lo + Yc.shape[0]] = d.double().cpu() / m
    eta = jitter_value(float(diag.mean()), jitter)
    s2 = float(sigma2) + eta
    if criterion == Criterion.ESE:
        return diag.sum(-1), eta
    if criterion == Criterion.DIAG_EIG:
        return 0.5 * torch.log1p(diag / s2).sum(-1), eta
    return torch.cat([0.5 * _logdet_plus_identity(G.cpu(), 1.0 / (m * s2)) for G in grams]), eta


def dense_posterior_blocks(K: np.ndarray, T: np.ndarray, chosen_rows, sigma2: float, k: int) -> np.ndarray:
    """Exact candidate blocks from a dense prior (float64 numpy): the reference for the design's routes.

    ``K`` ``(d_x, d_x)`` image prior covariance, ``T`` ``(n·k, d_x)`` all candidate rows (angle-major, ``k`` per
    candidate), ``chosen_rows`` the rows measured so far. Returns ``M`` ``(n, k, k)`` with
    ``M_β = T^β K_{x|y} T^βᵀ`` and ``K_{x|y} = K − K Tτᵀ (Tτ K Tτᵀ + σ²I)⁻¹ Tτ K`` formed explicitly.
    """
    K, T = np.asarray(K, np.float64), np.asarray(T, np.float64)
    rows = np.asarray(chosen_rows, dtype=np.int64)
    post = K
    if rows.size:
        Tt = T[rows]
        KT = K @ Tt.T
        post = K - KT @ np.linalg.solve(Tt @ KT + sigma2 * np.eye(rows.size), KT.T)
    TP = T @ post @ T.T
    n = T.shape[0] // k
    return np.stack([TP[i * k : (i + 1) * k, i * k : (i + 1) * k] for i in range(n)])


def information_gain_bruteforce(Psi: np.ndarray, chosen_rows, candidate_rows, a: float, sigma2: float) -> float:
    """``I(w; y_β | y_τ)`` by brute force: the drop in posterior entropy of the weights (nats).

    ``½ [log det Σ_τ − log det Σ_{τ∪β}]`` with ``Σ = (ΨᵀΨ/σ² + a I)⁻¹`` over the given rows of ``Ψ`` (``c × d``,
    float64 numpy): an independent formula for the EIG (weight space, not the candidate block), for tests.
    """
    Psi = np.asarray(Psi, np.float64)

    def logdet_precision(rows):
        P = Psi[np.asarray(rows, dtype=np.int64)]
        return np.linalg.slogdet(P.T @ P / sigma2 + a * np.eye(Psi.shape[1]))[1]

    both = np.concatenate([np.asarray(chosen_rows, np.int64), np.asarray(candidate_rows, np.int64)])
    return 0.5 * float(logdet_precision(both) - logdet_precision(chosen_rows))
