"""The reconstruction pipeline as a library: what the ``ctuq`` commands run, callable from Python.

* :mod:`.run_folder` — the one run-folder contract: every file name a run folder holds, and the ``--out`` checks
  (a file, under a file, not writable, already finished) made before any work starts.
* :mod:`.scan` — loading the scan a config names, after checking the setting against it (device, slice and
  subsampling in range, at least ``data.min_angles`` angles; warnings when a published setting cannot be met).
* :mod:`.phases` — :class:`RunState`, :class:`Phase` and the phases load, fbp, tv, dip, restore_dip, write.
* :mod:`.uq_phase` — the linearised-inference phase (:func:`phase_uq`).
* :mod:`.runner` — :func:`build_phases`, :func:`run_phases`, :func:`reconstruct` (``ctuq reconstruct``),
  :func:`rerun_uq` (``ctuq uq``, also sharded over ``torchrun`` ranks) and :func:`reconstruct_problem` (the same
  phases on a problem given in code, e.g. a 3D parallel-beam volume on the CPU).
* :mod:`.pretrain`, :mod:`.simulate` — ``ctuq pretrain`` and ``ctuq simulate``.

Errors meant for the person running ctuq are :mod:`ctuq.errors` user errors; ``ctuq.cli`` prints them as one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ctuq.pipeline import run_folder
from ctuq.utils import lazy_exports

# The phases are imported on first use: ctuq.uq (a lower layer) takes its file names from run_folder, and that
# import must not pull in the phases, which import ctuq.config and, lazily, ctuq.uq itself.
_LAZY = {
    "RunState": "phases", "Phase": "phases", "build_model": "phases", "make_input": "phases",
    "phase_load": "phases", "phase_fbp": "phases", "phase_tv": "phases", "phase_dip": "phases",
    "phase_restore_dip": "phases", "phase_write": "phases", "phase_uq": "uq_phase", "uq_phases": "runner",
    "build_phases": "runner", "run_phases": "runner", "reconstruct": "runner", "rerun_uq": "runner",
    "reconstruct_problem": "runner",
}

if TYPE_CHECKING:
    from ctuq.pipeline.phases import (Phase, RunState, build_model, make_input, phase_dip, phase_fbp, phase_load,
                                      phase_restore_dip, phase_tv, phase_write)
    from ctuq.pipeline.runner import build_phases, reconstruct, reconstruct_problem, rerun_uq, run_phases, uq_phases
    from ctuq.pipeline.uq_phase import phase_uq

__all__ = ["run_folder", *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
