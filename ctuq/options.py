"""Every option vocabulary of ctuq, as ``str`` enums, in one leaf module (it imports nothing from ctuq).

A member compares equal to its string (``GPriorMethod.EXACT == "exact"``), prints as its string
(``f"{GPriorMethod.EXACT}"`` is ``"exact"`` on every Python version) and encodes to JSON as its string, so configs,
checkpoints and messages keep plain strings; code names the member instead of repeating the literal. Configs and
checkpoints store ``.value`` (``torch.load(..., weights_only=True)`` cannot load an enum).

Solver and weight-prior names are not listed here: they are the keys of the registries
(:data:`ctuq.registry.SOLVERS`, :data:`ctuq.registry.PRIORS`), which each class fills when its module is imported,
so a new solver or prior is one file plus one registry line.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

__all__ = [
    "Vocabulary",
    "values",
    "option",
    # inference core
    "GPriorMethod",
    "Preconditioner",
    "CGBackend",
    "ExactSide",
    "SolverAlias",
    "EMUpdate",
    "EMStopRule",
    "LRDecay",
    "DenseFeatures",
    # CT front end and operators
    "Backend",
    "FilterType",
    # models
    "UNetPreset",
    "UNET_PRESETS",
    # experimental design
    "DesignPriorKind",
    "DesignPriorScale",
    "DesignRoute",
    "Criterion",
    "Baseline",
    # classification
    "LinearModel",
    "PriorMethod",
    "HessianRoot",
    "Link",
    "WeightSubset",
    "TupleSampling",
    # uncertainty metrics
    "Centering",
]


class Vocabulary(str, enum.Enum):
    """Base of every vocabulary: a ``str`` whose ``str()``/``format()`` is its value (Python 3.11 changed the
    default ``format()`` of mixed-in enums to ``Class.MEMBER``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value, what: str):
        """The member for ``value`` (a member or its string); ``ValueError`` naming ``what`` and the valid values."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {values(cls)}, got {value!r}") from None


def values(vocabulary: type[Vocabulary]) -> tuple[str, ...]:
    """The plain strings of a vocabulary, in definition order (for ``choices=``, ``--help`` and messages)."""
    return tuple(m.value for m in vocabulary)


def option(
    default: Any = None,
    *,
    help: str | Callable[[], str] = "",
    choices: tuple | Callable[[], tuple] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    factory=None,
):
    """A dataclass field that documents and constrains one option: a config key, or an option of a registered
    implementation (a solver's, a prior's) that the config derives its keys from.

    ``help``: one line, or a function returning it when the keys are listed (a help that names what a registry
    holds); ``choices``: allowed values, or a function returning them when a value is checked (for vocabularies
    that grow at run time, such as a registry's names); ``ge``/``gt``/``le``/``lt``: numeric bounds (also applied
    to list items). The config checks them on every assignment.
    """
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ---------------------------------------------------------------------------------------------- inference core
class GPriorMethod(Vocabulary):
    """How the g-prior's column norms are found: ``c`` VJPs, or Rademacher probes (unbiased)."""

    EXACT = "exact"
    STOCHASTIC = "stochastic"


class Preconditioner(Vocabulary):
    """CG preconditioners: low-rank ``K̄ ≈ UΛUᵀ`` by single-pass Nyström, Halko's two-pass method, pivoted Cholesky,
    or none."""

    NYSTROM = "nystrom"
    HALKO = "halko"
    PIVOTED_CHOLESKY = "pivoted_cholesky"
    NONE = "none"


class CGBackend(Vocabulary):
    """CG implementation: ctuq's deflating batched PCG, or linear_operator's ``linear_cg`` (comparison only)."""

    PCG = "pcg"
    LINEAR_CG = "linear_cg"


class ExactSide(Vocabulary):
    """Which Gram matrix an exact solver decomposes: ``ΨᵀΨ`` (primal, ``d × d``) or ``K̄ = ΨΨᵀ`` (dual, ``c × c``)."""

    AUTO = "auto"
    DUAL = "dual"
    PRIMAL = "primal"


