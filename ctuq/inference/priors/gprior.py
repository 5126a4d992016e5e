"""The g-prior, the scales ``s`` of ``v = diag(s) w`` (exact or stochastic column norms), and the scale functions
the other front ends use (:class:`GPrior`; the isotropic prior ``s = 1`` is :mod:`.isotropic`).

The g-prior (DESIGN.md §1) puts the same prior variance on every weight *in units of its effect on the data*:
``s_i = [Φᵀ Lᵀ L Φ]_ii^(−1/2) = 1 / ‖A_{:,i}‖`` with ``A = L Φ`` (``c × d``; CT: ``L = T``). Scaled weights
``w = (v − ṽ) / s`` then all have columns of unit norm in ``Ψ = A diag(s)``, so ``diag(ΨᵀΨ) = 1``.

Only ``A_rmatvec(R) = Aᵀ R`` (rows: ``(B, c)`` → ``(B, d)``, one VJP per row) is needed: column norms of ``A``
are sums over its rows, and a row ``j`` of ``A`` is ``Aᵀ e_j``. (``A_matvec`` would need ``d ≫ c`` products.)

* ``method="exact"``: ``‖A_{:,i}‖² = Σ_j (Aᵀ e_j)_i²`` with all ``c`` unit vectors, in chunks: ``c`` VJPs.
* ``method="stochastic"``: with ``m`` Rademacher probes ``z_k ∈ {±1}^c`` (thesis eq. 6.13 style)::

      n̂_i = (1/m) Σ_k (Aᵀ z_k)_i² ,   E[n̂_i] = Σ_j A_ji² = ‖A_{:,i}‖²  (unbiased, E[z zᵀ] = I),
      Var[n̂_i] = (2/m) (‖A_{:,i}‖⁴ − Σ_j A_ji⁴) ≤ (2/m) ‖A_{:,i}‖⁴ .

  The relative standard deviation of ``n̂_i`` is at most ``√(2/m)``, that of ``ŝ_i = n̂_i^(−1/2)`` about half
  of it: ``√(1/(2m))`` (delta method; 256 probes: ≤ 4.4 %). Rademacher probes are never worse than Gaussian
  ones (whose variance is exactly ``(2/m)‖A_{:,i}‖⁴``). Cost: ``m`` VJPs.
* ``method="isotropic"``: ``s = 1`` (no products).

Columns with zero norm (weights with no influence on ``A``'s output, e.g. behind a dead unit or in ``T``'s
null space) have no defined g-prior scale. They get ``s_i = zero_norm_value`` (default ``0``): the weight is
removed from the linear model. This choice does not affect inference at all (column ``i`` of ``Ψ = A diag(s)``
is zero for any finite ``s_i``); it only decides whether such weights add prior-only variance to image-space
samples ``Φ(s ⊙ ζ)`` — with ``0`` they add none, instead of an arbitrary (or infinite) amount. A column counts
as zero when ``‖A_{:,i}‖² ≤ zero_tol · max_k ‖A_{:,k}‖²`` (default ``zero_tol = 0``: exactly zero).

A floor (``floor = δ > 0``, :func:`scales_from_sq_norms`) adds ``δ · median_k ‖A_{:,k}‖²`` (over the non-zero
columns) to every non-zero squared norm before the inverse square root: the prior precision becomes
``a (diag(AᵀA) + δ m I)`` (a ridge on the diagonal g-prior, in the spirit of the extended g-prior of Gupta &
Ibrahim, 2007, which adds a ridge to ``XᵀX``). Without it a weight the data barely reach (a first-layer weight of
an input pixel that is non-zero in a handful of training images) gets a prior standard deviation up to
``1/√(min n)``, thousands of times the median, and any test input that excites it (noise, blur) gets a logit
variance to match. The classifier uses it (``LinearizedLaplace(prior_options={"floor": δ})``, default 1); CT and the
design keep ``δ = 0``.

The estimator itself is :func:`~ctuq.inference.kernel.column_sq_norms` (it lives in the kernel module, which the
priors build on; it is re-exported here). Random probes are drawn from ``generator`` (a ``torch.Generator``;
default: a CPU generator seeded with ``seed``); a CPU generator gives the same probes on every device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ctuq.inference.kernel import column_sq_norms
from ctuq.inference.priors.base import DiagonalPrior, PriorCost, PriorError, PriorProblem
from ctuq.options import GPriorMethod, option, values
from ctuq.registry import PRIORS

__all__ = ["GPrior", "column_sq_norms", "gprior_scales", "isotropic_scales", "scales_from_sq_norms"]


def scales_from_sq_norms(
    sq_norms: torch.Tensor, zero_norm_value: float = 0.0, zero_tol: float = 0.0, floor: float = 0.0
) -> torch.Tensor:
    """``s_i = 1/√(n_i + δ m)`` for squared column norms ``n`` ``(d,)``; zero columns get ``zero_norm_value``.

    A column is zero when ``n_i ≤ zero_tol · max(n)`` (see the module docstring for why the value is 0 by
    default). ``floor`` is ``δ ≥ 0`` and ``m`` the median of the non-zero ``n`` (module docstring: a ridge on the
    g-prior; ``δ = 0``, the default, is the plain g-prior). Returns float64 ``(d,)``; never Inf or NaN.
    """
    if not isinstance(sq_norms, torch.Tensor) or sq_norms.ndim != 1:
        raise ValueError("scales_from_sq_norms: sq_norms must be a 1-D tensor (d,)")
    if not torch.isfinite(sq_norms).all() or (sq_norms < 0).any():
        raise ValueError("scales_from_sq_norms: squared norms must be finite and >= 0")
    if not (math.isfinite(zero_norm_value) and zero_norm_value >= 0):
        raise ValueError(f"scales_from_sq_norms: zero_norm_value must be finite and >= 0, got {zero_norm_value}")
    if not 0.0 <= zero_tol < 1.0:
        raise ValueError(f"scales_from_sq_norms: zero_tol must be in [0, 1), got {zero_tol}")
    if not (math.isfinite(floor) and floor >= 0):
        raise ValueError(f"scales_from_sq_norms: floor must be finite and >= 0, got {floor}")
    n = sq_norms.double()
    threshold = zero_tol * float(n.max()) if n.numel() else 0.0
    zero = n <= threshold
    s = torch.full_like(n, float(zero_norm_value))
    kept = n[~zero]
    if floor > 0 and kept.numel():
        kept = kept + floor * float(kept.median())
    s[~zero] = kept.rsqrt()
    return s


def gprior_scales(
    A_rmatvec: Callable[[torch.Tensor], torch.Tensor] | None,
    n_rows: int | None = None,
    *,
    method: str = "exact",
    n_features: int | None = None,
    zero_norm_value: float = 0.0,
    zero_tol: float = 0.0,
    floor: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **options,
) -> torch.Tensor:
    """g-prior scales ``s_i = 1/‖A_{:,i}‖`` ``(d,)`` (dtype ``dtype``) for ``A = L Φ``, or ones.

    Parameters
    ----------
    A_rmatvec : callable or None
        ``R`` ``(B, c)`` → ``Aᵀ R`` ``(B, d)``; e.g. ``lambda R: net.vjp(T.adjoint_flat(R))``.
        Not needed (may be None) for ``method="isotropic"``.
    n_rows : int
        ``c``, rows of ``A`` (measurements).
    method : {"exact", "stochastic", "isotropic"}
        ``c`` VJPs, ``n_probes`` VJPs, or none (``s = 1``; needs ``n_features``).
    n_features : int, optional
        ``d``; required for ``"isotropic"``, checked against the products otherwise.
    zero_norm_value, zero_tol
        Treatment of zero columns (module docstring).
    floor : float
        ``δ ≥ 0``, the ridge of :func:`scales_from_sq_norms` (default 0: the plain g-prior).
    dtype, device
        Of the probes and of the returned scales.
    **options
        ``n_probes``, ``chunk_size``, ``generator``, ``seed``, ``progress`` of :func:`column_sq_norms`.
    """
    if method == "isotropic":
        return isotropic_scales(n_features, dtype=dtype, device=device)  # type: ignore[arg-type]
    if A_rmatvec is None or n_rows is None:
        raise ValueError(f"gprior_scales: method {method!r} needs A_rmatvec and n_rows")
    sq = column_sq_norms(A_rmatvec, n_rows, method=method, dtype=dtype, device=device, **options)
    if n_features is not None and sq.numel() != n_features:
        raise ValueError(f"gprior_scales: A_rmatvec returned {sq.numel()} columns but n_features={n_features}")
    return scales_from_sq_norms(sq, zero_norm_value, zero_tol, floor).to(dtype=dtype, device=torch.device(device))


def isotropic_scales(
    n_features: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``s = 1`` ``(d,)``: the isotropic prior ``v − ṽ ~ N(0, a⁻¹ I)``."""
    if not isinstance(n_features, int) or n_features < 1:
        raise ValueError(f"isotropic_scales: n_features must be a positive int, got {n_features!r}")
    return torch.ones(n_features, dtype=dtype, device=torch.device(device))


