"""Classification metrics for predictive distributions: NLL, accuracy, ECE, Brier score, reliability diagrams and
the joint log-likelihood of κ-tuples.

Shapes: ``probs`` ``(N, C)`` predictive class probabilities (rows sum to 1), ``labels`` ``(N,)`` integer classes,
``sample_log_probs`` ``(S, N, C)`` per-sample log-probabilities (``log_softmax`` of ``S`` logit samples; a point
estimate is ``S = 1``). Tensors or numpy arrays; results are Python floats (nats for likelihoods).

* NLL: ``−(1/N) Σ_i log p(y_i | x_i)`` (probabilities clamped at 1e-300).
* ECE (Guo et al. 2017): ``Σ_b (|B_b|/N) |acc(B_b) − conf(B_b)|`` over ``n_bins`` (default 15) equal-width bins
  ``(b/n_bins, (b+1)/n_bins]`` of the top-class confidence.
* Brier score: ``(1/N) Σ_i Σ_c (p_ic − 1[y_i = c])²`` (0 … 2).
* Paired bootstrap (:func:`paired_bootstrap`): the NLL and ECE of one predictive minus another's on the same inputs,
  with the spread of those differences over resamples of the inputs (Efron & Tibshirani 1993, §16): whether a test
  set this size can tell two predictives apart at all.
* Joint log-likelihood of κ-tuples (Osband et al. 2022, "Evaluating high-order predictive distributions in deep
  learning"; used for linearised Laplace by Antorán, Padhy et al. 2023): for a tuple ``τ`` of κ test points,
  ``log (1/S) Σ_s Π_{i∈τ} p_s(y_i | x_i)`` divided by κ (nats per point, so κ = 1 is the usual test log-likelihood),
  averaged over ``n_tuples`` tuples. ``sampling="dyadic"`` (default) draws two anchor points uniformly and then the
  κ members uniformly with replacement from the two anchors, so tuples repeat points and the joint predictive's
  correlations matter; ``"uniform"`` draws κ distinct points. A point estimate's value does not depend on κ beyond
  the sampling noise; a posterior whose samples agree on which points are hard gains with κ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

from ctuq.options import TupleSampling, values

__all__ = [
    "nll",
    "accuracy",
    "expected_calibration_error",
    "reliability_diagram",
    "brier_score",
    "paired_bootstrap",
    "joint_log_likelihood",
    "joint_log_likelihoods",
    "classification_summary",
]


def _probs(probs, labels, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.as_tensor(np.asarray(probs) if not isinstance(probs, torch.Tensor) else probs).double()
    y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels).long()
    if p.ndim != 2 or y.shape != (p.shape[0],) or p.shape[0] == 0:
        raise ValueError(
            f"{where}: probs must be (N, C) and labels (N,) with N >= 1, got {tuple(p.shape)} and {tuple(y.shape)}"
        )
    if int(y.min()) < 0 or int(y.max()) >= p.shape[1]:
        raise ValueError(f"{where}: labels must lie in 0..{p.shape[1] - 1}, got {int(y.min())}..{int(y.max())}")
    return p, y


def nll(probs, labels) -> float:
    """Mean negative log predictive probability of the labels (nats)."""
    p, y = _probs(probs, labels, "nll")
    return float(-p[torch.arange(len(y)), y].clamp_min(1e-300).log().mean())


def accuracy(probs, labels) -> float:
    """Fraction of argmax predictions equal to the labels."""
    p, y = _probs(probs, labels, "accuracy")
    return float((p.argmax(1) == y).double().mean())


def _confidence_bins(conf: torch.Tensor, n_bins, where: str) -> torch.Tensor:
    """The equal-width bin of each top-class confidence, ``(b/n_bins, (b+1)/n_bins] → b`` (the ECE's bins)."""
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"{where}: n_bins must be a positive int, got {n_bins!r}")
    return torch.clamp(torch.ceil(conf * n_bins).long() - 1, 0, n_bins - 1)


