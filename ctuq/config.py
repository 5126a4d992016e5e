"""Run configuration: nested dataclasses, YAML files, ``--set key.sub=value`` overrides, validation.

Layers, later ones win: dataclass defaults → YAML file → ``--set`` overrides → dedicated CLI flags
(``--data``, ``--device``, ``--seed``). Every layer is validated as it is applied, so an error names its
source (file or ``--set``), the full key, and — for unknown keys — the valid keys of that section.

Bundled configs live in ``ctuq/configs/*.yaml`` (package data, so ``pip install .`` ships them); the
top-level ``configs/`` folder holds symlinks to the same files for browsing. ``--config NAME`` accepts a
path or the name of a bundled config (``demo``, ``walnut_2d_60``, ...).

Extending: a section is any field of :class:`Config` whose type is a dataclass. To add one (e.g. the
linearised-inference settings), define a dataclass whose fields use :func:`option` and add
``uq: UQConfig = dataclasses.field(default_factory=UQConfig)`` to :class:`Config`; loading, overrides,
validation, error messages and ``to_dict()`` pick it up with no other change. Cross-field checks go in the
section's ``validate(self)`` method (called after every layer), raising :class:`ConfigError`.

Vocabularies come from :mod:`ctuq.options`; the values of ``uq.solver`` are read from the solver registry when a
value is checked (:func:`ctuq.inference.solvers.solver_choices`), so a solver registered after import is a valid
``uq.solver``. The config is the one place that maps its keys onto the core's keyword arguments
(:func:`posterior_arguments`): the core never reads a config key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Union

import yaml

from ctuq.errors import CTUQError
from ctuq.inference.solvers import Workload, solver_choices
from ctuq.models.unet import PRESETS
from ctuq.options import (
    Backend,
    Baseline,
    Calibration,
    Criterion,
    DenseFeatures,
    DesignPriorKind,
    DesignPriorScale,
    DesignRoute,
    EMStopRule,
    EMUpdate,
    FilterType,
    GPriorMethod,
    LRDecay,
    NoiseModel,
    Preconditioner,
    Prior,
    PriorFitOptimizer,
    values,
)

__all__ = [
    "ConfigError",
    "Config",
    "DataConfig",
    "ModelConfig",
    "DIPConfig",
    "FBPConfig",
    "TVConfig",
    "UQConfig",
    "DesignConfig",
    "OutputConfig",
    "option",
    "load_config",
    "bundled_configs",
    "resolve_config_path",
    "parse_override",
    "check_section",
    "posterior_arguments",
    "TVPredCPConfig",
]


class ConfigError(CTUQError):
    """A configuration file, override or value is invalid; the message names the key and source.

    A :class:`ctuq.errors.CTUQError` (hence a ``ValueError``): the ``ctuq`` commands print it as one line."""


def option(
    default: Any = None,
    *,
    help: str = "",
    choices: tuple | Callable[[], tuple] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    factory=None,
):
    """A config field with its documentation and value constraints (checked on every assignment).

    ``choices``: allowed values, or a function returning them when a value is checked (for vocabularies that grow
    at run time, such as the solver registry); ``ge``/``gt``/``le``/``lt``: numeric bounds (also applied to list
    items).
    """
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ----------------------------------------------------------------------------------------------- sections
@dataclasses.dataclass
class DataConfig:
    """Which scan to load and how to subsample it (see ``ctuq.data.load_walnut_slice``)."""

    path: str | None = option(
        None,
        help="scan: walnut folder, scan.yaml or NXtomo file (docs/data_formats.md); null: the bundled demo scan",
    )
    ndim: int = option(2, choices=(2, 3), help="2: one slice (sparse operator), 3: a volume (GPU, ASTRA CUDA)")
    orbit: int = option(2, choices=(1, 2, 3), help="source orbit (tubeV1..3)")
    angular_subsampling: int = option(20, ge=1, help="use every k-th of the 1200 angles (20 → 60 angles)")
    detector_subsampling: int = option(6, ge=1, help="use every k-th detector column (6 → 128 of 768)")
    slice_index: int | None = option(None, ge=0, help="volume slice; null: the central slice")
    image_shape: list[int] | None = option(None, ge=1, help="reconstruction grid; null: the loader's default")
    backend: str = option("auto", choices=values(Backend), help="ray-transform backend")
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
        if self.image_shape is not None and len(self.image_shape) != self.ndim:
            raise ConfigError(
                f"data.image_shape {self.image_shape} has {len(self.image_shape)} entries but data.ndim is {self.ndim}"
            )


@dataclasses.dataclass
class ModelConfig:
    """The U-Net ``g`` (see ``ctuq.models.unet``)."""

    preset: str = option("small", choices=tuple(PRESETS), help="architecture preset")
    channels: list[int] | None = option(None, ge=1, help="channels per scale; null: the preset's")
    skip_channels: list[int] | None = option(None, ge=0, help="skip widths per scale; null: the preset's")
    norm_groups: int = option(4, ge=1, help="GroupNorm groups")
    sigmoid: bool = option(False, help="sigmoid on the output")
    dropout: float = option(0.0, ge=0.0, lt=1.0, help="channel dropout after every conv (MC dropout)")
    input: str = option("noise", choices=("noise", "fbp"), help="fixed network input: seeded noise or the FBP")
    input_std: float = option(0.1, gt=0.0, help="std of the noise input")
    pretrained: str | None = option(None, help="weights to start from (.pt state dict / DIP checkpoint)")

    def validate(self) -> None:
        channels = self.channels if self.channels is not None else list(PRESETS[self.preset]["channels"])
        skips = self.skip_channels if self.skip_channels is not None else list(PRESETS[self.preset]["skip_channels"])
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


@dataclasses.dataclass
class FBPConfig:
    """Filtered back-projection baseline (``ctuq.operators.fbp``)."""

    filter: str = option("Hann", choices=values(FilterType), help="FBP filter")
    frequency_scaling: float = option(1.0, gt=0.0, le=1.0, help="relative filter cut-off frequency")


@dataclasses.dataclass
class TVConfig:
    """TV-regularised baseline with ODL's PDHG (``ctuq.reconstruct.classical``)."""

    enabled: bool = option(False, help="run the TV baseline")
    weight: float = option(1e-3, gt=0.0, help="λ in ½‖Tx − y‖² + λ TV(x) (original units, sums)")
    iterations: int = option(300, ge=1, help="PDHG iterations")
    nonnegative: bool = option(True, help="constrain x ≥ 0")
    isotropic: bool = option(True, help="isotropic (else anisotropic) TV")