class SolverAlias(Vocabulary):
    """Solver option values that are not registry names: pick by estimated cost, or the cheaper exact side."""

    AUTO = "auto"
    EXACT = "exact"


class EMUpdate(Vocabulary):
    """The EM's update of ``a``: MacKay's fixed point, or the damped update in ``log a``."""

    MACKAY = "mackay"
    DAMPED = "damped"


class EMStopRule(Vocabulary):
    """What the EM's tolerance is tested on."""

    A = "a"
    A_AND_SIGMA2 = "a_and_sigma2"


class LRDecay(Vocabulary):
    """Learning-rate schedule of the SGD solver."""

    LINEAR = "linear"
    NONE = "none"


class DenseFeatures(Vocabulary):
    """Whether to assemble the features as a dense matrix."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


# ---------------------------------------------------------------------------------------------- CT
class Backend(Vocabulary):
    """Ray-transform backends (``operator.backend``)."""

    AUTO = "auto"
    SPARSE = "sparse"
    ASTRA_CUDA = "astra_cuda"


class FilterType(Vocabulary):
    """FBP/FDK filters."""

    RAM_LAK = "Ram-Lak"
    SHEPP_LOGAN = "Shepp-Logan"
    COSINE = "Cosine"
    HAMMING = "Hamming"
    HANN = "Hann"


# ---------------------------------------------------------------------------------------------- models
class UNetPreset(Vocabulary):
    """Architecture presets of the U-Net (``model.preset``; :func:`ctuq.models.build_unet`)."""

    WALNUT = "walnut"
    SMALL = "small"
    TINY = "tiny"


#: Each :class:`UNetPreset`'s channels per scale and skip widths per scale: the table behind
#: :data:`ctuq.models.unet.PRESETS`, here so that the config checks a partial override (``model.channels`` without
#: ``model.skip_channels``) against the preset without importing the network code.
UNET_PRESETS: dict[str, dict[str, tuple[int, ...]]] = {
    UNetPreset.WALNUT.value: dict(channels=(128,) * 6, skip_channels=(0, 0, 0, 0, 4, 4)),
    UNetPreset.SMALL.value: dict(channels=(8, 16, 32, 32, 32), skip_channels=(0, 4, 4, 4, 4)),
    UNetPreset.TINY.value: dict(channels=(8, 8, 8), skip_channels=(0, 2, 2)),
}


# ---------------------------------------------------------------------------------------------- design
class DesignPriorKind(Vocabulary):
    """Image priors of ``ctuq design``."""

    ISOTROPIC = "isotropic"
    MATERN = "matern"
    DIP = "dip"


class DesignPriorScale(Vocabulary):
    """How ``ctuq design`` scales its image prior."""

    AUTO = "auto"
    EM = "em"
    ENERGY = "energy"


class DesignRoute(Vocabulary):
    """How the design engine applies the covariance: exact (dense) or sampled."""

    AUTO = "auto"
    EXACT = "exact"
    SAMPLED = "sampled"


class ForecastUpdate(Vocabulary):
    """What the forecast's calibration is refitted on during acquisition (``design.calibration_update``): the
    pilot's held-out rows and the acquired angles' (pooled), the acquired angles' alone, or never (pilot)."""

    POOLED = "pooled"
    ONLINE = "online"
    PILOT = "pilot"


class Criterion(Vocabulary):
    """Acquisition criteria: expected information gain, expected squared error, diagonal EIG."""

    EIG = "eig"
    ESE = "ese"
    DIAG_EIG = "diag_eig"


class Baseline(Vocabulary):
    """Angle choices that need no posterior."""

    EQUIDISTANT = "equidistant"
    GOLDEN = "golden"
    RANDOM = "random"


