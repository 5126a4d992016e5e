"""Dual Matheron-rule posterior samples and the posterior mean of ``ỹ = Ψ w + ε`` (DESIGN.md §1).

Model: ``w ~ N(0, a⁻¹ I)`` (``d`` scaled weights), ``ε ~ N(0, σ² I)`` (``c`` targets), ``C = K̄/a + σ² I``.

* Posterior mean: ``w* = a⁻¹ Ψᵀ u`` with ``u = C⁻¹ ỹ``; ``Ψ w* = ỹ − σ² u`` (no product needed).
* Zero-mean posterior sample (Matheron's rule, solved in the ``c``-dimensional dual space)::

      w₀ ~ N(0, a⁻¹ I),  ε ~ N(0, σ² I),  ζ = w₀ + a⁻¹ Ψᵀ C⁻¹ (ε − Ψ w₀)  ~ N(0, (ΨᵀΨ/σ² + a I)⁻¹)

  and, since ``a⁻¹ K̄ C⁻¹ = I − σ² C⁻¹``: ``Ψ ζ = ε − σ² C⁻¹(ε − Ψ w₀)`` (no product needed).
  Posterior samples of the weights are ``w* + ζ``; image-space samples are ``Φ(s ⊙ ζ)``
  (:meth:`ctuq.inference.features.LinearizedFeatures.network_matvec`), predictive samples ``x̃ + Φ(s ⊙ ζ)``.

Cost of ``k`` samples with the mean: ``k`` JVPs (``Ψ w₀``), one batched solve of ``k + 1`` right-hand sides
(mean and samples together, so one preconditioner application and one batched product per CG iteration serve
all of them), and ``k + 1`` VJPs (``Ψᵀ``).

Random numbers: each call draws, from its ``generator`` and in this order, ``w₀`` (``k × d`` standard normals)
then ``ε`` (``k × c``). Draws happen on the generator's device and are moved to the features' device, so a CPU
generator gives the same samples on every device. For resumable prediction runs, :func:`sample_chunks` draws
chunk ``i`` from :func:`chunk_generator` ``(seed, i)``: chunks are independent of each other and of the order in
which they are computed, so a run resumed at chunk ``i`` reproduces the uninterrupted run exactly (same
``seed`` and ``chunk_size``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from ctuq.inference.checks import check_hyper, check_targets
from ctuq.inference.features import FeatureOperator
from ctuq.inference.likelihoods import GaussianLikelihood, Likelihood
from ctuq.inference.solvers.base import Solver, SolveStats
from ctuq.utils import derived_seed_words

__all__ = [
    "PosteriorSamples",
    "sample_posterior",
    "posterior_mean",
    "chunk_generator",
    "sample_chunks",
    "draw_prior_and_noise",
]


@dataclasses.dataclass
class PosteriorSamples:
    """Output of :func:`sample_posterior`.

    Attributes
    ----------
    weights : torch.Tensor
        ``ζ`` ``(k, d)``: zero-mean posterior samples of the scaled weights.
    measurement : torch.Tensor
        ``Ψ ζ`` ``(k, c)`` (from the identity above; no products).
    mean : torch.Tensor or None
        ``w*`` ``(d,)`` when ``y_tilde`` was given.
    mean_measurement : torch.Tensor or None
        ``Ψ w* = ỹ − σ² u`` ``(c,)``.
    u : torch.Tensor or None
        ``C⁻¹ ỹ`` ``(c,)``.
    stats : SolveStats
        Of the joint solve (mean first, then samples).
    """

    weights: torch.Tensor
    measurement: torch.Tensor
    mean: torch.Tensor | None
    mean_measurement: torch.Tensor | None
    u: torch.Tensor | None
    stats: SolveStats


def draw_prior_and_noise(
    n: int,
    features: FeatureOperator,
    a: float,
    sigma2: float,
    generator: torch.Generator,
    *,
    likelihood: Likelihood | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w₀ (n, d), ε (n, c))`` with ``w₀ ~ N(0, a⁻¹ I)`` and the likelihood's noise ``ε`` (default
    ``N(0, σ² I)``); ``w₀`` drawn first."""
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"a torch.Generator is required for reproducible samples, got {type(generator).__name__}")
    dt, dev = features.dtype, features.device
    w0 = torch.randn((n, features.n_features), generator=generator, device=generator.device, dtype=dt)
    noise = likelihood if likelihood is not None else GaussianLikelihood(sigma2)
    eps = noise.draw_noise(n, features.n_outputs, generator, dt)
    return w0.to(dev).mul_(float(a) ** -0.5), eps.to(dev)