@dataclasses.dataclass
class TVPredCPConfig:
    """The TV-PredCP block prior (``uq.prior = tv_predcp``; :mod:`ctuq.priors.tv_predcp`, ``docs/tv_predcp.md``): its
    hyperprior rate, initial hyperparameters and the type-II MAP that fits them."""

    scale: float = option(
        1.0,
        gt=0.0,
        help="rate λ of the exponential hyperprior on a block's expected sample TV, in units of 1/TV(reconstruction)",
    )
    steps: int = option(
        100, ge=0, help="most steps of the type-II MAP; it stops earlier once converged (0: keep the initial values)"
    )
    optimizer: str = option(
        "lbfgs",
        choices=values(PriorFitOptimizer),
        help="type-II MAP optimiser: MacKay warm start + projected L-BFGS, or Adam + MacKay every step",
    )
    tol: float = option(
        1e-2, gt=0.0, help="converged when no log-hyperparameter changed by more than this in each of 3 steps"
    )
    max_step: float = option(1.0, gt=0.0, help="largest change of a log-hyperparameter in one L-BFGS step")
    lr: float = option(0.1, gt=0.0, help="Adam step size on the log-hyperparameters (optimizer=adam)")
    probes: int = option(8, ge=1, help="Hutchinson probes of the log-determinant gradient (one set for the whole fit)")
    tv_samples: int = option(
        32, ge=1, help="samples per block (9 JVPs each, once) of the tap Gram matrices behind the expected TV"
    )
    lengthscale: float = option(1.0, gt=0.0, help="initial Matérn-½ lengthscale of every 3×3 block (tap spacings)")
    variance: float = option(1.0, gt=0.0, help="initial variance σ²_b of every block (× 1/a)")
    precond_rank: int = option(400, ge=1, help="Nyström preconditioner rank of the fit's CG solves")

    def validate(self) -> None:
        # check_section checks the bounds of one level only: a section built in code gets them here
        for f in dataclasses.fields(self):
            _check_bounds(getattr(self, f.name), dict(f.metadata), f.name, "uq.tv_predcp")