# ---------------------------------------------------------------------------------------------- classification
class LinearModel(Vocabulary):
    """The linearised classifier: tangent (``Φw``) or affine (``g(ṽ) + Φ(w − ṽ)``)."""

    TANGENT = "tangent"
    AFFINE = "affine"


class PriorMethod(Vocabulary):
    """How ``LinearizedLaplace.optimize_prior`` chooses the prior precision."""

    SAMPLED_EM = "sampled_em"
    EXACT = "exact"
    GRIDSEARCH = "gridsearch"  # validation NLL over a log grid (post-hoc calibration, not Bayesian; issue 27)


class HessianRoot(Vocabulary):
    """Square root of the softmax Hessian ``B = diag(p) − ppᵀ``."""

    CLOSED_FORM = "closed_form"
    SYMMETRIC = "symmetric"


class Link(Vocabulary):
    """Predictive link: Monte Carlo over logit samples, or the probit approximation."""

    MC = "mc"
    PROBIT = "probit"


class WeightSubset(Vocabulary):
    """Which weights a classifier's Laplace approximation linearises."""

    ALL = "all"
    LAST_LAYER = "last_layer"


class TupleSampling(Vocabulary):
    """How joint-likelihood tuples of test points are drawn."""

    DYADIC = "dyadic"
    UNIFORM = "uniform"


# ---------------------------------------------------------------------------------------------- metrics
class Centering(Vocabulary):
    """How :mod:`ctuq.metrics` turns samples into zero-mean deviations: already zero-mean, minus their own
    average (Bessel-corrected), or minus the given predictive mean."""

    NONE = "none"
    EMPIRICAL = "empirical"
    MEAN = "mean"


# ---------------------------------------------------------------------------------------------- noise model (issue 26)
class NoiseModel(Vocabulary):
    """Noise of the log-transformed CT measurements: one variance ``σ²`` for every ray, or ``σ² d_i`` with relative
    per-ray variances ``d_i`` from the scan's photon statistics (``uq.noise``; resolved once per run, against the
    scan, by :func:`ctuq.pipeline.noise.resolve_noise`)."""

    HOMOSCEDASTIC = "homoscedastic"
    PER_RAY = "per_ray"
    # per_ray where the scan carries usable per-measurement variances (counts, flats, darks), homoscedastic otherwise:
    # the default since the calibration study (docs/calibration.md), resolved per run and recorded in metrics.json
    AUTO = "auto"


__all__ += ["NoiseModel"]


# ---------------------------------------------------------------------------------------------- phantoms (issue 26)
class PhantomKind(Vocabulary):
    """The object ``ctuq simulate --phantom`` scans: the ellipsoid walnut (exact analytic line integrals), the
    textured z-invariant phantom (multi-scale random texture, voxelised and supersampled line integrals) or the
    laminate (parallel plates in a round matrix, exact line integrals)."""

    WALNUT = "walnut"
    TEXTURED = "textured"
    LAMINATE = "laminate"


__all__ += ["PhantomKind"]


# ------------------------------------------------------------------------------------------ classification (issue 27)
class Approximation(Vocabulary):
    """The posterior ``LinearizedLaplace`` forms: over all linearised weights (``full``, the core's solvers) or in
    ELLA's ``K``-dimensional Nyström subspace of the tangent kernel (``ella``, :mod:`ctuq.inference.ella`)."""

    FULL = "full"
    ELLA = "ella"


class HessianAt(Vocabulary):
    """Where ``LinearizedLaplace`` evaluates the softmax Hessians ``B_i``: at the linearised model's mode at the
    current prior precision (self-consistent Laplace-GLM evidence, the default) or at the trained network (the
    published shortcut, exact only when the network is that mode)."""

    LINEAR_MODE = "linear_mode"
    NETWORK = "network"


__all__ += ["Approximation", "HessianAt"]


