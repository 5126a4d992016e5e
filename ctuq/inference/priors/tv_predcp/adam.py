"""The TV-PredCP fit's first method (``uq.tv_predcp.optimizer = adam``): every step an Adam step of size
``uq.tv_predcp.lr`` on ``θ`` (``torch.optim.Adam``, ascent) plus MacKay's updates of the global scale and the noise.
Adam needs only gradients, so the library's runs on the fit's gradient oracle as it is."""

from __future__ import annotations

import math
import time

import torch

from ctuq.inference.priors.tv_predcp.steps import convergence, mackay, record

__all__ = ["fit_adam"]


def fit_adam(prior, oracle, *, a, sigma2, c, learn_noise, g_var, emit) -> float:
    """Adam on ``θ`` with the MacKay updates after every step, until the convergence criterion holds or
    ``prior.steps`` steps are taken; ``emit(record)`` after every step. Returns the final ``σ²``. ``g_var`` is not
    used (no box: lengthscales are clipped to their range, variances are free)."""
    m = len(prior.matern)
    x = prior.theta().requires_grad_(True)
    # default betas and eps (Kingma & Ba); maximize: J is maximised
    adam = torch.optim.Adam([x], lr=prior.lr, betas=(0.9, 0.999), eps=1e-8, maximize=True)
    s2 = sigma2
    for _ in range(prior.steps):
        t0 = time.perf_counter()
        g, info, hp, details = oracle(x.detach(), s2)
        g = g[: prior.n_hyper]
        old = x.detach().clone()
        x.grad = g.clone()
        adam.step()
        scale, s2_new = mackay(info, a=a, c=c, s2=s2, learn_noise=learn_noise)
        oracle.since *= scale
        with torch.no_grad():
            x[m:] += math.log(scale)
            prior.set_theta(x)
            x.copy_(prior.theta())  # lengthscales clipped to their range
        change = max(float((x.detach() - old).abs().max()), abs(math.log(s2_new / s2)))
        s2 = s2_new
        emit(record(prior, info, hp, details, s2, g, "adam", scale, change, 1, t0))
        if convergence(prior.trace, prior.tol)["converged"]:
            break
    return s2