@dataclasses.dataclass
class UQConfig:
    """Linearised inference (DESIGN.md §1; ``ctuq.pipeline.uq.run_linearized_uq``). ``--no-uq`` skips it.

    The one settings class of the inference: the ``uq`` config section, and what the CT front end takes;
    :func:`posterior_arguments` maps it onto :class:`ctuq.inference.LinearizedPosterior`'s arguments. Built in
    code, check it with :func:`check_section`.

    Units: ``noise_variance`` is in *scaled* data units (× ``dip.scale``², where the network lives);
    ``prior_precision`` is the initial ``a`` of the g-prior-scaled weights.
    """

    prior: str = option(
        "gprior",
        choices=values(Prior),
        help="weight prior: g-prior or isotropic scaling s, or the tv_predcp block prior",
    )
    tv_predcp: TVPredCPConfig = dataclasses.field(default_factory=TVPredCPConfig)
    gprior_method: str = option(
        "exact",
        choices=values(GPriorMethod),
        help="g-prior column norms: exact (c VJPs) or stochastic (gprior_probes VJPs)",
    )
    gprior_probes: int = option(256, ge=1, help="probes of the stochastic g-prior")
    solver: str = option(
        "auto",
        choices=solver_choices,
        help="exact_primal (assemble Ψ, d < c), exact_dual (eigendecompose K̄, small c), cg "
        "(preconditioned CG), sdd (stochastic dual descent), sgd (primal "
        "sample-then-optimise); exact: the cheaper exact one; auto: by estimated cost",
    )
    preconditioner: str = option(
        "nystrom", choices=values(Preconditioner), help="CG preconditioner (randomised low-rank K̄, built once)"
    )
    rank: int = option(400, ge=1, help="preconditioner rank (the cap with adaptive_rank)")
    adaptive_rank: bool = option(
        False,
        help="grow the Nyström preconditioner until λ_r/a < rank_threshold·σ² (at the initial a, σ²), at most uq.rank",
    )
    rank_threshold: float = option(
        1.0, gt=0.0, help="adaptive_rank: the multiple of σ² below which λ_r/a stops the growth"
    )
    # The sdd_*/sgd_* defaults are the solvers' own (SDDSolver, SGDSolver); tests/test_config.py checks they agree.
    sdd_step: float = option(1.0, gt=0.0, help="SDD step size in units of 1/λ_max(C) (scale free)")
    sdd_momentum: float = option(0.99, ge=0.0, lt=1.0, help="SDD Nesterov momentum ρ")
    sdd_batch: int | None = option(
        None, ge=1, help="SDD coordinate block size; null: full batch (every CT step costs a full JVP + VJP anyway)"
    )
    sdd_iterations: int = option(1000, ge=1, help="SDD iteration budget per solve")
    sgd_lr: float = option(1.0, gt=0.0, help="SGD step in units of 1/λ_max(ΨᵀΨ/σ² + aI)")
    sgd_momentum: float = option(0.99, ge=0.0, lt=1.0, help="SGD Nesterov momentum")
    sgd_lr_decay: str = option("none", choices=values(LRDecay), help="SGD learning-rate schedule")
    sgd_clip: float | None = option(
        None, gt=0.0, help="SGD gradient clip (× the first step's gradient norm); null: none"
    )
    sgd_iterations: int = option(1000, ge=1, help="SGD iteration budget per solve")
    first_order_tol: float = option(
        1e-2,
        gt=0.0,
        lt=1.0,
        help="sdd/sgd: relative residual at which a solve stops early (above it at the budget: a warning)",
    )
    oversampling: int = option(10, ge=0, help="preconditioner oversampling")
    cg_tol: float = option(1e-3, gt=0.0, lt=1.0, help="CG relative tolerance")
    cg_max_iter: int = option(150, ge=1, help="CG iteration cap")
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
        choices=values(Calibration),
        help="none: std.tif is the posterior std; heldout: std.tif is the std × k fitted by maximum likelihood to the "
        "scan's unused angles (std_uncalibrated.tif keeps the posterior's); bias: std.tif is sqrt(std² + τ² M), a "
        "bias of std τ inside the object mask M fitted to the same angles; auto: when the held-out check runs, bias "
        "(g-prior) or heldout (tv_predcp), else none; the check runs either way when the scan has unused angles",
    )
    save_samples: bool = option(
        False, help="also write every image sample to the run folder (samples/, large); statistics never need them"
    )


