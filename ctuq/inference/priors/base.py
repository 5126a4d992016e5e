"""The weight-prior contract: :class:`WeightPrior`, one interface for diagonal and block priors.

A weight prior says what the prior over the network weights ``v`` is in units of standard weights
``w ~ N(0, a⁻¹ I)``: ``v − ṽ = L w`` with a *weight map* ``L`` (``d × d``). For a diagonal prior ``L = diag(s)``
(the g-prior, the isotropic prior: :class:`DiagonalPrior`); for a block prior ``L`` is block diagonal (TV-PredCP:
a Cholesky factor per 3×3 filter). The linear model in ``w`` has the features ``Ψ = Ψ₀ L``, so every solver, the
sampler and the EM run on ``Ψ`` unchanged, and the image samples are ``Φ (L ζ)``.

What :class:`~ctuq.inference.LinearizedPosterior` does with a prior, whatever the prior:

1. **make it**: by name from :data:`ctuq.registry.PRIORS` with its options (:meth:`WeightPrior.create`; the
   posterior's ``prior=name, prior_options={...}``), or take an instance (:meth:`WeightPrior.attach`);
2. (a front end, optionally) **prepare it**: :meth:`WeightPrior.prepare` completes the options from the problem
   (the network output and its shape; TV-PredCP takes its image shape and its rate ``scale / TV(output)``);
3. **set it up**, one call in the posterior's set-up: :meth:`WeightPrior.setup` restores nothing by itself (the
   posterior hands stored entries to :meth:`WeightPrior.restore` first), fits the hyperparameters if there are any
   and they are not final (:meth:`WeightPrior.fit`), and builds ``Ψ`` (:meth:`WeightPrior.build`) on the matrix-free
   route or, when the solver assembles ``Ψ₀``, on the dense one;
4. **use it**: :meth:`WeightPrior.apply` (``L w``) for image samples; :meth:`WeightPrior.checkpoint` for the
   posterior's state; :meth:`WeightPrior.summary` and :meth:`WeightPrior.figures` for the report.

What a prior owns besides ``L``: its registry :attr:`~WeightPrior.name` and the configuration section of its
:attr:`~WeightPrior.Options` (``uq.<name>``, and ``design.<name>`` for a diagonal prior of a design), the cost of its
set-up in Jacobian products (:meth:`WeightPrior.setup_cost`, which the whole-inference estimate sums), the key its
set-up seconds are booked under (:attr:`~WeightPrior.timing_key`), its short human name for logs, figures and
metrics (:attr:`~WeightPrior.label`), the key of its summary in a run's metrics (:attr:`~WeightPrior.summary_key`)
and the calibration method it calls for (:attr:`~WeightPrior.auto_calibration`).

The classifier (:class:`ctuq.classify.LinearizedLaplace`) and the linearised-DIP design prior
(:class:`ctuq.design.DIPPrior`) take the diagonal priors (:attr:`WeightPrior.diagonal`, :class:`DiagonalPrior`):
they keep the scales ``s`` themselves and ask a prior for them with :meth:`DiagonalPrior.compute_scales`, handing it
the exact squared column norms they compute their own way (:attr:`PriorProblem.column_norms`).

A new prior is one module with a subclass registered by ``@PRIORS.register`` (and its import line in
``ctuq/inference/priors/__init__.py`` for a built-in one); ``ctuq.testing.PriorContract`` is its test.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from ctuq.errors import CTUQError
from ctuq.inference.block_features import BlockFeatures
from ctuq.inference.features import DenseFeatures, FeatureOperator, ScaledFeatures
from ctuq.inference.kernel import column_sq_norms
from ctuq.registry import PRIORS

__all__ = ["PriorError", "PriorProblem", "PriorSetup", "PriorCost", "WeightPrior", "DiagonalPrior"]


class PriorError(CTUQError):
    """A weight prior cannot be built or fitted as asked (no 3×3 convolutions, a non-positive hyperparameter, a
    stored state of another network); the message names the option or parameter at fault (one line)."""


@dataclasses.dataclass
class PriorProblem:
    """What a prior's set-up sees; :class:`~ctuq.inference.LinearizedPosterior` fills it. Everything is in the
    likelihood's whitened space (``D^(−1/2)`` applied to the rows; nothing for a white likelihood).

    Attributes
    ----------
    features : FeatureOperator
        The unscaled features ``Ψ₀`` (``c × d``), matrix-free.
    targets : torch.Tensor or None
        ``ỹ`` ``(c,)``; ``None`` where a front end asks for scales before it has targets (the classifier: its
        pseudo-targets come from the mode, which needs the scales); a prior that fits needs them.
    a, sigma2 : float
        The prior precision and the noise variance at set-up.
    learn_noise : bool
        Whether the likelihood learns ``σ²`` (a fit may then set it).
    dense : torch.Tensor, optional
        ``Ψ₀`` assembled ``(c, d)`` (float64) when the solver assembles the features: the prior builds a dense ``Ψ``.
    seed : int
        Seeds the prior's random probes.
    progress : bool
        Progress bars.
    log : callable, optional
        One-line status messages.
    column_norms : callable, optional
        ``() →`` the exact squared column norms ``‖Ψ₀[:, i]‖²`` ``(d,)`` float64, computed the front end's own way
        (the classifier: the GGN diagonal from per-example Jacobians; the design: block by block, kept across
        refreshes); :meth:`exact_column_sq_norms` calls it instead of ``c`` VJPs.
    column_norms_free : bool
        :attr:`column_norms` costs nothing beyond what is at hand (an assembled Jacobian): a prior that would
        otherwise estimate the norms (the stochastic g-prior) takes the exact ones.
    """

    features: FeatureOperator
    targets: torch.Tensor | None
    a: float
    sigma2: float
    learn_noise: bool = False
    dense: torch.Tensor | None = None
    seed: int = 0
    progress: bool = False
    log: Callable[[str], None] | None = None
    column_norms: Callable[[], torch.Tensor] | None = None
    column_norms_free: bool = False

    def say(self, message: str) -> None:
        """Pass ``message`` to :attr:`log` (if any)."""
        if self.log is not None:
            self.log(message)

    def exact_column_sq_norms(self) -> torch.Tensor:
        """``‖Ψ₀[:, i]‖²`` ``(d,)`` float64: the front end's :attr:`column_norms` when given, else ``c`` VJPs of
        :attr:`features` (:func:`~ctuq.inference.kernel.column_sq_norms`)."""
        if self.column_norms is not None:
            return self.column_norms()
        b = self.features
        return column_sq_norms(b.rmatvec, b.n_outputs, dtype=b.dtype, device=b.device, progress=self.progress)


@dataclasses.dataclass(frozen=True)
class PriorCost:
    """The Jacobian products a prior's set-up spends beside the solver's (:meth:`WeightPrior.setup_cost`), per
    product of one vector: ``jvp`` products ``Ψ₀ v``, ``vjp`` products ``Ψ₀ᵀ r``."""

    jvp: float = 0.0
    vjp: float = 0.0

    def seconds(self, t_jvp: float, t_vjp: float) -> float:
        """``jvp·t_jvp + vjp·t_vjp`` (seconds, for ``t_*`` seconds per product; a count of zero adds nothing)."""
        return (self.jvp * t_jvp if self.jvp else 0.0) + (self.vjp * t_vjp if self.vjp else 0.0)


@dataclasses.dataclass
class PriorSetup:
    """The result of :meth:`WeightPrior.setup`: the features ``Ψ`` and, when a fit ran, the noise variance after it
    and its seconds (both ``None`` when nothing was fitted)."""

    features: FeatureOperator
    sigma2: float | None = None
    fit_seconds: float | None = None


class WeightPrior(abc.ABC):
    """A prior over the network weights in units of standard weights, ``v − ṽ = L w`` (module docstring).

    Subclasses give :attr:`name`, :meth:`apply` and :meth:`apply_t`; a prior with hyperparameters sets
    :attr:`fitted` false until they are final and implements :meth:`fit`; a prior with configurable options gives
    them as the dataclass :attr:`Options` (fields made with :func:`ctuq.options.option`), from which the
    configuration derives the section ``uq.<name>``. A prior whose set-up spends Jacobian products says how many
    (:meth:`setup_cost`); :attr:`label` and :attr:`timing_key` default to ``"prior <name>"`` and ``name``.

    Attributes
    ----------
    d : int or None
        The number of weights the prior covers (``None`` until :meth:`attach` learned it from the features).
    fitted : bool
        The hyperparameters are final (fitted, given or restored; always true without hyperparameters).
    """

    #: Registry name (:data:`ctuq.registry.PRIORS`): the value of ``LinearizedPosterior(prior=...)`` and
    #: ``uq.prior``.
    name: ClassVar[str] = ""
    #: The configurable options (a dataclass of :func:`ctuq.options.option` fields; ``None``: none). Its field
    #: names are keyword arguments of :meth:`create`.
    Options: ClassVar[type | None] = None
    #: The key of a CT run's ``metrics.json`` ``uq.stats`` that holds :meth:`summary`.
    summary_key: ClassVar[str] = "prior"
    #: The calibration method ``uq.calibration = auto`` means with this prior when the scan has held-out angles
    #: (a name of :data:`ctuq.registry.CALIBRATIONS`; docs/calibration.md measured ``bias`` for the g-prior).
    auto_calibration: ClassVar[str] = "bias"
    #: Short human name for logs, figures and metrics (``"g-prior"``); a class that sets none gets
    #: ``"prior <name>"``.
    label: ClassVar[str] = ""
    #: The key of :attr:`LinearizedPosterior.timings <ctuq.inference.LinearizedPosterior.timings>` (and of a CT
    #: run's ``metrics.json`` ``uq.timings`` / ``uq.products``) that holds this prior's set-up; a class that sets
    #: none gets its :attr:`name`.
    timing_key: ClassVar[str] = ""
    #: ``L`` is diagonal (a :class:`DiagonalPrior`): the prior gives scales ``s``, the form the classifier and the
    #: design take.
    diagonal: ClassVar[bool] = False

    d: int | None = None
    fitted: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # each class its own defaults (a subclass under another name does not inherit its parent's label or key)
        if not cls.__dict__.get("label"):
            cls.label = f"prior {cls.name}"
        if not cls.__dict__.get("timing_key"):
            cls.timing_key = cls.name

    # ------------------------------------------------------------------------------------------ making
    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The keyword arguments :meth:`create` takes: the constructor's named parameters and the fields of
        :attr:`Options`."""
        params = inspect.signature(cls.__init__).parameters.values()
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names = {p.name for p in params if p.kind in kinds and p.name != "self"}
        if cls.Options is not None:
            names |= {f.name for f in dataclasses.fields(cls.Options)}
        return frozenset(names)

    @classmethod
    def create(cls, features: FeatureOperator, **options: Any) -> WeightPrior:
        """The prior for the unscaled features ``features`` (``Ψ₀``, ``c × d``) from its options (the posterior's
        ``prior_options``); names it does not take raise ``ValueError``. Default: ``cls(**options)``, attached to
        ``features``."""
        cls.check_option_names(options)
        prior = cls(**options)
        prior.attach(features)
        return prior

    @classmethod
    def check_option_names(cls, options: Mapping[str, Any]) -> None:
        """Refuse option names that are not in :meth:`option_names` (one line naming them and the valid ones)."""
        valid = cls.option_names()
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"LinearizedPosterior: prior_options {unknown} are not options of the {cls.name!r} prior (its "
                f"options: {', '.join(sorted(valid)) or 'none'})"
            )

    def attach(self, features: FeatureOperator, **options: Any) -> None:
        """Bind the prior to the unscaled features ``Ψ₀`` of a posterior: learns :attr:`d`, or checks it. ``options``
        are what a given instance takes from the posterior's ``prior_options`` (none by default)."""
        if options:
            raise ValueError(
                f"LinearizedPosterior: prior_options {sorted(options)} do not apply to a given {self.name} prior"
            )
        if self.d is None:
            self.d = int(features.n_features)
        elif self.d != features.n_features:
            raise ValueError(
                f"LinearizedPosterior: the {self.name} prior covers {self.d} weights, the features have "
                f"{features.n_features}"
            )

    def prepare(self, *, output: torch.Tensor, output_shape: Sequence[int]) -> None:
        """Complete the options from the problem before :meth:`setup` (called by a front end, e.g. the CT one):
        ``output`` is the network output ``g(ṽ)`` (flat, ``prod(output_shape)``) and ``output_shape`` the shape of one
        output (an image). Default: nothing to complete."""
        return None

    def derived(self) -> WeightPrior:
        """The prior of a posterior on fewer or more rows (:meth:`LinearizedPosterior.restrict` / ``extend``).
        Default: this very prior (its hyperparameters are shared)."""
        return self

    def setup_cost(self, n_outputs: int, n_features: int, *, assembled: bool) -> PriorCost:
        """The Jacobian products :meth:`setup` spends on features of ``n_outputs`` rows and ``n_features`` columns
        (``assembled``: the solver assembles ``Ψ₀``, so products with it cost no Jacobian products), for the
        whole-inference estimate (:meth:`ctuq.pipeline.uq.UQRun.inference_estimate`). Default: none."""
        return PriorCost()

    # ------------------------------------------------------------------------------------------ set-up
    def setup(self, problem: PriorProblem) -> PriorSetup:
        """Fit the hyperparameters when they are not final, then build ``Ψ``: the one call of
        :meth:`LinearizedPosterior.setup <ctuq.inference.LinearizedPosterior.setup>`."""
        sigma2 = seconds = None
        if not self.fitted:
            t0 = time.perf_counter()
            sigma2 = float(self.fit(problem))
            seconds = time.perf_counter() - t0
        return PriorSetup(self.build(problem), sigma2, seconds)

    def fit(self, problem: PriorProblem) -> float:
        """Set the hyperparameters from the problem (e.g. type-II MAP), mark the prior :attr:`fitted`, and return
        ``σ²`` (learned when ``problem.learn_noise``, else ``problem.sigma2``). Default: nothing to fit."""
        self.fitted = True
        return problem.sigma2

    def build(self, problem: PriorProblem) -> FeatureOperator:
        """``Ψ = Ψ₀ L``: matrix-free (:class:`~ctuq.inference.block_features.BlockFeatures`), or dense from
        ``problem.dense`` (``Lᵀ`` applied to its rows in float64)."""
        if problem.dense is not None:
            return DenseFeatures(self.apply_t(problem.dense.double()).to(problem.dense.dtype))
        return BlockFeatures(problem.features, self)

    # ------------------------------------------------------------------------------------------ L
    @abc.abstractmethod
    def apply(self, W: torch.Tensor) -> torch.Tensor:
        """``L w`` for rows ``W`` ``(B, d)``: standard weights → network weights ``(B, d)``."""

    @abc.abstractmethod
    def apply_t(self, R: torch.Tensor) -> torch.Tensor:
        """``Lᵀ r`` for rows ``R`` ``(B, d)``: network-weight gradients → standard-weight gradients ``(B, d)``."""

    def weight_matrix(self) -> torch.Tensor:
        """The dense weight map ``L`` ``(d, d)`` float64 (for tests and small problems: ``d`` products)."""
        if self.d is None:
            raise ValueError(f"{type(self).__name__}.weight_matrix: the prior has no size yet (attach it first)")
        return self.apply(torch.eye(self.d, dtype=torch.float64)).double().T

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The prior's state (plain tensors and values; ``torch.load(..., weights_only=True)``-loadable). Default:
        no state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output. Default: no state (an empty one is accepted)."""
        if state:
            raise PriorError(f"the {self.name} prior keeps no state; got one with keys {sorted(state)}")

    def checkpoint(self) -> dict[str, Any]:
        """This prior's entries of :meth:`LinearizedPosterior.state_dict`: ``{"prior_state": state_dict()}`` once
        the hyperparameters are final and there is a state."""
        state = self.state_dict() if self.fitted else None
        return {"prior_state": state} if state else {}

    def restore(self, entries: Mapping[str, Any]) -> None:
        """Load the entries :meth:`checkpoint` wrote (from a posterior's state); absent ones are ignored."""
        if entries.get("prior_state") is not None:
            self.load_state_dict(entries["prior_state"])

    # ------------------------------------------------------------------------------------------ report
    def summary(self) -> dict:
        """Plain, JSON-serialisable numbers for reports (a CT run keeps them as ``uq.stats[summary_key]``)."""
        return {"prior": self.name}

    def figures(self, out_dir: str | Path) -> list[Path]:
        """Write the prior's figures into ``out_dir``; returns their paths. Default: none."""
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}(d={self.d})"


