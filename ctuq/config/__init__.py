"""Run configuration: nested dataclasses, YAML files, ``--set key.sub=value`` overrides, validation.

Layers, later ones win: dataclass defaults → YAML file → ``--set`` overrides → dedicated CLI flags
(``--data``, ``--device``, ``--seed``). Every layer is validated as it is applied, so an error names its
source (file or ``--set``), the full key, and — for unknown keys — the valid keys of that section.

Bundled configs live in ``ctuq/configs/*.yaml`` (package data, so ``pip install .`` ships them); the
top-level ``configs/`` folder holds symlinks to the same files for browsing. ``--config NAME`` accepts a
path or the name of a bundled config (``demo``, ``walnut_2d_60``, ...).

Two modules: :mod:`.schema` (every section and key: :class:`Config`, :class:`UQConfig`, ...; :func:`load_config`)
and :mod:`.engine` (files, ``--set`` parsing, coercion, bounds, messages, sections derived from registered classes'
options and which of them a run's config.yaml holds). The package is a leaf: it imports :mod:`ctuq.errors`,
:mod:`ctuq.options` and :mod:`ctuq.registry` only (registries load their implementations when a value is checked).
The mapping from these keys to the inference core's arguments is the CT front end's
(:func:`ctuq.pipeline.uq_settings.posterior_arguments`).
"""

from ctuq.config.engine import (
    ConfigError,
    apply_dict,
    bundled_configs,
    check_section,
    describe,
    parse_override,
    resolve_config_path,
    set_value,
)
from ctuq.config.schema import (
    Config,
    DataConfig,
    DesignConfig,
    DIPConfig,
    FBPConfig,
    ModelConfig,
    OutputConfig,
    TVConfig,
    UQConfig,
    load_config,
)
from ctuq.options import option

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
    "describe",
    "bundled_configs",
    "resolve_config_path",
    "parse_override",
    "check_section",
    "apply_dict",
    "set_value",
]
