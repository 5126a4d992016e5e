import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from ctuq.config import (
    Config,
    ConfigError,
    DIPConfig,
    apply_dict,
    bundled_configs,
    load_config,
    option,
    parse_override,
    resolve_config_path,
)

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
    assert cfg.model.pretrained is None and cfg.model.input == "noise"


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


# ------------------------------------------------------------------------------------------------ uq → the core
def test_posterior_arguments_give_each_solver_exactly_its_keys():
    from ctuq.config import UQConfig, posterior_arguments
    from ctuq.inference import SOLVERS, Workload, solver_kwargs

    uq = UQConfig(
        prior="isotropic",
        gprior_method="stochastic",
        gprior_probes=9,
        solver="cg",
        preconditioner="halko",
        rank=12,
        oversampling=3,
        cg_tol=1e-5,
        cg_max_iter=77,
        adaptive_rank=False,
        sdd_step=0.7,
        sdd_momentum=0.9,
        sdd_batch=5,
        sdd_iterations=33,
        sgd_lr=0.5,
        sgd_momentum=0.8,
        sgd_lr_decay="linear",
        sgd_clip=2.0,
        sgd_iterations=44,
        first_order_tol=1e-3,
        prior_precision=3.0,
        em_steps=2,
        em_samples=3,
        samples=10,
        sample_chunk=5,
    )
    args = posterior_arguments(uq)
    assert set(args) == {"prior", "gprior_method", "gprior_probes", "a", "solver", "solver_options", "workload"}
    assert (args["prior"], args["gprior_method"], args["gprior_probes"], args["a"], args["solver"]) == (
        "isotropic",
        "stochastic",
        9,
        3.0,
        "cg",
    )
    assert args["workload"] == Workload(
        em_steps=2,
        em_samples=3,
        prediction_samples=10,
        rank=12,
        oversampling=3,
        sdd_iterations=33.0,
        sgd_iterations=44.0,
        chunk=5,
    )
    opts = args["solver_options"]
    assert solver_kwargs(opts, "cg") == {
        "preconditioner": "halko",
        "rank": 12,
        "oversampling": 3,
        "rtol": 1e-5,
        "max_iter": 77,
        "adaptive_rank": False,
        "rank_threshold": 1.0,
    }
    assert solver_kwargs(opts, "sdd") == {
        "step_size": 0.7,
        "momentum": 0.9,
        "batch_size": 5,
        "max_iter": 33,
        "rtol": 1e-3,
    }
    assert solver_kwargs(opts, "sgd") == {
        "lr": 0.5,
        "momentum": 0.8,
        "lr_decay": "linear",
        "clip": 2.0,
        "max_iter": 44,
        "rtol": 1e-3,
    }
    assert solver_kwargs(opts, "exact_primal") == solver_kwargs(opts, "exact_dual") == {}
    for name in ("cg", "sdd", "sgd"):
        assert set(solver_kwargs(opts, name)) <= SOLVERS[name].option_names()


def test_uq_defaults_are_the_solvers_defaults():
    import inspect

    from ctuq.config import UQConfig
    from ctuq.inference import CGSolver, SDDSolver, SGDSolver

    uq = UQConfig()

    def default(cls, name):
        return inspect.signature(cls.__init__).parameters[name].default

    assert (uq.sdd_step, uq.sdd_momentum, uq.sdd_batch, uq.sdd_iterations) == tuple(
        default(SDDSolver, n) for n in ("step_size", "momentum", "batch_size", "max_iter")
    )
    assert (uq.sgd_lr, uq.sgd_momentum, uq.sgd_lr_decay, uq.sgd_clip, uq.sgd_iterations) == tuple(
        default(SGDSolver, n) for n in ("lr", "momentum", "lr_decay", "clip", "max_iter")
    )
    assert uq.first_order_tol == default(SDDSolver, "rtol") == default(SGDSolver, "rtol")
    assert (
        uq.preconditioner,
        uq.rank,
        uq.oversampling,
        uq.cg_tol,
        uq.cg_max_iter,
        uq.adaptive_rank,
        uq.rank_threshold,
    ) == tuple(
        default(CGSolver, n)
        for n in ("preconditioner", "rank", "oversampling", "rtol", "max_iter", "adaptive_rank", "rank_threshold")
    )


def test_the_config_imports_no_front_end():
    import subprocess
    import sys

    code = (
        "import sys, ctuq.config\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith(('ctuq.design', 'ctuq.classify', "
        "'ctuq.pipeline', 'ctuq.studies', 'ctuq.uq')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
