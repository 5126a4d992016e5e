"""ctuq: uncertainty for computed tomography with the linearised deep image prior.

The public face (DESIGN.md §11), imported on first use so that ``import ctuq`` and ``ctuq --help`` stay fast::

    import ctuq
    scan = ctuq.load_scan("path/to/scan.yaml")                         # or ctuq.Scan.from_astra(sino, pg, vg)
    run = ctuq.reconstruct(scan, config="demo", set={"dip.iterations": 500})
    run.images["dip"], run.std, run.metrics, run.posterior, run.check()
    run.save("runs/x"); again = ctuq.load_run("runs/x")

:func:`load_scan` and :class:`Scan` live in :mod:`ctuq.scan`; :func:`reconstruct`, :func:`uncertainty`,
:func:`load_run`, :class:`Run` and the design of the next angles (:func:`design_angles`, :class:`Design`) in
:mod:`ctuq.run`. The CT-free inference core is :mod:`ctuq.inference`
(``LinearizedPosterior``); :mod:`ctuq.design` and :mod:`ctuq.classify` are the other front ends on it. Every module,
its layer and where a new implementation goes: docs/DESIGN.md §2 and CONTRIBUTING.md.
"""

import importlib
import sys
import types

__version__ = "0.1.0"

_PUBLIC = {
    "load_scan": "ctuq.scan",
    "Scan": "ctuq.scan",
    "reconstruct": "ctuq.run",
    "uncertainty": "ctuq.run",
    "load_run": "ctuq.run",
    "Run": "ctuq.run",
    "design_angles": "ctuq.run",
    "Design": "ctuq.run",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    home = _PUBLIC.get(name)
    if home is None:
        raise AttributeError(f"module 'ctuq' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
    """The type of the ``ctuq`` module: ``ctuq.reconstruct`` is the function :func:`ctuq.run.reconstruct`, although
    the subpackage ``ctuq/reconstruct/`` (the DIP, FBP and TV fits) has that name. Importing a subpackage sets the
    package's attribute of its name, which would turn ``ctuq.reconstruct`` into that module the first time anything
    imports it (``import ctuq.run`` does); here the import system's assignment is dropped and the subpackage stays
    in ``sys.modules``, so ``from ctuq.reconstruct import fit_dip`` and ``importlib.import_module`` work as before
    (only attribute paths through the package, ``ctuq.reconstruct.dip``, do not)."""

    @property
    def reconstruct(self):
        return importlib.import_module("ctuq.run").reconstruct

    @reconstruct.setter
    def reconstruct(self, module) -> None:
        pass  # the subpackage ctuq.reconstruct being bound by its import: it is reached through sys.modules


sys.modules[__name__].__class__ = _Package