PRIORS.set_base(WeightPrior)


class DiagonalPrior(WeightPrior):
    """``L = diag(s)``: one scale per weight, given here or computed by a subclass's :meth:`compute_scales`.

    Given scales (``LinearizedPosterior(prior=s)``, or kept from an earlier posterior) are final; computed ones are
    computed once, on the first :meth:`build`, from the whitened ``Ψ₀`` (matrix-free) or from its assembled matrix.

    Parameters
    ----------
    scales : torch.Tensor, optional
        ``s`` ``(d,)``, finite.
    """

    name = "scales"
    label = "given scales"
    diagonal = True

    def __init__(self, scales: torch.Tensor | None = None):
        if scales is not None:
            if not isinstance(scales, torch.Tensor) or scales.ndim != 1:
                got = tuple(scales.shape) if isinstance(scales, torch.Tensor) else type(scales).__name__
                raise ValueError(f"{type(self).__name__}: scales must be a 1-D tensor (d,), got {got}")
            if not torch.isfinite(scales).all():
                raise ValueError(f"{type(self).__name__}: scales contain NaN or Inf")
            self.d = int(scales.numel())
        self.scales = scales
        self.from_dense = False  # the scales were computed from the assembled Ψ₀
        self._stored: torch.Tensor | None = None  # scales of a posterior state (restore)

    @property
    def method(self) -> str:
        """How the scales were obtained (``summary()["method"]``)."""
        return "given"

    def compute_scales(self, problem: PriorProblem) -> torch.Tensor:
        """The scales ``(d,)`` from the matrix-free whitened ``Ψ₀`` ``problem.features`` (on its device; its dtype,
        or float64 where they come from ``problem.column_norms``). Also what the classifier and the design call
        (module docstring)."""
        raise ValueError(f"{type(self).__name__}: no scales were given and this prior computes none")

    def kernel_trace(self, scales: torch.Tensor, problem: PriorProblem) -> float:
        """``tr(Ψ Ψᵀ) = Σ_i s_i² ‖Ψ₀[:, i]‖²`` for the scales ``scales`` ``(d,)`` on ``problem``'s rows: the prior
        predictive energy of those rows per unit of ``1/a`` (the design's energy rule for ``a``,
        :func:`ctuq.design.priors.energy_precision`). Default: from :meth:`PriorProblem.exact_column_sq_norms`."""
        norms = problem.exact_column_sq_norms().double().cpu()
        return float((scales.detach().double().cpu().pow(2) * norms).sum())

    def dense_scales(self, problem: PriorProblem) -> torch.Tensor:
        """The scales ``(d,)`` from the assembled whitened ``Ψ₀`` ``problem.dense``. Default: :meth:`compute_scales`
        on it as dense features."""
        dense = DenseFeatures(problem.dense.to(problem.features.dtype))
        return self.compute_scales(dataclasses.replace(problem, features=dense, dense=None))

    def build(self, problem: PriorProblem) -> FeatureOperator:
        """``Ψ = Ψ₀ diag(s)``: :class:`~ctuq.inference.features.ScaledFeatures`, or the dense ``Ψ₀ diag(s)`` in
        float64. The scales are computed here on first use."""
        b = problem.features
        if problem.dense is not None:
            if self.scales is None:
                # a stored state's scales are not used here: the assembled Ψ₀ gives the exact ones at no cost
                self.scales = self.dense_scales(problem)
                self.from_dense = True
            self.scales = self.scales.to(device=b.device, dtype=b.dtype)
            return DenseFeatures(problem.dense * self.scales.double()[None, :])
        if self.scales is None:
            if self._stored is not None:
                self.scales = self._stored.to(device=b.device, dtype=b.dtype)
            else:
                self.scales = self.compute_scales(problem)
        self.scales = self.scales.to(device=b.device, dtype=b.dtype)
        return ScaledFeatures(b, self.scales)

    def derived(self) -> DiagonalPrior:
        """A copy that keeps the scales once computed (before that, the derived posterior computes its own on its
        rows) and forgets a stored state."""
        other = copy.copy(self)
        other._stored = None
        return other

    def _rows(self, W: torch.Tensor, what: str) -> torch.Tensor:
        if self.scales is None:
            raise ValueError(f"{type(self).__name__}.{what}: the scales are not computed yet (set the posterior up)")
        if W.ndim != 2 or W.shape[1] != self.scales.numel():
            raise ValueError(
                f"{type(self).__name__}.{what}: rows must be (B, {self.scales.numel()}), got {tuple(W.shape)}"
            )
        return W

    def apply(self, W: torch.Tensor) -> torch.Tensor:
        """``s ⊙ w`` for rows ``W`` ``(B, d)`` (in the dtype of ``W`` times the scales')."""
        return self._rows(W, "apply") * self.scales

    def apply_t(self, R: torch.Tensor) -> torch.Tensor:
        """``s ⊙ r`` for rows ``R`` ``(B, d)`` (``L`` is symmetric)."""
        return self._rows(R, "apply_t") * self.scales

    def weight_matrix(self) -> torch.Tensor:
        """``diag(s)`` ``(d, d)`` float64."""
        if self.scales is None:
            raise ValueError(f"{type(self).__name__}.weight_matrix: the scales are not computed yet")
        return torch.diag(self.scales.detach().double().cpu())

    def state_dict(self) -> dict:
        """``{"name", "scales"}`` (the scales on the CPU; ``None`` before they are computed)."""
        return {"name": self.name, "scales": None if self.scales is None else self.scales.detach().cpu()}

    def load_state_dict(self, state: dict) -> None:
        """Take the scales of :meth:`state_dict` output of the same prior (final from then on)."""
        if not isinstance(state, dict) or state.get("name") != self.name:
            got = state.get("name") if isinstance(state, dict) else type(state).__name__
            raise PriorError(f"not a {self.name} prior state (got {got!r})")
        scales = state.get("scales")
        if scales is not None:
            if self.d is not None and tuple(scales.shape) != (self.d,):
                raise PriorError(f"the stored {self.name} scales have shape {tuple(scales.shape)}, not ({self.d},)")
            self.scales = scales.clone()
            self.d = int(scales.numel())

    def checkpoint(self) -> dict[str, Any]:
        """``{"scales": s}`` once computed (the key a posterior state has always kept them under)."""
        return {} if self.scales is None else {"scales": self.scales.detach().cpu()}

    def restore(self, entries: Mapping[str, Any]) -> None:
        """Keep a posterior state's scales for the matrix-free :meth:`build` (given scales win)."""
        if entries.get("scales") is not None:
            self._stored = entries["scales"]

    def summary(self) -> dict:
        """``method``, and once computed ``zero_scales`` (count), ``scale_min`` (of the non-zero ones; ``None`` if
        none) and ``scale_max``."""
        out: dict[str, Any] = {"method": self.method}
        s = self.scales
        if s is not None:
            pos = s[s > 0]
            out.update(
                zero_scales=int((s == 0).sum()),
                scale_min=float(pos.min()) if pos.numel() else None,
                scale_max=float(s.max()),
            )
        return out
