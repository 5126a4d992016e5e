"""Choosing the prior precision ``a`` of :class:`~ctuq.classify.LinearizedLaplace`: MacKay EM (sampled or exact ``γ``,
damped or plain, with the secant step where the map is monotone), the validation grid search, setting ``a`` by hand, the
held-out guard against the network itself, and the Laplace log evidence. :class:`PriorFitMixin` holds these methods; the
equations are in :mod:`ctuq.classify.laplace`'s docstring and docs/classification.md."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Self

import torch

from ctuq.classify.build import whitened_matrix
from ctuq.classify.data import check_labels, collect_loader
from ctuq.classify.jacobians import DenseJacobian
from ctuq.classify.predictive import link_probabilities
from ctuq.inference import DenseFeatures, dense_features_fit
from ctuq.metrics.classification import nll as _nll
from ctuq.options import EMUpdate, Link, PriorMethod, SolverAlias, values
from ctuq.utils import progress as _progress_bar

__all__ = ["PriorFitMixin", "DEFAULT_GRID", "GUARD_TOLERANCE", "GUARD_STEP", "GUARD_STEPS", "GuardWarning"]

DEFAULT_GRID = tuple(float(10.0**e) for e in torch.linspace(-2.0, 6.0, 25).tolist())
"""Prior precisions of ``optimize_prior("gridsearch")`` by default: 1e-2 … 1e6, three per decade (the g-prior's
``a`` is dimensionless; measured EM values lie between 3 and 2,500 on the benchmark's networks)."""


GUARD_TOLERANCE = 0.02
"""The held-out guard's tolerance: the EM's ``a`` stands while its validation NLL is at most ``1 + 0.02`` times the
network's own (a margin below 5 % for the noise of a few hundred held-out examples; docs/classification.md §2.5 for
its effect on the benchmark's networks)."""

GUARD_STEP = 10.0**0.5
"""Factor by which the held-out guard raises ``a`` per step (two steps a decade)."""

GUARD_STEPS = 12
"""Most steps of the held-out guard: ``a`` up to ``10⁶`` times the EM's."""


class GuardWarning(UserWarning):
    """The held-out guard reached :data:`GUARD_STEPS` without the predictive matching the network on validation
    data."""


def _check_predictive(where: str, link: str, samples: int) -> None:
    """The held-out predictive's settings of the grid search and the guard: a known ``link``, ``samples`` >= 1."""
    if link not in values(Link):
        raise ValueError(f"{where}: link must be one of {list(values(Link))}, got {link!r}")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"{where}: samples must be a positive int, got {samples!r}")


