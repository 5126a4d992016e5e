"""ctuq: uncertainty for computed tomography with the linearised deep image prior.

Layers, in the order data flows through them::

    data → operators → reconstruct → linearize → inference (posterior) → metrics
         → front ends (ctuq.uq; later experimental design and classification) → pipeline → commands

``data`` loads or simulates scans, ``operators`` are the ray transforms and FBP, ``reconstruct`` fits the DIP (and
the baselines), ``linearize``/``priors``/``inference`` form the CT-agnostic inference core (it imports nothing
CT-specific), ``metrics`` scores posteriors, a front end such as ``uq`` ties the core to one CT problem,
``pipeline`` runs the phases into a run folder (``pipeline.run_folder`` is its file contract), and ``commands`` /
``cli`` only parse arguments. User errors are the types of ``ctuq.errors``.
"""

__version__ = "0.1.0"