def sample_posterior(
    features: FeatureOperator,
    solver: Solver,
    a: float,
    sigma2: float,
    n_samples: int,
    *,
    generator: torch.Generator,
    y_tilde: torch.Tensor | None = None,
) -> PosteriorSamples:
    """``n_samples`` zero-mean posterior weight samples ``ζ`` (and ``w*`` if ``y_tilde`` is given).

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``).
    solver : Solver
        Solves ``C X = R`` (its kernel must be built on the same ``features``).
    a, sigma2 : float
        Prior precision and noise variance.
    n_samples : int
        ``k ≥ 0``.
    generator : torch.Generator
        Source of ``w₀`` then ``ε`` (module docstring).
    y_tilde : torch.Tensor, optional
        ``(c,)`` targets including any offset ``δ``; when given, the mean is solved in the same batch.
    """
    a_f, s2_f = check_hyper(a, sigma2, "sample_posterior")
    if not isinstance(n_samples, int) or n_samples < 0:
        raise ValueError(f"sample_posterior: n_samples must be an int >= 0, got {n_samples!r}")
    if solver.features is not features:
        raise ValueError("sample_posterior: the solver was built for a different feature operator")
    y = None if y_tilde is None else check_targets(y_tilde, features, "sample_posterior")
    w0, eps = draw_prior_and_noise(n_samples, features, a_f, s2_f, generator)
    rhs_s = eps - features.matvec(w0) if n_samples else eps
    rhs = rhs_s if y is None else torch.cat([y[None], rhs_s], dim=0)
    V, stats = solver.solve(rhs, a_f, s2_f)
    G = features.rmatvec(V)
    off = 0 if y is None else 1
    zeta = w0 + G[off:] / a_f
    meas = eps - s2_f * V[off:]
    if y is None:
        return PosteriorSamples(zeta, meas, None, None, None, stats)
    u = V[0]
    return PosteriorSamples(zeta, meas, G[0] / a_f, y - s2_f * u, u, stats)


def posterior_mean(
    features: FeatureOperator, solver: Solver, y_tilde: torch.Tensor, a: float, sigma2: float
) -> tuple[torch.Tensor, torch.Tensor, SolveStats]:
    """``(w* (d,), u = C⁻¹ỹ (c,), stats)``: one solve and one VJP."""
    a_f, s2_f = check_hyper(a, sigma2, "posterior_mean")
    y = check_targets(y_tilde, features, "posterior_mean")
    V, stats = solver.solve(y[None], a_f, s2_f)
    return features.rmatvec(V)[0] / a_f, V[0], stats


def chunk_generator(seed: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` for sample chunk ``index`` of a run seeded with ``seed``.

    The 64-bit seed comes from numpy's ``SeedSequence([seed, index])``, so chunk streams are statistically
    independent and do not depend on how many chunks were drawn before.
    """
    hi, lo = derived_seed_words(seed, index)
    derived = (hi << 32 | lo) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=torch.device(device)).manual_seed(derived)


def sample_chunks(
    features: FeatureOperator,
    solver: Solver,
    a: float,
    sigma2: float,
    n_samples: int,
    *,
    chunk_size: int,
    seed: int,
    start_chunk: int = 0,
    generator_device: torch.device | str = "cpu",
    chunks: Iterable[int] | None = None,
) -> Iterator[tuple[int, PosteriorSamples]]:
    """Yield ``(i, samples)`` for chunks ``i = start_chunk, …`` of ``n_samples`` zero-mean samples.

    Chunk ``i`` holds samples ``i·chunk_size … min(n_samples, (i+1)·chunk_size) − 1`` and draws from
    :func:`chunk_generator` ``(seed, i)``: resuming at ``start_chunk`` reproduces the same samples. The mean is
    not included (use :func:`posterior_mean` once). ``chunks``: only these chunk indices (ascending, each in
    ``start_chunk … n_chunks − 1``), e.g. one rank's round-robin share in a sharded run.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"sample_chunks: chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(n_samples, int) or n_samples < 0:
        raise ValueError(f"sample_chunks: n_samples must be an int >= 0, got {n_samples!r}")
    n_chunks = -(-n_samples // chunk_size)
    if not 0 <= start_chunk <= n_chunks:
        raise ValueError(f"sample_chunks: start_chunk {start_chunk} outside 0..{n_chunks}")
    todo = range(start_chunk, n_chunks)
    if chunks is not None:
        picked = sorted({int(i) for i in chunks})
        bad = [i for i in picked if i not in todo]
        if bad:
            raise ValueError(f"sample_chunks: chunk indices {bad[:5]} outside {start_chunk}..{n_chunks - 1}")
        todo = picked
    for i in todo:
        k = min(chunk_size, n_samples - i * chunk_size)
        gen = chunk_generator(seed, i, generator_device)
        yield i, sample_posterior(features, solver, a, sigma2, k, generator=gen)
