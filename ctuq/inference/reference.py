"""Exact dense reference (numpy, float64) for problems small enough to assemble ``Ψ`` (``c × d``).

Written in the *primal* (weight-space, ``d × d``) form, independently of the dual (``c × c``) formulas the solvers
use, so that agreement between the two is a real check. The noise covariance is ``σ² D`` with ``D = diag(d)``
(``D = I`` unless ``noise_variances`` are given), written directly from the Gaussian formulas (no whitening):

    Σ = (Ψᵀ D⁻¹ Ψ/σ² + a I)⁻¹,   w* = Σ Ψᵀ D⁻¹ ỹ / σ²,   γ = d − a tr Σ,
    log p(ỹ | a, σ²) = log N(ỹ; 0, ΨΨᵀ/a + σ² D)   (via a Cholesky factorisation of C),
    MacKay fixed point: a = γ/‖w*‖²,  σ² = (ỹ − Ψw*)ᵀ D⁻¹ (ỹ − Ψw*)/(c − γ)  (if learned), iterated to convergence.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg

__all__ = ["DenseLinearGaussian"]


class DenseLinearGaussian:
    """The linear model ``ỹ = Ψ w + ε``, ``w ~ N(0, a⁻¹ I)``, ``ε ~ N(0, σ² D)`` in dense float64.

    Parameters
    ----------
    Psi : array-like
        ``(c, d)`` feature matrix (torch tensors are converted).
    y_tilde : array-like
        ``(c,)`` targets.
    noise_variances : array-like, optional
        ``d`` ``(c,)``, the relative noise variances (finite, > 0) of ``D = diag(d)``; default ``D = I``.
    """

    def __init__(self, Psi, y_tilde, noise_variances=None):
        Psi = _as_np(Psi)
        y = _as_np(y_tilde)
        if Psi.ndim != 2:
            raise ValueError(f"DenseLinearGaussian: Psi must be (c, d), got shape {Psi.shape}")
        if y.shape != (Psi.shape[0],):
            raise ValueError(f"DenseLinearGaussian: y_tilde must have shape ({Psi.shape[0]},), got {y.shape}")
        self.Psi = Psi
        self.y = y
        self.c, self.d = Psi.shape
        if noise_variances is None:
            self.noise_var = np.ones(self.c)
        else:
            self.noise_var = _as_np(noise_variances)
            if self.noise_var.shape != (self.c,) or not np.all(np.isfinite(self.noise_var) & (self.noise_var > 0)):
                raise ValueError(
                    f"DenseLinearGaussian: noise_variances must be ({self.c},), finite and positive, got shape "
                    f"{self.noise_var.shape}"
                )
        self._prec = 1.0 / self.noise_var  # D⁻¹ (diagonal)
        self._gram = Psi.T @ (self._prec[:, None] * Psi)  # Ψᵀ D⁻¹ Ψ

    def posterior_covariance(self, a: float, sigma2: float) -> np.ndarray:
        """``Σ = (Ψᵀ D⁻¹ Ψ/σ² + a I)⁻¹`` ``(d, d)``."""
        H = self._gram / sigma2 + a * np.eye(self.d)
        return scipy.linalg.cho_solve(scipy.linalg.cho_factor(H), np.eye(self.d))

    def posterior_mean(self, a: float, sigma2: float) -> np.ndarray:
        """``w* = Σ Ψᵀ D⁻¹ ỹ / σ²`` ``(d,)``."""
        H = self._gram / sigma2 + a * np.eye(self.d)
        return scipy.linalg.cho_solve(scipy.linalg.cho_factor(H), self.Psi.T @ (self._prec * self.y) / sigma2)

    def effective_dimension(self, a: float, sigma2: float) -> float:
        """``γ = d − a tr Σ``."""
        return float(self.d - a * np.trace(self.posterior_covariance(a, sigma2)))

    def weight_norm_sq(self, a: float, sigma2: float) -> float:
        """``‖w*‖²``."""
        w = self.posterior_mean(a, sigma2)
        return float(w @ w)

    def residual_norm_sq(self, a: float, sigma2: float) -> float:
        """``(ỹ − Ψ w*)ᵀ D⁻¹ (ỹ − Ψ w*)`` (``‖ỹ − Ψ w*‖²`` for ``D = I``)."""
        r = self.y - self.Psi @ self.posterior_mean(a, sigma2)
        return float(r @ (self._prec * r))

    def measurement_covariance(self, a: float, sigma2: float) -> np.ndarray:
        """``C = ΨΨᵀ/a + σ² D`` ``(c, c)``."""
        return self.Psi @ self.Psi.T / a + sigma2 * np.diag(self.noise_var)

    def log_evidence(self, a: float, sigma2: float) -> float:
        """``log N(ỹ; 0, C)`` in nats."""
        L = np.linalg.cholesky(self.measurement_covariance(a, sigma2))
        z = scipy.linalg.solve_triangular(L, self.y, lower=True)
        return float(-0.5 * z @ z - np.log(np.diag(L)).sum() - 0.5 * self.c * math.log(2 * math.pi))

    def mackay_update(self, a: float, sigma2: float, learn_noise: bool = False) -> tuple[float, float]:
        """One exact MacKay update ``(a, σ²) → (γ/‖w*‖², (ỹ − Ψw*)ᵀD⁻¹(ỹ − Ψw*)/(c − γ) or σ²)``."""
        g = self.effective_dimension(a, sigma2)
        a_new = g / self.weight_norm_sq(a, sigma2)
        s2_new = self.residual_norm_sq(a, sigma2) / (self.c - g) if learn_noise else sigma2
        return a_new, s2_new

    def em_fixed_point(
        self, a0: float, sigma2: float, learn_noise: bool = False, rtol: float = 1e-12, max_iter: int = 100_000
    ) -> tuple[float, float, int]:
        """Iterate :meth:`mackay_update` from ``(a0, σ²)`` until the relative change is below ``rtol``.

        Returns ``(a*, σ²*, iterations)``; raises ``RuntimeError`` if ``max_iter`` is reached.
        """
        a, s2 = float(a0), float(sigma2)
        for it in range(1, max_iter + 1):
            a_new, s2_new = self.mackay_update(a, s2, learn_noise)
            done = abs(a_new - a) <= rtol * a and abs(s2_new - s2) <= rtol * s2
            a, s2 = a_new, s2_new
            if done:
                return a, s2, it
        raise RuntimeError(f"em_fixed_point: no convergence in {max_iter} iterations (a={a}, σ²={s2})")


def _as_np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float64)
