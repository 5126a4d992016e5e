"""ctuq: uncertainty for computed tomography with the linearised deep image prior.

The CT-free inference core is :mod:`ctuq.linearize` and :mod:`ctuq.inference` (``LinearizedPosterior``); the CT run
that reconstructs a scan and puts error bars on it is :mod:`ctuq.pipeline`, behind the ``ctuq`` command
(:mod:`ctuq.cli`); :mod:`ctuq.design` and :mod:`ctuq.classify` are the other front ends on the core. Every module,
its layer and where a new implementation goes: docs/DESIGN.md §2 and CONTRIBUTING.md. Importing ``ctuq`` imports
nothing else.
"""

__version__ = "0.1.0"
