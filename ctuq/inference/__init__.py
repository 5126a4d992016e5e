"""Linearised inference core: the Gaussian linear model ``ỹ = Ψ w + ε`` over (scaled) network weights.

Front ends (CT, experimental design, classification) use one object, :class:`LinearizedPosterior`
(``setup → fit → sample / mean / log_evidence``, ``state_dict``, ``restrict`` / ``extend``), which composes the
pieces below: features, a weight prior (:mod:`~ctuq.inference.priors`), a likelihood
(:mod:`~ctuq.inference.likelihoods`), a solver from the registry :data:`SOLVERS` (:mod:`ctuq.inference.solvers`), the
Matheron sampler and the sampled EM. It takes keyword
arguments only; a configuration maps onto them in :func:`ctuq.pipeline.uq_settings.posterior_arguments`.

Modules: the table below, and :mod:`~ctuq.inference.checks` (argument checks), :mod:`~ctuq.inference.distributed`;
the packages :mod:`~ctuq.inference.priors`, :mod:`~ctuq.inference.likelihoods` and :mod:`~ctuq.inference.solvers`
each hold a contract, a registry and one module per implementation (shared contract tests: :mod:`ctuq.testing`).

``w ~ N(0, a⁻¹ I)`` (``d`` weights), ``ε ~ N(0, σ² I)`` (``c`` targets). This package imports nothing CT-specific:
it sees a feature operator ``Ψ`` (batched ``Ψ``/``Ψᵀ`` row products) and the targets ``ỹ``, so CT
(``Ψ = T Φ diag(s)``) and classification (``Ψ = B^(1/2) Φ diag(s)``) share it.

Where DESIGN.md §1 lives in the code:

====================================================  =========================================================
equation                                              implementation
====================================================  =========================================================
``Φu``, ``Φᵀr`` (Jacobian of ``g`` at ``ṽ``)             :class:`ctuq.linearize.LinearizedNetwork` ``jvp``/``vjp``
``s_i = [ΦᵀTᵀTΦ]_ii^(−1/2)`` (exact / stochastic)     :class:`GPrior`, :func:`gprior_scales`
                                                      (``priors/gprior.py``)
``Ψ₀ = L Φ``; ``Ψ = Ψ₀ diag(s)``; dense ``Ψ``         :class:`LinearizedFeatures`; :class:`ScaledFeatures`;
                                                      :class:`DenseFeatures` (``features.py``)
any prior ``Ψ = Ψ₀ L``; TV-PredCP, its type-II MAP    :class:`WeightPrior` (``priors/base.py``);
                                                      :class:`BlockFeatures` (``block_features.py``);
                                                      :class:`TVPredCPPrior`, :func:`fit_block_prior`
                                                      (``priors/tv_predcp/``)
``K̄ = ΨΨᵀ``                                           :class:`KernelOperator` (``kernel.py``, a LinearOperator)
``C = K̄/a + σ²I``                                     :func:`measurement_covariance` (shares K̄)
``K̄ ≈ UΛUᵀ``, ``P = UΛUᵀ/a + σ²I``, Woodbury ``P⁻¹``  :func:`randomized_eig`, :func:`pivoted_cholesky_eig`,
                                                      :class:`LowRankPreconditioner` (``solvers/preconditioners.py``)
``C⁻¹R`` by preconditioned CG (rtol 1e-3, ≤150 it.)   :class:`CGSolver`, :func:`pcg` (``solvers/cg.py``)
``C⁻¹ = Q diag(1/(λ/a + σ²)) Qᵀ``; exact ``γ``,       :class:`ExactEigSolver` (``solvers/exact.py``: ``gamma``,
``‖w*‖²``, log evidence ``log N(ỹ; 0, C)``            ``weight_norm_sq``, ``log_evidence``), an :class:`ExactSolver`
``C⁻¹R`` by stochastic dual descent / primal SGD      :class:`SDDSolver`, :class:`SGDSolver` (``solvers/sdd.py``,
                                                      ``solvers/sgd.py``; large ``c``)
``‖C x − b‖/‖b‖`` (every solver's residual)           :func:`relative_residual` (``solvers/base.py``)
exact / CG / SDD / SGD by cost; solver registry       :func:`choose_solver`, :func:`resolve_solver` (``solvers/
                                                      cost.py``), :data:`SOLVERS` (``solvers/registry.py``)
``w* = a⁻¹ Ψᵀ C⁻¹ ỹ``                                 :func:`posterior_mean` (or ``sample_posterior(y_tilde=…)``)
``ζ = w₀ + a⁻¹ Ψᵀ C⁻¹ (ε − Ψ w₀)``                    :func:`sample_posterior`, resumable :func:`sample_chunks`
image-space sample ``x_j = Φ(s ⊙ ζ_j)``               :meth:`LinearizedPosterior.output_samples` (through
                                                      :meth:`LinearizedFeatures.network_matvec` of ``s ⊙ ζ``)
``γ̂ = (1/k) Σ ‖Ψζ_j‖²/σ²``; ``a ← γ̂/‖w*‖²``;          :class:`SampledEM` (uses ``Ψζ_j = ε_j − σ²C⁻¹(ε_j − Ψw₀_j)``
``σ² ← ‖ỹ − Ψw*‖²/(c − γ̂)``                           and ``‖w*‖² = a⁻¹(uᵀỹ − σ²‖u‖²)``: no VJPs)
dense float64 reference (primal form)                 :class:`DenseLinearGaussian`
ELLA: ``V = Ψ_Rᵀ U_K Λ_K^(−1/2)`` (``M`` rows);       :func:`nystrom_basis`, :class:`NystromBasis`;
features ``Ψ V`` of ``K`` weights, ``w = V u``        :func:`ella_features`, :class:`ProjectedFeatures` (``ella.py``)
====================================================  =========================================================

Product accounting: every feature operator counts rows multiplied by ``Ψ`` (``n_matvec``, = JVPs for a
network) and by ``Ψᵀ`` (``n_rmatvec``, = VJPs); :class:`ctuq.linearize.LinearizedNetwork` counts its own JVPs and
VJPs (including image-space ones).
"""

