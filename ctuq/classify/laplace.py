"""``LinearizedLaplace``: linearised Laplace for a trained PyTorch classifier on ctuq's inference core.

The model (DESIGN.md §1, classification row). A classifier ``f(x; v)`` with ``C`` logits, trained weights ``ṽ``,
``n`` training pairs ``(x_i, y_i)``, probabilities ``p_i = softmax(f(x_i; ṽ))`` and softmax Hessians
``B_i = diag(p_i) − p_i p_iᵀ = L_i L_iᵀ`` (:mod:`ctuq.classify.hessian`). Scaled weights ``w`` with
``v = s ⊙ w`` and prior ``w ~ N(0, a⁻¹ I)``; ``s`` is the g-prior ``s_j = [Σ_i J_iᵀ B_i J_i]_jj^(−1/2)`` (exact:
per-example Jacobians, :mod:`ctuq.classify.jacobians`; with a ridge, ``GPRIOR_FLOOR``), ones, or the scales of any
other diagonal prior of :data:`ctuq.registry.PRIORS` (``prior=name, prior_options={...}``).

* E-step: the categorical log-likelihood of the linearised model is replaced by its second-order expansion with
  curvature ``B_i``, evaluated at the linearised model's mode (``hessian_at="linear_mode"``, the default: ``p_i``
  below are then that mode's probabilities, rebuilt after every mode refresh, with the g-prior scales kept from
  the network's ``B``) or at the trained network (``"network"``, the published shortcut). In whitened coordinates
  this is the core's Gaussian linear model ``ỹ = Ψ w + ε``, ``ε ~ N(0, I)``
  (:class:`~ctuq.inference.CategoricalLikelihood`) with features ``Ψ = blockdiag(L_iᵀ) J diag(s)`` over all
  ``n·C`` logits and posterior covariance ``(ΨᵀΨ + aI)⁻¹``, sampled by :class:`~ctuq.inference.LinearizedPosterior`
  (Matheron's rule; CG, exact or any registered solver).
* Pseudo-targets ``ỹ = Ψ w* + ρ`` with ``L_i ρ_i = y_i − softmax(η_i(w*))`` where ``w*`` is the mode of the
  linearised categorical model at the current ``a`` (:mod:`ctuq.classify.mode`). Since
  ``Ψᵀρ = s ⊙ Jᵀ(Y − softmax(η)) = a w*`` there, the Gaussian model's posterior mean
  ``(ΨᵀΨ + aI)⁻¹Ψᵀỹ`` *is* ``w*``: the core's EM then computes ``‖w*‖²`` and ``γ̂`` as for CT, and when the
  trained network is the linearised model's mode the posterior mode is the trained network.
* M-step (MacKay): ``a ← γ̂ / ‖w*‖²``, ``γ̂`` from the posterior samples (or exact); the targets are rebuilt at the
  new ``a`` after every step (warm-started mode).
* Predictive: network logits plus linearised deviations of posterior samples, MC or probit
  (:mod:`ctuq.classify.predictive`).
* Evidence (exact solvers): ``log Z(a) = log N(ỹ; 0, ΨΨᵀ/a + I) + ½‖ρ‖² + (n·C/2) log 2π + Σ_i log p_lin(y_i)``,
  the Laplace evidence of the linearised model at its mode with curvature ``B`` (derivation in
  docs/classification.md).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ctuq.classify import state as _state
from ctuq.classify.build import (
    assembly_pays,
    forward_flops_per_example,
    prior_scales,
    whitened_features,
    whitened_matrix,
)
from ctuq.classify.data import check_labels, collect_loader, eval_logits, resolve_weights
from ctuq.classify.hessian import HessianMismatchWarning, SoftmaxHessianRoot, mean_hessian_trace
from ctuq.classify.jacobians import DenseJacobian, assemble_jacobian
from ctuq.classify.mode import LinearMode, OverfitWarning, mean_kl, overfit_fraction
from ctuq.classify.predictive import PredictiveMixin
from ctuq.classify.prior_fit import DEFAULT_GRID, PriorFitMixin
from ctuq.inference import (
    SOLVERS,
    CategoricalLikelihood,
    DenseFeatures,
    LinearizedFeatures,
    LinearizedPosterior,
    NystromBasis,
    ScaledFeatures,
    Workload,
    dense_features_fit,
    nystrom_basis,
    solver_choices,
)
from ctuq.inference.priors import GPrior
from ctuq.linearize import LinearizedNetwork
from ctuq.memory import Budget, memory_budget
from ctuq.options import (
    Approximation,
    HessianAt,
    HessianRoot,
    LinearModel,
    SolverAlias,
    values,
)
from ctuq.options import DenseFeatures as DenseChoice
from ctuq.registry import PRIORS

__all__ = [
    "LinearizedLaplace",
    "exact_solver",
    "GPRIOR_FLOOR",
    "HESSIAN_RATIO_WARNING",
    "OVERFIT_WARNING",
    "DEFAULT_GRID",
    "PRECONDITIONER_REUSE",
]

HESSIAN_RATIO_WARNING = 3.0
"""With ``hessian_at="network"``, a :class:`~ctuq.classify.hessian.HessianMismatchWarning` when the mean
``tr B_i`` at the linearised model's mode exceeds this multiple of that at the network."""

