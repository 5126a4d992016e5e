import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ctuq.config import (
    Config,
    ConfigError,
    DIPConfig,
    UQConfig,
    apply_dict,
    bundled_configs,
    check_section,
    load_config,
    option,
    parse_override,
    resolve_config_path,
)
from ctuq.config.engine import Derivation, DerivedSections, derived, section_class, to_dict
from ctuq.inference.solvers import SOLVERS, Solver
from ctuq.models.unet import PRESETS
from ctuq.options import UNET_PRESETS, UNetPreset, values
from ctuq.registry import CALIBRATIONS, PRIORS, RAY_TRANSFORMS, Registry

REPO = Path(__file__).resolve().parents[1]


def test_bundled_configs_load_and_match_top_level_folder():
    names = bundled_configs()
    assert set(names) >= {
        "demo",
        "demo_pretrained",
        "walnut_2d_60",
        "walnut_2d_120",
        "walnut_3d",
        "walnut_3d_published",
    }
    for name, path in names.items():
        cfg = load_config(name)
        assert isinstance(cfg, Config)
        top = REPO / "configs" / f"{name}.yaml"
        assert top.read_text() == path.read_text(), f"configs/{name}.yaml differs from the packaged copy"
    # published settings
    w60, w120 = load_config("walnut_2d_60"), load_config("walnut_2d_120")
    assert (w60.dip.lr, w60.dip.tv_weight, w60.dip.iterations, w60.dip.scale) == (1e-4, 6.5e-6, 1500, 14.0)
    assert (w120.dip.tv_weight, w120.dip.iterations) == (4e-6, 2500)
    assert w60.model.preset == "walnut" and load_config("walnut_3d").data.ndim == 3


def test_default_is_demo_on_cpu():
    cfg = load_config()
    assert cfg.device == "cpu" and cfg.model.preset == "tiny" and cfg.data.path is None
    # the demo's DIP starts at the held-out-tuned TV image (its input and a warm start), regularised as TV is, and is
    # tuned on held-out angles, as is its TV baseline
    assert cfg.model.pretrained is None and cfg.model.input == "tv"
    assert cfg.dip.warm_start == "tv" and cfg.dip.tv_weight_from_tv
    assert cfg.dip.tuning == cfg.tv.tuning == "heldout"


def test_tv_path_range_must_be_ordered():
    with pytest.raises(ConfigError, match=r"tv.weight_min = 1 must be below tv.weight_max = 0.1"):
        load_config("demo", ["tv.weight_min=1", "tv.weight_max=0.1"])
    with pytest.raises(ConfigError, match="tv.tuning"):
        load_config("demo", ["tv.tuning=oracle"])


def test_pretrained_demo_finds_the_bundled_weights_from_any_working_directory(tmp_path, monkeypatch):
    from ctuq.pipeline import build_model

    monkeypatch.chdir(tmp_path)  # the relative path is resolved in the repository's data/ folder
    cfg = load_config("demo_pretrained")
    assert cfg.model.pretrained == "pretrained/tiny_demo.pt" and cfg.model.input == "fbp"
    untrained = build_model(load_config("demo"), 2)
    model = build_model(cfg, 2)
    assert model.config.channels == (8, 8, 8)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), untrained.state_dict().values()))
    cfg_missing = load_config("demo", ["model.pretrained=nowhere/weights.pt"])
    with pytest.raises(FileNotFoundError, match="nowhere/weights.pt does not exist"):
        build_model(cfg_missing, 2)


def test_overrides_and_flags():
    cfg = load_config(
        "demo",
        [
            "dip.lr=1e-3",
            "model.channels=[8, 8, 8]",
            "model.skip_channels=[0, 2, 2]",
            "data.slice_index=null",
            "tv.enabled=false",
        ],
        seed=7,
        device="auto",
    )
    assert cfg.dip.lr == 1e-3 and isinstance(cfg.dip.lr, float)
    assert cfg.model.channels == [8, 8, 8] and cfg.seed == 7 and cfg.device == "auto"
    assert cfg.tv.enabled is False
    assert cfg.get("dip.lr") == 1e-3
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("x=") == (["x"], None)


