"""The one memory-budget policy of ctuq: how many bytes each kind of work may take on a device.

Every budget is a fraction of the free memory the device reports (:func:`free_memory_bytes`: CUDA's free memory, or
the host's available physical memory), with a cap on the host and a fallback where the OS does not say. The rules
differ by purpose because the work differs: a dense solver holds its matrices for the whole run, a chunk of Jacobian
products lives for one call, the design keeps projected rows beside a network that still needs room. Each purpose
is one :class:`Budget` member and one :data:`POLICY` row, so the fractions are named and written once.

Leaf module: imports nothing from ctuq.
"""

from __future__ import annotations

import dataclasses
import enum
import os

import torch

__all__ = ["Budget", "BudgetRule", "POLICY", "GIB", "free_memory_bytes", "memory_budget"]

GIB = 1024**3


class Budget(str, enum.Enum):
    """What a budget is for (one row of :data:`POLICY` each)."""

    DENSE_SOLVER = "dense_solver"
    """An exact solver's assembled ``Ψ`` or ``K̄`` and its eigendecomposition (held for the whole inference)."""
    SOLVER_CHOICE = "solver_choice"
    """The memory limit the solver cost model (``solver="auto"``) holds each candidate to."""
    PRODUCT_CHUNK = "product_chunk"
    """One ``vmap`` call of Jacobian products (lives for one call)."""
    DESIGN_ROWS = "design_rows"
    """Projected Jacobian rows the design keeps for its g-prior refreshes (beside the network)."""
    DESIGN_DENSE = "design_dense"
    """The design's dense ``Φ`` (``d × d_x``) on the weight-space route."""
    STUDY_EXACT = "study_exact"
    """A study's exact linearised inference (``--exact auto``)."""
    STATISTICS = "statistics"
    """Streaming statistics (pixel sums and patch covariances) of a UQ run."""

    def __str__(self) -> str:
        return str(self.value)


@dataclasses.dataclass(frozen=True)
class BudgetRule:
    """Bytes = ``gpu_fraction × free`` on CUDA; on the host ``min(host_cap, host_fraction × free)``, or
    ``host_fixed`` bytes regardless of the free memory; ``unknown`` bytes where the free memory is not reported
    (``None``: no limit)."""

    gpu_fraction: float
    host_fraction: float | None = None
    host_cap: int | None = None
    host_fixed: int | None = None
    unknown: int | None = None


POLICY: dict[Budget, BudgetRule] = {
    Budget.DENSE_SOLVER: BudgetRule(gpu_fraction=0.5, host_fraction=0.4, host_cap=8 * GIB, unknown=4 * GIB),
    Budget.SOLVER_CHOICE: BudgetRule(gpu_fraction=0.5, host_fixed=4 * GIB),
    Budget.PRODUCT_CHUNK: BudgetRule(gpu_fraction=0.5, host_fraction=0.25, host_cap=2 * GIB, unknown=GIB),
    Budget.DESIGN_ROWS: BudgetRule(gpu_fraction=0.25, host_fraction=0.25, unknown=None),
    Budget.DESIGN_DENSE: BudgetRule(gpu_fraction=0.25, host_fraction=0.25, unknown=2 * GIB),
    Budget.STUDY_EXACT: BudgetRule(gpu_fraction=0.5, host_fraction=0.5, unknown=4 * GIB),
    Budget.STATISTICS: BudgetRule(gpu_fraction=0.8, host_fraction=0.8, unknown=None),
}
"""The fractions of free memory each purpose may take (module docstring)."""


def free_memory_bytes(device: torch.device | str) -> int | None:
    """Free memory on ``device`` in bytes: CUDA's free memory, or the host's available physical memory (``None``
    where the OS does not say). The one source of every memory budget in ctuq."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget(purpose: Budget | str, device: torch.device | str) -> int | None:
    """Bytes that ``purpose`` (a :class:`Budget`) may use on ``device`` under :data:`POLICY`; ``None`` means no
    limit (the free memory is unknown and the rule sets none)."""
    rule = POLICY[Budget(purpose)]
    device = torch.device(device)
    if device.type != "cuda" and rule.host_fixed is not None:
        return int(rule.host_fixed)
    free = free_memory_bytes(device)
    if not free:
        return rule.unknown
    if device.type == "cuda":
        return int(rule.gpu_fraction * free)
    budget = rule.host_fraction * free
    return int(budget if rule.host_cap is None else min(rule.host_cap, budget))