class PriorFitMixin:
    """The prior-precision methods of :class:`~ctuq.classify.LinearizedLaplace` (it inherits them): they read and
    rebuild its posterior, mode and pseudo-targets."""

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
        val_loader=None,
        link: str = "probit",
        grid: Sequence[float] | None = None,
        samples: int = 64,
        tolerance: float = GUARD_TOLERANCE,
    ):
        """Choose the prior precision ``a``.

        ``"sampled_em"`` / ``"exact"``: MacKay EM (module docstring), ``γ̂`` from ``n_samples`` posterior samples
        per step or exact (switches to an exact solver if needed). Runs up to ``max_steps`` more steps, stopping
        when ``|Δa|/a < tol``; ``callback(record)`` after each. ``update``: ``"damped"`` (default: the MacKay map
        oscillates for networks whose effective dimension falls steeply with ``a``) or ``"mackay"``
        (:class:`~ctuq.inference.SampledEM`). With ``hessian_at="linear_mode"`` every step ends with the mode at
        the new ``a``, the softmax Hessians at that mode and the posterior rebuilt on them, so the EM's fixed
        point is joint in ``a`` and ``B``. Returns the core's :class:`~ctuq.inference.EMResult`; the trace is
        :attr:`em_trace` (records add ``mode_norm_sq``, ``mode_evaluations``, ``hessian_ratio``).

        ``"gridsearch"``: post-hoc calibration, not Bayesian model selection (as laplace-torch's): for every ``a``
        of ``grid`` (default :data:`DEFAULT_GRID`) the predictive with ``link`` (``"probit"`` or ``"mc"``) and
        ``samples`` posterior samples (the same seed at every ``a``) is scored by its NLL on ``val_loader``
        (``(x, y)`` batches of held-out data), and ``a`` is set to the best value (the first of equal ones). With
        ``hessian_at="linear_mode"`` each ``a`` gets its own mode, ``B`` and posterior, as the EM's would.
        Returns ``{"a": best a, "nll": its validation NLL, "trace": [{"a", "nll"}, …]}`` (also
        :attr:`gridsearch_trace`).

        ``val_loader`` with ``"sampled_em"`` / ``"exact"``: the **held-out guard**, a check of the EM's ``a`` against
        the network it wraps. The EM's evidence cannot see how a network that fits its training labels with
        near-certainty generalises (on the benchmark's digits MLP and CNNs alike every training label gets
        probability > 0.99), and where the network errs on few test inputs the EM's width costs NLL. After the EM,
        the predictive's NLL on ``val_loader`` (``link``, ``samples``) is compared with the network's own; while it
        exceeds ``(1 + tolerance)`` times the network's, ``a`` is raised by :data:`GUARD_STEP` (each ``a`` with its
        own mode and, at ``"linear_mode"``, ``B``), at most :data:`GUARD_STEPS` times (then a :class:`GuardWarning`).
        So the guard keeps the widest posterior that held-out data cannot tell from the network (``a`` → ∞ is the
        network's predictive), and leaves the EM's ``a`` alone where it is at least as good. The record is
        :attr:`guard` (``{"a_em", "a", "network_nll", "tolerance", "link", "trace": [{"a", "nll"}, …]}``); the
        return value stays the EM's result (its ``a`` is the EM's; :attr:`prior_precision` is the guarded one).
        """
        self._require("optimize_prior")
        if method not in values(PriorMethod):
            raise ValueError(
                f"LinearizedLaplace.optimize_prior: method must be one of {list(values(PriorMethod))}, got {method!r}"
            )
        if method == PriorMethod.GRIDSEARCH:
            return self._gridsearch(val_loader, link=link, grid=grid, samples=samples)
        if grid is not None:
            raise ValueError(f"LinearizedLaplace.optimize_prior: grid belongs to method='gridsearch', not {method!r}")
        held = None
        if val_loader is not None:  # checked and collected before the EM's minutes, not after
            held = self._guard_data(val_loader, link, samples, tolerance)
        post = self._em_posterior(method)
        bar = None
        if self.progress:
            bar = _progress_bar(total=max_steps, desc=f"EM ({method})")
        state = {"mode": self._mode}

        def after(record: dict) -> None:
            self._em_step_done(record, state["mode"], update)
            state["mode"] = self._mode
            if bar is not None:
                bar.update(1)
            if callback is not None:
                callback(record)

        gamma = "sampled" if method == PriorMethod.SAMPLED_EM else "exact"
        # probes fixed across steps would hold Ψξ of the features before B moved
        fixed = False if self._linear_mode else None
        if post.em is None:  # create the EM first (it restores a loaded EM state): steps count from there
            post.fit(
                max_steps=0, n_samples=int(n_samples), tol=float(tol), gamma=gamma, update=update, fixed_probes=fixed
            )
        steps = post.em.step_count
        result = post.fit(
            max_steps=steps + int(max_steps),
            n_samples=int(n_samples),
            tol=float(tol),
            gamma=gamma,
            callback=after,
            update=update,
            fixed_probes=fixed,
        )
        if self.posterior is not post:  # rebuilt during the EM: the newest posterior holds the result
            self.posterior.a, self.posterior.em_result = result.a, result
        if bar is not None:
            bar.close()
        self._warn_hessian()
        self._warn_overfit()
        if held is not None:
            self._heldout_guard(*held, link=link, samples=samples, tolerance=tolerance)
        return result

    def _em_posterior(self, method: str):
        """The posterior the EM of ``method`` runs on: rebuilt with an exact solver for ``"exact"`` (from the
        features at hand where it can), a new EM for the other γ method (the trace kept), else the same EM
        continued."""
        post = self.posterior
        if method == PriorMethod.EXACT and not post.exact:
            self.say("optimize_prior('exact'): rebuilding the posterior with an exact solver")
            self._old_trace += post.em_trace
            if self._linear_mode:
                self._hold_jacobian()
                base = self._whitened_base(exact=True)
            elif isinstance(post.base, DenseFeatures):
                base = post.base
            elif isinstance(getattr(post.base, "network", None), DenseJacobian) and dense_features_fit(
                post.base.n_outputs, post.base.n_features, "cpu"
            ):
                base = DenseFeatures(whitened_matrix(post.base.network, self._root))  # no Jacobians again
            else:
                base = self._features(self._net.net_input, True)[0]
            post = self._new_posterior(base, post.targets, post.a, SolverAlias.EXACT.value, None)
            self.posterior, self.solver = post, SolverAlias.EXACT.value
        elif post.em is not None and self._em_method not in (None, method):
            self._old_trace += post.em_trace  # a new EM for the other γ method; keep the trace
            post.reset_em()
        elif post.em is not None:
            post.em.converged = False  # continue the same EM (same generator) for max_steps more steps
        self._em_method = method
        return post

    def _em_step_done(self, record: dict, mode, update: str) -> None:
        """After an EM step (its ``record``, made at the linearised model's ``mode``): the secant step where it
        applies, the mode and pseudo-targets at the new ``a`` (with ``hessian_at="linear_mode"`` the posterior
        rebuilt on the new ``B``), the record's additions (:meth:`optimize_prior`) and its log line."""
        record["mode_norm_sq"] = float(mode.w.pow(2).sum())
        record["mode_evaluations"] = int(mode.evaluations)
        if self._linear_mode and update == EMUpdate.DAMPED:
            self._secant(record)
        a_new = float(record["a_new"])
        self.posterior.a = a_new
        targets = self._refresh_mode(a_new)
        if self._linear_mode:
            self._rebuild_posterior(targets)  # the EM moves to the posterior with B at the new mode
        else:
            self.posterior.set_targets(targets.to(self.dtype))
        record["hessian_ratio"] = self.hessian_ratio
        record["overfit_fraction"] = self.overfit_fraction
        self._samples = None
        damped = (
            f" ({'damped' if record['damping'] < 1 else 'secant'} {record['damping']:.2f}; "
            f"MacKay {record['a_mackay']:.4g})"
            if record["damping"] != 1
            else ""
        )
        self.say(
            f"EM step {record['step']}: a {record['a']:.4g} -> {record['a_new']:.4g}{damped}, "
            f"γ {record['gamma']:.4g}, ‖w*‖² {record['weight_norm_sq']:.4g}, "
            f"tr B ratio (mode/network) {self.hessian_ratio:.3g}"
        )

    def _secant(self, record: dict) -> None:
        """The damped update's secant step also where the map ``T(x) = log(γ/‖w*‖²)`` of ``x = log a`` has a slope
        ``0 < κ ≤ 2/3`` (``hessian_at="linear_mode"``).

        With ``B`` at the linear mode, ``γ`` grows with ``a`` (the mode's probabilities soften, ``B`` grows), so
        ``κ > 0``: MacKay's iterates approach the fixed point from one side, by a factor ``κ`` per step (measured
        0.45 on the tiny test network, 35 steps to 1e-11). The secant root ``x + (T(x) − x)/(1 − κ)`` of
        ``T(x) − x`` converges superlinearly instead. ``κ`` above 2/3 (``ω = 1/(1 − κ) > 3``) is taken as
        Monte Carlo noise of ``γ̂`` and gets MacKay's step. Updates the EM's ``a`` and the record in place
        (``a_new``, ``damping``, ``rel_change_a``; ``a_mackay`` stays MacKay's value)."""
        em = self.posterior.em
        trace = em.trace
        if len(trace) < 2 or trace[-1] is not record:
            return
        prev = trace[-2]
        dx = math.log(record["a"]) - math.log(prev["a"])
        if abs(dx) < 1e-12:
            return
        kappa = (math.log(record["a_mackay"]) - math.log(prev["a_mackay"])) / dx
        if not (0.0 < kappa <= 2.0 / 3.0):
            return
        omega = 1.0 / (1.0 - kappa)
        a = float(record["a"])
        a_new = math.exp(math.log(a) + omega * (math.log(record["a_mackay"]) - math.log(a)))
        rel = abs(a_new - a) / a
        record.update(a_new=a_new, damping=omega, rel_change_a=rel)
        em.a = a_new
        em.converged = em.tol > 0 and rel < em.tol

    def set_prior_precision(self, a: float) -> Self:
        """Set ``a`` by hand (no EM): the mode, the pseudo-targets and, with ``hessian_at="linear_mode"``, ``B`` and
        the posterior follow. A running EM is ended (its trace kept in :attr:`em_trace`). Returns ``self``."""
        self._require("set_prior_precision")
        a = float(a)
        if not (a > 0 and math.isfinite(a)):
            raise ValueError(f"LinearizedLaplace.set_prior_precision: a must be positive and finite, got {a}")
        post = self.posterior
        if post.em is not None:
            self._old_trace += post.em_trace
            post.reset_em()
            self._em_method = None
        post.a = a
        targets = self._refresh_mode(a)
        if self._linear_mode:
            self._rebuild_posterior(targets)
        else:
            post.set_targets(targets.to(self.dtype))
        self._samples = None
        return self

    def _gridsearch(self, val_loader, *, link: str, grid, samples: int) -> dict:
        where = "LinearizedLaplace.optimize_prior(method='gridsearch')"
        if val_loader is None:
            raise ValueError(f"{where}: needs val_loader=, (x, y) batches of held-out data")
        _check_predictive(where, link, samples)
        try:
            values_ = torch.as_tensor(DEFAULT_GRID if grid is None else grid, dtype=torch.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: grid must be a sequence of prior precisions, got {grid!r}") from exc
        if values_.numel() == 0 or not torch.isfinite(values_).all() or (values_ <= 0).any():
            raise ValueError(f"{where}: grid must hold at least one positive finite precision, got {grid!r}")
        Xv, yv = self._held_out(val_loader, where)
        trace = []
        for a in sorted(set(values_.tolist())):  # ascending: each mode warm-starts the next
            self.set_prior_precision(a)
            f, Z = self.logit_deviations(Xv, samples, seed=self.seed)
            trace.append({"a": a, "nll": _nll(link_probabilities(f, Z, link), yv)})
            self.say(f"gridsearch: a = {a:.4g}, validation NLL ({link}) {trace[-1]['nll']:.4f}")
        best = min(trace, key=lambda r: r["nll"])
        self.set_prior_precision(best["a"])
        self.gridsearch_trace = trace
        return {"a": best["a"], "nll": best["nll"], "trace": trace}

    def _held_out(self, val_loader, where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Xv, yv)``: the held-out inputs and labels of ``val_loader`` (labels checked against the classes)."""
        Xv, yv = collect_loader(val_loader, where=where)
        check_labels(yv, self.n_classes, where=where)
        return Xv, yv

    def _guard_data(self, val_loader, link: str, samples: int, tolerance: float):
        where = "LinearizedLaplace.optimize_prior(val_loader=...)"
        _check_predictive(where, link, samples)
        if not (float(tolerance) >= 0 and math.isfinite(float(tolerance))):
            raise ValueError(f"{where}: tolerance must be >= 0 and finite, got {tolerance!r}")
        return self._held_out(val_loader, where)

    def _heldout_guard(self, Xv, yv, *, link: str, samples: int, tolerance: float) -> dict:
        """The held-out guard of :meth:`optimize_prior` (its docstring) on validation inputs ``Xv`` and labels
        ``yv``; sets :attr:`guard` and returns it."""
        a_em = self.prior_precision
        trace: list[dict] = []
        network = None
        # at most GUARD_STEPS + 1 evaluations, each a mode, B and samples on a CNN (tens of seconds)
        bar = _progress_bar(total=GUARD_STEPS + 1, desc="held-out guard") if self.progress else None
        for k in range(GUARD_STEPS + 1):
            if k:
                self.set_prior_precision(a_em * GUARD_STEP**k)
            f, Z = self.logit_deviations(Xv, samples, seed=self.seed)
            if network is None:
                network = _nll(torch.softmax(f.double(), -1), yv)
            trace.append({"a": self.prior_precision, "nll": _nll(link_probabilities(f, Z, link), yv)})
            self.say(
                f"held-out guard: a = {trace[-1]['a']:.4g}, validation NLL ({link}) {trace[-1]['nll']:.4f}, "
                f"the network's {network:.4f}"
            )
            if bar is not None:
                bar.update(1)
            if trace[-1]["nll"] <= (1.0 + float(tolerance)) * network:
                break
        else:
            warnings.warn(
                f"LinearizedLaplace: the held-out guard raised a to {self.prior_precision:.4g} "
                f"({GUARD_STEP:.3g}^{GUARD_STEPS} × the EM's {a_em:.4g}) and the validation NLL ({link}) is still "
                f"{trace[-1]['nll']:.4g} against the network's {network:.4g}: the linearised predictive does not "
                f"reach the network's here (check the network's eval mode and the validation data)",
                GuardWarning,
                stacklevel=3,
            )
        if bar is not None:
            bar.close()
        self.guard = {
            "a_em": a_em,
            "a": self.prior_precision,
            "network_nll": network,
            "tolerance": float(tolerance),
            "link": link,
            "trace": trace,
        }
        return self.guard

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
