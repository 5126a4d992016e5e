"""The registries of ctuq's extensible abstractions: one place that knows every kind, a name → implementation
mapping per kind, filled by the implementations themselves.

Each kind (solvers, weight priors, likelihoods, calibration methods, scan formats, ray-transform backends) is a
:class:`Registry`. An implementation module registers its class with the registry's decorator::

    from ctuq.registry import CALIBRATIONS

    @CALIBRATIONS.register
    class MyCalibration(CalibrationMethod):
        name = "mine"

and from then on ``"mine"`` is a value of every option that offers a calibration method (``uq.calibration``,
``--set uq.calibration=mine``, ``--help``, error messages): those read the registry when they need it.

The registries live in this leaf module so that code low in the layering (the config schema, the command line)
can list and check names without importing the packages that implement them. Each registry names its *provider*,
the package whose import registers the built-in implementations; the first lookup imports it
(:func:`importlib.import_module`, once). A class defined anywhere else (a test, a user's script) registers itself
the same way, with one line.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = [
    "lazy_module",
    "LazyModule",
    "Registry",
    "RegistryError",
    "SOLVERS",
    "PRIORS",
    "LIKELIHOODS",
    "CALIBRATIONS",
    "DATA_FORMATS",
    "RAY_TRANSFORMS",
]

T = TypeVar("T")


class LazyModule:
    """A module imported on first attribute access (:func:`lazy_module`)."""

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy/pickle/introspection probes must not trigger the import
            raise AttributeError(attr)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


def lazy_module(name: str) -> LazyModule:
    """The module ``name`` (dotted), imported when an attribute of it is first read: for the command line, whose
    parsers (``--help``) must not pay for torch and the pipeline (issue 36: help in under a second). Written at a
    module's top like an import (``runner = lazy_module("ctuq.pipeline.runner")``); ``tests/test_import_graph.py``
    counts it as an import of ``name`` made at run time."""
    return LazyModule(name)


class RegistryError(KeyError):
    """A name that no implementation of the kind registered; the message lists the valid names.

    A ``KeyError`` (a registry is a mapping) whose ``str`` is the message itself, not its ``repr``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, Any]):
    """Name → implementation for one kind of extensible abstraction (module docstring).

    Parameters
    ----------
    kind : str
        What the entries are, for messages (``"solver"``, ``"calibration method"``).
    provider : str, optional
        The module whose import registers the built-in entries; imported on the first lookup.
    base : type, optional
        The class every entry must subclass (set by the provider with :meth:`set_base`, since the base class
        lives there); checked by :meth:`register`.
    reserved : tuple of str
        Names no entry may take (aliases that options accept besides the registry names, e.g. ``"auto"``).
    """

    def __init__(self, kind: str, provider: str | None = None, *, reserved: tuple[str, ...] = ()):
        self.kind = kind
        self.provider = provider
        self.reserved = tuple(reserved)
        self.base: type | None = None
        self._entries: dict[str, Any] = {}
        self._loaded = provider is None

    # ------------------------------------------------------------------------------------------ filling
    def set_base(self, base: type) -> None:
        """The class every later entry must subclass (the abstraction's own base class)."""
        self.base = base

    def register(self, obj: T | None = None, *, name: str | None = None) -> T | Callable[[T], T]:
        """Add ``obj`` under ``name`` (default ``obj.name``); usable as ``@REG.register`` or
        ``@REG.register(name="x")``. Re-registering the same object under its name is a no-op; another object
        under a taken name, an empty or reserved name, a class that is not a subclass of :attr:`base`, or an
        abstract class (one that leaves an abstract method of its base unimplemented) raise ``ValueError`` /
        ``TypeError``. Returns ``obj``."""

        def add(target: T) -> T:
            # The built-ins first (they keep their order, and the provider sets the base class checked below);
            # a no-op while the provider itself is being imported.
            self._load()
            key = name if name is not None else getattr(target, "name", None)
            if not isinstance(key, str) or not key:
                raise ValueError(f"{self.kind} registry: {target!r} has no name (a non-empty class attribute 'name')")
            if key in self.reserved:
                raise ValueError(f"{self.kind} registry: the name {key!r} is reserved ({list(self.reserved)})")
            if self.base is not None and not (isinstance(target, type) and issubclass(target, self.base)):
                raise TypeError(f"{self.kind} registry: {target!r} is not a subclass of {self.base.__name__}")
            if inspect.isabstract(target):  # it would fail only when first used: refuse it now, naming what it lacks
                missing = ", ".join(sorted(getattr(target, "__abstractmethods__", ())))
                raise TypeError(f"{self.kind} registry: {target.__name__} is abstract: it does not implement {missing}")
            taken = self._entries.get(key)
            if taken is not None and taken is not target:
                raise ValueError(
                    f"{self.kind} registry: the name {key!r} is taken by {getattr(taken, '__name__', taken)!r}"
                )
            self._entries[key] = target
            return target

        return add if obj is None else add(obj)

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register an implementation of their own clean up with this)."""
        self._entries.pop(name, None)

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # before the import: the provider's own lookups must not recurse into it
            before = dict(self._entries)
            try:
                importlib.import_module(self.provider)
            except BaseException:
                # A provider that fails to import is retried, with its error, at the next lookup, rather than
                # leaving a registry that looks loaded and lacks the built-ins; what it registered before failing
                # goes (Python re-executes the module, so its classes come back as new objects).
                self._loaded = False
                self._entries = before
                raise

    # ------------------------------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise RegistryError(f"unknown {self.kind} {name!r}; valid: {', '.join(self._entries)}") from None

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order (built-ins first)."""
        self._load()
        return tuple(self._entries)

    def choices(self) -> tuple[str, ...]:
        """The values an option of this kind accepts: the reserved aliases, then :meth:`names` (a callable for
        ``option(choices=REG.choices)``, read when a value is checked)."""
        return (*self.reserved, *self.names())

    def __repr__(self) -> str:
        state = ", ".join(self._entries) if self._loaded else f"not loaded: {self.provider}"
        return f"Registry({self.kind!r}: {state})"


#: Solvers of the posterior's linear systems (:mod:`ctuq.inference.solvers`).
SOLVERS = Registry("solver", "ctuq.inference.solvers", reserved=("auto", "exact"))
#: Weight priors of the linearised model.
PRIORS = Registry("weight prior", "ctuq.inference.priors")
#: Likelihoods (noise models) of the linear model (:mod:`ctuq.inference.likelihoods`).
LIKELIHOODS = Registry("likelihood", "ctuq.inference.likelihoods")
#: Calibration methods of a std map, fitted on held-out measurements.
CALIBRATIONS = Registry("calibration method", "ctuq.calibration", reserved=("auto",))
#: Scan formats ``--data`` reads and ``ctuq simulate --layout`` writes.
DATA_FORMATS = Registry("data format", "ctuq.data.formats")
#: Ray-transform backends (:mod:`ctuq.operators`).
RAY_TRANSFORMS = Registry("ray-transform backend", "ctuq.operators", reserved=("auto",))
