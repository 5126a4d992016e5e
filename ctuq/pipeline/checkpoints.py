"""The checkpoints of the CT linearised inference: their format, version, fingerprint and resume checks.

A work folder (a run folder, a study method's folder) holds, under the names of :mod:`ctuq.pipeline.run_folder`:

* ``uq_state.pt`` — ``{"version", "fingerprint", "stage", "posterior"}``: the posterior's
  :meth:`~ctuq.inference.LinearizedPosterior.state_dict` after the g-prior, the solver set-up and every EM step;
* ``uq_moments.pt`` (one process) or ``uq_moments.rank{r}of{N}.pt`` (rank ``r`` of a sharded run) —
  ``{"version", "fingerprint", "next_chunk", "moments", "cg_iterations", "cg_residuals"}``: the running sums of the
  prediction and the index of the next sample chunk.

Both carry :data:`UQ_STATE_VERSION` and a fingerprint of the problem and the settings (:func:`uq_fingerprint`);
resuming from a file of another version or fingerprint raises :class:`~ctuq.errors.CheckpointMismatch` naming the
file, what differs and how to start afresh. Files are written atomically (:func:`save_uq_checkpoint`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ctuq.config import UQConfig
from ctuq.config.engine import to_dict
from ctuq.errors import CheckpointMismatch
from ctuq.pipeline.run_folder import UQ_MOMENTS_NAME, UQ_MOMENTS_SHARD_PATTERN
from ctuq.utils import atomic_torch_save, check_fingerprint

__all__ = [
    "UQ_STATE_VERSION",
    "uq_fingerprint",
    "load_uq_checkpoint",
    "save_uq_checkpoint",
    "moments_file_name",
    "shard_moments_files",
    "shard_world_sizes",
    "check_shard_checkpoints",
]

UQ_STATE_VERSION = 2  # 1: ctuq 0.1 (samples kept per chunk, routes dense/exact/cg)

# Settings that do not change the numbers of the inference (what is done with them afterwards, or how the work is
# chunked in memory): left out of the fingerprint, so that a run may resume with other values of them. ``method``: only
# the linearised inference (uq.method = linearised) writes these checkpoints; ``approximation``: a CT run has one value
# (``full``; the config refuses ``ella``), and runs checkpointed before the key existed must still resume.
_NOT_FINGERPRINTED = frozenset(
    {"calibration", "memory_budget_gb", "chunk_size", "save_samples", "method", "approximation"}
)


def uq_fingerprint(net, op, y: torch.Tensor, scale: float, seed: int, settings: UQConfig) -> dict:
    """What identifies a run of the inference: sizes, sums of the data (``y`` in data units, ``op.measurement_shape``)
    and of the linearisation point ``ṽ`` (``net.params()``), the DIP ``scale``, the ``seed`` and every setting that
    changes the numbers: the ``uq`` section as config.yaml holds it (the chosen prior's and solver's sections and any
    other set to non-default values), less :data:`_NOT_FINGERPRINTED`, under dotted keys (``"cg.rank"``). Enough to
    catch resuming with other data, another network or other settings."""
    v = net.params().double()
    fp = {
        "image_shape": list(op.image_shape),
        "c": int(op.c),
        "d": int(net.d),
        "y_sum": float(y.double().sum() * scale),
        "weights_sum": float(v.sum()),
        "weights_sq_sum": float(v.pow(2).sum()),
        "scale": float(scale),
        "seed": int(seed),
    }
    for key, value in _dotted(to_dict(settings)).items():
        if key.split(".")[0] not in _NOT_FINGERPRINTED:
            fp[key] = value
    return fp


def _dotted(d: dict, prefix: str = "") -> dict:
    """``{"cg": {"rank": 4}}`` → ``{"cg.rank": 4}`` (the first differing setting is named in a mismatch message)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_uq_checkpoint(path: Path, fingerprint: dict) -> dict:
    """The checkpoint at ``path`` after checking its version and ``fingerprint`` (:class:`CheckpointMismatch`
    naming the file, the setting that differs and how to start afresh otherwise; also for a damaged file)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged or truncated file: re-raised with the file named
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointMismatch(
            f"{path}: not a readable ctuq UQ checkpoint ({type(exc).__name__}: {reason}); delete "
            f"{path.parent / 'uq_*'} to start the inference afresh"
        ) from exc
    version = state.get("version") if isinstance(state, dict) else None
    if version != UQ_STATE_VERSION:
        raise CheckpointMismatch(
            f"cannot resume from {path}: it is a ctuq UQ checkpoint of version {version!r}, this ctuq reads version "
            f"{UQ_STATE_VERSION} (delete {path.parent / 'uq_*'} to start the inference afresh)"
        )
    check_fingerprint(
        state.get("fingerprint", {}),
        fingerprint,
        what=f"cannot resume the uncertainty phase from {path}",
        error=CheckpointMismatch,
        hint=f"delete {path.parent / 'uq_*'} to start the inference afresh, or use the same data/settings",
    )
    return state


def save_uq_checkpoint(path: Path, fingerprint: dict, **content) -> None:
    """Write ``{"version", "fingerprint", **content}`` atomically to ``path`` (a killed run never leaves half a
    file)."""
    atomic_torch_save(path, {"version": UQ_STATE_VERSION, "fingerprint": fingerprint, **content})


def moments_file_name(shard) -> str:
    """The running sums' file of this process: ``uq_moments.pt``, or rank ``r``'s ``uq_moments.rank{r}of{N}.pt`` in a
    sharded run (``shard``: a :class:`ctuq.inference.Shard`)."""
    if not shard.distributed:
        return UQ_MOMENTS_NAME
    return UQ_MOMENTS_SHARD_PATTERN.format(rank=shard.rank, world=shard.world_size)


def shard_moments_files(work: Path) -> list[Path]:
    """The per-rank running sums in ``work`` (any rank, any rank count)."""
    return sorted(work.glob(UQ_MOMENTS_SHARD_PATTERN.format(rank="*", world="*")))


def shard_world_sizes(work: Path) -> set[int]:
    """The rank counts of the per-rank running sums in ``work``."""
    rx = re.compile(re.escape(UQ_MOMENTS_SHARD_PATTERN).replace(r"\{rank\}", r"(\d+)").replace(r"\{world\}", r"(\d+)"))
    return {int(m.group(2)) for p in shard_moments_files(work) if (m := rx.fullmatch(p.name))}


def check_shard_checkpoints(work: Path, shard) -> None:
    """Refuse to resume a sharded prediction with another number of ranks than the one that wrote it, or from the
    running sums of a single-process run (:class:`CheckpointMismatch` saying how to resume)."""
    other = sorted(shard_world_sizes(work) - {shard.world_size})
    if other:
        raise CheckpointMismatch(
            f"cannot resume the sharded prediction in {work}: its running sums were written by {other[0]} rank(s), "
            f"this run has {shard.world_size}; resume with --nproc_per_node={other[0]} (or delete "
            f"{work / 'uq_moments.rank*'} to sample afresh)"
        )
    if (work / UQ_MOMENTS_NAME).is_file():
        raise CheckpointMismatch(
            f"cannot resume the sharded prediction in {work}: {UQ_MOMENTS_NAME} holds the running sums of a "
            f"single-process run; resume without torchrun (or delete it to sample afresh)"
        )
