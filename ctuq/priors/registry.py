"""The registry of block priors: priors that are a map ``v = L w`` from standard to network weights rather than
per-weight scales (:mod:`ctuq.priors.scaling` holds the diagonal ones: the g-prior and the isotropic prior).

A new block prior is one module in :mod:`ctuq.priors` whose class has a ``name`` (its value of
``LinearizedPosterior(prior=...)`` and of :class:`ctuq.options.Prior`), the constructor
``cls(param_shapes, **options)`` and the methods ``apply`` / ``apply_t`` (``L``, ``Lᵀ`` on rows), ``state_dict`` /
``load_state_dict``, ``summary`` and the attribute ``fitted``; it calls :func:`register_block_prior` on itself, and
its module is imported in ``ctuq/priors/__init__.py`` (the one registry line).
"""

from __future__ import annotations

__all__ = ["BLOCK_PRIORS", "register_block_prior"]

BLOCK_PRIORS: dict[str, type] = {}
"""Block-prior name → class."""


def register_block_prior(cls: type) -> type:
    """Add ``cls`` under ``cls.name`` to :data:`BLOCK_PRIORS` (usable as a class decorator)."""
    name = getattr(cls, "name", "")
    if not name:
        raise ValueError(f"register_block_prior: {cls.__name__} has no name")
    BLOCK_PRIORS[name] = cls
    return cls
