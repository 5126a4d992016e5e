"""Peak CPU memory of a piece of code, measured with the torch profiler (tests only).

Why not ``prof.events()``: in torch 2.13 that list attributes every allocation made inside an operator to
the operator's ``cpu_memory_usage`` and keeps as ``"[memory]"`` entries only the unattributed events, which
are mostly frees (verified empirically: ``torch.zeros(1024, 64, 64, dtype=float64)`` followed by ``del``
shows a single ``"[memory]"`` entry of −32 MiB, the +32 MiB sits on ``aten::empty``). Summing those gives a
running total that never rises. The profiler's raw kineto event list (``prof.profiler.kineto_results``)
still holds one ``"[memory]"`` event per allocation (``nbytes > 0``) and per free (``nbytes < 0``) with its
timestamp, so the running sum in time order is the live-byte curve that this module reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def _memory_events(prof) -> list[tuple[int, int]]:
    """``(start_ns, nbytes)`` of every CPU allocation (> 0) and free (< 0) recorded by ``prof``."""
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        raise RuntimeError(
            "peak_cpu_bytes: this torch version exposes no raw profiler events "
            "(prof.profiler.kineto_results); the memory measurement needs updating"
        )
    out = []
    for e in results.events():
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU and e.nbytes():
            out.append((e.start_ns(), e.nbytes()))
    out.sort(key=lambda t: t[0])  # stable: events with equal stamps keep the recorded order
    return out


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak number of CPU bytes allocated by torch while ``fn()`` runs, above what was live before.

    Runs ``fn`` under ``torch.profiler.profile(activities=[CPU], profile_memory=True)`` and returns the
    maximum of the running sum of allocation (+) and free (−) events, in time order (0 if nothing was
    allocated). Only torch's CPU allocator is seen: numpy arrays and Python objects are not counted.
    Frees of memory allocated before ``fn`` started push the running sum below zero and are harmless.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, nbytes in _memory_events(prof):
        live += nbytes
        peak = max(peak, live)
    return peak
