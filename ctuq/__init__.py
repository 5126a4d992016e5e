"""ctuq: uncertainty for computed tomography with the linearised deep image prior.

Layers, bottom to top (README "Layout"; ``tests/test_import_graph.py`` enforces them)::

    errors, options, memory, utils, geometry → data, operators, metrics, outputs, figures → models
      → linearize, priors, inference (the CT-free core) → reconstruct → design, classify → config
      → pipeline (the CT run, with the CT front end pipeline.uq) → studies → commands, cli

``data`` loads or simulates scans, ``operators`` are the ray transforms and FBP, ``reconstruct`` fits the DIP (and
the baselines), ``linearize``/``priors``/``inference`` form the CT-agnostic inference core (it imports nothing
CT-specific), ``metrics`` scores posteriors, ``pipeline.uq`` ties the core to one CT problem, ``pipeline`` runs the
phases into a run folder (``pipeline.run_folder`` is its file contract), and ``commands`` / ``cli`` only parse
arguments. Option vocabularies are ``ctuq.options``; user errors are the types of ``ctuq.errors``.
"""

__version__ = "0.1.0"
