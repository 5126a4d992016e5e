"""Argument checks shared by the inference core (one home; every module that takes ``a``, ``σ²``, targets or
right-hand sides calls these, so the messages read the same everywhere).

Each check names the caller (``where``, e.g. ``"CGSolver.solve"``) and the problem, and returns the argument in the
form the caller computes with.
"""

from __future__ import annotations

import torch

__all__ = ["check_hyper", "check_targets", "check_rhs"]


def check_hyper(a, sigma2, where: str) -> tuple[float, float]:
    """``(float(a), float(σ²))`` after checking both are positive and finite (NaN is refused).

    ``a``: prior precision of the scaled weights; ``σ²``: noise variance (squared target units). Floats or 0-dim
    tensors.
    """
    a_f = float(a)
    s2_f = float(sigma2)
    if not (a_f > 0 and a_f < float("inf")):
        raise ValueError(f"{where}: prior precision a must be positive and finite, got {a_f}")
    if not (s2_f > 0 and s2_f < float("inf")):
        raise ValueError(f"{where}: noise variance sigma2 must be positive and finite, got {s2_f}")
    return a_f, s2_f


def check_targets(y_tilde: torch.Tensor, features, where: str) -> torch.Tensor:
    """The targets ``ỹ`` ``(c,)`` (offset ``δ`` included) checked against ``features`` (``c × d``) and finite,
    moved to the features' device and dtype."""
    c = features.n_outputs
    if not isinstance(y_tilde, torch.Tensor) or tuple(y_tilde.shape) != (c,):
        got = tuple(y_tilde.shape) if isinstance(y_tilde, torch.Tensor) else type(y_tilde).__name__
        raise ValueError(f"{where}: y_tilde must have shape ({c},) (flat targets incl. offset δ), got {got}")
    if not torch.isfinite(y_tilde).all():
        raise ValueError(f"{where}: y_tilde contains NaN or Inf")
    return y_tilde.to(device=features.device, dtype=features.dtype)


def check_rhs(rhs: torch.Tensor, features, where: str) -> torch.Tensor:
    """Right-hand-side rows ``(k, c)`` checked against ``features`` (``c`` outputs) and finite, moved to the
    features' device and dtype."""
    c = features.n_outputs
    if not isinstance(rhs, torch.Tensor) or rhs.ndim != 2 or rhs.shape[1] != c:
        got = tuple(rhs.shape) if isinstance(rhs, torch.Tensor) else type(rhs).__name__
        raise ValueError(f"{where}: rhs has shape {got}; expected (k, {c})")
    if not torch.isfinite(rhs).all():
        raise ValueError(f"{where}: rhs contains NaN or Inf")
    return rhs.to(device=features.device, dtype=features.dtype)
