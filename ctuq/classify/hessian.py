"""The softmax Hessian ``B_i = diag(p_i) − p_i p_iᵀ`` and its square roots: the whitening of the categorical
likelihood that turns linearised Laplace for a classifier into the core's Gaussian linear model.

For ``n`` examples with ``C`` classes and trained-network probabilities ``p_i`` (rows of ``P`` ``(n, C)``), the
GGN is ``Σ_i J_iᵀ B_i J_i`` with ``J_i`` the ``C × d`` Jacobian of example ``i``'s logits. Any factor
``B_i = L_i L_iᵀ`` gives features ``Ψ₀ = blockdiag(L_iᵀ) J`` (``n·C × d``) with ``Ψ₀ᵀΨ₀ = GGN``.

``B_i`` is singular: ``B_i 1 = 0`` (rank ``C − 1`` when every ``p_ik > 0``, lower when some ``p_ik``
underflow). Two factors are offered, both exact on that rank:

* ``"closed_form"`` (default): ``L = diag(√p) − p √pᵀ``. Using ``Σ_k p_k = 1``,
  ``L Lᵀ = diag(p) − 2ppᵀ + p (√pᵀ√p) pᵀ = diag(p) − ppᵀ``. Applying ``L`` or ``Lᵀ`` costs ``O(C)`` per example and
  needs no eigendecomposition; ``null(L) = span(√p)``. Probabilities that underflow to 0 give zero rows/columns,
  exactly as in ``B``.
* ``"symmetric"``: ``B^(1/2) = U diag(√λ) Uᵀ`` from ``eigh`` per example in float64, eigenvalues clamped at 0
  (round-off makes the null eigenvalue ±1e-17). ``O(C²)`` per application plus ``n·C³`` once.

Pseudo-targets (see :mod:`ctuq.classify.laplace`) need a ``ρ_i`` with ``L_i ρ_i = y_i − p_i`` (one-hot ``y_i``),
which exists because ``1ᵀ(y_i − p_i) = 0`` and ``range(B_i) = 1⊥`` when all ``p_ik > 0``:

* closed form: ``ρ = (y − p) ⊘ √p`` — then ``Lρ = (y − p) − p·Σ(y − p) = y − p``, and ``ρ ⊥ √p`` so it is the
  minimum-norm solution; ``‖ρ‖² = Σ_k (y_k − p_k)²/p_k`` (Pearson's χ² of the example);
* symmetric: ``ρ = B^(+1/2)(y − p)`` with ``1/√λ`` for ``λ > eig_floor`` and 0 otherwise.

Both have the same norm (the two factors differ by an orthogonal matrix on ``1⊥``). When a probability ``p_k``
is (numerically) zero the equation has no exact solution unless ``(y − q)_k ≈ 0``; below ``prob_floor`` (default
``1e-12``) ``ρ_k`` is 0 where ``|(y − q)_k| ≤ 10³·prob_floor`` and ``(y − q)_k / √prob_floor`` otherwise — a
confidently wrong training example becomes a large but finite residual. :attr:`SoftmaxHessianRoot.n_floored` counts
the floored entries.
"""

from __future__ import annotations

import torch

from ctuq.options import HessianRoot, values

__all__ = ["SoftmaxHessianRoot", "softmax_hessian", "mean_hessian_trace", "HessianMismatchWarning"]


class HessianMismatchWarning(UserWarning):
    """The softmax Hessians at the trained network are far smaller than at the linearised model's mode
    (:attr:`LinearizedLaplace.hessian_ratio <ctuq.classify.LinearizedLaplace.hessian_ratio>` above 3 with
    ``hessian_at="network"``): the evidence then sees too little curvature and chooses too wide a prior."""


def mean_hessian_trace(probs: torch.Tensor) -> float:
    """``(1/n) Σ_i tr B_i = (1/n) Σ_i (1 − ‖p_i‖²)`` for probabilities ``probs`` ``(n, C)`` (float64 sum): the mean
    curvature of the categorical log-likelihood in logit space (0 for one-hot rows, ``1 − 1/C`` for uniform)."""
    p = probs.detach().double()
    return float((1.0 - p.pow(2).sum(1)).clamp_min(0.0).mean())


def softmax_hessian(probs: torch.Tensor) -> torch.Tensor:
    """``B_i = diag(p_i) − p_i p_iᵀ`` ``(n, C, C)`` for probabilities ``probs`` ``(n, C)`` (dense; tests, small C)."""
    return torch.diag_embed(probs) - probs[:, :, None] * probs[:, None, :]