from ctuq.inference.block_features import BlockFeatures
from ctuq.inference.checks import check_hyper, check_rhs, check_targets
from ctuq.inference.distributed import LocalShard, Shard, TorchShard, current_shard, init_from_env, shutdown
from ctuq.inference.ella import NystromBasis, ProjectedFeatures, ella_features, nystrom_basis
from ctuq.inference.em import EMResult, SampledEM
from ctuq.inference.features import (
    DenseFeatures,
    FeatureOperator,
    LinearizedFeatures,
    RowScaledFeatures,
    RowSubsetFeatures,
    ScaledFeatures,
    StackedFeatures,
    stack_features,
)
from ctuq.inference.kernel import (
    KernelOperator,
    assemble_features,
    assemble_kernel,
    kernel_diagonal,
    measurement_covariance,
)
from ctuq.inference.likelihoods import (
    LIKELIHOODS,
    CategoricalLikelihood,
    DiagonalGaussianLikelihood,
    GaussianLikelihood,
    Likelihood,
)
from ctuq.inference.posterior import LinearizedPosterior
from ctuq.inference.priors import (
    PRIORS,
    DiagonalPrior,
    GPrior,
    IsotropicPrior,
    PriorError,
    TVPredCPPrior,
    WeightPrior,
    column_sq_norms,
    fit_block_prior,
    gprior_scales,
    isotropic_scales,
    mll_gradient,
    scales_from_sq_norms,
)
from ctuq.inference.reference import DenseLinearGaussian
from ctuq.inference.sampler import (
    PosteriorSamples,
    chunk_generator,
    draw_prior_and_noise,
    posterior_mean,
    sample_chunks,
    sample_posterior,
)
from ctuq.inference.solvers import (
    SOLVERS,
    CGSolver,
    ConvergenceWarning,
    ExactDualSolver,
    ExactEigSolver,
    ExactPrimalSolver,
    ExactSolver,
    FirstOrderSolver,
    LowRankEig,
    LowRankPreconditioner,
    SDDSolver,
    SGDSolver,
    Solver,
    SolverCostEstimate,
    SolveStats,
    Workload,
    adaptive_nystrom_eig,
    check_solver_options,
    choose_solver,
    dense_features_fit,
    estimate_solver_costs,
    lanczos_top_eigenvalue,
    make_solver,
    pcg,
    pivoted_cholesky_eig,
    randomized_eig,
    relative_residual,
    resolve_solver,
    solver_choices,
    solver_kwargs,
)

__all__ = [
    "LinearizedPosterior",
    "Likelihood",
    "GaussianLikelihood",
    "DiagonalGaussianLikelihood",
    "CategoricalLikelihood",
    "LIKELIHOODS",
    "FeatureOperator",
    "DenseFeatures",
    "LinearizedFeatures",
    "ScaledFeatures",
    "BlockFeatures",
    "PRIORS",
    "WeightPrior",
    "DiagonalPrior",
    "GPrior",
    "IsotropicPrior",
    "TVPredCPPrior",
    "PriorError",
    "fit_block_prior",
    "mll_gradient",
    "gprior_scales",
    "scales_from_sq_norms",
    "isotropic_scales",
    "column_sq_norms",
    "RowSubsetFeatures",
    "RowScaledFeatures",
    "NystromBasis",
    "nystrom_basis",
    "ProjectedFeatures",
    "ella_features",
    "StackedFeatures",
    "stack_features",
    "check_hyper",
    "check_targets",
    "check_rhs",
    "KernelOperator",
    "measurement_covariance",
    "assemble_features",
    "assemble_kernel",
    "kernel_diagonal",
    "SOLVERS",
    "solver_choices",
    "check_solver_options",
    "solver_kwargs",
    "Solver",
    "ExactSolver",
    "SolveStats",
    "ConvergenceWarning",
    "relative_residual",
    "Workload",
    "SolverCostEstimate",
    "estimate_solver_costs",
    "choose_solver",
    "resolve_solver",
    "dense_features_fit",
    "make_solver",
    "CGSolver",
    "pcg",
    "ExactEigSolver",
    "ExactPrimalSolver",
    "ExactDualSolver",
    "FirstOrderSolver",
    "lanczos_top_eigenvalue",
    "SDDSolver",
    "SGDSolver",
    "LowRankEig",
    "LowRankPreconditioner",
    "randomized_eig",
    "adaptive_nystrom_eig",
    "pivoted_cholesky_eig",
    "PosteriorSamples",
    "sample_posterior",
    "posterior_mean",
    "chunk_generator",
    "sample_chunks",
    "draw_prior_and_noise",
    "SampledEM",
    "EMResult",
    "Shard",
    "LocalShard",
    "TorchShard",
    "current_shard",
    "init_from_env",
    "shutdown",
    "DenseLinearGaussian",
]