def posterior_arguments(uq: UQConfig) -> dict:
    """The keyword arguments of :class:`ctuq.inference.LinearizedPosterior` that the ``uq`` section sets:
    ``prior``, ``gprior_method``, ``gprior_probes``, ``a`` (``prior_precision``), ``solver``, ``solver_options``
    and ``workload`` (for ``solver="auto"``'s cost model); with ``prior = tv_predcp`` also ``prior_options`` from
    ``uq.tv_predcp`` (the front end adds the image shape and the rate, ``scale / TV(reconstruction)``). The front end
    adds what is not configuration (``likelihood``, ``seed``, ``output_map``, ``progress``, ``log``, ``shard``).

    ``solver_options`` holds one mapping per solver that has configuration keys (``cg``: ``preconditioner``,
    ``rank``, ``oversampling``, ``rtol`` = ``cg_tol``, ``max_iter`` = ``cg_max_iter``, ``adaptive_rank``,
    ``rank_threshold``; ``sdd``: ``sdd_*`` and ``first_order_tol``; ``sgd``: ``sgd_*`` and ``first_order_tol``), so
    each solver gets exactly its own keys; the exact solvers take none.
    """
    options = {
        "cg": {
            "preconditioner": uq.preconditioner,
            "rank": uq.rank,
            "oversampling": uq.oversampling,
            "rtol": uq.cg_tol,
            "max_iter": uq.cg_max_iter,
            "adaptive_rank": bool(uq.adaptive_rank),
            "rank_threshold": float(uq.rank_threshold),
        },
        "sdd": {
            "step_size": uq.sdd_step,
            "momentum": uq.sdd_momentum,
            "batch_size": uq.sdd_batch,
            "max_iter": uq.sdd_iterations,
            "rtol": uq.first_order_tol,
        },
        "sgd": {
            "lr": uq.sgd_lr,
            "momentum": uq.sgd_momentum,
            "lr_decay": uq.sgd_lr_decay,
            "clip": uq.sgd_clip,
            "max_iter": uq.sgd_iterations,
            "rtol": uq.first_order_tol,
        },
    }
    workload = Workload(
        em_steps=uq.em_steps,
        em_samples=uq.em_samples,
        prediction_samples=uq.samples,
        rank=uq.rank,
        oversampling=uq.oversampling,
        sdd_iterations=float(uq.sdd_iterations),
        sgd_iterations=float(uq.sgd_iterations),
        chunk=int(uq.sample_chunk),
    )
    out = {
        "prior": uq.prior,
        "gprior_method": uq.gprior_method,
        "gprior_probes": uq.gprior_probes,
        "a": uq.prior_precision,
        "solver": uq.solver,
        "solver_options": options,
        "workload": workload,
    }
    if uq.prior == Prior.TV_PREDCP:
        # the front end adds image_shape and turns scale into the rate λ (it knows the reconstruction's TV)
        tv = uq.tv_predcp
        out["prior_options"] = {
            "steps": tv.steps,
            "optimizer": tv.optimizer,
            "tol": tv.tol,
            "max_step": tv.max_step,
            "lr": tv.lr,
            "probes": tv.probes,
            "tv_samples": tv.tv_samples,
            "lengthscale": tv.lengthscale,
            "variance": tv.variance,
            "precond_rank": tv.precond_rank,
        }
    return out


