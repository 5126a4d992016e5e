"""Sampled EM (MacKay updates) for the prior precision ``a`` and, optionally, the noise variance ``σ²``.

One step at the current ``(a, σ²)`` (DESIGN.md §1):

    u = C⁻¹ ỹ,                                    ‖w*‖² = a⁻¹ (uᵀỹ − σ² ‖u‖²)
    Ψ ζ_j = ε_j − σ² C⁻¹(ε_j − Ψ w₀_j),          γ̂ = (1/k) Σ_j ‖Ψ ζ_j‖² / σ²
    a ← γ̂ / ‖w*‖²,                               σ² ← ‖ỹ − Ψ w*‖² / (c − γ̂) = σ⁴ ‖u‖² / (c − γ̂)   (if learned)

The identities (``a⁻¹ K̄ C⁻¹ = I − σ² C⁻¹``) mean a step needs **no VJPs**: ``k`` JVPs for ``Ψ w₀`` plus one
batched solve of ``k + 1`` right-hand sides (mean and samples together). ``γ̂`` is the kernelised,
low-variance estimator of the effective dimension ``γ = Σ_i λ_i/(λ_i + a σ²)`` (``E[γ̂] = γ``).

With an :class:`~ctuq.inference.solvers.ExactEigSolver` and ``gamma="auto"`` (or ``"exact"``), ``γ``, ``‖w*‖²``
and ``‖ỹ − Ψw*‖²`` are evaluated exactly from the eigendecomposition: EM then costs no Jacobian products at
all and converges to the exact MacKay fixed point; the trace also records the exact log evidence
``log N(ỹ; 0, C)`` at the ``(a, σ²)`` of each step.

Update of ``a`` (``update``). ``"mackay"``: ``a ← T(a) = γ/‖w*‖²``. ``"damped"``: the same fixed point, reached
where the MacKay map oscillates. In ``x = log a`` the map has a local slope ``κ = dT/dx``; the iteration converges
like ``|κ|^t``, and for ``κ < 0`` overshoots alternately (seen with linearised Laplace of a CNN, where ``γ`` falls
from 1390 to 0.3 as ``a`` grows from 1 to 8·10⁴ while ``‖w*‖²`` changes tenfold: ``κ ≈ −0.6``, ``a`` still 50 %
from its fixed point after 5 steps). The damped update estimates ``κ`` from the last two steps (secant) and, when
``κ < 0``, steps ``x ← x + (T(x) − x)/(1 − κ)`` — the secant root of ``T(x) − x`` — else takes the MacKay step;
the first step is always MacKay's. Records keep both (``a_mackay``, ``a_new``).

Stopping: after ``max_steps`` steps or when ``|a_new − a| / a < tol`` (``stop_on="a"``, the default), or when
both ``a`` and ``σ²`` changed by less than ``tol`` (``stop_on="a_and_sigma2"``: EM to convergence when the noise is
learned). Defaults follow the publications: 5 steps, 16 samples (noise variance fixed).

Fixed probes (``fixed_probes=True``, for the first-order solvers): the step's probes are drawn *once* as standard
normals ``ξ`` (``k × d``) and ``η`` (``k × c``), and every step uses ``w₀ = a^(−1/2) ξ``, ``ε = σ η``, i.e. the same
probes rescaled in closed form to the current ``(a, σ²)``. ``Ψξ`` is computed once (``k`` JVPs), so later steps
spend no JVPs on the right-hand sides, and a solver with :attr:`~ctuq.inference.solvers.Solver.warm_starts`
starts each step from the previous step's solutions (``x0``), which are close because the right-hand sides only
moved with ``(a, σ²)``. The EM then iterates a deterministic map, so ``tol`` measures its convergence and not
the Monte Carlo noise of fresh probes; ``γ̂`` keeps its per-probe variance (``k = 16`` probes of an effective
dimension ``γ`` give a relative sd ``≈ (2/(kγ))^½``).

Sharding (``shard``, :mod:`ctuq.inference.distributed`): every rank draws all ``k`` probes and solves the rows
it owns (rank 0 also ``ỹ``); the step's sums are summed over ranks, so all ranks update ``a`` and ``σ²`` alike.

Checkpoint/resume: :meth:`SampledEM.state_dict` holds step, ``a``, ``σ²``, trace, convergence flag, the
generator state and a fingerprint of the problem; it contains only tensors and plain Python values, so
``ctuq.utils.atomic_torch_save`` + ``torch.load(..., weights_only=True)`` round-trips it, and
:meth:`SampledEM.load_state_dict` continues exactly where the saved run stopped (same random draws).

Random numbers: step ``t`` draws ``w₀`` (``k × d``) then ``ε`` (``k × c``) from the EM's generator (seeded with
``seed`` on ``generator_device``); exact-γ steps draw nothing.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch

from ctuq.errors import CheckpointMismatch
from ctuq.inference.checks import check_hyper, check_targets
from ctuq.inference.distributed import LocalShard, Shard
from ctuq.inference.features import FeatureOperator
from ctuq.inference.likelihoods import GaussianLikelihood, Likelihood
from ctuq.inference.sampler import draw_prior_and_noise
from ctuq.inference.solvers.base import Solver
from ctuq.options import EMStopRule, EMUpdate, values
from ctuq.utils import check_fingerprint

__all__ = ["SampledEM", "EMResult"]

_STATE_VERSION = 1


@dataclasses.dataclass
class EMResult:
    """Final ``a``, ``σ²``, the per-step trace (list of dicts, see :meth:`SampledEM.step`), and whether the
    relative change of ``a`` fell below ``tol`` (else ``max_steps`` was reached)."""

    a: float
    sigma2: float
    trace: list[dict]
    converged: bool
    steps: int


class SampledEM:
    """MacKay / sampled-EM updates of ``a`` (and optionally ``σ²``) for ``ỹ = Ψ w + ε``.

    Parameters
    ----------
    features : FeatureOperator
        ``Ψ`` (``c × d``).
    solver : Solver
        Solves with ``C``; an ``ExactEigSolver`` enables exact ``γ`` and the exact log evidence.
    y_tilde : torch.Tensor
        ``(c,)`` regression targets, including any offset ``δ`` (CT: ``y + T(Φṽ − g(ṽ))``).
    a : float
        Initial prior precision (> 0) of the scaled weights.
    sigma2 : float
        Initial (or fixed) noise variance (> 0), in squared target units (ignored with ``likelihood``).
    learn_noise : bool
        Also update ``σ²`` (ignored with ``likelihood``).
    likelihood : Likelihood, optional
        The noise model (:mod:`ctuq.inference.likelihoods`); default ``GaussianLikelihood(sigma2, learn_noise)``.
        The EM updates its ``σ²`` in place.
    n_samples : int
        ``k``, samples per step for ``γ̂`` (default 16).
    max_steps : int
        Step limit (default 5).
    tol : float
        Stop when ``|a_new − a|/a < tol`` (0 disables).
    gamma : {"auto", "sampled", "exact"}
        ``γ`` from samples, or exactly (needs an exact solver); ``"auto"``: exact when the solver allows it.
    seed : int
        Seeds the EM's ``torch.Generator``.
    generator_device : str or torch.device
        Device of that generator (CPU default: identical draws on every device).
    fixed_probes : bool
        Draw the probes once and rescale them to each step's ``(a, σ²)`` (module docstring); warm starts for
        solvers that take them.
    stop_on : {"a", "a_and_sigma2"}
        Convergence rule (module docstring).
    shard : Shard, optional
        This process's share of the probes (:mod:`ctuq.inference.distributed`); default one process.
    update : {"mackay", "damped"}
        How ``a`` moves (module docstring; :class:`~ctuq.options.EMUpdate`).
    """

    def __init__(
        self,
        features: FeatureOperator,
        solver: Solver,
        y_tilde: torch.Tensor,
        *,
        a: float = 1.0,
        sigma2: float = 1.0,
        learn_noise: bool = False,
        n_samples: int = 16,
        max_steps: int = 5,
        tol: float = 1e-2,
        gamma: str = "auto",
        seed: int = 0,
        generator_device: torch.device | str = "cpu",
        likelihood: Likelihood | None = None,
        fixed_probes: bool = False,
        stop_on: str = "a",
        shard: Shard | None = None,
        update: str = "mackay",
    ):
        if likelihood is None:
            likelihood = GaussianLikelihood(sigma2, learn_noise)
        a_f, s2_f = check_hyper(a, likelihood.sigma2, "SampledEM")
        if solver.features is not features:
            raise ValueError("SampledEM: the solver was built for a different feature operator")
        if gamma not in ("auto", "sampled", "exact"):
            raise ValueError(f"SampledEM: gamma must be 'auto', 'sampled' or 'exact', got {gamma!r}")
        if gamma == "exact" and not solver.exact:
            raise ValueError(f"SampledEM: gamma='exact' needs an exact solver, got {type(solver).__name__}")
        if not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"SampledEM: n_samples must be a positive int, got {n_samples!r}")
        if not isinstance(max_steps, int) or max_steps < 0:
            raise ValueError(f"SampledEM: max_steps must be an int >= 0, got {max_steps!r}")
        if not (tol >= 0 and math.isfinite(tol)):
            raise ValueError(f"SampledEM: tol must be >= 0, got {tol}")
        if stop_on not in values(EMStopRule):
            raise ValueError(f"SampledEM: stop_on must be one of {list(values(EMStopRule))}, got {stop_on!r}")
        if update not in values(EMUpdate):
            raise ValueError(f"SampledEM: update must be one of {list(values(EMUpdate))}, got {update!r}")
        self.features = features
        self.solver = solver
        self.y_tilde = check_targets(y_tilde, features, "SampledEM")
        self.likelihood = likelihood
        self.n_samples = n_samples
        self.max_steps = max_steps
        self.tol = float(tol)
        self.exact_gamma = solver.exact and gamma in ("auto", "exact")
        self.seed = int(seed)
        self.generator = torch.Generator(device=torch.device(generator_device)).manual_seed(self.seed)
        self.a = a_f
        self.likelihood.sigma2 = s2_f
        self.step_count = 0
        self.trace: list[dict] = []
        self.converged = False
        self.fixed_probes = bool(fixed_probes)
        self.stop_on = str(stop_on)
        self.update = str(update)
        self.shard = shard if shard is not None else LocalShard()
        self.generator_device = torch.device(generator_device)
        self._probes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # ξ, η, Ψξ (own rows)
        self._warm: torch.Tensor | None = None  # previous step's solutions (own rows), for warm starts

    @property
    def sigma2(self) -> float:
        """Current noise variance ``σ²`` (the likelihood's)."""
        return self.likelihood.sigma2

    @sigma2.setter
    def sigma2(self, value: float) -> None:
        self.likelihood.sigma2 = float(value)

    @property
    def learn_noise(self) -> bool:
        """Whether the EM updates ``σ²`` (the likelihood's setting)."""
        return self.likelihood.learn_noise

    # ------------------------------------------------------------------------------------------ stepping
    @property
    def done(self) -> bool:
        """True once converged or after ``max_steps`` steps."""
        return self.converged or self.step_count >= self.max_steps

    def step(self) -> dict:
        """One EM step; updates ``a`` (``σ²``) and returns (and appends to :attr:`trace`) its record.

        Record keys: ``step``, ``a``, ``sigma2`` (values used in this step), ``gamma``, ``weight_norm_sq``,
        ``residual_norm_sq``, ``a_new``, ``sigma2_new``, ``rel_change_a``, ``log_evidence`` (exact solver only,
        at the step's ``a, σ²``, of the measurements: with a whitening likelihood the features and targets given
        are the whitened ones and its ``−½ log det D`` is added; else None), ``gamma_method``, ``solver``
        (:meth:`SolveStats.summary` or None), ``jvp``, ``vjp`` (feature products spent in the step), ``time_s``.
        """
        t0 = time.perf_counter()
        jvp0, vjp0 = self.features.n_matvec, self.features.n_rmatvec
        a, s2, y = self.a, self.sigma2, self.y_tilde
        c = self.features.n_outputs
        solver_summary = None
        if self.exact_gamma:
            gamma = self.solver.gamma(a, s2)
            wnorm = self.solver.weight_norm_sq(y, a, s2)
            rnorm = self.solver.residual_norm_sq(y, a, s2)
        else:
            gamma, wnorm, rnorm, solver_summary = self._sampled_step(a, s2, y)
        # the evidence of the measurements: a whitened likelihood adds its −½ log det D (0 for a white one)
        log_ev = (
            self.solver.log_evidence(y, a, s2) + float(self.likelihood.log_evidence_correction())
            if self.solver.exact
            else None
        )
        if not wnorm > 0:
            raise FloatingPointError(
                f"SampledEM step {self.step_count}: ‖w*‖² = {wnorm:.3e} (ỹ is zero or explained by noise alone); "
                f"the MacKay update a = γ/‖w*‖² is undefined"
            )
        a_mackay = gamma / wnorm
        a_new, omega = self._damped(a, a_mackay) if self.update == "damped" else (a_mackay, 1.0)
        s2_new = self.likelihood.noise_update(rnorm, c, gamma)
        if not (a_new > 0 and math.isfinite(a_new)) or not (s2_new > 0 and math.isfinite(s2_new)):
            raise FloatingPointError(f"SampledEM step {self.step_count}: update gave a={a_new}, σ²={s2_new}")
        rel = abs(a_new - a) / a
        rel_s2 = abs(s2_new - s2) / s2
        record = {
            "step": self.step_count,
            "a": a,
            "sigma2": s2,
            "gamma": gamma,
            "weight_norm_sq": wnorm,
            "residual_norm_sq": rnorm,
            "a_new": a_new,
            "a_mackay": a_mackay,
            "damping": omega,
            "sigma2_new": s2_new,
            "rel_change_a": rel,
            "log_evidence": log_ev,
            "gamma_method": "exact" if self.exact_gamma else "sampled",
            "solver": solver_summary,
            "jvp": self.features.n_matvec - jvp0,
            "vjp": self.features.n_rmatvec - vjp0,
            "time_s": time.perf_counter() - t0,
        }
        if self.shard.distributed:
            counts = self.shard.all_reduce_sum(torch.tensor([record["jvp"], record["vjp"]], dtype=torch.float64))
            record["jvp"], record["vjp"] = int(counts[0]), int(counts[1])
        if self.stop_on == "a_and_sigma2":
            record["rel_change_sigma2"] = rel_s2
        self.trace.append(record)
        self.a, self.sigma2 = a_new, s2_new
        self.step_count += 1
        worst = rel if self.stop_on == "a" else max(rel, rel_s2)
        self.converged = self.tol > 0 and worst < self.tol
        return record

    def _damped(self, a: float, a_mackay: float) -> tuple[float, float]:
        """``(a_new, ω)`` of the damped update (module docstring) from this step and the last record."""
        if not self.trace or "a_mackay" not in self.trace[-1]:
            return a_mackay, 1.0
        prev = self.trace[-1]
        dx = math.log(a) - math.log(prev["a"])
        if abs(dx) < 1e-12:
            return a_mackay, 1.0
        kappa = (math.log(a_mackay) - math.log(prev["a_mackay"])) / dx
        if not (kappa < 0 and math.isfinite(kappa)):
            return a_mackay, 1.0
        omega = max(1.0 / (1.0 - kappa), 0.05)  # a slope beyond −19 is noise, not a map to follow
        return math.exp(math.log(a) + omega * (math.log(a_mackay) - math.log(a))), omega

    # ------------------------------------------------------------------------------------------ fixed / sharded
    def _own_rows(self) -> list[int]:
        return [j for j in range(self.n_samples) if self.shard.owns(j)]

    def _fixed_probes(self, own: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(η, Ψξ)`` of this rank's probes (drawn once from a fresh generator seeded with ``seed``: the same
        numbers as the first fresh-probe step, and reproducible after a resume)."""
        if self._probes is None:
            f = self.features
            gen = torch.Generator(device=self.generator_device).manual_seed(self.seed)
            xi = torch.randn((self.n_samples, f.n_features), generator=gen, device=gen.device, dtype=f.dtype)
            eta = torch.randn((self.n_samples, f.n_outputs), generator=gen, device=gen.device, dtype=f.dtype)
            idx = torch.as_tensor(own, dtype=torch.long)
            xi_o, eta_o = xi[idx].to(f.device), eta[idx].to(f.device)
            del xi
            psi_xi = f.matvec(xi_o) if len(own) else torch.zeros((0, f.n_outputs), dtype=f.dtype, device=f.device)
            self._probes = (eta_o, psi_xi, idx)
        return self._probes[0], self._probes[1]

    def _sampled_step(self, a: float, s2: float, y: torch.Tensor) -> tuple[float, float, float, dict]:
        """One sampled step — fresh or fixed probes, in one process or across shards (one process is a shard that
        owns every probe and whose reductions are the identity): ``(γ̂, ‖w*‖², ‖ỹ − Ψw*‖², solver summary)``.

        With the posterior-mean solve ``u = C⁻¹ỹ`` and the probe solves ``v_j = C⁻¹(ε_j − Ψw_j)``:
        ``Ψζ_j = ε_j − σ² v_j`` are the fitted parts of the zero-mean posterior samples, ``γ̂ = Σ_j ‖Ψζ_j‖²/(kσ²)``,
        ``‖w*‖² = (ỹᵀu − σ²‖u‖²)/a`` and ``‖ỹ − Ψw*‖² = σ⁴‖u‖²``."""
        k, f, sh = self.n_samples, self.features, self.shard
        own = self._own_rows()
        if self.fixed_probes:
            eta, psi_xi = self._fixed_probes(own)
            eps = eta * s2**0.5
            rhs_s = eps - psi_xi * a**-0.5
        else:
            w0, eps_all = draw_prior_and_noise(k, f, a, s2, self.generator, likelihood=self.likelihood)
            idx = torch.as_tensor(own, dtype=torch.long, device=w0.device)
            eps = eps_all[idx]
            rhs_s = eps - f.matvec(w0[idx]) if len(own) else eps
        rows = ([0] if sh.is_root else []) + [1 + j for j in own]
        rhs = torch.cat([y[None], rhs_s], dim=0) if sh.is_root else rhs_s
        warm = self.fixed_probes and self.solver.warm_starts and self._warm is not None
        if rhs.shape[0]:
            if warm:
                x0 = self._warm[torch.as_tensor(rows, dtype=torch.long)].to(device=rhs.device, dtype=rhs.dtype)
                V, stats = self.solver.solve(rhs, a, s2, x0=x0)
            else:
                V, stats = self.solver.solve(rhs, a, s2)
            summary = stats.summary()
        else:
            V = rhs
            summary = {
                "method": None,
                "n_rhs": 0,
                "max_iterations": 0,
                "mean_iterations": 0.0,
                "max_relative_residual": 0.0,
                "n_converged": 0,
                "n_products": 0,
            }
        if self.fixed_probes and self.solver.warm_starts:
            full = torch.zeros((k + 1, f.n_outputs), dtype=torch.float64)
            full[torch.as_tensor(rows, dtype=torch.long)] = V.detach().double().cpu()
            self._warm = sh.all_reduce_sum(full)  # every rank holds every row: one checkpoint resumes all ranks
        off = 1 if sh.is_root else 0
        psi_zeta = eps.double() - s2 * V[off:].double()
        sums = torch.zeros(8, dtype=torch.float64)
        sums[0] = psi_zeta.pow(2).sum()
        if sh.is_root:
            u = V[0].double()
            sums[1], sums[2] = u @ y.double(), u @ u
        n = summary["n_rhs"]
        sums[3], sums[4], sums[5] = n, summary["mean_iterations"] * n, summary["n_converged"]
        sums[6] = summary["n_products"]
        sums = sh.all_reduce_sum(sums)
        worst = sh.all_reduce_max(
            torch.tensor([summary["max_iterations"], summary["max_relative_residual"]], dtype=torch.float64)
        )
        gamma = float(sums[0] / k / s2)
        wnorm = max(float(sums[1] - s2 * sums[2]) / a, 0.0)  # uᵀ(K̄/a)u ≥ 0: clamp round-off
        rnorm = float(s2**2 * sums[2])
        method = summary["method"] if sh.is_root else None
        combined = {
            "method": sh.broadcast_object(method) if sh.distributed else method,
            "n_rhs": int(sums[3]),
            "max_iterations": int(worst[0]),
            "mean_iterations": float(sums[4] / max(sums[3], 1)),
            "max_relative_residual": float(worst[1]),
            "n_converged": int(sums[5]),
            "n_products": int(sums[6]),
        }
        return gamma, wnorm, rnorm, combined

    def run(self, callback: Callable[[SampledEM, dict], None] | None = None) -> EMResult:
        """Step until :attr:`done`; ``callback(em, record)`` after each step (e.g. to checkpoint
        ``em.state_dict()`` atomically)."""
        while not self.done:
            record = self.step()
            if callback is not None:
                callback(self, record)
        return EMResult(self.a, self.sigma2, list(self.trace), self.converged, self.step_count)

    # ------------------------------------------------------------------------------------------ state
    def _fingerprint(self) -> dict:
        return {
            "c": int(self.features.n_outputs),
            "d": int(self.features.n_features),
            "y_sum": float(self.y_tilde.double().sum()),
            "n_samples": self.n_samples,
            "learn_noise": self.learn_noise,
            "exact_gamma": self.exact_gamma,
            "seed": self.seed,
            "fixed_probes": self.fixed_probes,
            "stop_on": self.stop_on,
        }

    def state_dict(self) -> dict:
        """Everything needed to resume (tensors and plain values only; ``weights_only``-loadable)."""
        return {
            "version": _STATE_VERSION,
            "step": self.step_count,
            "a": self.a,
            "sigma2": self.sigma2,
            "converged": self.converged,
            "trace": [dict(r) for r in self.trace],
            "generator_state": self.generator.get_state(),
            "fingerprint": self._fingerprint(),
            **({"warm": self._warm.clone()} if self._warm is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` output; raises :class:`CheckpointMismatch` for another problem/settings."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            what = f"keys {sorted(state)[:10]}" if isinstance(state, dict) else type(state).__name__
            raise CheckpointMismatch(f"not a SampledEM state (version {_STATE_VERSION}): {what}")
        missing = {"step", "a", "sigma2", "converged", "trace", "generator_state", "fingerprint"} - set(state)
        if missing:
            raise CheckpointMismatch(f"SampledEM state lacks {sorted(missing)}")
        now = self._fingerprint()
        check_fingerprint(state["fingerprint"], now, what="cannot resume EM", error=CheckpointMismatch, abs_tol=1e-9)
        a_f, s2_f = check_hyper(state["a"], state["sigma2"], "SampledEM.load_state_dict")
        self.a, self.sigma2 = a_f, s2_f
        self.step_count = int(state["step"])
        self.converged = bool(state["converged"])
        self.trace = [dict(r) for r in state["trace"]]
        self.generator.set_state(state["generator_state"])
        warm = state.get("warm")
        if warm is not None and (
            not isinstance(warm, torch.Tensor) or tuple(warm.shape) != (self.n_samples + 1, self.features.n_outputs)
        ):
            raise CheckpointMismatch(
                f"SampledEM state: warm-start solutions must be ({self.n_samples + 1}, "
                f"{self.features.n_outputs}), got {getattr(warm, 'shape', type(warm).__name__)}"
            )
        self._warm = None if warm is None else warm.double()
        self._probes = None  # fixed probes are redrawn from the seed (k JVPs) at the next step
