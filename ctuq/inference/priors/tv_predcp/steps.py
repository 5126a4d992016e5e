"""What every step of the TV-PredCP type-II MAP shares, whichever optimiser takes it: MacKay's update of the global
scale and the noise, the step's trace record and the convergence criterion over the trace (``docs/tv_predcp.md``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ctuq.inference.priors.tv_predcp.model import TVPredCPModel

__all__ = ["CONVERGENCE_PATIENCE", "convergence", "mackay", "record"]

CONVERGENCE_PATIENCE = 3  # steps in a row whose changes must all be below the tolerance


def convergence(trace: list[dict], tol: float) -> dict:
    """``converged`` when each of the last :data:`CONVERGENCE_PATIENCE` records changed every log-hyperparameter
    by at most ``tol``; ``max_change`` is the largest such change over those records (``None`` if too few)."""
    last = [r["max_change"] for r in trace[-CONVERGENCE_PATIENCE:]]
    worst = max(last) if len(last) == CONVERGENCE_PATIENCE else None
    return {
        "converged": worst is not None and worst <= tol,
        "criterion": f"max |Δ log hyperparameter| <= {tol:g} in each of the last {CONVERGENCE_PATIENCE} steps",
        "max_change": worst,
        "tolerance": tol,
    }


def mackay(info: dict, *, a: float, c: int, s2: float, learn_noise: bool) -> tuple[float, float]:
    """MacKay's factor on all variances and the new ``σ²`` (``(1, σ²)`` where ``γ`` is not a usable estimate), from a
    gradient's ``info`` (:func:`~ctuq.inference.priors.tv_predcp.mll.mll_gradient`): variances ×
    ``a γ⁻¹ ‖w*‖²``, ``σ² ← ‖ỹ − Ψw*‖²/(c − γ)`` (the EM's updates)."""
    gamma, wnorm = info["gamma"], info["weight_norm_sq"]
    if not (0 < gamma < c and wnorm > 0):
        return 1.0, s2
    return a / (gamma / wnorm), (info["residual_norm_sq"] / (c - gamma) if learn_noise else s2)


def record(
    prior: TVPredCPModel,
    info: dict,
    hp: float,
    details: list[dict],
    s2: float,
    g: torch.Tensor,
    phase: str,
    scale: float,
    change: float,
    evaluations: int,
    t0: float,
) -> dict:
    """One step's trace record (keys: :func:`~ctuq.inference.priors.tv_predcp.fit.fit_block_prior`) at the prior's
    current hyperparameters; ``g``: the gradient of the free coordinates, ``t0``: ``time.perf_counter()`` at the
    step's start."""
    return {
        "phase": phase,
        "lengthscale": prior.log_lengthscale.exp().tolist(),
        "variance": prior.log_variance.exp().tolist(),
        "sigma2": s2,
        "data_fit": info["data_fit"],
        "log_hyperprior": hp,
        "kappa": [dd["kappa"] for dd in details],
        "gamma": info["gamma"],
        "mackay_scale": scale,
        "grad_norm": float(g.norm()),
        "max_change": change,
        "evaluations": evaluations,
        "cg_max_iterations": info["cg_max_iterations"],
        "cg_max_residual": info["cg_max_residual"],
        "time_s": time.perf_counter() - t0,
    }
