"""The override engine of the run configuration: sections, YAML files, ``--set key.sub=value``, validation.

The engine knows no key: it works on *sections*, dataclasses whose fields are made with :func:`ctuq.options.option`
(default, help, choices, bounds). A field whose type is a dataclass is a nested section. Layers are applied in order,
later ones winning (dataclass defaults → YAML file → ``--set`` overrides → dedicated CLI flags), and every layer is
checked as it is applied, so an error names its source (file or ``--set``), the full key and, for unknown keys, the
valid keys of that section.

A section may declare **derived sections** besides its fields (:func:`derived`): a field whose value holds one
section per registered class of a :class:`ctuq.registry.Registry` that carries a dataclass of options
(``Options``). Their keys sit directly in the declaring section: ``uq.cg.rank`` is ``CGSolver.Options.rank`` with
its default, bounds and help. They are read from the registry when first needed (the registry imports its provider
then, not when the config is imported), so a class registered later, e.g. in a test, has its section too. Keys
listed in a class attribute named by the :class:`Derivation` (``runtime_options`` for solvers: what the caller
supplies at run time) are left out.

:func:`to_dict` (a run folder's ``config.yaml``, the config in ``metrics.json``) writes only the derived sections of
what runs: the one that the key named by :attr:`Derivation.chosen_by` names (``uq.solver: cg`` writes ``uq.cg``;
``auto`` names none until the run resolves it), and any other set to values other than its defaults (nothing set is
lost). So a folder written while a plugin was registered reads without it unless the run used or configured it; a
file with the section of a class that is not registered is refused with one line naming the section.

Cross-field checks go in a section's ``validate(self)`` method, called after every layer, raising
:class:`ConfigError`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import operator
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Union

import yaml

from ctuq.errors import CTUQError
from ctuq.registry import Registry

__all__ = [
    "ConfigError",
    "Derivation",
    "DerivedSections",
    "derived",
    "accepts_derived_keys",
    "section_class",
    "set_value",
    "apply_dict",
    "check_section",
    "validate_all",
    "to_dict",
    "get_value",
    "keys_of",
    "parse_override",
    "bundled_configs",
    "resolve_config_path",
    "load",
    "apply_overrides",
]


class ConfigError(CTUQError):
    """A configuration file, override or value is invalid; the message names the key and source.

    A :class:`ctuq.errors.CTUQError` (hence a ``ValueError``): the ``ctuq`` commands print it as one line."""


# ----------------------------------------------------------------------------------------------- derived sections
@dataclasses.dataclass(frozen=True, eq=False)
class Derivation:
    """One source of derived sections: every entry of ``registry`` whose class attribute ``attr`` is a dataclass of
    options gets a section under its registry name, without the option names listed in the entry's class attribute
    ``exclude`` (when given; e.g. ``runtime_options``). An entry without ``attr`` has no section. ``chosen_by``: the
    key of the declaring section whose value names the entry that runs (``"solver"`` for ``uq.solver``): its section
    is the one :func:`to_dict` always writes (module docstring)."""

    registry: Registry
    attr: str = "Options"
    exclude: str | None = None
    chosen_by: str | None = None


_SUPPORTED = (int, float, bool, str)
_SECTION_CLASSES: dict[tuple[type, str, str | None], type | None] = {}


def _supported(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return all(a is type(None) or _supported(a) for a in typing.get_args(tp))
    if origin is list:
        return _supported(typing.get_args(tp)[0])
    return tp in _SUPPORTED or tp is Any


def section_class(entry: type, derivation: Derivation, name: str = "") -> type | None:
    """The section class of the registry entry ``entry`` under ``derivation`` (cached), or ``None`` when it has no
    options to configure.

    That is ``entry.<attr>`` itself when every field is configurable as declared; otherwise a dataclass of the same
    fields (defaults, metadata, ``validate``) without the excluded names, types the engine cannot read from YAML taking
    any value. :class:`ConfigError` when an option has no default (a configurable option needs one)."""
    key = (entry, derivation.attr, derivation.exclude)
    if key in _SECTION_CLASSES:
        return _SECTION_CLASSES[key]
    options = getattr(entry, derivation.attr, None)
    if options is None or not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        _SECTION_CLASSES[key] = None
        return None
    excluded = frozenset(getattr(entry, derivation.exclude, ()) if derivation.exclude else ())
    hints = typing.get_type_hints(options)
    fields, as_declared = [], True
    for f in dataclasses.fields(options):
        if not f.init or f.name in excluded:
            as_declared = False
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(
                f"the {derivation.registry.kind} {name or entry.__name__!r}: option {f.name!r} of "
                f"{options.__qualname__} has no default (a configurable option needs one)"
            )
        tp = hints.get(f.name, Any)
        if not _supported(tp):
            tp, as_declared = Any, False
        kw: dict[str, Any] = {"metadata": f.metadata}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        else:
            kw["default_factory"] = f.default_factory
        fields.append((f.name, tp, dataclasses.field(**kw)))
    if not fields:
        cls = None
    elif as_declared:
        cls = options
    else:
        namespace = {"__doc__": options.__doc__}
        if callable(getattr(options, "validate", None)):
            namespace["validate"] = options.validate
        cls = dataclasses.make_dataclass(options.__name__, fields, namespace=namespace)
        cls.__module__, cls.__qualname__ = options.__module__, options.__qualname__
    _SECTION_CLASSES[key] = cls
    return cls


class DerivedSections:
    """The sections derived from registered classes' options (:class:`Derivation`), as one field's value.

    Holds the sections that were read or set; the others are their classes' defaults, built when first asked for.
    Equality compares every section (defaults included); copies are deep (a section's values are its own)."""

    def __init__(self, sources: tuple[Derivation, ...], values: Mapping[str, Any] | None = None):
        self.sources = tuple(sources)
        self._values: dict[str, Any] = dict(values or {})

    def classes(self) -> dict[str, tuple[type, Derivation]]:
        """Section name → (section class, its derivation), every registered entry with options, in registry order
        (this reads the registries: their providers are imported on the first call)."""
        out: dict[str, tuple[type, Derivation]] = {}
        for src in self.sources:
            for name, entry in src.registry.items():
                cls = section_class(entry, src, name)
                if cls is None:
                    continue
                if name in out:
                    raise ConfigError(
                        f"the {out[name][1].registry.kind} {name!r} and the {src.registry.kind} {name!r} would both "
                        f"have the config section {name!r}; one of them needs another name"
                    )
                out[name] = (cls, src)
        return out

    def names(self) -> tuple[str, ...]:
        """The names of every derived section now."""
        return tuple(self.classes())

    def get(self, name: str, classes: dict | None = None) -> Any:
        """The section ``name`` (its defaults when not set yet); ``KeyError`` when no registered class has it."""
        cls = (classes if classes is not None else self.classes())[name][0]
        section = self._values.get(name)
        if not isinstance(section, cls):
            section = self._values[name] = cls()
        return section

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(name, section)`` for every derived section now (defaults for those not set)."""
        classes = self.classes()
        for name in classes:
            yield name, self.get(name, classes)

    def created(self) -> Iterator[tuple[str, Any]]:
        """``(name, section)`` for the sections read or set so far (no registry is read)."""
        return iter(list(self._values.items()))

    def written(self, owner: Any, resolved: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
        """``(name, section)`` for the sections :func:`to_dict` writes, in registry order: the one named by the value
        of each source's ``chosen_by`` key of ``owner`` (the section holding this field; ``resolved[prefix + key]``
        instead where given: what the run resolved ``auto`` to), and every other section set to values other than
        its defaults."""
        classes = self.classes()
        for name, (cls, src) in classes.items():
            key = src.chosen_by
            chosen = None if key is None else resolved.get(f"{prefix}{key}", getattr(owner, key))
            if name == chosen:
                yield name, self.get(name, classes)
                continue
            section = self._values.get(name)
            if isinstance(section, cls) and to_dict(section) != to_dict(cls()):
                yield name, section

    def copy(self) -> DerivedSections:
        """An independent copy (the sources shared, the sections deep-copied)."""
        return DerivedSections(self.sources, copy.deepcopy(self._values))

    def __copy__(self) -> DerivedSections:
        return self.copy()

    def __deepcopy__(self, memo) -> DerivedSections:
        return self.copy()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DerivedSections):
            return NotImplemented
        return {n: to_dict(s) for n, s in self.items()} == {n: to_dict(s) for n, s in other.items()}

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclasses holding it

    def __repr__(self) -> str:
        return f"DerivedSections({', '.join(f'{n}={s!r}' for n, s in self._values.items())})"


def derived(*sources: Derivation, help: str = "") -> Any:
    """A field holding the sections derived from ``sources`` (:class:`DerivedSections`); their keys sit directly in
    the section that declares the field (module docstring)."""
    return dataclasses.field(default_factory=lambda: DerivedSections(sources), metadata={"derived": True, "help": help})


def _is_derived(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("derived"))


def _containers(obj: Any) -> list[DerivedSections]:
    return [getattr(obj, f.name) for f in dataclasses.fields(obj) if _is_derived(f)]


def _derived_classes(obj: Any) -> dict[str, tuple[DerivedSections, dict]]:
    """Derived section name → (its container, that container's classes), checking the names against ``obj``'s own
    keys."""
    own = {f.name for f in dataclasses.fields(obj) if not _is_derived(f)}
    out: dict[str, tuple[DerivedSections, dict]] = {}
    for box in _containers(obj):
        classes = box.classes()
        for name, (_, src) in classes.items():
            if name in own or name in out:
                raise ConfigError(
                    f"the {src.registry.kind} {name!r} would have the config section {name!r}, which is already a "
                    f"key of {type(obj).__name__}; it needs another name"
                )
            out[name] = (box, classes)
    return out


def keys_of(obj: Any) -> list[str]:
    """The keys of the section ``obj`` in order: its fields, with each derived field replaced by its sections'
    names."""
    out: list[str] = []
    for f in dataclasses.fields(obj):
        if _is_derived(f):
            out.extend(getattr(obj, f.name).names())
        else:
            out.append(f.name)
    return out


# ----------------------------------------------------------------------------------------------- types and bounds
def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(obj) -> dict:
    return typing.get_type_hints(type(obj) if not isinstance(obj, type) else obj)


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


_BOUNDS = (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="), ("lt", operator.lt, "<"))


def _check_bounds(value: Any, meta: Mapping, key: str, source: str) -> None:
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
        for bound, op, text in _BOUNDS:
            b = meta.get(bound)
            if b is not None and not op(v, b):
                raise ConfigError(f"{source}: {key} must be {text} {b}, got {value!r}")


# ----------------------------------------------------------------------------------------------- setting values
def set_value(obj: Any, path: list[str], value: Any, source: str, prefix: str = "") -> None:
    """Assign ``value`` at ``path`` inside the section ``obj``, checking key, type and bounds.

    A whole section may be assigned a mapping (merged key by key); ``path`` may name a derived section. An unknown
    key is refused naming the valid keys of its section (and, for a mapping under a section with derived sections,
    that no registered class has that section).
    """
    name = path[0]
    full = f"{prefix}{name}"
    fields = {f.name: f for f in dataclasses.fields(obj) if not _is_derived(f)}
    if name in fields:
        tp = _hints(obj)[name]
        if _is_section(tp):
            _set_in_section(getattr(obj, name), path, value, source, full)
            return
        if len(path) > 1:
            raise ConfigError(f"{source}: '{full}' is a value, not a section, so '{full}.{path[1]}' does not exist")
        try:
            coerced = _coerce(value, tp)
        except _CoerceError:
            raise ConfigError(
                f"{source}: {full} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})"
            ) from None
        _check_bounds(coerced, fields[name].metadata, full, source)
        setattr(obj, name, coerced)
        return
    derived_names = _derived_classes(obj)
    if name in derived_names:
        box, classes = derived_names[name]
        _set_in_section(box.get(name, classes), path, value, source, full)
        return
    where = f"section '{prefix[:-1]}'" if prefix else "the top level"
    unregistered = ""
    containers = _containers(obj)
    if containers and (len(path) > 1 or isinstance(value, dict)):
        # a section: of a plugin that is not registered in this process, or a typo
        kinds = " or ".join(dict.fromkeys(src.registry.kind for box in containers for src in box.sources))
        unregistered = f" (no registered {kinds} named {name!r} has options: register it before reading this)"
    raise ConfigError(
        f"{source}: unknown config key '{full}'{unregistered}; valid keys of {where}: {', '.join(keys_of(obj))}"
    )


def _set_in_section(section: Any, path: list[str], value: Any, source: str, full: str) -> None:
    if len(path) > 1:
        set_value(section, path[1:], value, source, f"{full}.")
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = to_dict(value)  # a section built in code (e.g. the options dataclass it derives from), key by key
    if not isinstance(value, dict):
        raise ConfigError(
            f"{source}: '{full}' is a section and needs a mapping of keys "
            f"({', '.join(keys_of(section))}), got {type(value).__name__}"
        )
    apply_dict(section, value, source, f"{full}.")


def apply_dict(obj: Any, d: dict, source: str, prefix: str = "") -> None:
    """Merge the nested mapping ``d`` into ``obj`` (a :class:`Config` or a section), validating everything."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a mapping of config keys, got {type(d).__name__}")
    for key, value in d.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: config keys must be strings, got {key!r}")
        set_value(obj, [key], value, source, prefix)
    if not prefix:
        validate_all(obj, source)