class SoftmaxHessianRoot:
    """Block-diagonal ``Lᵀ`` (``n·C × n·C``) with ``L_i L_iᵀ = B_i``, applied to flat logit rows.

    Parameters
    ----------
    probs : torch.Tensor
        ``(n, C)`` softmax probabilities of the trained network (rows sum to 1); kept in float64.
    root : {"closed_form", "symmetric"}
        The factor (module docstring).
    prob_floor : float
        Smallest probability divided by in :meth:`residual_targets` (closed form).
    eig_floor : float
        Eigenvalues of ``B_i`` at or below this count as zero (symmetric root).

    Flat layout: logit ``k`` of example ``i`` at ``i·C + k`` (:class:`ctuq.linearize.LinearizedNetwork`'s).
    """

    def __init__(
        self, probs: torch.Tensor, root: str = "closed_form", prob_floor: float = 1e-12, eig_floor: float = 1e-12
    ):
        if root not in values(HessianRoot):
            raise ValueError(f"SoftmaxHessianRoot: root must be one of {list(values(HessianRoot))}, got {root!r}")
        if not isinstance(probs, torch.Tensor) or probs.ndim != 2 or probs.shape[1] < 2:
            got = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            raise ValueError(f"SoftmaxHessianRoot: probs must be (n, C) with C >= 2, got {got}")
        p = probs.detach().double()
        if not torch.isfinite(p).all() or (p < 0).any():
            raise ValueError("SoftmaxHessianRoot: probabilities must be finite and >= 0")
        if not torch.allclose(p.sum(1), torch.ones_like(p[:, 0]), atol=1e-6):
            raise ValueError("SoftmaxHessianRoot: probability rows must sum to 1 (pass softmax(logits))")
        self.root = root
        self.p = p
        self.n, self.C = (int(s) for s in p.shape)
        self.sqrt_p = p.sqrt()
        self.prob_floor = float(prob_floor)
        self.eig_floor = float(eig_floor)
        self.n_floored = 0
        if root == HessianRoot.SYMMETRIC:
            lam, U = torch.linalg.eigh(softmax_hessian(p))
            lam = lam.clamp_min(0.0)
            self._sym = U @ torch.diag_embed(lam.sqrt()) @ U.mT
            inv = torch.where(lam > self.eig_floor, lam.clamp_min(self.eig_floor).rsqrt(), torch.zeros_like(lam))
            self._sym_pinv = U @ torch.diag_embed(inv) @ U.mT

    @property
    def n_outputs(self) -> int:
        """``n·C``."""
        return self.n * self.C

    def _blocks(self, X: torch.Tensor) -> torch.Tensor:
        if X.ndim != 2 or X.shape[1] != self.n_outputs:
            raise ValueError(f"SoftmaxHessianRoot: rows must be (B, {self.n_outputs}), got {tuple(X.shape)}")
        return X.reshape(X.shape[0], self.n, self.C)

    def apply_transpose(self, X: torch.Tensor) -> torch.Tensor:
        """``Lᵀ x`` per example for rows ``X`` ``(B, n·C)`` → ``(B, n·C)`` (the features' output map)."""
        Z = self._blocks(X)
        if self.root == HessianRoot.SYMMETRIC:
            out = torch.einsum("ikl,bil->bik", self._sym.to(X.dtype), Z)
        else:  # Lᵀz = √p ⊙ z − √p (pᵀz)
            sp, p = self.sqrt_p.to(X.dtype), self.p.to(X.dtype)
            out = sp * Z - sp * (Z * p).sum(-1, keepdim=True)
        return out.reshape(X.shape)

    def apply(self, X: torch.Tensor) -> torch.Tensor:
        """``L x`` per example for rows ``X`` ``(B, n·C)`` → ``(B, n·C)`` (the output map's adjoint)."""
        Z = self._blocks(X)
        if self.root == HessianRoot.SYMMETRIC:
            out = torch.einsum("ikl,bil->bik", self._sym.to(X.dtype), Z)
        else:  # Lz = √p ⊙ z − p (√pᵀz)
            sp, p = self.sqrt_p.to(X.dtype), self.p.to(X.dtype)
            out = sp * Z - p * (Z * sp).sum(-1, keepdim=True)
        return out.reshape(X.shape)

    def transpose_blocks(self, J: torch.Tensor, start: int) -> torch.Tensor:
        """``L_iᵀ J_i`` for per-example matrices ``J`` ``(m, C, d)`` of examples ``start … start + m − 1``."""
        stop = start + J.shape[0]
        if J.ndim != 3 or J.shape[1] != self.C or not 0 <= start < stop <= self.n:
            raise ValueError(
                f"SoftmaxHessianRoot.transpose_blocks: J must be (m, {self.C}, d) for examples within "
                f"0..{self.n - 1}, got {tuple(J.shape)} from {start}"
            )
        if self.root == HessianRoot.SYMMETRIC:
            return torch.einsum("ikl,ild->ikd", self._sym[start:stop].to(J.dtype), J)
        sp, p = self.sqrt_p[start:stop, :, None].to(J.dtype), self.p[start:stop, :, None].to(J.dtype)
        return sp * J - sp * (p * J).sum(1, keepdim=True)

    def residual_targets(self, labels: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """``ρ`` ``(n·C,)`` float64 with ``L_i ρ_i = y_i − q_i`` (one-hot ``y_i`` of ``labels`` ``(n,)``; ``q``
        ``(n, C)`` defaults to the probabilities ``p`` that define ``B``; any rows summing to 1 work, e.g. the
        linearised model's at its mode)."""
        if labels.shape != (self.n,):
            raise ValueError(f"SoftmaxHessianRoot: labels must have shape ({self.n},), got {tuple(labels.shape)}")
        q = self.p if probs is None else probs.detach().double()
        if q.shape != self.p.shape:
            raise ValueError(f"SoftmaxHessianRoot: probs must have shape {tuple(self.p.shape)}, got {tuple(q.shape)}")
        v = torch.nn.functional.one_hot(labels.long(), self.C).double() - q
        v = v - v.mean(1, keepdim=True)  # exactly in 1⊥ (removes the rounding of Σ q = 1)
        if self.root == HessianRoot.SYMMETRIC:
            rho = torch.einsum("ikl,il->ik", self._sym_pinv, v)
        else:
            small = self.p < self.prob_floor
            negligible = v.abs() <= 1e3 * self.prob_floor
            self.n_floored = int((small & ~negligible).sum())
            rho = torch.where(small & negligible, torch.zeros_like(v), v / self.p.clamp_min(self.prob_floor).sqrt())
        return rho.reshape(-1)

    def dense(self) -> torch.Tensor:
        """``blockdiag(Lᵀ)`` ``(n·C, n·C)`` float64 (tests only)."""
        eye = torch.eye(self.n_outputs, dtype=torch.float64)
        return self.apply_transpose(eye).T