OVERFIT_WARNING = 0.01
"""After an EM (``optimize_prior("sampled_em" | "exact")``), an :class:`~ctuq.classify.mode.OverfitWarning` when more
than this fraction of the training labels are predicted by the trained network and not by the linearised model's
mode at the chosen ``a`` (docs/classification.md §2.4: 0.0008 and 0 on the two digits MLPs, whose predictives beat
MAP; 0.057 on the MNIST-1D MLP, which over-fits and whose evidence-chosen predictive stays at 0.85 × MAP's NLL)."""

GPRIOR_FLOOR = 1.0
"""Default ridge ``δ`` of the classifier's g-prior (``prior_options={"floor": δ}``): the g-prior's squared column norms
get ``δ ×`` their median added (a ridge on the
g-prior; docs/notebook/classification.md §2.1: on the digits MLP it takes the corrupted-input NLL at noise σ = 0.1
from 2.9 to 0.09 and the test NLL below MAP's; MNIST-1D's GGN diagonal spans only 3 decades and hardly moves)."""

PRECONDITIONER_REUSE = 1.5
"""With ``hessian_at="linear_mode"`` and CG, a rebuilt posterior keeps the previous low-rank preconditioner while the
mean ``tr B_i`` stays within this factor of the one it was built at (a preconditioner only steers CG, which still
solves to its tolerance; on the digits MLP a rank-400 rebuild costs 400 Jacobian-product pairs, several EM steps'
worth of solves)."""


def _prior_options(prior, options: dict | None) -> dict:
    """The checked ``prior_options`` of the ``prior`` argument: for a diagonal prior of the registry by name, its
    option names (the g-prior's ``floor`` defaulting to :data:`GPRIOR_FLOOR`); none for given scales."""
    options = dict(options or {})
    if isinstance(prior, torch.Tensor):
        if options:
            raise ValueError(f"LinearizedLaplace: prior_options {sorted(options)} do not apply to given scales")
        return options
    diagonal = [n for n in PRIORS.names() if PRIORS[n].diagonal]
    if not isinstance(prior, str) or prior not in diagonal:  # a block prior (CT's tv_predcp) gives no scales
        raise ValueError(
            f"LinearizedLaplace: prior must be a diagonal prior ({', '.join(diagonal)}) or a tensor of scales, "
            f"got {prior!r}"
        )
    cls = PRIORS[prior]
    cls.check_option_names(options)
    if issubclass(cls, GPrior):
        options.setdefault("floor", GPRIOR_FLOOR)
    return options


def _check_forward_mode(model: nn.Module, x: torch.Tensor, names, where: str) -> None:
    """One Jacobian-vector product on one input: a model whose operations have no forward-mode rule gets one line
    now (the linearised model's mode and ELLA's features run on JVPs), not a traceback from deep in the fit."""
    net = LinearizedNetwork(model, x, param_names=list(names), mode="recompute")
    try:
        net.jvp(torch.zeros((1, net.d), dtype=next(model.parameters()).dtype))
    except (NotImplementedError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"{where}: the model does not support forward-mode differentiation (torch.func.jvp), which the "
            f"linearised model's mode and ELLA's features need: {first}"
        ) from None


def exact_solver(solver: str) -> bool:
    """Whether the ``solver=`` value ``solver`` names an exact solver: the ``"exact"`` alias or a registry solver
    with exact ``γ`` and evidence (:attr:`ctuq.inference.Solver.exact`)."""
    return solver == SolverAlias.EXACT or (solver in SOLVERS and SOLVERS[solver].exact)


