"""The mode of the linearised categorical model, for the M-step of linearised Laplace.

With scaled weights ``w`` (``v = s ⊙ w``), prior ``w ~ N(0, a⁻¹ I)`` and per-example logits ``η_i(w)``:

* ``"tangent"`` (default; the linear model of Antorán, Padhy et al. 2023, through the origin):
  ``η_i(w) = J_i (s ⊙ w)`` — a zero-mean Gaussian process over logits with the network's tangent kernel;
* ``"affine"``: ``η_i(w) = f̃_i + J_i (s ⊙ (w − w̃))`` with ``w̃ = ṽ / s`` the trained weights — the first-order
  Taylor expansion of the network itself,

the mode is ``w*(a) = argmin F(w)``, ``F(w) = Σ_i CE(η_i(w), y_i) + ½ a ‖w‖²`` (convex), with gradient
``∇F = s ⊙ Jᵀ(softmax(η) − Y) + a w``: one JVP and one VJP on the training inputs per evaluation. It is found with
full-batch L-BFGS (strong-Wolfe line search) started from the previous EM step's mode (first step: ``w̃``), to a
relative gradient norm ``‖∇F‖ ≤ gtol · max(1, a‖w‖)`` (default ``1e-4``). Since ``∇²F ⪰ aI``, the error of ``w`` is
then at most ``gtol·‖w‖`` (relative), far below the Monte Carlo error of the sampled ``γ̂`` it is combined with
(measured on digits: ``gtol`` 1e-5 / 1e-4 / 1e-3 change the EM's ``a`` in the fourth digit at most, with 137 / 112 /
93 evaluations for the first mode and 47 / 35 / 20 for the fifth).

Why not the paper's Nesterov SGD: at the sizes a CPU handles (all training logits in one batch) the objective is a
smooth convex function of ``d`` variables that L-BFGS solves to 1e-8 in tens to hundreds of evaluations, with no
learning rate to tune; mini-batch SGD pays off only when the data do not fit one batch.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ctuq.options import LinearModel, values

__all__ = ["LinearMode", "ModeResult", "OverfitWarning", "overfit_fraction", "mean_kl", "scaled_weights"]


class OverfitWarning(UserWarning):
    """The trained network fits training labels that the linearised model, at the prior precision the evidence
    chose, explains as noise (:attr:`LinearizedLaplace.overfit_fraction
    <ctuq.classify.LinearizedLaplace.overfit_fraction>` above :data:`~ctuq.classify.laplace.OVERFIT_WARNING`): the
    network over-fits relative to its own linearisation, and a predictive centred at the network is then likely to
    be over-confident on new inputs."""


def overfit_fraction(network_logits: torch.Tensor, mode_logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of the ``n`` training inputs whose label the trained network predicts (arg-max of
    ``network_logits`` ``(n, C)``) and the linearised model's mode does not (arg-max of ``mode_logits`` ``(n, C)``);
    ``labels`` ``(n,)`` class indices. Labels the network itself gets wrong do not count: an under-trained network
    is not an over-fitted one."""
    if (
        network_logits.shape != mode_logits.shape
        or network_logits.ndim != 2
        or labels.shape != network_logits.shape[:1]
    ):
        raise ValueError(
            f"overfit_fraction: network_logits {tuple(network_logits.shape)} and mode_logits "
            f"{tuple(mode_logits.shape)} must be the same (n, C), labels {tuple(labels.shape)} (n,)"
        )
    y = labels.long()
    return float(((network_logits.argmax(1) == y) & (mode_logits.argmax(1) != y)).double().mean())