def check_section(section: Any, name: str, source: str = "settings") -> None:
    """Check a section built in code (e.g. ``UQConfig(solver="cg")``): every field's choices and bounds, those of
    its nested sections and of the derived sections it holds, then every ``validate()``. :func:`load` checks files
    and ``--set`` as it applies them; this is for the rest.

    Raises :class:`ConfigError` naming ``name.key`` (e.g. ``uq.solver must be one of [...]``).
    """
    _check_all_bounds(section, name, source)
    validate_all(section, source)


def _check_all_bounds(obj: Any, name: str, source: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_derived(f):
            for sub, section in value.created():
                _check_all_bounds(section, f"{name}.{sub}", source)
        elif dataclasses.is_dataclass(value):
            _check_all_bounds(value, f"{name}.{f.name}", source)
        else:
            _check_bounds(value, f.metadata, f"{name}.{f.name}", source)


def validate_all(obj: Any, source: str) -> None:
    """Every ``validate()`` of ``obj``, its nested sections and the derived sections set so far (a section nobody
    set holds its class's defaults); a :class:`ConfigError` gets ``source`` in front."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_derived(f):
            for _, section in value.created():
                validate_all(section, source)
        elif dataclasses.is_dataclass(value):
            validate_all(value, source)
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None


# ----------------------------------------------------------------------------------------------- reading values
def to_dict(obj: Any, resolved: Mapping[str, Any] | None = None, prefix: str = "") -> dict:
    """The section ``obj`` as a plain nested dict (JSON/YAML serialisable; strings as plain ``str``).

    Derived sections appear under their names where they are written (:meth:`DerivedSections.written`): the chosen
    entry's, and any set to values other than its defaults. ``resolved`` maps a choosing key (dotted, from ``obj``:
    ``{"uq.solver": "cg"}``) to the entry a run resolved it to, whose section is written instead of the one its value
    names (``auto`` names none); ``prefix`` is ``obj``'s own dotted key (with the dot) inside the root of
    ``resolved``'s keys.
    """
    resolved = resolved or {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_derived(f):
            for name, section in value.written(obj, resolved, prefix):
                out[name] = to_dict(section)
        elif dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value, resolved, f"{prefix}{f.name}.")
        else:
            out[f.name] = _plain(value)
    return out


def describe(obj: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """Every key of the section ``obj`` as ``(dotted key, value, help)``, in :func:`to_dict`'s order (derived sections
    under their names): what ``ctuq reconstruct --config-keys`` prints."""
    out: list[tuple[str, Any, str]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if _is_derived(f):
            for name, section in value.items():
                out.extend(describe(section, f"{prefix}{name}."))
        elif dataclasses.is_dataclass(value):
            out.extend(describe(value, f"{prefix}{f.name}."))
        else:
            text = f.metadata.get("help", "")
            out.append((f"{prefix}{f.name}", _plain(value), text() if callable(text) else text))
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return str(value)  # a vocabulary member (str enum): its value, which YAML can write
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)


def get_value(obj: Any, key: str) -> Any:
    """The value at the dotted ``key`` inside ``obj`` (derived sections resolved: ``get_value(cfg, "uq.cg.rank")``)."""
    for part in key.split("."):
        obj = _attribute(obj, part)
    return obj


def _attribute(obj: Any, name: str) -> Any:
    if name in {f.name for f in dataclasses.fields(obj) if not _is_derived(f)}:
        return getattr(obj, name)
    derived_names = _derived_classes(obj)
    if name in derived_names:
        box, classes = derived_names[name]
        return box.get(name, classes)
    raise AttributeError(f"{type(obj).__name__} has no config key {name!r}; keys: {', '.join(keys_of(obj))}")


def accepts_derived_keys(prefix: str):
    """Class decorator (over ``@dataclass``) for a section with derived sections: attribute access (``uq.cg``) and
    constructor keywords (``UQConfig(cg={"rtol": 1e-5})``, checked like a file's keys; ``prefix`` is the section's
    key for the messages, e.g. ``"uq"``); assigning an attribute that is no key is refused. The derived sections of a
    new instance are its own copies, so that :func:`dataclasses.replace` gives an independent section."""

    def wrap(cls: type) -> type:
        init = cls.__init__
        params = {f.name for f in dataclasses.fields(cls) if f.init}
        derived_fields = [f.name for f in dataclasses.fields(cls) if _is_derived(f)]
        plain = {f.name for f in dataclasses.fields(cls)}

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in params}
            init(self, *args, **kwargs)
            for name in derived_fields:
                object.__setattr__(self, name, getattr(self, name).copy())
            if extra:
                apply_dict(self, extra, f"{cls.__name__}(...)", f"{prefix}.")

        def __getattr__(self, name: str):
            # only called when normal lookup fails: derived sections
            if name.startswith("_") or not all(n in self.__dict__ for n in derived_fields):
                raise AttributeError(name)
            return _attribute(self, name)

        def __setattr__(self, name: str, value: Any) -> None:
            if name in plain or name.startswith("_"):
                object.__setattr__(self, name, value)
            else:
                raise AttributeError(
                    f"{cls.__name__} has no config key {name!r} to assign; keys: {', '.join(keys_of(self))}"
                )

        cls.__init__ = __init__
        cls.__getattr__ = __getattr__
        cls.__setattr__ = __setattr__
        return cls

    return wrap


# ----------------------------------------------------------------------------------------------- files and --set
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


def load(root: type, path: str | Path | None, overrides: list[str] | None, flags: Mapping[str, Any]) -> Any:
    """A new ``root()`` section updated by the YAML file ``path`` (or bundled config name; ``None``: ``demo``), then
    the ``--set`` strings ``overrides`` in order, then the dotted ``flags`` that are not ``None``; cross-field checks
    after each layer (the file's, then once after all overrides and flags: a pair of keys may change one at a time).
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
    cfg = root()
    if raw is not None:
        apply_dict(cfg, raw, f"config file {cfg_path}")
    apply_overrides(cfg, f"config file {cfg_path}", overrides or (), flags=flags)
    return cfg


def apply_overrides(
    cfg: Any,
    where: str,
    overrides: Sequence[str] = (),
    *,
    values: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
    check: bool = False,
) -> None:
    """Update ``cfg`` in place by the ``--set`` strings ``overrides`` (``KEY=VALUE``, in order), then the dotted
    keys of ``values`` (every value, ``None`` included: YAML's null), then the dotted ``flags`` that are not
    ``None``; then the cross-field checks once, named ``where`` with the overrides applied (also without any
    override when ``check``: a config whose attributes may have been assigned unchecked). Each error names the
    override at fault: ``--set KEY=VALUE``, ``set KEY=VALUE`` for ``values``, the command-line option for ``flags``.
    """
    applied = []
    for item in overrides:
        keys, value = parse_override(item)
        set_value(cfg, keys, value, f"--set {item}")
        applied.append(f"--set {item}")
    for key, value in (values or {}).items():
        set_value(cfg, key.split("."), value, f"set {key}={value!r}")
        applied.append(f"{key}={value!r}")
    for key, value in (flags or {}).items():
        if value is None:
            continue
        set_value(cfg, key.split("."), value, f"command-line option for {key}")
        applied.append(f"{key}={value!r}")
    if applied or check:
        validate_all(cfg, f"{where} with overrides {', '.join(applied)}" if applied else where)