@PRIORS.register
class GPrior(DiagonalPrior):
    """The g-prior ``s_i = ‖Ψ₀[:, i]‖⁻¹`` of the whitened features (module docstring): every weight has the same
    prior variance in units of its effect on the data (the diagonal of ``Ψ₀ᵀ D⁻¹ Ψ₀``, the weights' Fisher
    information). Computed on the first build: from the assembled ``Ψ₀`` exactly at no further cost, from the front
    end's exact column norms where it gives them (:attr:`PriorProblem.column_norms`: the classifier, the design),
    else by :func:`gprior_scales` (``c`` VJPs exact, ``probes`` VJPs stochastic, seeded by the posterior's seed).

    Parameters
    ----------
    method : {"exact", "stochastic"} (:class:`~ctuq.options.GPriorMethod`)
        Column norms of the matrix-free ``Ψ₀`` (``prior_options={"method": ...}``, ``uq.gprior.method``).
    probes : int
        Rademacher probes of the stochastic method (``uq.gprior.probes``).
    floor : float
        ``δ ≥ 0``, the ridge of :func:`scales_from_sq_norms` (module docstring; 0: the plain g-prior).
    scales : torch.Tensor, optional
        Given scales ``(d,)`` (final; e.g. from a stored state).
    """

    name = "gprior"
    label = "g-prior"
    summary_key = "gprior"  # metrics.json has kept the diagonal priors' summary under uq.stats.gprior

    @dataclasses.dataclass
    class Options:
        """The g-prior (``uq.prior = gprior``, the default): how the column norms of a matrix-free ``Ψ₀`` are
        found (an assembled ``Ψ₀`` gives the exact ones at no cost)."""

        method: str = option(
            "exact",
            choices=values(GPriorMethod),
            help="column norms: exact (c VJPs) or stochastic (probes VJPs); exact when Ψ₀ is assembled",
        )
        probes: int = option(256, ge=1, help="Rademacher probes of the stochastic g-prior")

    def __init__(
        self,
        method: str = "exact",
        probes: int = 256,
        floor: float = 0.0,
        scales: torch.Tensor | None = None,
    ):
        super().__init__(scales)
        if method not in values(GPriorMethod):
            raise PriorError(f"GPrior: method must be one of {list(values(GPriorMethod))}, got {method!r}")
        if not isinstance(probes, int) or isinstance(probes, bool) or probes < 1:
            raise PriorError(f"GPrior: probes must be a positive int, got {probes!r}")
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not (math.isfinite(floor) and floor >= 0):
            raise PriorError(f"GPrior: floor must be finite and >= 0, got {floor!r}")
        self.gprior_method = str(method)
        self.probes = int(probes)
        self.floor = float(floor)

    @property
    def method(self) -> str:
        """``exact`` when computed from the assembled ``Ψ₀`` (whatever was asked), else the asked method."""
        return GPriorMethod.EXACT.value if self.from_dense else self.gprior_method

    def compute_scales(self, problem: PriorProblem) -> torch.Tensor:
        if problem.column_norms is not None and (self.gprior_method == GPriorMethod.EXACT or problem.column_norms_free):
            # the front end's exact norms (no products of ours; float64, as the classifier keeps its scales)
            return scales_from_sq_norms(problem.column_norms(), floor=self.floor)
        b = problem.features
        n = b.n_outputs if self.gprior_method == GPriorMethod.EXACT else self.probes
        problem.say(f"g-prior scales ({self.gprior_method}, {n} VJPs)")
        return gprior_scales(
            b.rmatvec,
            b.n_outputs,
            method=self.gprior_method,
            n_features=b.n_features,
            n_probes=self.probes,
            floor=self.floor,
            seed=problem.seed,
            dtype=b.dtype,
            device=b.device,
            chunk_size=64,
            progress=problem.progress,
        )

    def dense_scales(self, problem: PriorProblem) -> torch.Tensor:
        # exact column norms are free once Ψ₀ is assembled: no stochastic estimate is needed
        return scales_from_sq_norms(problem.dense.pow(2).sum(0), floor=self.floor).to(problem.features.dtype)

    def kernel_trace(self, scales: torch.Tensor, problem: PriorProblem) -> float:
        """Without a ridge every column of ``Ψ = Ψ₀ diag(s)`` with ``s_i > 0`` has unit norm: the trace is the
        number of non-zero scales (no products; the authors' energy rule counts them for the stochastic scales
        too). With a ridge, the default's ``Σ s_i² ‖Ψ₀[:, i]‖²``."""
        if self.floor > 0:
            return super().kernel_trace(scales, problem)
        return float((scales > 0).sum())

    def setup_cost(self, n_outputs: int, n_features: int, *, assembled: bool) -> PriorCost:
        """The column norms of a matrix-free ``Ψ₀``: ``c`` VJPs (exact) or ``probes`` VJPs; none when the solver
        assembles ``Ψ₀`` (its norms are then free)."""
        if assembled:
            return PriorCost()
        return PriorCost(vjp=n_outputs if self.gprior_method == GPriorMethod.EXACT else self.probes)

    def __repr__(self) -> str:
        floor = f", floor={self.floor:g}" if self.floor else ""
        return f"GPrior(method={self.gprior_method!r}, probes={self.probes}{floor}, d={self.d})"