def reliability_diagram(probs, labels, n_bins: int = 15) -> dict:
    """Per-bin ``confidence``, ``accuracy`` and ``count`` (arrays of length ``n_bins``; empty bins NaN / 0) and
    the bin ``edges`` (``n_bins + 1``) of the top-class confidence."""
    p, y = _probs(probs, labels, "reliability_diagram")
    conf, pred = p.max(1)
    correct = (pred == y).double()
    idx = _confidence_bins(conf, n_bins, "reliability_diagram")
    count = torch.bincount(idx, minlength=n_bins).double()
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf)
    acc_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, correct)
    nan = torch.full_like(count, float("nan"))
    return {
        "edges": np.linspace(0.0, 1.0, n_bins + 1),
        "confidence": torch.where(count > 0, conf_sum / count.clamp_min(1), nan).numpy(),
        "accuracy": torch.where(count > 0, acc_sum / count.clamp_min(1), nan).numpy(),
        "count": count.numpy().astype(int),
    }


def expected_calibration_error(probs, labels, n_bins: int = 15) -> float:
    """ECE with ``n_bins`` equal-width confidence bins (module docstring)."""
    d = reliability_diagram(probs, labels, n_bins)
    w = d["count"] / d["count"].sum()
    gap = np.abs(np.nan_to_num(d["accuracy"]) - np.nan_to_num(d["confidence"]))
    return float((w * gap).sum())


def brier_score(probs, labels) -> float:
    """Multi-class Brier score ``(1/N) Σ_i ‖p_i − e_{y_i}‖²``."""
    p, y = _probs(probs, labels, "brier_score")
    onehot = torch.nn.functional.one_hot(y, p.shape[1]).double()
    return float((p - onehot).pow(2).sum(1).mean())


_BOOTSTRAP_BLOCK = 2**22  # resample multiplicities held at once by paired_bootstrap (float64: 32 MB)