@dataclasses.dataclass
class DesignConfig:
    """Experimental design of scan angles (``ctuq design``; :mod:`ctuq.design`, ``docs/design.md``).

    The one settings class of the design: the ``design`` config section and what :func:`ctuq.design.run_design`
    and the angle-selection study take. ``noise_variance`` is in data units² (line integrals²); the linearised DIP
    works in scaled units (× ``dip.scale``²) and converts it.
    """

    criterion: str = option(
        "eig",
        choices=values(Criterion) + values(Baseline),
        help="eig (D-optimal), ese (expected squared error), diag_eig, or a baseline: equidistant, random",
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
    refresh_every: int = option(
        5, ge=0, help="refresh the DIP's g-prior scales and a every this many angles (0: never)"
    )
    retrain_every: int = option(0, ge=0, help="retrain the DIP (warm start) every this many angles (0: never)")
    retrain_iterations: int = option(300, ge=1, help="Adam iterations of one retraining")
    prior_scale: str = option(
        "auto",
        choices=values(DesignPriorScale),
        help="a by exact EM on the chosen rows, or by the signal energy; auto: em for "
        "isotropic/Matérn, energy for the DIP",
    )
    gprior_method: str = option("exact", choices=values(GPriorMethod), help="g-prior of a non-assembled network")
    gprior_probes: int = option(256, ge=1, help="probes of the stochastic g-prior")
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

    # -------------------------------------------------------------------- conversion
    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML serialisable): the resolved config written into metrics.json."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "dict") -> Config:
        """Defaults updated by the nested dict ``d`` (partial dicts allowed), validated."""
        cfg = cls()
        apply_dict(cfg, d, source)
        return cfg

    def get(self, key: str) -> Any:
        """Value at a dotted key, e.g. ``cfg.get('dip.lr')``."""
        obj: Any = self
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj


# ----------------------------------------------------------------------------------------------- machinery
def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(obj) -> dict:
    return typing.get_type_hints(type(obj) if not isinstance(obj, type) else obj)


