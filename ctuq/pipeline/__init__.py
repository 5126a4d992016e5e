"""The reconstruction pipeline as a library: what the ``ctuq`` commands run, callable from Python.

* :mod:`.run_folder` — the one run-folder contract: every file name a run folder holds, and the ``--out`` checks
  (a file, under a file, not writable, already finished) made before any work starts.
* :mod:`.scan` — loading the scan a config names, after checking the setting against it (device, slice and
  subsampling in range, at least ``data.min_angles`` angles; warnings when a published setting cannot be met).
* :mod:`.phases` — :class:`RunState`, :class:`Phase` and the phases load, fbp, tv, dip, restore_dip, write.
* The CT front end of the inference core: :mod:`.ct_model` (the linearised DIP as a CT posterior: ``Ψ₀ = T Φ``,
  scale, offset, ``σ²₀``), :mod:`.noise` (``uq.noise`` resolved once per run), :mod:`.moments` (the streaming
  statistics' region and memory check), :mod:`.uq` (one run of the inference, :class:`~ctuq.pipeline.uq.UQRun`:
  set up or resume → fit → stream moments → report); :mod:`.checkpoints` — the format of its checkpoints;
  :mod:`.uq_phase` — the linearised-inference phase of a run (:func:`phase_uq`).
* :mod:`.runner` — :func:`build_phases`, :func:`run_phases`, :func:`reconstruct` (``ctuq reconstruct``),
  :func:`rerun_uq` (``ctuq uq``, also sharded over ``torchrun`` ranks) and :func:`reconstruct_problem` (the same
  phases on a problem given in code, e.g. a 3D parallel-beam volume on the CPU).
* :mod:`.pretrain`, :mod:`.simulate`, :mod:`.design` — ``ctuq pretrain``, ``ctuq simulate`` and ``ctuq design``.

Errors meant for the person running ctuq are :mod:`ctuq.errors` user errors; ``ctuq.cli`` prints them as one line.
"""

import importlib

# Where each name lives; importing this package imports none of them (the command line's --help reads
# ctuq.pipeline.run_folder without paying for torch), the first read of a name imports its module (PEP 562).
_HOMES = {
    "run_folder": "ctuq.pipeline.run_folder",
    **dict.fromkeys(
        (
            "Phase",
            "RunState",
            "build_model",
            "make_input",
            "phase_dip",
            "phase_fbp",
            "phase_load",
            "phase_restore_dip",
            "phase_tv",
            "phase_write",
        ),
        "ctuq.pipeline.phases",
    ),
    **dict.fromkeys(
        ("build_phases", "reconstruct", "reconstruct_problem", "rerun_uq", "run_phases", "uq_phases", "write_config"),
        "ctuq.pipeline.runner",
    ),
    **dict.fromkeys(("UQResult", "UQRun", "UQSettings"), "ctuq.pipeline.uq"),
    **dict.fromkeys(("ct_features", "ct_posterior"), "ctuq.pipeline.ct_model"),
    **dict.fromkeys(("ResolvedNoise", "resolve_noise"), "ctuq.pipeline.noise"),
    "phase_uq": "ctuq.pipeline.uq_phase",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ctuq.pipeline' has no attribute {name!r}")
    module = importlib.import_module(home)
    return module if home.endswith("." + name) else getattr(module, name)


__all__ = [
    "run_folder",
    "RunState",
    "Phase",
    "build_model",
    "make_input",
    "phase_load",
    "phase_fbp",
    "phase_tv",
    "phase_dip",
    "phase_restore_dip",
    "phase_write",
    "phase_uq",
    "uq_phases",
    "build_phases",
    "run_phases",
    "write_config",
    "reconstruct",
    "rerun_uq",
    "reconstruct_problem",
    "UQRun",
    "UQSettings",
    "UQResult",
    "ct_features",
    "ct_posterior",
    "ResolvedNoise",
    "resolve_noise",
]
