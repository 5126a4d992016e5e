"""Typed study options: each study's options are one frozen dataclass whose fields carry a type, a default and a
one-line help (:func:`option`); its script builds it from the command line (:func:`option_help` for the flags' help)
and ``study.json`` records it (:func:`plain`, then :func:`ctuq.studies.common.study_fingerprint`).

Sequence fields hold tuples (:func:`freeze`, called from ``__post_init__``, turns lists given by a caller into
tuples), so an options object is immutable and compares by value; a mapping field (the calibration study's targets)
stays a dict.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["option", "option_help", "freeze", "plain"]


def option(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING) -> Any:  # noqa: A002
    """A dataclass field with its one-line ``help`` (``field.metadata["help"]``): ``default``, or ``factory`` for a
    mutable default (a dict)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


def option_help(cls: type, name: str, default: Any = dataclasses.MISSING) -> str:
    """The help of the field ``name`` of the options class ``cls`` with its default (``default`` when given, e.g.
    the default of a preset such as ``--tiny``), for an ``argparse`` flag."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if default is dataclasses.MISSING:
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    shown = list(default) if isinstance(default, tuple) else default
    return f"{field.metadata['help']} (default {shown})"


def freeze(options: Any) -> None:
    """Turn the list values of the frozen dataclass ``options`` into tuples, in place (for its ``__post_init__``)."""
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, list):
            object.__setattr__(options, field.name, tuple(value))


def plain(options: Any) -> dict:
    """``options`` as plain JSON values (tuples as lists), in field order: what ``study.json`` and ``results.json``
    record."""
    return json.loads(json.dumps(dataclasses.asdict(options)))