class LinearizedLaplace(PriorFitMixin, PredictiveMixin):
    """Linearised Laplace over all (or some) weights of a classifier (module docstring for the equations).

    Parameters
    ----------
    model : nn.Module
        Maps inputs ``(N, ...)`` to logits ``(N, C)``. Copied (in ``dtype``) at :meth:`fit`; evaluated in eval mode.
    prior : str or torch.Tensor
        The prior scales ``s``: a diagonal prior of :data:`ctuq.registry.PRIORS` by name (``"gprior"``,
        ``"isotropic"``, or one registered later; :attr:`ctuq.inference.priors.WeightPrior.diagonal`), made with
        ``prior_options`` on the whitened features ``Ψ₀`` (its
        :meth:`~ctuq.inference.priors.DiagonalPrior.compute_scales`, given the exact GGN diagonal as
        :attr:`~ctuq.inference.priors.PriorProblem.column_norms`), or the scales themselves ``(d,)``.
    prior_options : dict, optional
        Options of a prior given by name. The g-prior's: ``method`` (``"exact"``: the GGN diagonal from per-example
        Jacobians, ``C`` backward passes over the data; ``"stochastic"``: ``probes`` Rademacher probes), ``probes``
        and ``floor``, ``δ ≥ 0``: its precision is ``a (diag(GGN) + δ m)`` with ``m`` the median of the non-zero
        GGN diagonal (:mod:`ctuq.inference.priors.gprior`), so that weights the training data barely reach do not
        get prior standard deviations thousands of times the typical one (which any shifted input then turns into
        huge logit variances); ``0`` is the plain g-prior of the published method. Default ``floor``:
        ``GPRIOR_FLOOR`` (docs/notebook/classification.md §2.1 for the measurements behind it).
    weights : {"all", "last_layer"} or list of str
        The linearised parameters (all by default, biases and normalisation parameters included).
    prior_precision : float
        Initial ``a``.
    linear_model : {"tangent", "affine"}
        Whose categorical mode enters the M-step (:mod:`ctuq.classify.mode`).
    hessian_root : {"closed_form", "symmetric"}
        Factor of ``B_i`` (:mod:`ctuq.classify.hessian`).
    hessian_at : {"linear_mode", "network"}
        Where the softmax Hessians ``B_i`` are evaluated (:class:`ctuq.options.HessianAt`). ``"linear_mode"``
        (default): at the linearised model's mode at the current ``a``, rebuilt (features, pseudo-targets, solver
        set-up) after every mode refresh, so the EM iterates to a joint fixed point of ``a`` and ``B`` and the
        evidence is the Laplace-GLM evidence of the linearised model at its mode. ``"network"``: at the trained
        network (the published shortcut; a :class:`~ctuq.classify.hessian.HessianMismatchWarning` when
        :attr:`hessian_ratio` exceeds 3). The g-prior scales come from the network's ``B`` either way.
    solver : str
        A :func:`~ctuq.inference.solver_choices` value. Exact solvers get ``Ψ₀`` assembled from per-example
        Jacobians (``n·C·d`` float64 numbers).
    solver_options : dict, optional
        Passed to the posterior (CG: ``rank``, ``rtol``, ``max_iter``, ``preconditioner`` …).
    dtype : torch.dtype
        Precision of the linearisation (default float64; the model is copied, never modified).
    seed : int
        Seeds the g-prior probes, the preconditioner, the EM and (with ``seed`` of :meth:`predict`) the samples.
    progress : bool
        Progress bars for data collection, Jacobians, EM steps and prediction.
    log : callable, optional
        One-line status messages.
    mode_options : dict, optional
        ``max_iter``, ``gtol`` of the mode finder.
    jacobian_chunk : int
        Examples per batch of per-example Jacobians.
    approximation : {"full", "ella"}
        ``"full"`` (default): the posterior over all ``d`` linearised weights, through the core's solvers.
        ``"ella"``: ELLA (Deng, Zhou & Zhu 2022): the Nyström eigenbasis ``V`` (``d × K``) of the tangent kernel
        ``Ψ Ψᵀ`` (``Ψ = Ψ₀ diag(s)``, ``B`` at the network) from ``landmarks`` sampled rows (``M`` (input, class)
        pairs: ``M`` vector-Jacobian products; :mod:`ctuq.inference.ella`), then ``G = J diag(s) V`` (``n·C × K``,
        ``K`` Jacobian-vector products over the data), on which everything else runs in the ``K`` coordinates
        ``u`` of ``w = V u``: the linearised model's mode, the features ``blockdiag(L_iᵀ) G``, the posterior (exact
        solver), its EM, evidence and grid search. The prior scales ``s`` and the predictive are the full route's;
        ``Ψ₀`` is never assembled and no product over the data runs after ``G``.
    landmarks, rank : int
        ELLA's ``M`` and ``K`` (``K ≤ M ≤ n·C``; ``K`` at most the rank the landmark rows have).
    dense_features : {"auto", "always", "never"}
        Whether ``Ψ₀`` (``n·C × d``) is assembled from per-example Jacobians (``C`` backward passes over the data;
        then every solver product is a GEMM) or applied through Jacobian products over all ``n`` inputs. ``"auto"``:
        assembled for the exact solvers when two float64 copies fit the dense budget, and for the iterative ones
        when one copy in ``dtype`` fits and a forward pass costs at least ``2·C·d`` flops per example
        (:func:`~ctuq.classify.build.assembly_pays`: CNNs, not MLPs); ``"always"``: for every
        solver, when one copy in ``dtype`` fits it (else a ``MemoryError`` naming the sizes) — measured on the
        MNIST-1D CNN (4,000 signals, d = 33,930, float32): assembling ``Ψ₀`` (5.4 GB) 36–43 s, against 0.8 s for one
        JVP and one VJP over the data and ≈ 0.03 s for one GEMM pair with ``Ψ₀``; ``"never"``: products always.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        prior: str | torch.Tensor = "gprior",
        prior_options: dict | None = None,
        weights: str | Sequence[str] = "all",
        prior_precision: float = 1.0,
        linear_model: str = "tangent",
        hessian_root: str = "closed_form",
        hessian_at: str = "linear_mode",
        solver: str = "auto",
        solver_options: dict | None = None,
        dtype: torch.dtype = torch.float64,
        seed: int = 0,
        progress: bool = False,
        log: Callable[[str], None] | None = None,
        mode_options: dict | None = None,
        jacobian_chunk: int = 32,
        dense_features: str = "auto",
        approximation: str = "full",
        landmarks: int = 2000,
        rank: int = 20,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"LinearizedLaplace: model must be an nn.Module, got {type(model).__name__}")
        options = _prior_options(prior, prior_options)
        if not (float(prior_precision) > 0 and math.isfinite(float(prior_precision))):
            raise ValueError(f"LinearizedLaplace: prior_precision must be positive and finite, got {prior_precision}")
        for name, value, allowed in (
            ("linear_model", linear_model, values(LinearModel)),
            ("hessian_root", hessian_root, values(HessianRoot)),
            ("hessian_at", hessian_at, values(HessianAt)),
            ("solver", solver, solver_choices()),
            ("dense_features", dense_features, values(DenseChoice)),
            ("approximation", approximation, values(Approximation)),
        ):
            if value not in allowed:
                raise ValueError(f"LinearizedLaplace: {name} must be one of {list(allowed)}, got {value!r}")
        for name, value in (("landmarks", landmarks), ("rank", rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LinearizedLaplace: {name} must be a positive int, got {value!r}")
        if approximation == Approximation.ELLA and landmarks < rank:
            raise ValueError(
                f"LinearizedLaplace(approximation='ella'): landmarks M = {landmarks} must be at least the rank "
                f"K = {rank}"
            )
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"LinearizedLaplace: dtype must be torch.float32 or torch.float64, got {dtype}")
        self.model = model
        self.weights = weights if isinstance(weights, str) else list(weights)
        self.param_names = resolve_weights(model, weights)
        self.prior = prior
        self.prior_options = options
        self.a0 = float(prior_precision)
        self.linear_model = linear_model
        self.hessian_root = hessian_root
        self.hessian_at = str(hessian_at)
        self.solver = solver
        self.solver_options = dict(solver_options or {})
        self.dtype = dtype
        self.seed = int(seed)
        self.progress = progress
        self.say = log or (lambda _msg: None)
        self.mode_options = dict(mode_options or {})
        self.jacobian_chunk = int(jacobian_chunk)
        self.dense_features = dense_features
        self.approximation = str(approximation)
        self.landmarks, self.rank = int(landmarks), int(rank)
        self.basis: NystromBasis | None = None  # ELLA's subspace (fit or a loaded state)
        # set by fit() / load_state_dict()
        self.posterior: LinearizedPosterior | None = None
        self.scales: torch.Tensor | None = None
        self.n_classes: int | None = None
        self.n_train: int | None = None
        self._model: nn.Module | None = None
        self._net = None
        self._root: SoftmaxHessianRoot | None = None  # the B of the features (network or linear mode)
        self._jnet = None  # J on the training inputs (products or held densely): the features' and the mode's
        self._trace_net: float | None = None  # mean tr B_i at the network
        self._trace_mode: float | None = None  # mean tr B_i at the linearised model's mode (at _hessian_a)
        self._hessian_a: float | None = None
        self._precond_trace: float | None = None  # mean tr B_i at which the CG preconditioner was built
        self.gridsearch_trace: list[dict] = []
        self.guard: dict | None = None  # the held-out guard's record (optimize_prior(val_loader=...))
        self._mode_finder: LinearMode | None = None
        self._mode = None  # ModeResult at the current a
        self._mode_w: torch.Tensor | None = None  # restored from a state before fit
        self._labels: torch.Tensor | None = None
        self._samples: dict | None = None
        self._em_method: str | None = None
        self._pending_posterior: dict | None = None
        self._pending_a: float | None = None
        self._old_trace: list[dict] = []
        self._rho: torch.Tensor | None = None
        self._ella_directions: tuple | None = None  # ELLA's last inputs' K directions (the predictive's cache)

    # ------------------------------------------------------------------------------------------ properties
    @property
    def prior_precision(self) -> float:
        """The current ``a``."""
        if self.posterior is not None:
            return float(self.posterior.a)
        return self._pending_a if self._pending_a is not None else self.a0

    @property
    def hessian_ratio(self) -> float | None:
        """Mean ``tr B_i`` over the training data at the linearised model's mode (at the current ``a``) divided by
        that at the trained network (``None`` before :meth:`fit`). Near 1 the published shortcut
        (``hessian_at="network"``) is justified; far above it (a network fitted to near-zero training loss) the
        network's curvature understates what the data say about the linear model."""
        if self._trace_mode is None or self._trace_net is None:
            return None
        return self._trace_mode / self._trace_net if self._trace_net > 0 else math.inf

    @property
    def overfit_fraction(self) -> float | None:
        """Fraction of the training labels that the trained network predicts and the linearised model's mode at
        the current ``a`` does not (``None`` before :meth:`fit`); :attr:`mode_kl` is the mean divergence of the two.
        A train-only check of the predictive centred at the network: above :data:`OVERFIT_WARNING` the network
        fits labels that the linearised model at this prior treats as noise (it over-fits), and its predictive on
        new inputs is likely over-confident (:class:`~ctuq.classify.mode.OverfitWarning`)."""
        if self._mode is None:
            return None
        return overfit_fraction(self._mode_finder.f, self._mode.logits, self._labels)

    @property
    def mode_kl(self) -> float | None:
        """Mean ``KL(softmax(f_i) ‖ softmax(η_i(w*)))`` in nats over the training inputs: network ``f`` against the
        linearised model's mode at the current ``a`` (``None`` before :meth:`fit`)."""
        return None if self._mode is None else mean_kl(self._mode_finder.f, self._mode.logits)

    def _warn_overfit(self) -> None:
        fraction = self.overfit_fraction
        if fraction is not None and fraction > OVERFIT_WARNING:
            warnings.warn(
                f"LinearizedLaplace: at the EM's a = {self.prior_precision:.4g}, {round(fraction * self.n_train)} "
                f"of the {self.n_train} training labels ({fraction:.1%}) are predicted by the trained network and "
                f"not by the linearised model's mode (mean KL(network ‖ mode) {self.mode_kl:.3g} nats): the "
                f"network fits labels its linearisation explains as noise (over-fitting), and a predictive centred "
                f"at the network is then likely over-confident; check it on held-out data, e.g. "
                f"optimize_prior('gridsearch', val_loader=...), or compare hessian_at='network' "
                f"(docs/classification.md §2.4)",
                OverfitWarning,
                stacklevel=3,
            )

    def _warn_hessian(self) -> None:
        ratio = self.hessian_ratio
        if self.hessian_at == HessianAt.NETWORK and ratio is not None and ratio > HESSIAN_RATIO_WARNING:
            warnings.warn(
                f"LinearizedLaplace(hessian_at='network'): the mean softmax-Hessian trace at the linearised "
                f"model's mode (a = {self._hessian_a:.4g}) is {ratio:.3g}× that at the trained network: the "
                f"evidence sees less curvature than the linearised model has and may pick too wide a prior; "
                f"compare hessian_at='linear_mode'",
                HessianMismatchWarning,
                stacklevel=3,
            )

    @property
    def n_params(self) -> int:
        """``d``, the number of linearised weights."""
        params = dict(self.model.named_parameters())
        return int(sum(params[n].numel() for n in self.param_names))

    @property
    def em_trace(self) -> list[dict]:
        """One record per EM step (the core's :meth:`SampledEM.step` record plus ``mode_norm_sq`` and
        ``mode_evaluations`` of the linearised model's mode at that step's ``a``)."""
        if self.posterior is not None:
            return self._old_trace + self.posterior.em_trace
        pending = (self._pending_posterior or {}).get("em") or {}
        return self._old_trace + list(pending.get("trace", []))

    def _require(self, what: str, samples_ok: bool = False) -> None:
        if self.posterior is None and not (samples_ok and self._samples is not None):
            raise RuntimeError(
                f"LinearizedLaplace.{what}: call fit(train_loader) first"
                + (" (or load a state that holds posterior samples)" if samples_ok else "")
            )

    # ------------------------------------------------------------------------------------------ fit
    def fit(self, train_loader) -> LinearizedLaplace:
        """Linearise at the trained weights on the training data of ``train_loader`` (``(x, y)`` batches).

        Collects the data, computes the softmax Hessians, the prior scales, the linearised model's mode at the
        current ``a`` and its pseudo-targets, and sets the posterior up (solver, preconditioner or
        eigendecomposition). Returns ``self``.
        """
        where = "LinearizedLaplace.fit"
        X, y = collect_loader(train_loader, where=where, progress=self.progress)
        if self._model is None:
            self._model = copy.deepcopy(self.model).to(self.dtype)
        X = X.to(self.dtype)
        logits = eval_logits(self._model, X, where=where)
        n, C = logits.shape
        check_labels(y, C, where=where)
        if self.n_classes is not None and self.n_classes != C:
            raise ValueError(f"{where}: the model returns {C} logits but the loaded state has {self.n_classes} classes")
        self.n_classes, self.n_train, self._labels = int(C), int(n), y
        try:
            self._net = LinearizedNetwork(self._model, X, param_names=self.param_names)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        _check_forward_mode(self._model, X[:1], self.param_names, where)
        self._root = root = SoftmaxHessianRoot(torch.softmax(logits.double(), 1), self.hessian_root)
        self._trace_net = mean_hessian_trace(root.p)
        # A network's fit can take minutes (every product runs over all n training inputs): say what runs.
        t0 = time.perf_counter()
        base, sq_norms, mode_net = self._features(X)
        self.say(
            f"features Ψ₀ ({n * C} × {self.n_params}, "
            f"{'assembled' if sq_norms is not None else 'Jacobian products'}): {time.perf_counter() - t0:.1f} s"
        )
        if self.scales is None:  # else restored from a state
            t0 = time.perf_counter()
            self.scales, made = prior_scales(
                self.prior,
                self.prior_options,
                base=base,
                model=self._model,
                X=X,
                names=self.param_names,
                root=root,
                n_params=self.n_params,
                sq_norms=sq_norms,
                a=self.prior_precision,
                seed=self.seed,
                chunk_size=self.jacobian_chunk,
                progress=self.progress,
            )
            what = "given" if made is None else f"{made.label}, {made.method}"
            self.say(f"prior scales ({what}): {time.perf_counter() - t0:.1f} s")
        self._jnet, scales = mode_net, self.scales
        if self._ella:
            # ELLA's model lives in its K coordinates: the basis from Ψ₀ diag(s) with B at the network, then
            # G = J diag(s) V (K JVPs) carries the mode, the features and the EM; nothing of size d after that
            if self.basis is None:  # else restored from a state
                self.basis = self._ella_basis(base, n * C)
            self._jnet = self._subspace_jacobian(mode_net)
            scales = torch.ones(self.rank, dtype=torch.float64)
        self._mode_finder = LinearMode(self._jnet, scales, y, logits, kind=self.linear_model, **self.mode_options)
        a = self.prior_precision
        targets = self._refresh_mode(a, self._mode_w)
        if self._linear_mode or self._ella:  # features with B at the linear model's mode; ELLA's: blockdiag(Lᵀ) G
            base = self._whitened_base(exact_solver(self.solver) or self._ella)
        pending, self._pending_posterior = self._pending_posterior, None
        self.posterior = self._new_posterior(base, targets, a, self.solver, self.solver_options, pending)
        if self._precond_trace is None or pending is None:  # else restored with the preconditioner it describes
            self._precond_trace = self._trace_mode
        self.say(f"linearised Laplace: n={n}, C={C}, d={self._net.d}, solver {self.posterior.solver_name}")
        self._warn_hessian()
        return self

    @property
    def _linear_mode(self) -> bool:
        return self.hessian_at == HessianAt.LINEAR_MODE

    @property
    def _ella(self) -> bool:
        return self.approximation == Approximation.ELLA

    def _ella_basis(self, base, c: int) -> NystromBasis:
        """ELLA's basis from ``landmarks`` rows of ``Ψ = Ψ₀ diag(s)`` (one-line errors naming M, K and the rank)."""
        t0 = time.perf_counter()
        try:
            basis = nystrom_basis(
                ScaledFeatures(base, self.scales.to(base.dtype)), min(self.landmarks, c), self.rank, seed=self.seed
            )
        except ValueError as exc:
            raise ValueError(f"LinearizedLaplace(approximation='ella'): {exc}") from None
        if self.landmarks > c:
            self.say(f"ELLA: {self.landmarks} landmarks asked, the training data have {c} rows: all of them")
        self.say(
            f"ELLA: {self.rank} of the {basis.rank_found} eigenpairs of {basis.rows.numel()} landmark rows: "
            f"{time.perf_counter() - t0:.1f} s"
        )
        return basis

    def _subspace_jacobian(self, net) -> DenseJacobian:
        """ELLA's ``G = J diag(s) V`` ``(n·C, K)``: ``K`` Jacobian-vector products over the training inputs."""
        t0 = time.perf_counter()
        jac = DenseJacobian.of_subspace(net, self.scales, self.basis.V)
        self.say(f"ELLA: J diag(s) V ({jac.d_out} × {jac.d}): {time.perf_counter() - t0:.1f} s")
        return jac

    def _lift(self, W: torch.Tensor) -> torch.Tensor:
        """Scaled weights ``(B, d)`` of the posterior's samples ``W``: ``V u`` for ELLA's ``K`` coordinates."""
        return self.basis.lift(W.to(self.basis.V.dtype)).double() if self._ella else W

    def _new_posterior(self, base, targets, a, solver, solver_options, pending=None) -> LinearizedPosterior:
        """A set-up posterior on ``base`` (``Ψ₀``) with ``targets`` at ``a`` (a stored posterior state resumes). ELLA:
        ``base`` is ``Ψ₀ diag(s) V`` of its ``K`` coordinates (unit scales), solved exactly."""
        prior = self.scales.to(self.dtype)
        if self._ella:
            prior = torch.ones(base.n_features, dtype=self.dtype)
            solver, solver_options = SolverAlias.EXACT.value, None
        post = LinearizedPosterior(
            base,
            targets.to(self.dtype),
            prior=prior,
            likelihood=CategoricalLikelihood(),
            a=a,
            solver=solver,
            solver_options=solver_options,
            seed=self.seed,
            progress=self.progress,
            log=self.say,
            workload=Workload(em_steps=5, em_samples=16, prediction_samples=64),
        )
        if pending is not None:
            post.load_state_dict(pending)
        return post.setup()

    def _whitened_base(self, exact: bool):
        """``Ψ₀ = blockdiag(L_iᵀ) J`` with the current roots :attr:`_root`: assembled from a held ``J`` for an exact
        solver (no Jacobian products), else the roots applied per product."""
        net = self._jnet
        if exact and isinstance(net, DenseJacobian):
            return DenseFeatures(whitened_matrix(net, self._root))
        return LinearizedFeatures(
            net, output_map=self._root.apply_transpose, output_adjoint=self._root.apply, n_outputs=net.d_out
        )

    def _hold_jacobian(self) -> None:
        """Assemble ``J`` once (when it fits the dense budget) for the mode finder and the features, so that an exact
        solver's ``Ψ₀`` is rebuilt from it at every move of ``B`` instead of by ``d`` Jacobian products."""
        net = self._jnet
        if isinstance(net, DenseJacobian) or not dense_features_fit(net.d_out, net.d, "cpu"):
            return
        t0 = time.perf_counter()
        X = self._net.net_input
        J = assemble_jacobian(
            self._model, X, self.param_names, chunk_size=self.jacobian_chunk, progress=self.progress, dtype=self.dtype
        )
        self._jnet = self._mode_finder.net = DenseJacobian(J, self._net)
        self.say(
            f"logit Jacobian J ({net.d_out} × {net.d}) assembled for the exact solver: {time.perf_counter() - t0:.1f} s"
        )

    def _rebuild_posterior(self, targets: torch.Tensor) -> None:
        """Rebuild the posterior (features, targets, solver set-up) at its ``a`` for the current roots; a running EM
        moves over with its generator, trace and step count (``hessian_at="linear_mode"``)."""
        old = self.posterior
        t0 = time.perf_counter()
        pending, built = None, self._trace_mode
        reuse = (
            old.solver_name == "cg"
            and self._precond_trace is not None
            and 1 / PRECONDITIONER_REUSE < self._trace_mode / self._precond_trace < PRECONDITIONER_REUSE
        )
        if reuse:
            pending = {k: v for k, v in old.state_dict().items() if k != "em"}  # its preconditioner, no EM
            built = self._precond_trace
        new = self._new_posterior(
            self._whitened_base(old.exact), targets, old.a, old.solver_name, old.solver_options, pending
        )
        self._precond_trace = built
        if old.em is not None:
            em = old.em
            em.features, em.solver, em.y_tilde = new.features, new.solver, new.whitened_targets
            new.em, new.em_result = em, old.em_result
        self.posterior = new
        self._samples = None
        self.say(
            f"posterior rebuilt with B at the linear mode (a = {old.a:.4g}"
            f"{', preconditioner kept' if reuse else ''}): {time.perf_counter() - t0:.1f} s"
        )

    def _features(self, X, exact: bool | None = None):
        """``(Ψ₀, squared column norms or None, the mode finder's network)`` by :attr:`dense_features` for an exact
        (or the configured) solver (:func:`~ctuq.classify.build.whitened_features`), with the roots
        :attr:`_root`. With ``hessian_at="linear_mode"`` an assembled ``J`` is kept for an exact solver too (``Ψ₀``
        is rebuilt from it whenever ``B`` moves)."""
        c, d = X.shape[0] * self.n_classes, self.n_params
        exact = exact_solver(self.solver) if exact is None else exact
        need = c * d * torch.empty((), dtype=self.dtype).element_size()
        budget = memory_budget(Budget.DENSE_SOLVER, "cpu")
        if self.dense_features == DenseChoice.ALWAYS:
            dense = True
            if need > budget:
                raise MemoryError(
                    f"LinearizedLaplace(dense_features='always'): Ψ₀ ({c} × {d}, {self.dtype}) needs "
                    f"{need / 2**30:.1f} GiB, the dense budget is {budget / 2**30:.1f} "
                    f"GiB; use dtype=torch.float32, dense_features='auto', or fewer training examples"
                )
        elif self.dense_features == DenseChoice.NEVER:
            dense = False
        elif self._ella:  # the basis takes M rows of Ψ₀ and G = J diag(s) V K columns: products, never all of it
            dense = False
        elif exact:
            dense = dense_features_fit(c, d, "cpu")
            if not dense:
                self.say("Ψ₀ does not fit the dense memory budget: the exact solver goes through Jacobian products")
        else:
            flops = forward_flops_per_example(self._model, X)
            dense = assembly_pays(flops, self.n_classes, d)
            why = (
                f"a forward pass costs {flops:.3g} flops per example "
                f"{'≥' if dense else '<'} 2·C·d = {2.0 * self.n_classes * d:.3g}"
            )
            if dense and need > budget:
                dense = False
                self.say(
                    f"Ψ₀ would pay ({why}) but needs {need / 2**30:.1f} GiB of a {budget / 2**30:.1f} GiB dense "
                    f"budget: Jacobian products"
                    + (
                        " (with dtype=torch.float32 it would fit)"
                        if need / 2 <= budget and self.dtype == torch.float64
                        else ""
                    )
                )
            else:
                self.say(f"Ψ₀ {'assembled' if dense else 'through Jacobian products'}: {why}")
        return whitened_features(
            self._model,
            self._net,
            X,
            self.param_names,
            self._root,
            dense=dense,
            dtype=self.dtype,
            chunk_size=self.jacobian_chunk,
            keep_jacobian=not exact or self._linear_mode,
            progress=self.progress,
        )

    def _refresh_mode(self, a: float, w0: torch.Tensor | None = None) -> torch.Tensor:
        """Mode at ``a`` (warm start) and the pseudo-targets ``ỹ = Ψ w* + ρ`` ``(n·C,)`` float64. With
        ``hessian_at="linear_mode"`` the roots :attr:`_root` move to the mode's probabilities first (the caller
        rebuilds the features); ``ρ`` solves ``L_i ρ_i = y_i − q_i`` with those roots, so ``Ψᵀρ = a w*`` holds for
        either choice of ``B``."""
        start = w0 if w0 is not None else (self._mode.w if self._mode is not None else None)
        t0 = time.perf_counter()
        self._mode = mode = self._mode_finder.fit(a, start)
        self.say(
            f"mode of the linearised model at a = {a:.4g}: {mode.evaluations} L-BFGS evaluations (a JVP and a "
            f"VJP each), ‖∇‖ {mode.grad_norm:.2e}, {time.perf_counter() - t0:.1f} s"
        )
        self._trace_mode, self._hessian_a = mean_hessian_trace(mode.probs), float(a)
        if self._linear_mode:
            self._root = SoftmaxHessianRoot(mode.probs, self.hessian_root)
        self._rho = self._root.residual_targets(self._labels, mode.probs)
        eta = self._mode_finder.jvp(mode.w)  # J (s ⊙ w*), flat
        return self._root.apply_transpose(eta[None])[0] + self._rho

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything to predict and resume; tensors and plain values (``torch.load(weights_only=True)``)."""
        return _state.state_dict(self)

    def load_state_dict(self, state: dict) -> LinearizedLaplace:
        """Restore :meth:`state_dict` output into this (unfitted) object: stored posterior samples predict at once;
        a later :meth:`fit` resumes the posterior (no g-prior or EM work is repeated). Returns ``self``."""
        _state.load_state_dict(self, state)
        return self

    @classmethod
    def from_state_dict(cls, model: nn.Module, state: dict, **kwargs) -> LinearizedLaplace:
        """A new object for ``model`` with the settings stored in ``state`` (``kwargs`` override), restored."""
        return cls(model, **{**_state.settings(state), **kwargs}).load_state_dict(state)

    def save(self, path) -> Path:
        """Write :meth:`state_dict` to ``path`` atomically (with its checksum: a file edited afterwards is refused by
        :meth:`load`). Returns the path."""
        return _state.save_state(path, self.state_dict())

    @classmethod
    def load(cls, model: nn.Module, path, **kwargs) -> LinearizedLaplace:
        """A new object for ``model`` restored from a file of :meth:`save` (``weights_only`` loading); a damaged or
        modified file, or one saved for another network, raises :class:`~ctuq.classify.state.ClassifierStateError`
        naming the file."""
        state = _state.load_state(path)
        try:
            return cls.from_state_dict(model, state, **kwargs)
        except _state.ClassifierStateError as exc:
            raise _state.ClassifierStateError(f"{path}: {exc}") from exc

    def __repr__(self) -> str:
        prior = self.prior if isinstance(self.prior, str) else "scales"
        return (
            f"LinearizedLaplace(d={self.n_params}, prior={prior}, "
            f"a={self.prior_precision:.4g}, hessian_at={self.hessian_at!r}, solver={self.solver!r}, "
            + (f"approximation='ella', landmarks={self.landmarks}, rank={self.rank}, " if self._ella else "")
            + f"fitted={self.posterior is not None})"
        )
