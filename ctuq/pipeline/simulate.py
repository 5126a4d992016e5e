"""``ctuq simulate`` as a library call: a simulated cone-beam walnut scan in the walnut data set's layout
(:func:`ctuq.data.simulate_scan`), with the parameter and output-folder checks done before any ray is traced."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctuq.data.phantom import make_phantom
from ctuq.data.simulate import SimulationParameters, check_layouts, estimate_work, simulate_scan
from ctuq.data.walnut import WalnutFormat
from ctuq.errors import CTUQError, OutDirError
from ctuq.options import PhantomKind, values
from ctuq.pipeline.lock import run_lock
from ctuq.pipeline.run_folder import check_writable_folder

__all__ = ["simulate", "PAIRS_PER_SECOND"]

_log = logging.getLogger(__name__)

# Ray–ellipsoid pairs per second of the simulator on a 2-core CPU (bundled preset: 8.8·10⁶ rays × 59 ellipsoids
# in ≈ 15 s), for the duration warning of large presets.
PAIRS_PER_SECOND = 3.5e7
# Ray–fine-pixel steps per second of the textured phantom's ASTRA line kernel on one CPU core (1200 views × 768
# rays through a 384² image in 2.6 s).
TEXTURED_STEPS_PER_SECOND = 1.4e8


def simulate(
    out: str | Path,
    preset: str = "bundled",
    *,
    overrides: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    phantom: str = PhantomKind.WALNUT,
    layouts: tuple[str, ...] | str = (WalnutFormat.name,),
) -> dict[str, Any]:
    """Simulate the scan of ``preset`` with ``overrides`` (fields of :class:`ctuq.data.SimulationParameters`;
    ``None`` values ignored) into the folder ``out``.

    ``phantom`` (``--phantom``, :class:`ctuq.options.PhantomKind`): ``walnut`` (the ellipsoid walnut, exact
    analytic line integrals; the default, unchanged), ``textured`` (:func:`ctuq.data.phantom.textured_phantom`:
    multi-scale texture, line integrals through its fine voxelised image, sub-rays per detector pixel) or ``laminate``
    (:func:`ctuq.data.phantom.laminate_phantom`: parallel plates, exact line integrals).

    ``layouts`` (``--layout``, :func:`ctuq.data.formats.write_layouts`: the layouts of the registered formats): the
    file layouts to write the same scan in (:func:`ctuq.data.simulate.simulate_scan`): one into ``out``, several into
    ``out/<layout>/``.

    Warns through ``log`` (default: a logged warning, ``ctuq simulate: warning: ...`` on the terminal) when the
    work would take more than half an hour. Returns ``{"out", "params", "sidecar", "bytes" (files written),
    "time_s", "layouts"}``.

    Raises
    ------
    CTUQError
        Unknown preset, unknown ``phantom`` or invalid parameters (the message names the option or parameter).
    OutDirError
        ``out`` is a file, lies under a file, is not writable, or is a non-empty folder that is not a simulated
        scan (or is one and ``overwrite`` is false).
    """
    if log is None:
        log = _log.warning
    try:
        params = SimulationParameters.preset(preset, **(overrides or {}))
        layouts = check_layouts(layouts, params)
    except ValueError as exc:  # the simulator's own parameter checks: user input, named in the message
        raise CTUQError(str(exc)) from exc
    if phantom not in values(PhantomKind):
        raise CTUQError(f"--phantom {phantom!r}: unknown phantom; valid: {', '.join(values(PhantomKind))}")
    out = check_writable_folder(out)
    work = estimate_work(params)
    hours = work["ray_ellipsoid_pairs"] / PAIRS_PER_SECOND / 3600
    obj = None
    if phantom != PhantomKind.WALNUT:
        obj = make_phantom(phantom, params.seed, voxel_size=params.gt_voxel_size)
    if phantom == PhantomKind.TEXTURED:
        hours = work["rays"] * obj.image.shape[0] / TEXTURED_STEPS_PER_SECOND / 3600
    if hours > 0.5:
        log(
            f"this traces {work['rays']:.2e} rays and writes ~{work['bytes_uncompressed'] / 1e9:.1f} GB "
            f"(uncompressed): expect about {hours:.0f} hours on a 2-core CPU"
        )
    t0 = time.perf_counter()
    try:
        # simulate_scan checks the folder (prepare_output_dir) before it traces a ray; the lock lies beside the
        # folder, which must hold nothing but the scan
        with run_lock(out, beside=True):
            sidecar = simulate_scan(
                out, params, phantom=obj, preset=preset, overwrite=overwrite, progress=progress, layouts=layouts
            )
    except FileExistsError as exc:
        if exc.filename is not None:  # an OS error, not prepare_output_dir's refusal
            raise
        raise OutDirError(f"--out {out}: {str(exc).removeprefix('simulate: ')}") from None
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "out": out,
        "params": params,
        "sidecar": sidecar,
        "bytes": size,
        "time_s": time.perf_counter() - t0,
        "layouts": layouts,
    }
