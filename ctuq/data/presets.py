"""The simulator's scan presets (``ctuq simulate --preset``): sizes only, no code, so that the command line lists
them without loading the simulator (:mod:`ctuq.data.simulate` turns one into :class:`~ctuq.data.simulate.
SimulationParameters`)."""

from __future__ import annotations

from typing import Any

__all__ = ["SCAN_PRESETS"]

SCAN_PRESETS: dict[str, dict[str, Any]] = {
    "walnut": {
        "help": "the real data set's sizes: 3 orbits × 1201 projections of 972 × 768 pixels, 501³ GT at 0.1 mm. "
        "SLOW: ~12 CPU hours and ~5 GB on disk",
        "params": {},
    },
    "bundled": {
        "help": "the scan shipped in data/Walnut1: orbit 2, 241 projections (240 angles), 16 × 256 pixels of "
        "0.4488 mm, GT 31 × 128² at 0.4 mm; ~20 s, ~1.8 MB",
        "params": {
            "n_projections": 241,
            "det_rows": 16,
            "det_cols": 256,
            "pixel_size": 0.4488,  # 3 × 0.1496 mm (data/Walnut1 was written with 3 * 0.1496 in floating point)
            "orbits": (2,),
            "gt_shape": (31, 128, 128),
            "gt_voxel_size": 0.4,
        },
    },
    "tiny": {
        "help": "for tests: orbit 2, 33 projections (32 angles), 8 × 96 pixels of 1.2 mm, GT 5 × 128² at 0.4 mm; "
        "a few seconds",
        "params": {
            "n_projections": 33,
            "det_rows": 8,
            "det_cols": 96,
            "pixel_size": 1.2,
            "orbits": (2,),
            "gt_shape": (5, 128, 128),
            "gt_voxel_size": 0.4,
            "gt_supersampling": 2,
        },
    },
}
"""Preset name → ``help`` (one line for ``--help``) and ``params`` (fields of
:class:`~ctuq.data.simulate.SimulationParameters`)."""
