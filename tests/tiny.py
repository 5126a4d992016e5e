"""The tiny run the tests share (imported as ``from tiny import ...``, like tv_toy): one settings list for
``ctuq reconstruct`` on conftest's ``tiny_scan``, the argument lists built from it, and a :class:`RunState` restored
from a finished run folder for tests of one phase; and :func:`load_script`, a script of ``scripts/`` as a module.

conftest.py writes the finished runs once per session (``tiny_run``, ``tiny_run_none``); a test that changes a run
works on a copy (``shutil.copytree``)."""

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

from ctuq.config import load_config
from ctuq.pipeline.phases import RunState, phase_load, phase_restore_dip

# A seconds-long run with uncertainty: 32² image, every 2nd of the 32 angles used (the other half held out for the
# held-out check) × 32 detector columns (c = 512), 60 DIP iterations, 20 TV iterations, 64 posterior samples, 3 EM
# steps. Later settings override earlier ones: tests append what they change.
TINY_DATA = ("data.image_shape=[32, 32]", "data.angular_subsampling=2", "data.detector_subsampling=3")
TINY_SETTINGS = (
    *TINY_DATA,
    "dip.iterations=60",
    "dip.warm_start_iterations=30",  # the demo's warm start at the TV image, at test size
    "tv.iterations=20",
    "tv.path_iterations=10",  # TV's weight path at test size: 10 PDHG iterations a weight, 2 weights a decade
    "tv.per_decade=2",
    "uq.samples=64",
    "uq.em_steps=3",
)
# On top of TINY_SETTINGS: no TV baseline, and so none of the demo's DIP settings that start from its image.
NO_TV = ("tv.enabled=false", "model.input=fbp", "dip.warm_start=none", "dip.tv_weight_from_tv=false")
# On top of TINY_SETTINGS: a run that stops after a 2-iteration DIP, for tests of what happens before or around it.
QUICK = ("dip.iterations=2", *NO_TV, "output.figure=false")
NO_FIGURES = ("output.figure=false",)


def sets(*settings: str) -> list[str]:
    """``["--set", s1, "--set", s2, ...]`` for the ``KEY=VALUE`` strings ``settings``."""
    return [arg for setting in settings for arg in ("--set", setting)]


def tiny_args(*overrides: str, uq: bool = True) -> list[str]:
    """``ctuq reconstruct`` options (no ``--data``/``--out``) for :data:`TINY_SETTINGS` then ``overrides``, without
    progress bars; ``uq=False`` adds ``--no-uq``."""
    return [*sets(*TINY_SETTINGS, *overrides), "--no-progress", *([] if uq else ["--no-uq"])]


def restored_state(run_dir: Path, *overrides: str) -> RunState:
    """The state ``ctuq uq RUN`` has before its uncertainty phase: the finished run ``run_dir``'s config (plus
    ``overrides``), its scan loaded and its fitted DIP restored (no refitting). Later phases write into ``run_dir``:
    pass a copy of a shared run."""
    cfg = load_config(Path(run_dir) / "config.yaml", list(overrides))
    state = RunState(cfg=cfg, out_dir=Path(run_dir), device=torch.device("cpu"), progress=False, command="uq")
    phase_load(state)
    phase_restore_dip(state)
    return state


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` executed as a module named ``name`` (the scripts are not a package), for tests that call
    its ``main`` or its functions."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