def _valid_keys(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


class _CoerceError(Exception):
    pass


def _coerce(value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except _CoerceError:
                pass
        raise _CoerceError
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise _CoerceError
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _CoerceError
    if tp is int:
        if isinstance(value, bool):
            raise _CoerceError
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _CoerceError
    if tp is float:
        if isinstance(value, bool):
            raise _CoerceError
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads '1e-4' (no dot) as a string; accept it as the number it obviously is.
            try:
                return float(value)
            except ValueError:
                raise _CoerceError from None
        raise _CoerceError
    if tp is str:
        if isinstance(value, str):
            return value
        raise _CoerceError
    if tp is Any:
        return value
    raise TypeError(f"config: unsupported field type {tp!r}")


def _check_bounds(value: Any, meta: dict, key: str, source: str) -> None:
    items = value if isinstance(value, list) else [value]
    choices = meta.get("choices")
    if callable(choices):
        choices = choices()
    if choices is not None and value is not None and value not in choices:
        raise ConfigError(f"{source}: {key} must be one of {list(choices)}, got {value!r}")
    for v in items:
        if v is None or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{source}: {key} must be finite, got {v}")
        for bound, op, text in (
            ("ge", lambda a, b: a >= b, ">="),
            ("gt", lambda a, b: a > b, ">"),
            ("le", lambda a, b: a <= b, "<="),
            ("lt", lambda a, b: a < b, "<"),
        ):
            b = meta.get(bound)
            if b is not None and not op(v, b):
                raise ConfigError(f"{source}: {key} must be {text} {b}, got {value!r}")


def set_value(obj: Any, path: list[str], value: Any, source: str, prefix: str = "") -> None:
    """Assign ``value`` at ``path`` inside the (section) dataclass ``obj``, checking key, type and bounds.

    A whole section may be assigned a mapping (merged key by key).
    """
    name = path[0]
    full = f"{prefix}{name}"
    valid = _valid_keys(obj)
    if name not in valid:
        where = f"section '{prefix[:-1]}'" if prefix else "the top level"
        raise ConfigError(f"{source}: unknown config key '{full}'; valid keys of {where}: {', '.join(valid)}")
    tp = _hints(obj)[name]
    if _is_section(tp):
        section = getattr(obj, name)
        if len(path) > 1:
            set_value(section, path[1:], value, source, f"{full}.")
            return
        if not isinstance(value, dict):
            raise ConfigError(
                f"{source}: '{full}' is a section and needs a mapping of keys "
                f"({', '.join(_valid_keys(section))}), got {type(value).__name__}"
            )
        apply_dict(section, value, source, f"{full}.")
        return
    if len(path) > 1:
        raise ConfigError(f"{source}: '{full}' is a value, not a section, so '{full}.{path[1]}' does not exist")
    field = next(f for f in dataclasses.fields(obj) if f.name == name)
    try:
        coerced = _coerce(value, tp)
    except _CoerceError:
        raise ConfigError(
            f"{source}: {full} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})"
        ) from None
    _check_bounds(coerced, dict(field.metadata), full, source)
    setattr(obj, name, coerced)


def check_section(section: Any, name: str, source: str = "settings") -> None:
    """Check a section built in code (e.g. ``UQConfig(solver="cg")``): every field's choices and bounds, then its
    ``validate()``. :func:`load_config` checks files and ``--set`` as it applies them; this is for the rest.

    Raises :class:`ConfigError` naming ``name.key`` (e.g. ``uq.solver must be one of [...]``).
    """
    for f in dataclasses.fields(section):
        _check_bounds(getattr(section, f.name), dict(f.metadata), f"{name}.{f.name}", source)
    _validate_all(section, source)


def _validate_all(obj: Any, source: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _validate_all(value, source)
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None


def apply_dict(obj: Any, d: dict, source: str, prefix: str = "") -> None:
    """Merge the nested mapping ``d`` into ``obj`` (a :class:`Config` or a section), validating everything."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys, got {type(d).__name__}")
    for key, value in d.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: config keys must be strings, got {key!r}")
        set_value(obj, [key], value, source, prefix)
    if not prefix:
        _validate_all(obj, source)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'dip.lr=1e-3'`` → ``(['dip', 'lr'], 0.001)``; the value is parsed with ``yaml.safe_load``."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set dip.lr=1e-3")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r}: the key {key!r} is empty or has an empty part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value {raw!r} is not valid YAML: {exc}") from None
    return key.split("."), value


def bundled_configs() -> dict[str, Path]:
    """Names → paths of the YAML configs shipped in ``ctuq/configs``."""
    root = resources.files("ctuq") / "configs"
    out = {}
    for entry in root.iterdir():
        if entry.name.endswith(".yaml"):
            out[entry.name[: -len(".yaml")]] = Path(str(entry))
    return dict(sorted(out.items()))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """An existing file path, or the path of the bundled config with that name (``'demo'``, ``'demo.yaml'``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = bundled_configs()
    stem = p.name[: -len(".yaml")] if p.name.endswith(".yaml") else p.name
    if str(p) in (p.name, f"{stem}.yaml") and stem in bundled:
        return bundled[stem]
    raise ConfigError(
        f"config file {str(name_or_path)!r} does not exist and is not a bundled config; bundled: {', '.join(bundled)}"
    )


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
    cfg_path = resolve_config_path("demo" if path is None else path)
    try:
        text = cfg_path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {cfg_path}: cannot read: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {cfg_path}: not valid YAML: {exc}") from None
    cfg = Config()
    if raw is not None:
        apply_dict(cfg, raw, f"config file {cfg_path}")
    applied = []
    for text in overrides or []:
        keys, value = parse_override(text)
        set_value(cfg, keys, value, f"--set {text}")
        applied.append(f"--set {text}")
    for key, value in flags.items():
        if value is None:
            continue
        set_value(cfg, key.split("."), value, f"command-line option for {key}")
        applied.append(f"{key}={value!r}")
    if applied:
        # Cross-field checks run once after all overrides: a pair of keys may be changed one at a time.
        _validate_all(cfg, f"config file {cfg_path} with overrides {', '.join(applied)}")
    return cfg