def scaled_weights(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The scaled weights ``w = v / s`` ``(d,)`` float64 of network weights ``v`` under prior scales ``s`` (both
    ``(d,)``); zero where ``s = 0`` (a weight the prior fixes cannot move, and its coordinate is not used)."""
    v, s = v.double(), s.double()
    return torch.where(s > 0, v / torch.where(s > 0, s, 1.0), torch.zeros_like(v))


def mean_kl(network_logits: torch.Tensor, mode_logits: torch.Tensor) -> float:
    """``(1/n) Σ_i KL(softmax(f_i) ‖ softmax(η_i))`` in nats (float64) for logits ``(n, C)`` of the network ``f``
    and of the linearised model's mode ``η``."""
    log_p, log_q = torch.log_softmax(network_logits.double(), 1), torch.log_softmax(mode_logits.double(), 1)
    return max(float((log_p.exp() * (log_p - log_q)).sum(1).mean()), 0.0)


@dataclasses.dataclass
class ModeResult:
    """``w`` ``(d,)`` float64, the objective ``F(w)``, ``‖∇F‖``, function evaluations, linear-model logits
    ``η`` ``(n, C)`` and probabilities at the mode."""

    w: torch.Tensor
    objective: float
    grad_norm: float
    evaluations: int
    logits: torch.Tensor
    probs: torch.Tensor


class LinearMode:
    """Mode finder of the linearised categorical model (module docstring).

    Parameters
    ----------
    network : LinearizedNetwork
        ``J`` on the training inputs (``d_out = n·C``).
    scales : torch.Tensor
        ``s`` ``(d,)``.
    labels : torch.Tensor
        ``(n,)`` class indices.
    logits : torch.Tensor
        ``f̃`` ``(n, C)`` of the trained network (``"affine"`` only).
    kind : {"tangent", "affine"}
        The linearised model whose categorical mode sets ``‖w*‖²`` in the M-step (:class:`ctuq.options.LinearModel`;
        module docstring).
    max_iter : int
        Function evaluations per call.
    gtol : float
        Relative gradient tolerance.
    """

    def __init__(
        self,
        network,
        scales: torch.Tensor,
        labels: torch.Tensor,
        logits: torch.Tensor,
        *,
        kind: str = "tangent",
        max_iter: int = 500,
        gtol: float = 1e-4,
    ):
        if kind not in values(LinearModel):
            raise ValueError(f"LinearMode: kind must be one of {list(values(LinearModel))}, got {kind!r}")
        self.net = network
        self.s = scales.detach().double()
        self.labels = labels.long()
        self.f = logits.detach().double()
        self.n, self.C = (int(v) for v in self.f.shape)
        self.kind = kind
        self.max_iter = int(max_iter)
        self.gtol = float(gtol)
        self.w_trained = scaled_weights(network.params(), self.s)
        self._offset = None
        if kind == LinearModel.AFFINE:  # f̃ − J ṽ (zero-scale weights cannot move and stay at ṽ)
            self._offset = self.f - self.jvp(self.w_trained).reshape(self.n, self.C)

    def jvp(self, w: torch.Tensor) -> torch.Tensor:
        """``J (s ⊙ w)`` ``(n·C,)`` float64 for scaled weights ``w`` ``(d,)``: the tangent logits, flat (no offset)."""
        return self.net.jvp((w * self.s)[None].to(self.net.dtype))[0].double()

    def logits_at(self, w: torch.Tensor) -> torch.Tensor:
        """Linear-model logits ``η(w)`` ``(n, C)``."""
        eta = self.jvp(w).reshape(self.n, self.C)
        return eta if self._offset is None else eta + self._offset

    def objective(self, w: torch.Tensor, a: float) -> tuple[float, torch.Tensor, torch.Tensor]:
        """``(F(w), ∇F(w), η(w))``."""
        eta = self.logits_at(w)
        logp = torch.log_softmax(eta, 1)
        nll = -logp[torch.arange(self.n), self.labels].sum()
        resid = logp.exp()
        resid[torch.arange(self.n), self.labels] -= 1.0
        grad = self.net.vjp(resid.reshape(1, -1).to(self.net.dtype))[0].double() * self.s + a * w
        return float(nll + 0.5 * a * w.pow(2).sum()), grad, eta

    def fit(self, a: float, w0: torch.Tensor | None = None) -> ModeResult:
        """The mode at prior precision ``a``, from ``w0`` (default: the trained weights ``w̃``)."""
        if not (a > 0 and math.isfinite(a)):
            raise ValueError(f"LinearMode.fit: a must be positive and finite, got {a}")
        w = (self.w_trained if w0 is None else w0.detach().double()).clone().requires_grad_(True)
        opt = torch.optim.LBFGS(
            [w],
            lr=1.0,
            max_iter=self.max_iter,
            history_size=20,
            line_search_fn="strong_wolfe",
            tolerance_grad=0.0,
            tolerance_change=0.0,
        )
        count = [0]

        def closure():
            count[0] += 1
            with torch.no_grad():
                value, grad, _ = self.objective(w.detach(), a)
            w.grad = grad
            # stop L-BFGS once the gradient is small relative to the prior term (a‖w‖ = ‖data gradient‖ at the mode)
            if float(grad.norm()) <= self.gtol * max(1.0, a * float(w.detach().norm())):
                w.grad = torch.zeros_like(grad)
            return torch.tensor(value, dtype=torch.float64)

        opt.step(closure)
        with torch.no_grad():
            value, grad, eta = self.objective(w.detach(), a)
        return ModeResult(w.detach().clone(), value, float(grad.norm()), count[0], eta, torch.softmax(eta, 1))
