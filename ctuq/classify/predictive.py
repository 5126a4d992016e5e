"""Predictive distributions of linearised Laplace at new inputs.

Given zero-mean posterior samples ``ζ_j`` (``k × d``) of the scaled weights, the linearised network's logits at
inputs ``x`` are ``f(x; ṽ) + J(x)(s ⊙ ζ_j)`` (``J(x)`` by one JVP per sample, batched over inputs). From them:

* ``link="mc"``: ``p(y | x) ≈ (1/k) Σ_j softmax(f(x) + J(x)(s ⊙ ζ_j))`` (Monte Carlo over logits);
* ``link="probit"``: ``p(y | x) ≈ softmax(f(x) / √(1 + π/8 · v(x)))`` with the per-class logit variances
  ``v(x)_c = (1/k) Σ_j [J(x)(s ⊙ ζ_j)]_c²`` (MacKay's probit approximation, as laplace-torch's ``probit``).

The mean is the trained network's logits (the linear model's covariance, the network's mean: the published
setting). All work happens in the model's dtype; inputs are processed in batches of ``batch_size``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from ctuq.classify.data import check_logits, collect_inputs
from ctuq.linearize import LinearizedNetwork
from ctuq.options import Link, values
from ctuq.utils import progress as _progress

__all__ = ["logit_samples", "link_probabilities", "PredictiveMixin"]


@torch.no_grad()
def logit_samples(
    model: nn.Module,
    names: Sequence[str],
    X: torch.Tensor,
    scaled_weights: torch.Tensor,
    scales: torch.Tensor,
    *,
    batch_size: int = 256,
    progress: bool = False,
    where: str = "LinearizedLaplace",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f (N, C), Z (k, N, C))``: network logits and zero-mean linearised deviations ``J(x)(s ⊙ ζ_j)``.

    ``model`` is in the dtype of the computation; ``X`` ``(N, ...)`` is converted to it; ``scaled_weights``
    ``(k, d)`` and ``scales`` ``(d,)``.
    """
    dtype = next(model.parameters()).dtype
    V = (scaled_weights.to(torch.float64) * scales.to(torch.float64)).to(dtype)
    means, devs = [], []
    starts = range(0, X.shape[0], batch_size)
    for start in _progress(starts, total=len(starts), desc="predict", disable=not progress):
        xb = X[start : start + batch_size].to(dtype)
        try:
            net = LinearizedNetwork(model, xb, param_names=list(names), mode="recompute")
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"{where}: the model failed on inputs of shape {tuple(xb.shape)} (do they have the "
                f"training inputs' shape per example?): {exc}"
            ) from exc
        f = check_logits(net.output().reshape(net.output_shape), xb.shape[0], where=where)
        means.append(f)
        devs.append(net.jvp(V).reshape(V.shape[0], *f.shape) if V.shape[0] else f.new_zeros((0, *f.shape)))
    return torch.cat(means), torch.cat(devs, dim=1)


def link_probabilities(f: torch.Tensor, Z: torch.Tensor, link: str = "mc") -> torch.Tensor:
    """Predictive class probabilities ``(N, C)`` (float64) from logits ``f`` ``(N, C)`` and deviations ``Z``
    ``(k, N, C)`` with the ``link`` of the module docstring."""
    if link not in values(Link):
        raise ValueError(f"link must be one of {list(values(Link))}, got {link!r}")
    f, Z = f.double(), Z.double()
    if Z.shape[0] == 0:
        return torch.softmax(f, -1)
    if link == Link.MC:
        return torch.softmax(f[None] + Z, -1).mean(0)
    var = Z.pow(2).mean(0)
    return torch.softmax(f / torch.sqrt(1.0 + math.pi / 8.0 * var), -1)


