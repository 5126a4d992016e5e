"""ctuq: uncertainty for computed tomography with the linearised deep image prior.

Data flows one way: ``data`` + ``operators`` → ``reconstruct`` → ``linearize`` → ``inference`` →
``metrics``. The inference core (``linearize``, ``priors``, ``inference``) imports nothing CT-specific.
"""

__version__ = "0.1.0"
