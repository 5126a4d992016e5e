"""The schema of the run configuration: every section, every key with its default, bounds and help.

A section is a dataclass whose fields are made with :func:`ctuq.options.option`; a field whose type is a dataclass is
a nested section. :class:`Config` holds them all; :func:`load_config` builds one from a YAML file and ``--set``
overrides (the engine, :mod:`ctuq.config.engine`, does the work and knows no key).

Extending: a section is any field of :class:`Config` whose type is a dataclass. To add one, define a dataclass whose
fields use :func:`option` and add ``extra: ExtraConfig = option(factory=ExtraConfig)`` to :class:`Config`; loading,
overrides, validation, error messages and ``to_dict()`` pick it up with no other change. Cross-field checks go in the
section's ``validate(self)`` method (called after every layer), raising :class:`ConfigError`.

Choices that are registry names are read from :mod:`ctuq.registry` when a value is checked (``uq.solver``,
``uq.prior``, ``uq.calibration``, ``data.backend``), and the options of solvers and weight priors are sections derived
from their classes (``uq.cg.rank``, ``uq.tv_predcp.steps``: see :class:`UQConfig`); the registries import their
implementations then, not when the config is imported. The schema imports only leaves (:mod:`ctuq.errors`,
:mod:`ctuq.options`, :mod:`ctuq.registry`): mapping these keys onto the inference core's arguments is the CT front
end's job (:mod:`ctuq.pipeline.uq_settings`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ctuq.config.engine import (
    ConfigError,
    Derivation,
    DerivedSections,
    accepts_derived_keys,
    apply_dict,
    derived,
    get_value,
    load,
    to_dict,
)
from ctuq.options import (
    UNET_PRESETS,
    Approximation,
    Baseline,
    Criterion,
    DenseFeatures,
    DesignPriorKind,
    DesignPriorScale,
    DesignRoute,
    EMStopRule,
    EMUpdate,
    FilterType,
    ForecastUpdate,
    NoiseModel,
    Tuning,
    TVCriterion,
    TVInit,
    UQMethod,
    WarmStart,
    option,
    values,
)
from ctuq.registry import CALIBRATIONS, PRIORS, RAY_TRANSFORMS, SOLVERS

__all__ = [
    "Config",
    "DataConfig",
    "ModelConfig",
    "DIPConfig",
    "FBPConfig",
    "TVConfig",
    "UQConfig",
    "DesignConfig",
    "OutputConfig",
    "load_config",
]

#: Why ``uq.approximation = ella`` is refused on CT, measured on the bundled scan (docs/classification.md, "ELLA on CT";
#: ``scripts/benchmark_ella_ct.py``): one line, the config error.
ELLA_ON_CT = (
    "uq.approximation = 'ella' is for classifiers (ctuq.classify): on CT its subspace keeps an eighth of the "
    "posterior's pixel variance at K = 100 and at most half where float32 Jacobian products stop (~300 directions), "
    "and the exact route is faster on the bundled scan (docs/classification.md, 'ELLA on CT'); use "
    "uq.approximation = full"
)


# ----------------------------------------------------------------------------------------------- sections
@dataclasses.dataclass
class DataConfig:
    """Which scan to load and how to subsample it (see :mod:`ctuq.data.loader`)."""

    path: str | None = option(
        None,
        help="scan: walnut folder, scan.yaml or NXtomo file (docs/data_formats.md); null: the bundled demo scan",
    )
    ndim: int = option(2, choices=(2, 3), help="2: one slice (sparse operator), 3: a volume (GPU, ASTRA CUDA)")
    orbit: int = option(2, choices=(1, 2, 3), help="source orbit (tubeV1..3)")
    angles: list[int] | None = option(
        None,
        ge=0,
        help="indices of the scan's distinct angles the run measures (the others are held out for the held-out "
        "check); null: every angle, thinned by angular_subsampling",
    )
    angular_subsampling: int = option(20, ge=1, help="use every k-th of the 1200 angles (20 → 60 angles)")
    detector_subsampling: int = option(6, ge=1, help="use every k-th detector column (6 → 128 of 768)")
    slice_index: int | None = option(None, ge=0, help="volume slice; null: the central slice")
    image_shape: list[int] | None = option(None, ge=1, help="reconstruction grid; null: the loader's default")
    backend: str = option(
        "auto", choices=RAY_TRANSFORMS.choices, help="ray-transform backend (auto: sparse for 2D, ASTRA CUDA for 3D)"
    )
    min_angles: int = option(
        8,
        ge=1,
        help="refuse a scan and angular_subsampling that leave fewer projection angles than "
        "this (a reconstruction from so few is not meaningful); lower it to force a run",
    )
    expect_angles: int | None = option(
        None,
        ge=1,
        help="angles the setting is meant to have (published configs); a scan "
        "that gives another number runs with a warning; null: no check",
    )
    expect_columns: int | None = option(
        None,
        ge=1,
        help="detector columns the setting is meant to have (published "
        "configs); another number runs with a warning; null: no check",
    )

    def validate(self) -> None:
        if self.angles is not None and (not self.angles or len(set(self.angles)) != len(self.angles)):
            raise ConfigError(f"data.angles must be distinct indices (at least one), got {self.angles}")
        if self.image_shape is not None and len(self.image_shape) != self.ndim:
            raise ConfigError(
                f"data.image_shape {self.image_shape} has {len(self.image_shape)} entries but data.ndim is {self.ndim}"
            )


@dataclasses.dataclass
class ModelConfig:
    """The U-Net ``g`` (see ``ctuq.models.unet``)."""

    preset: str = option("small", choices=tuple(UNET_PRESETS), help="architecture preset")
    channels: list[int] | None = option(None, ge=1, help="channels per scale; null: the preset's")
    skip_channels: list[int] | None = option(None, ge=0, help="skip widths per scale; null: the preset's")
    norm_groups: int = option(4, ge=1, help="GroupNorm groups")
    sigmoid: bool = option(False, help="sigmoid on the output")
    dropout: float = option(0.0, ge=0.0, lt=1.0, help="channel dropout after every conv (MC dropout)")
    input: str = option(
        "noise",
        choices=("noise", "fbp", "tv"),
        help="fixed network input: seeded noise, the FBP or the TV image (the FBP, with a warning, without TV)",
    )
    input_std: float = option(0.1, gt=0.0, help="std of the noise input")
    pretrained: str | None = option(
        None, help="weights to start from: a model file (ctuq pretrain, dip_model.pt) or a DIP checkpoint"
    )

    def validate(self) -> None:
        preset = UNET_PRESETS[self.preset]
        channels = self.channels if self.channels is not None else list(preset["channels"])
        skips = self.skip_channels if self.skip_channels is not None else list(preset["skip_channels"])
        if len(channels) != len(skips) or not channels:
            raise ConfigError(
                f"model.channels {channels} and model.skip_channels {skips} (preset {self.preset!r} where not set) "
                f"must have the same, non-zero length (one entry per scale); set both"
            )


@dataclasses.dataclass
class DIPConfig:
    """DIP fit (see ``ctuq.reconstruct.dip.fit_dip`` for the objective's exact form)."""

    iterations: int = option(1000, ge=1, help="Adam iterations")
    lr: float = option(1e-4, gt=0.0, help="Adam learning rate")
    tv_weight: float = option(6.5e-6, ge=0.0, help="TV weight γ (mean-squared data term, summed TV)")
    scale: float = option(14.0, gt=0.0, help="data and image are multiplied by this while fitting")
    clip_grad_norm: float | None = option(1.0, ge=0.0, help="gradient-norm clip; null or 0 disables")
    checkpoint_every: int = option(100, ge=0, help="checkpoint period in iterations (0: only at the end)")
    enabled: bool = option(True, help="fit the DIP (false: only the FBP and, when enabled, TV; no uncertainty phase)")
    tuning: str = option(
        "heldout",
        choices=values(Tuning),
        help="heldout: keep the iterate with the lowest error on the tuning half of the scan's held-out angles "
        "(scored every dip.heldout_every iterations) and stop dip.patience iterations after it; fixed: the iterate "
        "with the lowest loss after dip.iterations. Without held-out angles: fixed",
    )
    tv_weights: list[float] | None = option(
        None,
        ge=0.0,
        help="dip.tuning = heldout: candidate TV weights γ, one fit each (the cost of one fit per weight); the fit "
        "whose kept iterate has the lowest held-out error wins. null: dip.tv_weight only",
    )
    heldout_every: int = option(25, ge=1, help="dip.tuning = heldout: score the iterate every this many iterations")
    patience: int | None = option(
        750, ge=1, help="dip.tuning = heldout: stop this many iterations after the lowest held-out error; null: never"
    )
    tv_weight_from_tv: bool = option(
        False,
        help="γ from the TV baseline's weight λ (held-out-tuned when tv.tuning = heldout) as the same balance of data "
        "and TV: γ = 2 dip.scale λ / c, c the measurement count; replaces dip.tv_weight(s) (kept, with a warning, "
        "without the TV baseline)",
    )
    warm_start: str = option(
        "none",
        choices=values(WarmStart),
        help="tv: fit the network's output to the TV reconstruction first (dip.warm_start_iterations), so the fit "
        "starts where TV ended (none, with a warning, without the TV baseline); none: from the initial weights",
    )
    warm_start_iterations: int = option(
        1500, ge=0, help="dip.warm_start = tv: Adam iterations of the warm start (lr 1e-2)"
    )


@dataclasses.dataclass
class FBPConfig:
    """Filtered back-projection baseline (``ctuq.operators.fbp``)."""

    filter: str = option("Hann", choices=values(FilterType), help="FBP filter")
    frequency_scaling: float = option(1.0, gt=0.0, le=1.0, help="relative filter cut-off frequency")


@dataclasses.dataclass
class TVConfig:
    """TV-regularised baseline with ODL's PDHG (``ctuq.reconstruct.classical``)."""

    enabled: bool = option(False, help="run the TV baseline")
    weight: float = option(
        1e-3,
        gt=0.0,
        help="λ in ½‖Tx − y‖² + λ TV(x) (original units, sums); with tv.tuning = heldout only without held-out angles",
    )
    iterations: int = option(300, ge=1, help="PDHG iterations (tv.tuning = heldout: after the path, at the chosen λ)")
    tuning: str = option(
        "heldout",
        choices=values(Tuning),
        help="heldout: λ from a warm-started path over tv.weight_range (tv.path_iterations each, largest first), "
        "the one with the lowest error on the tuning half of the scan's held-out angles; fixed: tv.weight. "
        "Without held-out angles: fixed",
    )
    weight_min: float = option(1e-4, gt=0.0, help="tv.tuning = heldout: the path's smallest λ")
    weight_max: float = option(1.0, gt=0.0, help="tv.tuning = heldout: the path's largest λ (its first)")
    per_decade: int = option(4, ge=1, help="tv.tuning = heldout: weights per decade between tv.weight_min and max")
    path_iterations: int = option(60, ge=1, help="tv.tuning = heldout: PDHG iterations per weight of the path")
    criterion: str = option(
        "discrepancy",
        choices=values(TVCriterion),
        help="tv.tuning = heldout: discrepancy: the largest λ whose residual on the used rows is at most the path's "
        "lowest held-out error (Morozov's principle, the noise level measured on held-out angles); heldout: the "
        "lowest held-out error",
    )
    path_stop_early: bool = option(
        True, help="tv.tuning = heldout: end the path once past the minimum (false: every weight, the whole curve)"
    )
    nonnegative: bool = option(True, help="constrain x ≥ 0")
    isotropic: bool = option(True, help="isotropic (else anisotropic) TV")
    init: str = option("fbp", choices=values(TVInit), help="PDHG's starting image: the FBP, or zeros")

    def validate(self) -> None:
        if self.weight_min >= self.weight_max:
            raise ConfigError(f"tv.weight_min = {self.weight_min:g} must be below tv.weight_max = {self.weight_max:g}")


def _calibration_help() -> str:
    """The help of ``uq.calibration``: ``auto`` and every registered calibration method's summary (read when the
    keys are listed, so a method registered later is listed too)."""
    methods = "; ".join(f"{name}: {method.summary}" for name, method in CALIBRATIONS.items())
    preferred = ", ".join(f"{prior}: {getattr(cls, 'auto_calibration', '?')}" for prior, cls in PRIORS.items())
    return (
        f"{methods}; auto: when the held-out check runs, the method the weight prior prefers ({preferred}), else "
        "none. A method that changes the map writes it to std.tif and keeps the posterior's in "
        "std_uncalibrated.tif; the check runs either way when the scan has unused angles"
    )


@accepts_derived_keys("uq")
@dataclasses.dataclass
class UQConfig:
    """Linearised inference (DESIGN.md §1; ``ctuq.pipeline.uq.UQRun``). ``--no-uq`` skips it.

    The one settings class of the inference: the ``uq`` config section, and what the CT front end takes;
    :func:`ctuq.pipeline.uq_settings.posterior_arguments` maps it onto :class:`ctuq.inference.LinearizedPosterior`'s
    arguments. Built in code, check it with :func:`check_section`.

    Each registered solver's options are a section of their own, derived from the solver class
    (:attr:`ctuq.inference.solvers.Solver.Options`): ``uq.cg.rank``, ``uq.sdd.max_iter``, ``uq.sgd.lr``, ... with
    the solver's defaults, bounds and help (a solver registered later has its section too); so are each registered
    weight prior's (``uq.tv_predcp.steps``: :attr:`ctuq.inference.priors.TVPredCPPrior.Options`; a prior without
    ``Options`` has none). The values of ``uq.prior``, ``uq.solver`` and ``uq.calibration`` are the registries' names
    (:mod:`ctuq.registry`). A run folder's ``config.yaml`` holds the section of the chosen prior and solver (none for
    ``solver: auto`` or ``exact`` until the run resolves it: ``metrics.json`` has the resolved one's) and any other
    set to values other than its defaults (:func:`ctuq.config.engine.to_dict`).

    Units: ``noise_variance`` is in *scaled* data units (× ``dip.scale``², where the network lives);
    ``prior_precision`` is the initial ``a`` of the g-prior-scaled weights.
    """

    method: str = option(
        "linearised",
        choices=values(UQMethod),
        help="linearised: the linearised DIP's Gaussian posterior (the keys below); mc_dropout: uq.samples "
        "stochastic forward passes (uq.sample_chunk at a time) of a DIP fitted with dropout (model.dropout > 0), "
        "the MC-dropout baseline: no held-out check, no calibration, no posterior object",
    )
    prior: str = option(
        "gprior",
        choices=PRIORS.choices,
        help="weight prior: g-prior or isotropic scaling s, or the tv_predcp block prior",
    )
    prior_sections: DerivedSections = derived(
        Derivation(PRIORS, "Options", chosen_by="prior"),
        help="one section per registered weight prior with options (uq.gprior, uq.tv_predcp, ...): its Options",
    )
    solver: str = option(
        "auto",
        choices=SOLVERS.choices,
        help="exact_primal (assemble Ψ, d < c), exact_dual (eigendecompose K̄, small c), cg "
        "(preconditioned CG), sdd (stochastic dual descent), sgd (primal "
        "sample-then-optimise); exact: the cheaper exact one; auto: by estimated cost",
    )
    solver_sections: DerivedSections = derived(
        Derivation(SOLVERS, "Options", exclude="runtime_options", chosen_by="solver"),
        help="one section per registered solver with options (uq.cg, uq.sdd, uq.sgd, ...): its Options",
    )
    em_steps: int = option(5, ge=0, help="sampled-EM steps (0: keep the initial a, σ²)")
    em_samples: int = option(16, ge=1, help="posterior samples per EM step")
    em_tol: float = option(1e-2, ge=0.0, help="stop the EM when a changes by less than this (relative)")
    em_stop_on: str = option(
        "a", choices=values(EMStopRule), help="EM convergence: a alone, or a and σ² (both below em_tol)"
    )
    em_update: str = option(
        "mackay",
        choices=values(EMUpdate),
        help="EM update of a: MacKay's, or damped where it oscillates (secant in log a)",
    )
    em_fixed_probes: bool | None = option(
        None,
        help="EM probes drawn once and rescaled to each (a, σ²), with warm starts; null: on for sdd/sgd, off otherwise",
    )
    memory_budget_gb: float | None = option(
        None,
        gt=0.0,
        help="GiB one chunk of Jacobian products may use (too small for one "
        "product: an error naming the sizes); null: automatic",
    )
    prior_precision: float = option(100.0, gt=0.0, help="initial prior precision a")
    noise_variance: float | None = option(
        None, gt=0.0, help="σ² (scaled data units); null: the DIP's mean squared residual"
    )
    learn_noise: bool = option(True, help="update σ² in the EM too")
    noise: str = option(
        "auto",
        choices=values(NoiseModel),
        help="homoscedastic: ε ~ N(0, σ² I); per_ray: ε ~ N(0, σ² D) with D the scan's photon-statistics variances; "
        "auto: per_ray when the scan has usable photon statistics (raw counts, flats, darks), else homoscedastic",
    )
    samples: int = option(1024, ge=2, help="prediction samples")
    sample_chunk: int = option(64, ge=1, help="prediction samples solved (and checkpointed) together")
    chunk_size: int | None = option(None, ge=1, help="vectors per vmapped Jacobian product; null: automatic")
    roi: str = option(
        "inner_square",
        choices=("inner_square", "full"),
        help="evaluation region: the published inner square (72:424 of 501², scaled) or all pixels",
    )
    patch_sizes: list[int] = option(factory=lambda: list(range(1, 11)), ge=1, help="joint-LL patch sizes")
    calibration: str = option(
        "auto",
        choices=CALIBRATIONS.choices,
        help=lambda: _calibration_help(),
    )
    approximation: str = option(
        "full",
        choices=values(Approximation),
        help="full: the posterior over all linearised weights; ella is the classifier's Nyström route and CT runs "
        "refuse it (docs/classification.md, 'ELLA on CT')",
    )
    save_samples: bool = option(
        False, help="also write every image sample to the run folder (samples/, large); statistics never need them"
    )


@accepts_derived_keys("design")
@dataclasses.dataclass
class DesignConfig:
    """Experimental design of scan angles (``ctuq design``; :mod:`ctuq.design`, ``docs/experimental_design.md``).

    The one settings class of the design: the ``design`` config section and what :func:`ctuq.design.run_design`
    and the angle-selection study take. ``noise_variance`` is in data units² (line integrals²); the linearised DIP
    works in scaled units (× ``dip.scale``²) and converts it. The linearised DIP's weight prior is
    ``design.weight_prior`` (any diagonal prior of :data:`ctuq.registry.PRIORS`), with its options in the section
    derived from its class, ``design.<name>`` (``design.gprior.method``), as ``uq.<name>`` is for the inference.
    """

    criterion: str = option(
        "eig",
        choices=values(Criterion) + values(Baseline),
        help="eig (D-optimal), ese (expected squared error), diag_eig, or a baseline: equidistant, golden "
        "(the golden-angle sequence), random",
    )
    prior: str = option(
        "dip", choices=values(DesignPriorKind), help="image prior: linearised DIP, isotropic, Matérn-1/2"
    )
    pilot: int = option(20, ge=1, help="pilot angles, equidistant among the candidates")
    acquire: int = option(40, help="angles to acquire after the pilot")
    candidates: int | None = option(
        None,
        ge=1,
        help="candidate angles: this many evenly spaced among the scan's angles; null: all of the scan's angles",
    )
    route: str = option(
        "auto",
        choices=values(DesignRoute),
        help="exact candidate blocks, m pathwise-conditioned samples, or auto (exact unless the "
        "prior is refreshed during the design)",
    )
    samples: int = option(1000, ge=2, help="m, pseudo-measurement samples (sampled route)")
    sample_chunk: int = option(256, ge=1, help="samples drawn together by the core sampler")
    jitter: float = option(
        0.01, ge=0.0, help="criteria jitter η as a fraction of the mean diagonal of the candidate blocks"
    )
    spread: float = option(
        0.0,
        ge=0.0,
        le=1.0,
        help="spread constraint of a greedy design: each angle is taken only from the gaps between the chosen "
        "angles at least this fraction as wide as the widest (0: anywhere; 1: the widest gap)",
    )
    refresh_every: int = option(
        5, ge=0, help="refresh the DIP's weight-prior scales and a every this many angles (0: never)"
    )
    retrain_every: int = option(0, ge=0, help="retrain the DIP (warm start) every this many angles (0: never)")
    retrain_iterations: int = option(300, ge=1, help="Adam iterations of one retraining")
    retrain_lr: float | None = option(None, gt=0.0, help="Adam learning rate of a retraining; null: dip.lr")
    prior_scale: str = option(
        "auto",
        choices=values(DesignPriorScale),
        help="a by exact EM on the chosen rows, or by the signal energy; auto: em for "
        "isotropic/Matérn, energy for the DIP",
    )
    weight_prior: str = option(
        "gprior",
        choices=lambda: tuple(n for n in PRIORS.names() if PRIORS[n].diagonal),
        help="weight prior of the linearised DIP (design.prior = dip): a diagonal prior of the registry; its options "
        "are the section design.<name> (design.gprior.method, ...)",
    )
    prior_sections: DerivedSections = derived(
        Derivation(PRIORS, "Options", chosen_by="weight_prior"),
        help="one section per registered weight prior with options (design.gprior, ...): its Options",
    )
    dense: str = option(
        "auto",
        choices=values(DenseFeatures),
        help="assemble the DIP Jacobian (d JVPs) so every product is a GEMM: auto, always, never",
    )
    matern_lengthscales: list[float] | None = option(
        None, gt=0.0, help="Matérn lengthscale grid (pixels); null: 1 … image side, 9 values"
    )
    noise_variance: float | None = option(
        None, gt=0.0, help="σ² in data units²; null: the pilot DIP's mean squared residual"
    )
    std_samples: int = option(256, ge=2, help="posterior samples for the std maps after pilot and design")
    reconstruct: bool = option(True, help="reconstruct pilot+designed and pilot+equidistant angles (FBP, TV, DIP)")
    forecast: bool = option(
        True,
        help="forecast the error during a greedy design (its calibration, online recalibration, stop targets, --plan "
        "and the std map after the pilot); false: the plain greedy loop, whose samples nothing else draws from",
    )
    calibration: str = option(
        "heldout",
        choices=CALIBRATIONS.names,
        help="calibration of the error forecast, a calibration method as uq.calibration (not auto), fitted on unseen "
        "rows (pilot: other candidates; then each new angle)",
    )
    calibration_update: str = option(
        "online",
        choices=values(ForecastUpdate),
        help="refit the forecast's calibration on each new angle's rows: alone (online), with the pilot's (pooled), "
        "or never (pilot)",
    )
    track_iterations: int | None = option(
        None,
        ge=0,
        help="predict each new angle from the pilot DIP warm-started on the acquired angles for this many Adam steps "
        "(0: from the design's linearised update); null: 300 with a stop target, else 0",
    )
    calibration_angles: int = option(60, ge=1, help="candidates outside the pilot whose rows calibrate at the pilot")
    forecast_points: int = option(8, ge=2, help="angle counts of the predicted error curve (--plan)")
    plan_samples: int = option(
        250, ge=2, help="m of the plan's designed curve (sampled route): its order only, not its error forecast"
    )
    forecast_samples: int = option(128, ge=2, help="posterior samples per forecast variance map")
    target_rmse: str | None = option(
        None, help="stop when the predicted RMS error inside the object is at most this, e.g. 0.002/mm"
    )
    target_psnr: str | None = option(None, help="stop when the predicted PSNR is at least this, e.g. 30dB")
    min_gain: str | None = option(
        None, help="stop when the last angle improved the predicted RMS error by less than this, e.g. 1% or 1e-4/mm"
    )
    intensity_range: float | None = option(
        None, gt=0.0, help="intensity range (mm⁻¹) of the predicted PSNR; null: the ground truth's max − min"
    )


@dataclasses.dataclass
class OutputConfig:
    """What goes into the run folder besides the images and metrics.json."""

    figure: bool = option(True, help="write the PNG comparison figure")
    keep_checkpoint: bool = option(True, help="keep dip_checkpoint.pt after a finished run")
    save_model: bool = option(True, help="write dip_model.pt (best weights, input, architecture)")
    stack: bool = option(
        False, help="also write stack.tif: reconstruction, std, |error|, ground truth as one ImageJ multi-channel stack"
    )
    hdf5: bool = option(
        False, help="also write results.h5: every image of the run and its geometry (voxel grid, projection vectors)"
    )
    psnr_trace: bool = option(
        False,
        help="with a ground truth, record the PSNR after every TV and DIP iteration in metrics.json (tv.psnr_trace, "
        "dip.psnr_trace): the best over the iterations is an oracle (it looks at the ground truth)",
    )


@dataclasses.dataclass
class Config:
    """The full configuration of ``ctuq reconstruct`` and ``ctuq design``. Sections: ``data``, ``model``, ``dip``,
    ``fbp``, ``tv``, ``uq``, ``design``, ``output``; top level: ``device``, ``seed``."""

    device: str = option("cpu", choices=("cpu", "cuda", "auto"), help="cpu, cuda, or auto")
    seed: int = option(0, ge=0, help="seed for the network input, initial weights and dropout")
    data: DataConfig = option(factory=DataConfig)
    model: ModelConfig = option(factory=ModelConfig)
    dip: DIPConfig = option(factory=DIPConfig)
    fbp: FBPConfig = option(factory=FBPConfig)
    tv: TVConfig = option(factory=TVConfig)
    uq: UQConfig = option(factory=UQConfig)
    design: DesignConfig = option(factory=DesignConfig)
    output: OutputConfig = option(factory=OutputConfig)

    def validate(self) -> None:
        if self.data.ndim == 3 and self.device == "cpu":
            raise ConfigError("data.ndim = 3 (volumes) needs device 'cuda': ASTRA has no 3D projectors on CPU")
        if self.uq.approximation == Approximation.ELLA:
            raise ConfigError(ELLA_ON_CT)
        if self.uq.method == UQMethod.MC_DROPOUT and not self.model.dropout > 0:
            raise ConfigError(
                "uq.method = 'mc_dropout' needs a DIP fitted with dropout: set model.dropout > 0 (e.g. 0.05); "
                f"model.dropout is {self.model.dropout}"
            )

    # -------------------------------------------------------------------- conversion
    def to_dict(self, resolved: dict[str, str] | None = None) -> dict:
        """Plain nested dict (JSON/YAML serialisable): the resolved config written into metrics.json and the run
        folder's config.yaml. Of the derived sections (``uq.cg.rank``) it holds the chosen prior's and solver's and
        any set to other than its defaults; ``resolved`` (e.g. ``{"uq.solver": "cg"}``: what ``auto`` resolved to)
        adds that one's (:func:`ctuq.config.engine.to_dict`)."""
        return to_dict(self, resolved)

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict") -> Config:
        """Defaults updated by the nested dict ``d`` (partial dicts allowed), validated."""
        cfg = cls()
        apply_dict(cfg, d, source)
        return cfg

    def get(self, key: str) -> Any:
        """Value at a dotted key, e.g. ``cfg.get('dip.lr')``, ``cfg.get('uq.cg.rank')``."""
        return get_value(self, key)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    **flags: Any,
) -> Config:
    """Build the resolved :class:`Config`.

    Parameters
    ----------
    path : str or Path, optional
        YAML file or bundled config name; ``None`` uses the bundled ``demo``.
    overrides : list of str
        ``KEY=VALUE`` strings (``--set``), applied in order after the file.
    **flags
        Dotted keys with values applied last when not ``None`` (``**{'data.path': ..., 'device': 'cuda'}``).

    Raises
    ------
    ConfigError
        Unknown keys (listing the valid keys of that section), wrong types or out-of-range values, naming
        the key and where it came from.
    """
    return load(Config, path, overrides, flags)