def paired_bootstrap(probs, reference, labels, *, n_resamples: int = 2000, seed: int = 0, n_bins: int = 15) -> dict:
    """NLL and ECE of ``probs`` minus those of ``reference`` on the same ``N`` inputs, with bootstrap intervals.

    Each of ``n_resamples`` resamples draws ``N`` inputs with replacement (numpy ``default_rng(seed)``) and scores
    both predictives on the same draw, so what the two share (the hard inputs) cancels. ``probs`` and ``reference``
    are ``(N, C)``, ``labels`` ``(N,)``.

    Returns ``{"nll": …, "ece": …, "n": N, "n_resamples": …}``; each metric is ``{"difference"`` (on all ``N``
    inputs; negative: ``probs`` is better), ``"interval_95"`` (the 2.5 / 97.5 % percentiles over the resamples),
    ``"p_better"`` (the fraction of resamples in which ``probs`` scores lower)``}``.
    """
    p, y = _probs(probs, labels, "paired_bootstrap")
    q, _ = _probs(reference, labels, "paired_bootstrap")
    if q.shape != p.shape:
        raise ValueError(
            f"paired_bootstrap: probs and reference must have one shape, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    if not isinstance(n_resamples, int) or n_resamples < 1:
        raise ValueError(f"paired_bootstrap: n_resamples must be a positive int, got {n_resamples!r}")
    n = len(y)
    rows = torch.arange(n)
    # per-input terms, so that every resample is a weighted sum: the NLL's −log p, and ECE's signed
    # (correct − confidence) in its confidence bin (ECE is Σ_b |Σ_{i∈b} (correct_i − conf_i)| / N)
    terms = {}
    for name, r in (("probs", p), ("reference", q)):
        conf, pred = r.max(1)
        b = _confidence_bins(conf, n_bins, "paired_bootstrap")
        gap = torch.zeros(n, n_bins, dtype=torch.float64)
        gap[rows, b] = (pred == y).double() - conf
        terms[name] = (-r[rows, y].clamp_min(1e-300).log().numpy(), gap.numpy())

    def score(weights):  # (R, n) multiplicities → {metric: (R,) probs' score − reference's}
        return {
            "nll": weights @ (terms["probs"][0] - terms["reference"][0]) / n,
            "ece": (np.abs(weights @ terms["probs"][1]).sum(1) - np.abs(weights @ terms["reference"][1]).sum(1)) / n,
        }

    # the resamples' multiplicities a block at a time (~32 MB of float64 whatever n_resamples), drawn row by row from
    # one generator, so the draws are those of one (n_resamples, n) call
    rng = np.random.default_rng(seed)
    block = max(1, min(n_resamples, _BOOTSTRAP_BLOCK // n))
    diffs = {"nll": [], "ece": []}
    for start in range(0, n_resamples, block):
        r = min(block, n_resamples - start)
        idx = rng.integers(0, n, size=(r, n)) + n * np.arange(r)[:, None]
        weights = np.bincount(idx.ravel(), minlength=r * n).reshape(r, n).astype(np.float64)
        for metric, d in score(weights).items():
            diffs[metric].append(d)
    full = score(np.ones((1, n)))
    out: dict = {"n": n, "n_resamples": n_resamples}
    for metric in ("nll", "ece"):
        diff_full = float(full[metric][0])
        diff = np.concatenate(diffs[metric])
        lo, hi = np.percentile(diff, [2.5, 97.5])
        out[metric] = {
            "difference": diff_full,
            "interval_95": (float(lo), float(hi)),
            "p_better": float((diff < 0).mean()),
        }
    return out


def _label_log_probs(sample_log_probs, labels, where: str) -> torch.Tensor:
    lp = (
        sample_log_probs
        if isinstance(sample_log_probs, torch.Tensor)
        else torch.as_tensor(np.asarray(sample_log_probs))
    )
    lp = lp.double()
    if lp.ndim == 2:
        lp = lp[None]
    y = torch.as_tensor(np.asarray(labels) if not isinstance(labels, torch.Tensor) else labels).long()
    if lp.ndim != 3 or y.shape != (lp.shape[1],) or lp.shape[0] == 0 or lp.shape[1] == 0:
        raise ValueError(
            f"{where}: sample_log_probs must be (S, N, C) (or (N, C)) and labels (N,), got "
            f"{tuple(lp.shape)} and {tuple(y.shape)}"
        )
    if int(y.min()) < 0 or int(y.max()) >= lp.shape[2]:
        raise ValueError(f"{where}: labels must lie in 0..{lp.shape[2] - 1}")
    return lp[:, torch.arange(lp.shape[1]), y]  # (S, N)


def _tuples(N: int, kappa: int, n_tuples: int, sampling: str, gen: torch.Generator) -> torch.Tensor:
    if sampling == TupleSampling.DYADIC:
        anchors = torch.randint(0, N, (n_tuples, 2), generator=gen)
        pick = torch.randint(0, 2, (n_tuples, kappa), generator=gen)
        return torch.gather(anchors, 1, pick)
    if kappa > N:
        raise ValueError(f"joint_log_likelihood: kappa={kappa} distinct points need N >= kappa, got N={N}")
    return torch.argsort(torch.rand((n_tuples, N), generator=gen), dim=1)[:, :kappa]


def joint_log_likelihood(
    sample_log_probs, labels, kappa: int, *, n_tuples: int = 10000, sampling: str = TupleSampling.DYADIC, seed: int = 0
) -> float:
    """Joint log-likelihood of κ-tuples, nats per point (module docstring); tuples drawn with ``seed``."""
    lp = _label_log_probs(sample_log_probs, labels, "joint_log_likelihood")
    if not isinstance(kappa, int) or kappa < 1:
        raise ValueError(f"joint_log_likelihood: kappa must be a positive int, got {kappa!r}")
    if sampling not in values(TupleSampling):
        raise ValueError(
            f"joint_log_likelihood: sampling must be one of {list(values(TupleSampling))}, got {sampling!r}"
        )
    gen = torch.Generator().manual_seed(int(seed))
    idx = _tuples(lp.shape[1], kappa, int(n_tuples), sampling, gen)
    total = lp[:, idx].sum(-1)  # (S, T)
    joint = torch.logsumexp(total, 0) - math.log(lp.shape[0])
    return float(joint.mean() / kappa)


def joint_log_likelihoods(sample_log_probs, labels, kappas: Iterable[int] = range(1, 11), **kwargs) -> dict[int, float]:
    """``{κ: joint_log_likelihood(…, κ)}`` for each κ (same tuples seed for every κ and every method)."""
    return {int(k): joint_log_likelihood(sample_log_probs, labels, int(k), **kwargs) for k in kappas}


def classification_summary(
    probs, labels, sample_log_probs=None, *, n_bins: int = 15, kappas: Iterable[int] = range(1, 11), seed: int = 0
) -> dict:
    """``{"nll", "accuracy", "ece", "brier"}`` and, with ``sample_log_probs``, ``"joint_ll"`` ``{κ: value}``."""
    out = {
        "nll": nll(probs, labels),
        "accuracy": accuracy(probs, labels),
        "ece": expected_calibration_error(probs, labels, n_bins),
        "brier": brier_score(probs, labels),
    }
    if sample_log_probs is not None:
        out["joint_ll"] = joint_log_likelihoods(sample_log_probs, labels, kappas, seed=seed)
    return out
