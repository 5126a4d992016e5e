"""``LinearizedLaplace``: linearised Laplace for a trained PyTorch classifier on ctuq's inference core.

The model (DESIGN.md §1, classification row). A classifier ``f(x; v)`` with ``C`` logits, trained weights ``ṽ``,
``n`` training pairs ``(x_i, y_i)``, probabilities ``p_i = softmax(f(x_i; ṽ))`` and softmax Hessians
``B_i = diag(p_i) − p_i p_iᵀ = L_i L_iᵀ`` (:mod:`ctuq.classify.hessian`). Scaled weights ``w`` with
``v = s ⊙ w`` and prior ``w ~ N(0, a⁻¹ I)``; ``s`` is the g-prior ``s_j = [Σ_i J_iᵀ B_i J_i]_jj^(−1/2)`` (exact:
per-example Jacobians, :mod:`ctuq.classify.jacobians`) or ones.

* E-step (Laplace at the trained network): the categorical log-likelihood of the linearised model is replaced by
  its second-order expansion with the curvature ``B_i`` of the trained network. In whitened coordinates this is
  the core's Gaussian linear model ``ỹ = Ψ w + ε``, ``ε ~ N(0, I)`` (:class:`~ctuq.inference.CategoricalLikelihood`)
  with features ``Ψ = blockdiag(L_iᵀ) J diag(s)`` over all ``n·C`` logits and posterior covariance
  ``(ΨᵀΨ + aI)⁻¹``, sampled by :class:`~ctuq.inference.LinearizedPosterior` (Matheron's rule; CG, exact or any
  registered solver).
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
from collections.abc import Callable, Sequence

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
from ctuq.classify.hessian import SoftmaxHessianRoot
from ctuq.classify.jacobians import DenseJacobian
from ctuq.classify.mode import LinearMode
from ctuq.classify.predictive import PredictiveMixin
from ctuq.inference import (
    SOLVERS,
    CategoricalLikelihood,
    DenseFeatures,
    LinearizedPosterior,
    Workload,
    dense_features_fit,
    solver_choices,
)
from ctuq.linearize import LinearizedNetwork
from ctuq.memory import Budget, memory_budget
from ctuq.options import DenseFeatures as DenseChoice
from ctuq.options import GPriorMethod, HessianRoot, LinearModel, Prior, PriorMethod, SolverAlias, values
from ctuq.utils import progress as _progress_bar

__all__ = ["LinearizedLaplace", "exact_solver"]


def exact_solver(solver: str) -> bool:
    """Whether the ``solver=`` value ``solver`` names an exact solver: the ``"exact"`` alias or a registry solver
    with exact ``γ`` and evidence (:attr:`ctuq.inference.Solver.exact`)."""
    return solver == SolverAlias.EXACT or (solver in SOLVERS and SOLVERS[solver].exact)


class LinearizedLaplace(PredictiveMixin):
    """Linearised Laplace over all (or some) weights of a classifier (module docstring for the equations).

    Parameters
    ----------
    model : nn.Module
        Maps inputs ``(N, ...)`` to logits ``(N, C)``. Copied (in ``dtype``) at :meth:`fit`; evaluated in eval mode.
    prior : {"gprior", "isotropic"} or torch.Tensor
        Prior scales ``s``, or the scales themselves ``(d,)``.
    weights : {"all", "last_layer"} or list of str
        The linearised parameters (all by default, biases and normalisation parameters included).
    prior_precision : float
        Initial ``a``.
    linear_model : {"tangent", "affine"}
        Whose categorical mode enters the M-step (:mod:`ctuq.classify.mode`).
    gprior_method : {"exact", "stochastic"}
        Exact GGN diagonal (``C`` per-example backward passes) or ``gprior_probes`` Rademacher probes.
    hessian_root : {"closed_form", "symmetric"}
        Factor of ``B_i`` (:mod:`ctuq.classify.hessian`).
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
        weights: str | Sequence[str] = "all",
        prior_precision: float = 1.0,
        linear_model: str = "tangent",
        gprior_method: str = "exact",
        gprior_probes: int = 256,
        hessian_root: str = "closed_form",
        solver: str = "auto",
        solver_options: dict | None = None,
        dtype: torch.dtype = torch.float64,
        seed: int = 0,
        progress: bool = False,
        log: Callable[[str], None] | None = None,
        mode_options: dict | None = None,
        jacobian_chunk: int = 32,
        dense_features: str = "auto",
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"LinearizedLaplace: model must be an nn.Module, got {type(model).__name__}")
        if isinstance(prior, str) and prior not in values(Prior):
            raise ValueError(
                f"LinearizedLaplace: prior must be 'gprior', 'isotropic' or a tensor of scales, got {prior!r}"
            )
        if not (float(prior_precision) > 0 and math.isfinite(float(prior_precision))):
            raise ValueError(f"LinearizedLaplace: prior_precision must be positive and finite, got {prior_precision}")
        for name, value, allowed in (
            ("linear_model", linear_model, values(LinearModel)),
            ("hessian_root", hessian_root, values(HessianRoot)),
            ("gprior_method", gprior_method, values(GPriorMethod)),
            ("solver", solver, solver_choices()),
            ("dense_features", dense_features, values(DenseChoice)),
        ):
            if value not in allowed:
                raise ValueError(f"LinearizedLaplace: {name} must be one of {list(allowed)}, got {value!r}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"LinearizedLaplace: dtype must be torch.float32 or torch.float64, got {dtype}")
        self.model = model
        self.weights = weights if isinstance(weights, str) else list(weights)
        self.param_names = resolve_weights(model, weights)
        self.prior = prior
        self.a0 = float(prior_precision)
        self.linear_model = linear_model
        self.gprior_method, self.gprior_probes = gprior_method, int(gprior_probes)
        self.hessian_root = hessian_root
        self.solver = solver
        self.solver_options = dict(solver_options or {})
        self.dtype = dtype
        self.seed = int(seed)
        self.progress = progress
        self.say = log or (lambda _msg: None)
        self.mode_options = dict(mode_options or {})
        self.jacobian_chunk = int(jacobian_chunk)
        self.dense_features = dense_features
        # set by fit() / load_state_dict()
        self.posterior: LinearizedPosterior | None = None
        self.scales: torch.Tensor | None = None
        self.n_classes: int | None = None
        self.n_train: int | None = None
        self._model: nn.Module | None = None
        self._net = None
        self._root: SoftmaxHessianRoot | None = None
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

    # ------------------------------------------------------------------------------------------ properties
    @property
    def prior_precision(self) -> float:
        """The current ``a``."""
        if self.posterior is not None:
            return float(self.posterior.a)
        return self._pending_a if self._pending_a is not None else self.a0

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
        self._root = root = SoftmaxHessianRoot(torch.softmax(logits.double(), 1), self.hessian_root)
        # A network's fit can take minutes (every product runs over all n training inputs): say what runs.
        t0 = time.perf_counter()
        base, sq_norms, mode_net = self._features(X)
        self.say(
            f"features Ψ₀ ({n * C} × {self.n_params}, "
            f"{'assembled' if sq_norms is not None else 'Jacobian products'}): {time.perf_counter() - t0:.1f} s"
        )
        if self.scales is None:  # else restored from a state
            t0 = time.perf_counter()
            self.scales = prior_scales(
                self.prior,
                base=base,
                model=self._model,
                X=X,
                names=self.param_names,
                root=root,
                n_params=self.n_params,
                sq_norms=sq_norms,
                gprior_method=self.gprior_method,
                gprior_probes=self.gprior_probes,
                seed=self.seed,
                chunk_size=self.jacobian_chunk,
                progress=self.progress,
            )
            self.say(
                f"prior scales ({self.prior if isinstance(self.prior, str) else 'given'}"
                f"{', ' + self.gprior_method if self.prior == 'gprior' else ''}): "
                f"{time.perf_counter() - t0:.1f} s"
            )
        self._mode_finder = LinearMode(mode_net, self.scales, y, logits, kind=self.linear_model, **self.mode_options)
        a = self.prior_precision
        targets = self._refresh_mode(a, self._mode_w)
        post = LinearizedPosterior(
            base,
            targets.to(self.dtype),
            prior=self.scales.to(self.dtype),
            likelihood=CategoricalLikelihood(),
            a=a,
            solver=self.solver,
            solver_options=self.solver_options,
            seed=self.seed,
            progress=self.progress,
            log=self.say,
            workload=Workload(em_steps=5, em_samples=16, prediction_samples=64),
        )
        if self._pending_posterior is not None:
            post.load_state_dict(self._pending_posterior)
            self._pending_posterior = None
        self.posterior = post.setup()
        self.say(f"linearised Laplace: n={n}, C={C}, d={self._net.d}, solver {post.solver_name}")
        return self

    def _features(self, X, exact: bool | None = None):
        """``(Ψ₀, squared column norms or None, the mode finder's network)`` by :attr:`dense_features` for an exact
        (or the configured) solver (:func:`~ctuq.classify.build.whitened_features`)."""
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
            keep_jacobian=not exact,
            progress=self.progress,
        )

    def _refresh_mode(self, a: float, w0: torch.Tensor | None = None) -> torch.Tensor:
        """Mode at ``a`` (warm start) and the pseudo-targets ``ỹ = Ψ w* + ρ`` ``(n·C,)`` float64."""
        start = w0 if w0 is not None else (self._mode.w if self._mode is not None else None)
        t0 = time.perf_counter()
        self._mode = mode = self._mode_finder.fit(a, start)
        self.say(
            f"mode of the linearised model at a = {a:.4g}: {mode.evaluations} L-BFGS evaluations (a JVP and a "
            f"VJP each), ‖∇‖ {mode.grad_norm:.2e}, {time.perf_counter() - t0:.1f} s"
        )
        self._rho = self._root.residual_targets(self._labels, mode.probs)
        eta = self._mode_finder.jvp(mode.w)  # J (s ⊙ w*), flat
        return self._root.apply_transpose(eta[None])[0] + self._rho

    # ------------------------------------------------------------------------------------------ EM
    def optimize_prior(
        self,
        method: str = "sampled_em",
        *,
        max_steps: int = 5,
        n_samples: int = 16,
        tol: float = 1e-2,
        callback: Callable[[dict], None] | None = None,
        update: str = "damped",
    ):
        """MacKay EM for ``a`` (module docstring): ``"sampled_em"`` (``γ̂`` from ``n_samples`` posterior samples
        per step) or ``"exact"`` (exact ``γ``; switches to an exact solver if needed). Runs up to ``max_steps``
        more steps, stopping when ``|Δa|/a < tol``; ``callback(record)`` after each. ``update``: ``"damped"``
        (default: the MacKay map oscillates for networks whose effective dimension falls steeply with ``a``) or
        ``"mackay"`` (:class:`~ctuq.inference.SampledEM`). Returns the core's
        :class:`~ctuq.inference.EMResult`; the trace is :attr:`em_trace`."""
        self._require("optimize_prior")
        if method not in values(PriorMethod):
            raise ValueError(
                f"LinearizedLaplace.optimize_prior: method must be one of {list(values(PriorMethod))}, got {method!r}"
            )
        post = self.posterior
        if method == PriorMethod.EXACT and not post.exact:
            self.say("optimize_prior('exact'): rebuilding the posterior with an exact solver")
            self._old_trace += post.em_trace
            if isinstance(post.base, DenseFeatures):
                base = post.base
            elif isinstance(getattr(post.base, "network", None), DenseJacobian) and dense_features_fit(
                post.base.n_outputs, post.base.n_features, "cpu"
            ):
                base = DenseFeatures(whitened_matrix(post.base.network, self._root))  # no Jacobians again
            else:
                base = self._features(self._net.net_input, True)[0]
            post = LinearizedPosterior(
                base,
                post.targets,
                prior=self.scales.to(self.dtype),
                likelihood=CategoricalLikelihood(),
                a=post.a,
                solver=SolverAlias.EXACT.value,
                seed=self.seed,
                progress=self.progress,
                log=self.say,
            ).setup()
            self.posterior, self.solver = post, SolverAlias.EXACT.value
        elif post.em is not None and self._em_method not in (None, method):
            self._old_trace += post.em_trace  # a new EM for the other γ method; keep the trace
            post.reset_em()
        elif post.em is not None:
            post.em.converged = False  # continue the same EM (same generator) for max_steps more steps
        self._em_method = method
        bar = None
        if self.progress:
            bar = _progress_bar(total=max_steps, desc=f"EM ({method})")
        state = {"mode": self._mode}

        def after(record: dict) -> None:
            record["mode_norm_sq"] = float(state["mode"].w.pow(2).sum())
            record["mode_evaluations"] = int(state["mode"].evaluations)
            post.set_targets(self._refresh_mode(post.a).to(self.dtype))
            state["mode"] = self._mode
            self._samples = None
            damped = (
                f" (damped {record['damping']:.2f}; MacKay {record['a_mackay']:.4g})" if record["damping"] < 1 else ""
            )
            self.say(
                f"EM step {record['step']}: a {record['a']:.4g} -> {record['a_new']:.4g}{damped}, "
                f"γ {record['gamma']:.4g}, ‖w*‖² {record['weight_norm_sq']:.4g}"
            )
            if bar is not None:
                bar.update(1)
            if callback is not None:
                callback(record)

        gamma = "sampled" if method == PriorMethod.SAMPLED_EM else "exact"
        if post.em is None:  # create the EM first (it restores a loaded EM state): steps count from there
            post.fit(max_steps=0, n_samples=int(n_samples), tol=float(tol), gamma=gamma, update=update)
        steps = post.em.step_count
        result = post.fit(
            max_steps=steps + int(max_steps),
            n_samples=int(n_samples),
            tol=float(tol),
            gamma=gamma,
            callback=after,
            update=update,
        )
        if bar is not None:
            bar.close()
        return result

    def log_evidence(self) -> float:
        """Laplace log evidence (nats) of the linearised model at the current ``a`` (module docstring); exact
        solvers only."""
        self._require("log_evidence")
        if not self.posterior.exact:
            raise ValueError(
                f"LinearizedLaplace.log_evidence needs an exact solver (solver='exact'); this one uses "
                f"{self.posterior.solver_name!r}"
            )
        c = self.posterior.n_outputs
        logp = torch.log_softmax(self._mode.logits, 1)[torch.arange(self.n_train), self._labels].sum()
        return (
            self.posterior.log_evidence()
            + 0.5 * float(self._rho.pow(2).sum())
            + 0.5 * c * math.log(2 * math.pi)
            + float(logp)
        )

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

    def __repr__(self) -> str:
        prior = self.prior if isinstance(self.prior, str) else "scales"
        return (
            f"LinearizedLaplace(d={self.n_params}, prior={prior}, "
            f"a={self.prior_precision:.4g}, solver={self.solver!r}, fitted={self.posterior is not None})"
        )
