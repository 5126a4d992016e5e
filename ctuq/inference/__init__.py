"""Linearised inference core: the Gaussian linear model ``ỹ = Ψ w + ε`` over (scaled) network weights.

Front ends (CT: :mod:`ctuq.uq`; later experimental design and classification) use one object,
:class:`LinearizedPosterior` (``setup → fit → sample / mean / log_evidence``, ``state_dict``, ``restrict`` /
``extend``), which composes the pieces below: features, prior scales, a likelihood
(:mod:`~ctuq.inference.likelihoods`), a solver from the registry :data:`SOLVERS`, the Matheron sampler and the
sampled EM.

``w ~ N(0, a⁻¹ I)`` (``d`` weights), ``ε ~ N(0, σ² I)`` (``c`` targets). This package imports nothing CT-specific:
it sees a feature operator ``Ψ`` (batched ``Ψ``/``Ψᵀ`` row products) and the targets ``ỹ``, so CT
(``Ψ = T Φ diag(s)``) and classification (``Ψ = B^(1/2) Φ diag(s)``) share it.

Where DESIGN.md §1 lives in the code:

====================================================  =========================================================
equation                                              implementation
====================================================  =========================================================
``Φu``, ``Φᵀr`` (Jacobian of ``g`` at ``ṽ``)             :class:`ctuq.linearize.LinearizedNetwork` ``jvp``/``vjp``
``s_i = [ΦᵀTᵀTΦ]_ii^(−1/2)`` (exact / stochastic)     :func:`ctuq.priors.gprior_scales`
``Ψ = L Φ diag(s)``; dense ``Ψ``                      :class:`LinearizedFeatures`; :class:`DenseFeatures`
``K̄ = ΨΨᵀ``                                           :class:`KernelOperator` (a linear_operator LinearOperator)
``C = K̄/a + σ²I``                                     :func:`measurement_covariance` (shares K̄)
``K̄ ≈ UΛUᵀ``, ``P = UΛUᵀ/a + σ²I``, Woodbury ``P⁻¹``  :func:`randomized_eig`, :func:`pivoted_cholesky_eig`,
                                                      :class:`LowRankPreconditioner`
``C⁻¹R`` by preconditioned CG (rtol 1e-3, ≤150 it.)  :class:`CGSolver`, :func:`pcg`
``C⁻¹ = Q diag(1/(λ/a + σ²)) Qᵀ``; exact ``γ``,        :class:`ExactEigSolver` (``gamma``, ``weight_norm_sq``,
``‖w*‖²``, log evidence ``log N(ỹ; 0, C)``             ``log_evidence``)
``C⁻¹R`` by stochastic dual descent / primal SGD       :class:`SDDSolver`, :class:`SGDSolver` (large ``c``)
exact / CG / SDD / SGD by cost; solver registry      :func:`choose_solver`, :func:`resolve_solver`, :data:`SOLVERS`
``w* = a⁻¹ Ψᵀ C⁻¹ ỹ``                                 :func:`posterior_mean` (or ``sample_posterior(y_tilde=…)``)
``ζ = w₀ + a⁻¹ Ψᵀ C⁻¹ (ε − Ψ w₀)``                     :func:`sample_posterior`, resumable :func:`sample_chunks`
image-space sample ``x_j = Φ(s ⊙ ζ_j)``               :meth:`LinearizedFeatures.network_matvec`
``γ̂ = (1/k) Σ ‖Ψζ_j‖²/σ²``; ``a ← γ̂/‖w*‖²``;           :class:`SampledEM` (uses ``Ψζ_j = ε_j − σ²C⁻¹(ε_j − Ψw₀_j)``
``σ² ← ‖ỹ − Ψw*‖²/(c − γ̂)``                          and ``‖w*‖² = a⁻¹(uᵀỹ − σ²‖u‖²)``: no VJPs)
dense float64 reference (primal form)                 :class:`DenseLinearGaussian`
====================================================  =========================================================

Product accounting: every feature operator counts rows multiplied by ``Ψ`` (``n_matvec``, = JVPs for a
network) and by ``Ψᵀ`` (``n_rmatvec``, = VJPs); :class:`ctuq.linearize.LinearizedNetwork` counts its own JVPs and
VJPs (including image-space ones).
"""