# ---------------------------------------------------------------------------------------------- data formats (issue 28)
class ScanGeometry(Vocabulary):
    """Beam geometry of a scan description: parallel beam (any number of detector rows), fan beam (one detector row),
    cone beam (several rows); all circular about ``z``."""

    PARALLEL = "parallel"
    FAN = "fan"
    CONE = "cone"


class AngleUnit(Vocabulary):
    """Unit of projection angles in a scan description (``angles.unit``)."""

    DEGREE = "degree"
    RADIAN = "radian"


class LengthUnit(Vocabulary):
    """Unit of lengths in a scan description (``units``); ctuq converts them to mm."""

    MM = "mm"
    CM = "cm"
    M = "m"
    UM = "um"


class MeasurementKind(Vocabulary):
    """What a scan description's projections hold: raw detector counts (with flats and darks; per-ray variances
    follow from the photon statistics) or line integrals ``−log(I/I₀)`` (dimensionless)."""

    COUNTS = "counts"
    LINE_INTEGRALS = "line_integrals"


# The scan formats (``--data``) and the layouts ``ctuq simulate --layout`` writes are a registry, not a vocabulary:
# ctuq.registry.DATA_FORMATS (each format's ``layouts``; ctuq.data.formats.write_layouts).
__all__ += ["ScanGeometry", "AngleUnit", "LengthUnit", "MeasurementKind"]


# ------------------------------------------------------------------------------------------------------------------
# TV-PredCP type-II MAP (issue 26, H1): the optimiser of uq.tv_predcp (ctuq.inference.priors.tv_predcp.fit_block_prior)
class PriorFitOptimizer(Vocabulary):
    """Optimiser of the TV-PredCP hyperparameter fit (``uq.tv_predcp.optimizer``): a MacKay warm start of the
    global scale then projected L-BFGS with fixed Hutchinson probes, or Adam with MacKay updates every step (the
    first method, docs/tv_predcp.md)."""

    LBFGS = "lbfgs"
    ADAM = "adam"


__all__ += ["PriorFitOptimizer"]


# ------------------------------------------------------------------------------------------------------------------
# The uncertainty method of a run (issue 43: the walnut study's MC-dropout baseline through ctuq.uncertainty)
class UQMethod(Vocabulary):
    """What the uncertainty phase computes (``uq.method``): the linearised DIP's Gaussian posterior
    (:class:`ctuq.pipeline.uq.UQRun`), or MC dropout: stochastic forward passes of a DIP fitted with dropout
    (``model.dropout > 0``; :func:`ctuq.reconstruct.mc_dropout_predict`)."""

    LINEARISED = "linearised"
    MC_DROPOUT = "mc_dropout"


class TVInit(Vocabulary):
    """The starting image of the TV baseline's PDHG (``tv.init``): the FBP, or zeros."""

    FBP = "fbp"
    ZERO = "zero"


class Tuning(Vocabulary):
    """How a reconstruction's regularisation is set (``tv.tuning``, ``dip.tuning``): on the scan's held-out angles
    (``ctuq.reconstruct.heldout``; the fixed setting when the scan has none), or the fixed setting of the config."""

    HELDOUT = "heldout"
    FIXED = "fixed"


class WarmStart(Vocabulary):
    """Where the DIP's weights start (``dip.warm_start``, :mod:`ctuq.reconstruct.warm_start`): as initialised (or
    ``model.pretrained``), or fitted first to the held-out-tuned TV reconstruction of the same scan."""

    NONE = "none"
    TV = "tv"


class TVCriterion(Vocabulary):
    """How the TV baseline's weight is read off its held-out path (``tv.criterion``,
    :func:`ctuq.reconstruct.heldout.tv_weight_path`): the lowest held-out error, or the discrepancy principle with
    the noise level the held-out angles measure."""

    HELDOUT = "heldout"
    DISCREPANCY = "discrepancy"


__all__ += ["UQMethod", "TVInit", "Tuning", "TVCriterion", "WarmStart"]