class PredictiveMixin:
    """The prediction methods of :class:`~ctuq.classify.LinearizedLaplace` (it provides ``posterior``,
    ``_samples``, ``_model``, ``param_names``, ``scales``, ``progress``, ``_require``, ``_lift``, ``_ella``,
    ``basis`` and the cache ``_ella_directions``)."""

    def posterior_samples(self, n: int, seed: int = 0) -> torch.Tensor:
        """``n`` zero-mean posterior samples ``ζ`` ``(n, d)`` of the scaled weights (cached per ``(n, seed, a)``)."""
        c = self._samples
        if (
            c is not None
            and c["n"] == n
            and c["seed"] == seed
            and (self.posterior is None or c["a"] == self.posterior.a)
        ):
            return c["weights"]
        self._require("posterior_samples")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"LinearizedLaplace: the number of samples must be a positive int, got {n!r}")
        W = torch.cat([ps.weights.double() for _, ps in self.posterior.sample(n, chunk_size=64, seed=seed)])
        W = self._lift(W)  # ELLA's K coordinates → the d scaled weights
        self._samples = {"n": n, "seed": seed, "a": float(self.posterior.a), "weights": W}
        return W

    def _logits(self, x, n_samples: int, seed: int, batch_size: int, where: str):
        self._require(where, samples_ok=True)
        X = collect_inputs(x, where=f"LinearizedLaplace.{where}")
        W = self.posterior_samples(n_samples, seed)
        basis = self.basis if self._ella else None

        def deviations(weights: torch.Tensor):
            return logit_samples(
                self._model,
                self.param_names,
                X,
                weights,
                self.scales,
                batch_size=batch_size,
                progress=self.progress,
                where=f"LinearizedLaplace.{where}",
            )

        if basis is None:
            return deviations(W)
        # ELLA: the K feature directions J(x)(s ⊙ V) by K Jacobian-vector products per input, then the samples'
        # coordinates u = Vᵀw combine them (w = V u); not one product per sample as for the other routes. The
        # directions do not depend on a: the last inputs' are kept, so that a grid search or the held-out guard
        # takes them once for all its a (the same tensor, not modified in place since)
        kept = self._ella_directions
        if kept is not None and kept[0]() is X and kept[1] == X._version and kept[2] is basis.V:
            f, D = kept[3], kept[4]
        else:
            f, D = deviations(basis.V.T.double())
            self._ella_directions = (weakref.ref(X), X._version, basis.V, f, D)
        return f.clone(), torch.einsum("nk,kbc->nbc", basis.project(W).to(D.dtype), D)

    def logit_deviations(self, x, n_samples: int = 64, *, seed: int = 0, batch_size: int = 256):
        """``(f (N, C), Z (n_samples, N, C))``: the network's logits at ``x`` and the zero-mean linearised
        deviations ``J(x)(s ⊙ ζ_j)`` of the posterior samples (every predictive here is built from these)."""
        return self._logits(x, n_samples, seed, batch_size, "logit_deviations")

    def sample_logits(self, x, n_samples: int = 64, *, seed: int = 0, batch_size: int = 256) -> torch.Tensor:
        """Linearised-network logit samples ``(n_samples, N, C)`` at inputs ``x`` (a tensor or a loader)."""
        f, Z = self._logits(x, n_samples, seed, batch_size, "sample_logits")
        return f[None] + Z

    def predict_logits(self, x, n_samples: int = 64, *, seed: int = 0, batch_size: int = 256):
        """``(mean (N, C), covariance (N, C, C))`` of the linearised logits: the network's logits and the sample
        covariance ``(1/k) Σ_j z_j z_jᵀ`` of the zero-mean deviations."""
        f, Z = self._logits(x, n_samples, seed, batch_size, "predict_logits")
        return f, torch.einsum("kna,knb->nab", Z, Z) / Z.shape[0]

    def predict(self, x, link: str = "mc", samples: int = 64, *, seed: int = 0, batch_size: int = 256) -> torch.Tensor:
        """Predictive class probabilities ``(N, C)`` float64 at inputs ``x``; ``link`` ``"mc"`` or ``"probit"``."""
        if link not in values(Link):
            raise ValueError(f"LinearizedLaplace.predict: link must be one of {list(values(Link))}, got {link!r}")
        f, Z = self._logits(x, samples, seed, batch_size, "predict")
        return link_probabilities(f, Z, link)