from ctuq.inference.distributed import LocalShard, Shard, TorchShard, current_shard, init_from_env
from ctuq.inference.em import EM_STOP_RULES, EM_UPDATES, EMResult, EMStateMismatch, SampledEM
from ctuq.inference.features import (
    DenseFeatures,
    FeatureOperator,
    LinearizedFeatures,
    RowSubsetFeatures,
    ScaledFeatures,
    StackedFeatures,
    stack_features,
)
from ctuq.inference.kernel import (
    KernelOperator,
    DENSE_CHOICES,
    assemble_features,
    assemble_kernel,
    kernel_diagonal,
    measurement_covariance,
)
from ctuq.inference.preconditioners import (
    LowRankEig,
    LowRankPreconditioner,
    adaptive_nystrom_eig,
    pivoted_cholesky_eig,
    randomized_eig,
)
from ctuq.inference.likelihoods import LIKELIHOODS, CategoricalLikelihood, GaussianLikelihood, Likelihood
from ctuq.inference.posterior import GPRIOR_METHODS, PRIORS, LinearizedPosterior
from ctuq.inference.reference import DenseLinearGaussian
from ctuq.inference.first_order import FirstOrderSolver, lanczos_top_eigenvalue
from ctuq.inference.sdd import SDD_DEFAULTS, SDDSolver
from ctuq.inference.sgd import LR_DECAYS, SGD_DEFAULTS, SGDSolver
from ctuq.inference.sampler import (
    PosteriorSamples,
    chunk_generator,
    draw_prior_and_noise,
    posterior_mean,
    sample_chunks,
    sample_posterior,
)
from ctuq.inference.solvers import (
    CGSolver,
    ConvergenceWarning,
    ExactEigSolver,
    SolverCostEstimate,
    SolveStats,
    Solver,
    Workload,
    choose_solver,
    estimate_solver_costs,
    make_solver,
    pcg,
    PRECONDITIONERS,
    SOLVER_CHOICES,
    SOLVERS,
    SolverSpec,
    dense_features_fit,
    dense_memory_budget,
    resolve_solver,
)

__all__ = [
    "LinearizedPosterior", "PRIORS", "GPRIOR_METHODS",
    "Likelihood", "GaussianLikelihood", "CategoricalLikelihood", "LIKELIHOODS",
    "FeatureOperator", "DenseFeatures", "LinearizedFeatures", "ScaledFeatures", "RowSubsetFeatures",
    "StackedFeatures", "stack_features",
    "SOLVERS", "SOLVER_CHOICES", "PRECONDITIONERS", "SolverSpec", "resolve_solver", "dense_memory_budget",
    "dense_features_fit",
    "KernelOperator", "measurement_covariance", "assemble_features", "DENSE_CHOICES", "assemble_kernel", "kernel_diagonal",
    "LowRankEig", "LowRankPreconditioner", "randomized_eig", "pivoted_cholesky_eig",
    "ConvergenceWarning", "SolveStats", "pcg", "Solver", "CGSolver", "ExactEigSolver",
    "Workload", "SolverCostEstimate", "estimate_solver_costs", "choose_solver", "make_solver",
    "PosteriorSamples", "sample_posterior", "posterior_mean", "chunk_generator", "sample_chunks",
    "draw_prior_and_noise",
    "SampledEM", "EMResult", "EMStateMismatch", "EM_STOP_RULES", "EM_UPDATES",
    "FirstOrderSolver", "lanczos_top_eigenvalue", "SDDSolver", "SDD_DEFAULTS", "SGDSolver", "SGD_DEFAULTS",
    "LR_DECAYS", "adaptive_nystrom_eig",
    "Shard", "LocalShard", "TorchShard", "current_shard", "init_from_env",
    "DenseLinearGaussian",
]