def test_unknown_key_lists_valid_keys_of_its_section():
    with pytest.raises(ConfigError) as e:
        load_config("demo", ["dip.learning_rate=1e-3"])
    msg = str(e.value)
    assert "dip.learning_rate" in msg
    for key in ("iterations", "lr", "tv_weight", "scale", "clip_grad_norm", "checkpoint_every"):
        assert key in msg
    with pytest.raises(ConfigError, match="valid keys of the top level: device, seed, data, model"):
        load_config("demo", ["colour=red"])


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("dip:\n  lr: 1.0e-3\n  iters: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(f) in str(e.value) and "dip.iters" in str(e.value) and "iterations" in str(e.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("dip.lr=-1e-3", "dip.lr must be > 0"),
        ("dip.lr=fast", "dip.lr must be a number"),
        ("dip.iterations=2.5", "dip.iterations must be an integer"),
        ("dip.iterations=0", "dip.iterations must be >= 1"),
        ("tv.enabled=3", "tv.enabled must be true or false"),
        ("model.preset=huge", "model.preset must be one of ['walnut', 'small', 'tiny']"),
        ("model.dropout=1.0", "model.dropout must be < 1.0"),
        ("model.channels=[8, 8]", "model.channels"),
        ("device=gpu", "device must be one of"),
        ("dip=3", "'dip' is a section"),
        ("dip.lr.x=3", "'dip.lr' is a value"),
        ("dip.tv_weight=.nan", "dip.tv_weight must be finite"),
        ("uq.approximation=nystrom", "uq.approximation must be one of ['full', 'ella']"),
        # ELLA is the classifier's route: a CT run refuses it with the measured reason (scripts/benchmark_ella_ct.py)
        ("uq.approximation=ella", "uq.approximation = 'ella' is for classifiers (ctuq.classify)"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("demo", [override])
    assert fragment in str(e.value)
    assert f"--set {override}" in str(e.value) or "overrides" in str(e.value)


def test_cross_field_check_runs_after_all_overrides():
    # Changing both lists one override at a time must not trip the length check in between.
    cfg = load_config("demo", ["model.channels=[4, 4]", "model.skip_channels=[0, 2]"])
    assert cfg.model.channels == [4, 4]
    with pytest.raises(ConfigError, match="needs device 'cuda'"):
        load_config("demo", ["data.ndim=3", "data.image_shape=[8, 8, 8]"])


def test_missing_config_and_malformed_override():
    with pytest.raises(ConfigError, match="bundled: demo"):
        resolve_config_path("nonexistent_config")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("dip.lr")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_override("dip.lr=[1,")


def test_non_mapping_file(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(f)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config("walnut_2d_60", ["seed=3"])
    f = tmp_path / "resolved.yaml"
    f.write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(f) == cfg
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_a_new_section_needs_only_a_dataclass():
    @dataclasses.dataclass
    class ExtraConfig:
        samples: int = option(16, ge=1)

    @dataclasses.dataclass
    class Extended(Config):
        extra: ExtraConfig = option(factory=ExtraConfig)

    cfg = Extended()
    apply_dict(cfg, {"extra": {"samples": 32}, "dip": {"lr": 1e-3}}, "test")
    assert cfg.extra.samples == 32 and cfg.dip.lr == 1e-3
    assert cfg.to_dict()["extra"] == {"samples": 32}
    with pytest.raises(ConfigError, match="valid keys of section 'extra': samples"):
        apply_dict(cfg, {"extra": {"n": 1}}, "test")
    with pytest.raises(ConfigError, match="extra.samples must be >= 1"):
        apply_dict(cfg, {"extra": {"samples": 0}}, "test")
    assert isinstance(cfg.dip, DIPConfig)


# ------------------------------------------------------------------------------------------------ the U-Net presets
def test_the_preset_vocabulary_is_the_networks_table():
    assert values(UNetPreset) == tuple(UNET_PRESETS) == tuple(PRESETS)
    assert PRESETS is UNET_PRESETS  # one table: the config checks partial overrides against the network's presets
    with pytest.raises(ConfigError, match=r"model.channels \[8, 8\] and model.skip_channels \[0, 2, 2\]"):
        load_config("demo", ["model.preset=tiny", "model.channels=[8, 8]"])


# ------------------------------------------------------------------------------------------------ solver sections
def _runtime_free_fields(cls):
    return [f for f in dataclasses.fields(cls.Options) if f.name not in cls.runtime_options]


@pytest.mark.parametrize("name", ["exact_primal", "exact_dual", "cg", "sdd", "sgd"])
def test_each_solver_section_is_its_options(name):
    cls = SOLVERS[name]
    section = getattr(UQConfig(), name)
    want = _runtime_free_fields(cls)
    got = dataclasses.fields(section)
    assert [f.name for f in got] == [f.name for f in want] and "seed" not in [f.name for f in got]
    for g, w in zip(got, want):
        # the solver's default, bounds and help, unchanged
        assert getattr(section, g.name) == getattr(cls.Options(), w.name)
        assert dict(g.metadata) == dict(w.metadata)
    assert to_dict(section) == {f.name: getattr(cls.Options(), f.name) for f in want}


def test_the_solver_defaults_are_todays():
    uq = UQConfig()
    assert to_dict(uq.cg) == {
        "preconditioner": "nystrom",
        "rank": 400,
        "oversampling": 10,
        "rtol": 1e-3,
        "max_iter": 150,
        "backend": "pcg",
        "pivoted_diagonal": "exact",
        "adaptive_rank": False,
        "rank_threshold": 1.0,
        "initial_rank": 100,
    }
    assert (uq.sdd.step_size, uq.sdd.momentum, uq.sdd.batch_size, uq.sdd.max_iter, uq.sdd.rtol) == (
        1.0,
        0.99,
        None,
        1000,
        1e-2,
    )
    assert (uq.sgd.lr, uq.sgd.momentum, uq.sgd.lr_decay, uq.sgd.clip, uq.sgd.max_iter, uq.sgd.rtol) == (
        1.0,
        0.99,
        "none",
        None,
        1000,
        1e-2,
    )
    assert to_dict(uq.exact_dual) == to_dict(uq.exact_primal) == {"chunk_size": 64, "memory_budget": None}


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("uq.cg.rank=0", "--set uq.cg.rank=0: uq.cg.rank must be >= 1, got 0"),
        ("uq.rank=0", "--set uq.rank=0: unknown config key 'uq.rank'; valid keys of section 'uq': method, prior, "),
        ("uq.sdd.momentum=1.0", "uq.sdd.momentum must be < 1.0"),
        ("uq.sgd.lr_decay=cosine", "uq.sgd.lr_decay must be one of ['linear', 'none']"),
        ("uq.cg.preconditioner=magic", "uq.cg.preconditioner must be one of"),
        ("uq.cg.seed=3", "unknown config key 'uq.cg.seed'; valid keys of section 'uq.cg': preconditioner, rank"),
        ("uq.sdd.iterations=3", "unknown config key 'uq.sdd.iterations'"),
        ("uq.cg=3", "'uq.cg' is a section and needs a mapping of keys (preconditioner, rank"),
        ("uq.cgx.rank=3", "valid keys of section 'uq': method, prior, gprior, tv_predcp, solver, "),
        ("uq.samples.x=3", "'uq.samples' is a value, not a section"),
    ],
)
def test_bad_solver_options_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("demo", [override])
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_unknown_uq_key_lists_the_solver_sections():
    with pytest.raises(ConfigError) as e:
        load_config("demo", ["uq.colour=red"])
    assert "solver, exact_primal, exact_dual, cg, sdd, sgd, em_steps" in str(e.value)


# ------------------------------------------------------------------------------------------------ prior sections
def test_the_tv_predcp_section_is_the_priors_options():
    options = PRIORS["tv_predcp"].Options
    section = UQConfig().tv_predcp
    assert type(section) is options  # used as declared: every option is configurable
    cfg = load_config("demo", ["uq.prior=tv_predcp", "uq.tv_predcp.steps=7"])
    assert cfg.uq.tv_predcp == options(steps=7) and cfg.to_dict()["uq"]["tv_predcp"]["steps"] == 7
    # priors without options have no section; the g-prior's options are its section uq.gprior
    assert [n for n in PRIORS if getattr(PRIORS[n], "Options", None) is None] == ["isotropic"]
    with pytest.raises(ConfigError, match="unknown config key 'uq.isotropic'"):
        load_config("demo", ["uq.isotropic.probes=3"])
    cfg = load_config("demo", ["uq.gprior.probes=3"])
    assert type(cfg.uq.gprior) is PRIORS["gprior"].Options and cfg.uq.gprior.probes == 3
    assert cfg.to_dict()["uq"]["gprior"] == {"method": "exact", "probes": 3}
    # a section given as its options object
    assert UQConfig(tv_predcp=options(steps=3)).tv_predcp.steps == 3


def test_registry_names_are_the_values_of_their_keys():
    for key, registry in (
        ("uq.prior", PRIORS),
        ("uq.solver", SOLVERS),
        ("uq.calibration", CALIBRATIONS),
        ("data.backend", RAY_TRANSFORMS),
    ):
        section, name = key.split(".")
        field = next(f for f in dataclasses.fields(getattr(Config(), section)) if f.name == name)
        assert field.metadata["choices"] == registry.choices, key  # read when a value is checked
        with pytest.raises(ConfigError) as e:
            load_config("demo", [f"{key}=nonsense"])
        assert f"{key} must be one of {list(registry.choices())}, got 'nonsense'" in str(e.value)


# ------------------------------------------------------------------------------------------------ no old flat keys
@pytest.mark.parametrize("key", ["rank", "cg_tol", "sdd_iterations", "sgd_lr", "first_order_tol"])
def test_a_flat_key_of_an_unreleased_version_is_an_unknown_key(key, tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text(yaml.safe_dump({"uq": {key: 1}}))
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert f"unknown config key 'uq.{key}'; valid keys of section 'uq': method, prior, " in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=f"UQConfig\\(...\\): unknown config key 'uq.{key}'"):
        UQConfig(**{key: 1})
    with pytest.raises(AttributeError, match=f"no config key '{key}'"):
        UQConfig().__setattr__(key, 1)


def test_replace_and_copies_keep_their_own_sections():
    uq = UQConfig(cg={"rank": 20})
    other = dataclasses.replace(uq, noise="per_ray")
    assert other.cg.rank == 20 and other.solver_sections is not uq.solver_sections
    other.cg.rank = 5
    assert uq.cg.rank == 20
    assert UQConfig(cg={"rank": 20}) == uq != UQConfig()
    check_section(uq, "uq")
    uq.cg.rank = 0
    with pytest.raises(ConfigError, match="uq.cg.rank must be >= 1, got 0"):
        check_section(uq, "uq")


# ------------------------------------------------------------------------------------------------ derivation
class ToyIterative(Solver):
    """A solver defined here: its Options become the config section uq.toy_iterative."""

    name = "toy_iterative"
    summary = "a test solver"

    @dataclasses.dataclass
    class Options:
        sweeps: int = option(3, ge=1, help="sweeps per solve")
        damping: float = option(0.5, gt=0.0, le=1.0, help="step damping")
        seed: int = option(0, help="supplied by the posterior")

    def __init__(
        self,
        features,
        *,
        sweeps: int = Options.sweeps,
        damping: float = Options.damping,
        seed: int = Options.seed,
    ):
        super().__init__(features)

    def solve(self, rhs, a, sigma2, *, x0=None):
        raise NotImplementedError  # never solved here: the config reads only its options


class ToyUndeclared(Solver):
    """A solver that declares no Options: they are derived from its __init__."""

    name = "toy_undeclared"

    def __init__(self, features, *, jitter: float = 0.0, mode: str = "a"):
        super().__init__(features)

    def solve(self, rhs, a, sigma2, *, x0=None):
        raise NotImplementedError


@pytest.fixture
def toy_solvers():
    SOLVERS.register(ToyIterative)
    SOLVERS.register(ToyUndeclared)
    yield
    SOLVERS.unregister("toy_iterative")
    SOLVERS.unregister("toy_undeclared")


def test_a_solver_registered_later_has_its_section(toy_solvers):
    cfg = load_config("demo", ["uq.toy_iterative.sweeps=7", "uq.toy_undeclared.jitter=0.25"])
    assert cfg.uq.toy_iterative.sweeps == 7 and cfg.uq.toy_iterative.damping == 0.5
    assert cfg.uq.toy_undeclared.jitter == 0.25 and cfg.uq.toy_undeclared.mode == "a"
    assert cfg.to_dict()["uq"]["toy_iterative"] == {"sweeps": 7, "damping": 0.5}  # seed: the posterior's
    with pytest.raises(ConfigError, match=r"uq.toy_iterative.damping must be <= 1.0, got 2.0"):
        load_config("demo", ["uq.toy_iterative.damping=2"])
    with pytest.raises(ConfigError, match="unknown config key 'uq.toy_iterative.seed'"):
        load_config("demo", ["uq.toy_iterative.seed=2"])
    assert ToyUndeclared.option_names() == {"jitter", "mode"}


def test_a_section_goes_with_its_solver(toy_solvers):
    SOLVERS.unregister("toy_iterative")
    with pytest.raises(ConfigError, match="unknown config key 'uq.toy_iterative'"):
        load_config("demo", ["uq.toy_iterative.sweeps=7"])
    names = UQConfig().solver_sections.names()
    assert "toy_iterative" not in names and "toy_undeclared" in names


def _uq_sections(d: dict) -> set[str]:
    return set(d["uq"]) & {*SOLVERS, *PRIORS}


def test_a_run_config_holds_the_sections_of_what_ran(toy_solvers):
    prior = {UQConfig().prior} & set(UQConfig().prior_sections.names())  # the default prior's, if it has options
    cfg = load_config("demo")
    assert _uq_sections(cfg.to_dict()) == prior  # solver auto: no solver section until resolved
    # what auto resolved to, as metrics.json holds it: that solver's section, uq.solver still auto
    resolved = cfg.to_dict(resolved={"uq.solver": "cg"})
    assert _uq_sections(resolved) == {"cg", *prior} and resolved["uq"]["solver"] == "auto"
    assert resolved["uq"]["cg"] == to_dict(UQConfig().cg)
    cases = {
        ("uq.solver=cg",): {"cg", *prior},
        ("uq.solver=toy_iterative", "uq.prior=tv_predcp"): {"toy_iterative", "tv_predcp"},
        ("uq.solver=exact",): prior,  # exact_primal or exact_dual: resolved by the run
        # a section set away from its defaults is kept (nothing configured is lost), the same value is not
        ("uq.solver=cg", "uq.sdd.max_iter=5", "uq.sgd.max_iter=1000"): {"cg", "sdd", *prior},
    }
    for overrides, sections in cases.items():
        cfg = load_config("demo", list(overrides))
        d = cfg.to_dict()
        assert _uq_sections(d) == sections, overrides
        assert Config.from_dict(d) == cfg, overrides  # reads back as the same config
    assert load_config("demo", ["uq.solver=cg", "uq.sdd.max_iter=5"]).to_dict()["uq"]["sdd"]["max_iter"] == 5


def test_a_folder_written_while_a_plugin_was_registered_reads_without_it(toy_solvers, tmp_path):
    plain, used = tmp_path / "plain.yaml", tmp_path / "used.yaml"
    plain.write_text(yaml.safe_dump(load_config("demo").to_dict(), sort_keys=False))
    used.write_text(yaml.safe_dump(load_config("demo", ["uq.toy_undeclared.jitter=0.5"]).to_dict(), sort_keys=False))
    SOLVERS.unregister("toy_undeclared")
    assert load_config(plain) == load_config("demo")
    # a run that configured the plugin needs it: one line naming the section and why
    with pytest.raises(ConfigError) as e:
        load_config(used)
    msg = str(e.value)
    assert f"config file {used}: unknown config key 'uq.toy_undeclared' (no registered weight prior or solver " in msg
    assert "named 'toy_undeclared' has options: register it before reading this)" in msg and "\n" not in msg


def test_a_solver_name_that_is_already_a_key_is_refused():
    class Samples(ToyUndeclared):
        name = "samples"

    SOLVERS.register(Samples)
    try:
        with pytest.raises(ConfigError, match="the solver 'samples' would have the config section 'samples', which"):
            load_config("demo", ["uq.cg.rank=3"])
    finally:
        SOLVERS.unregister("samples")


def test_options_that_disagree_with_init_are_refused_where_the_class_is_defined():
    with pytest.raises(TypeError, match=r"option 'sweeps' defaults to 4 in __init__ but to 3 in Options"):

        class _Bad(ToyIterative):
            Options = ToyIterative.Options

            def __init__(self, features, *, sweeps: int = 4, damping: float = 0.5, seed: int = 0):
                super().__init__(features)

    with pytest.raises(TypeError, match=r"declares \['damping', 'seed', 'sweeps'\] but _Missing.__init__ takes"):

        class _Missing(ToyIterative):
            Options = ToyIterative.Options

            def __init__(self, features, *, sweeps: int = 3):
                super().__init__(features)


# A registry and classes of the test's own: the derivation is generic (a registry + the attribute that holds the
# options); here a toy weight prior with options and one without.
TOY_PRIORS = Registry("toy prior")


@TOY_PRIORS.register
class BlockToy:
    name = "block_toy"

    @dataclasses.dataclass
    class Options:
        blocks: int = option(4, ge=1, help="blocks per layer")
        spread: list[float] = option(factory=lambda: [1.0, 2.0], gt=0.0, help="block variances")


@TOY_PRIORS.register
class PlainToy:
    name = "plain_toy"  # no Options: no section


@dataclasses.dataclass
class PriorSettings:
    prior: str = option("block_toy", choices=TOY_PRIORS.choices, help="which toy prior")
    sections: DerivedSections = derived(Derivation(TOY_PRIORS, "Options"))


@dataclasses.dataclass
class ToyRoot:
    toy: PriorSettings = option(factory=PriorSettings)


def test_sections_derive_from_any_registry():
    cfg = ToyRoot()
    apply_dict(cfg, {"toy": {"prior": "plain_toy", "block_toy": {"blocks": 2, "spread": [0.5]}}}, "test")
    assert cfg.toy.prior == "plain_toy" and to_dict(cfg) == {
        "toy": {"prior": "plain_toy", "block_toy": {"blocks": 2, "spread": [0.5]}}
    }
    # a class without options has no section; a class with them is used as declared
    assert section_class(BlockToy, Derivation(TOY_PRIORS)) is BlockToy.Options
    assert section_class(PlainToy, Derivation(TOY_PRIORS)) is None
    with pytest.raises(ConfigError) as e:
        apply_dict(cfg, {"toy": {"plain_toy": {}}}, "test")
    assert str(e.value) == (
        "test: unknown config key 'toy.plain_toy' (no registered toy prior named 'plain_toy' has options: register "
        "it before reading this); valid keys of section 'toy': prior, block_toy"
    )
    with pytest.raises(ConfigError, match=r"test: toy.block_toy.spread must be > 0.0, got \[-1.0\]"):
        apply_dict(cfg, {"toy": {"block_toy": {"spread": [-1.0]}}}, "test")
    with pytest.raises(ConfigError, match="toy.prior must be one of \\['block_toy', 'plain_toy'\\]"):
        apply_dict(cfg, {"toy": {"prior": "other"}}, "test")


def test_an_option_without_default_cannot_be_configured():
    reg = Registry("toy prior")

    @reg.register
    class NoDefault:
        name = "no_default"

        @dataclasses.dataclass
        class Options:
            size: int

    with pytest.raises(ConfigError, match="the toy prior 'no_default': option 'size' of .*Options has no default"):
        DerivedSections((Derivation(reg),)).names()


# ------------------------------------------------------------------------------------------------ the leaf
def test_importing_the_config_imports_no_torch_and_no_front_end():
    code = (
        "import sys, ctuq.config\n"
        "print(','.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('ctuq.design', "
        "'ctuq.classify', 'ctuq.pipeline', 'ctuq.studies', 'ctuq.inference', 'ctuq.operators', 'ctuq.models', "
        "'ctuq.data')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
