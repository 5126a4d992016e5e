"""``uq.prior = tv_predcp`` and its ``uq.tv_predcp`` section: accepted values, the mapping onto the posterior's
arguments (the default g-prior's through its own section, ``uq.gprior``), and one-line errors for bad values."""

import pytest

from ctuq.config import ConfigError, UQConfig, check_section, load_config
from ctuq.pipeline.uq_settings import posterior_arguments
from ctuq.registry import PRIORS


def test_tv_predcp_is_a_prior_and_its_section_maps_to_prior_options():
    cfg = load_config("demo", ["uq.prior=tv_predcp", "uq.tv_predcp.steps=7", "uq.tv_predcp.scale=0.5"])
    assert cfg.uq.prior == "tv_predcp" and cfg.uq.tv_predcp.steps == 7 and cfg.uq.tv_predcp.scale == 0.5
    args = posterior_arguments(cfg.uq)
    assert args["prior"] == "tv_predcp"
    assert args["prior_options"]["steps"] == 7 and "rate" not in args["prior_options"]  # the front end sets the rate
    assert (args["prior_options"]["optimizer"], args["prior_options"]["tol"]) == ("lbfgs", 1e-2)
    cfg = load_config("demo", ["uq.prior=tv_predcp", "uq.tv_predcp.optimizer=adam", "uq.tv_predcp.max_step=0.5"])
    opts = posterior_arguments(cfg.uq)["prior_options"]
    assert (opts["optimizer"], opts["max_step"]) == ("adam", 0.5)
    cfg = load_config("demo", ["uq.tv_predcp={steps: 3, lr: 0.1}"])
    assert (cfg.uq.tv_predcp.steps, cfg.uq.tv_predcp.lr) == (3, 0.1)


def test_the_default_prior_gets_its_section_as_prior_options():
    args = posterior_arguments(load_config("demo").uq)
    assert args["prior"] == "gprior" and args["prior_options"] == {"method": "exact", "probes": 256}
    args = posterior_arguments(load_config("demo", ["uq.gprior.method=stochastic", "uq.gprior.probes=32"]).uq)
    assert args["prior_options"] == {"method": "stochastic", "probes": 32}
    # a prior without options gets none, and the old flat keys are gone
    assert "prior_options" not in posterior_arguments(load_config("demo", ["uq.prior=isotropic"]).uq)
    for old in ("uq.gprior_method=stochastic", "uq.gprior_probes=8", "design.gprior_method=exact"):
        with pytest.raises(ConfigError, match="unknown config key"):
            load_config("demo", [old])


@pytest.mark.parametrize(
    "override, match",
    [
        ("uq.prior=matern", "uq.prior must be one of"),
        ("uq.tv_predcp.scale=0", "uq.tv_predcp.scale must be > 0"),
        ("uq.tv_predcp.scale=-1", "uq.tv_predcp.scale must be > 0"),
        ("uq.tv_predcp.lengthscale=0", "uq.tv_predcp.lengthscale must be > 0"),
        ("uq.tv_predcp.variance=-2", "uq.tv_predcp.variance must be > 0"),
        ("uq.tv_predcp.steps=-1", "uq.tv_predcp.steps must be >= 0"),
        ("uq.tv_predcp.probes=0", "uq.tv_predcp.probes must be >= 1"),
        ("uq.tv_predcp.optimizer=newton", "uq.tv_predcp.optimizer must be one of"),
        ("uq.tv_predcp.tol=0", "uq.tv_predcp.tol must be > 0"),
        ("uq.tv_predcp.max_step=-1", "uq.tv_predcp.max_step must be > 0"),
        ("uq.tv_predcp.rate=2", "unknown config key 'uq.tv_predcp.rate'"),
        ("uq.tv_predcp=3", "is a section"),
        ("uq.gprior.method=guess", "uq.gprior.method must be one of"),
        ("uq.gprior.probes=0", "uq.gprior.probes must be >= 1"),
        ("design.gprior.probes=0", "design.gprior.probes must be >= 1"),
        ("design.weight_prior=tv_predcp", "design.weight_prior must be one of"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match) as info:
        load_config("demo", [override])
    assert "\n" not in str(info.value)


def test_a_section_built_in_code_is_checked_too():
    with pytest.raises(ConfigError, match="scale must be > 0"):
        check_section(UQConfig(prior="tv_predcp", tv_predcp=PRIORS["tv_predcp"].Options(scale=0.0)), "uq")
