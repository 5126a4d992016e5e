"""Sharding independent samples across processes (``torch.distributed``): which share a process computes, and
how the shares are combined.

Posterior samples are independent given ``(a, σ²)``, so the EM's probes and the prediction's sample chunks can
be computed anywhere as long as every draw comes from a generator that does not depend on *who* computes it:

* the EM draws all ``k`` probes of a step on every rank from the same generator (random numbers are cheap),
  and each rank solves the rows ``j ≡ rank (mod world_size)``; rank 0 also solves the mean's row ``ỹ``. The
  step's sums (``Σ_j ‖Ψζ_j‖²``, ``uᵀỹ``, ``‖u‖²``) are summed over ranks, so every rank computes the same
  ``a`` and ``σ²``;
* prediction chunk ``i`` draws from :func:`~ctuq.inference.sampler.chunk_generator` ``(seed, i)`` and is computed
  by rank ``i mod world_size``; each rank's running sums (:class:`ctuq.metrics.SampleMoments`) are summed onto
  rank 0 at the end.

The union of the shards is therefore the single-process run for the same seed; only the order of float64
summation differs (results agree to ~1e-12 relative, ``tests/inference/test_distributed.py``).

:class:`LocalShard` (one process) makes every operation a no-op; :class:`TorchShard` wraps an initialised default
process group (``gloo`` on CPU tensors, ``nccl`` on CUDA tensors: collectives run on :attr:`TorchShard.device`).
:func:`init_from_env` initialises the group from the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

NCCL on GPUs: one process per GPU (``torchrun --nproc_per_node=<GPUs>``), each pinned to ``cuda:LOCAL_RANK``
(:func:`init_from_env` does it); NCCL needs CUDA tensors for every collective, which :class:`TorchShard` moves
them to. Multi-node: the same command on every node with ``--nnodes``, ``--node_rank`` and a reachable
``--rdzv_endpoint``; the run folder must be on a file system all nodes share (rank 0 writes the results, every
rank its own checkpoint of running sums).
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ctuq.errors import CTUQError

__all__ = ["Shard", "LocalShard", "TorchShard", "current_shard", "init_from_env", "shutdown", "DistributedSetupError"]


class DistributedSetupError(CTUQError, RuntimeError):
    """``torch.distributed`` could not be set up from the environment (the message says what is missing); a user
    error (:mod:`ctuq.errors`)."""


class Shard:
    """A process's share of independent work: ``rank`` of ``world_size``; collectives over all shares."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_root(self) -> bool:
        """Rank 0: solves the mean's row, writes results and logs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    def owns(self, index: int) -> bool:
        """Whether item ``index`` (an EM probe or a prediction chunk) is computed here (round robin)."""
        return index % self.world_size == self.rank

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ranks (returned; ``t`` itself may be overwritten)."""
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` maximised elementwise over ranks."""
        return t

    def reduce_sum_(self, t: torch.Tensor) -> None:
        """Sum ``t`` over ranks *in place* on rank 0 (other ranks' ``t`` is left unspecified)."""

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects)."""
        return obj

    def barrier(self) -> None:
        """Wait for every rank."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class LocalShard(Shard):
    """One process: it owns everything and collectives are identities."""


class TorchShard(Shard):
    """A share in the initialised default ``torch.distributed`` process group.

    Parameters
    ----------
    device : torch.device or str, optional
        Where collectives run: CPU for ``gloo`` (default), the rank's CUDA device for ``nccl`` (default when
        the backend is ``nccl``).
    """

    def __init__(self, device: torch.device | str | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedSetupError(
                "TorchShard: torch.distributed is not initialised (use init_from_env or "
                "torch.distributed.init_process_group first)"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if dist.get_backend() == "nccl"
                else torch.device("cpu")
            )
        self.device = torch.device(device)

    def _run(self, t: torch.Tensor, op) -> torch.Tensor:
        buf = t.detach().to(self.device).contiguous()
        dist.all_reduce(buf, op=op)
        return buf.to(t.device)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._run(t, dist.ReduceOp.SUM)

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._run(t, dist.ReduceOp.MAX)

    def reduce_sum_(self, t: torch.Tensor) -> None:
        buf = t.detach().to(self.device).contiguous()
        dist.reduce(buf, dst=0, op=dist.ReduceOp.SUM)
        if self.is_root:
            t.copy_(buf.to(t.device))

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj if self.is_root else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()


def current_shard() -> Shard:
    """A :class:`TorchShard` when a process group with more than one rank is initialised, else a
    :class:`LocalShard`."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchShard()
    return LocalShard()


def shutdown(*, clean: bool) -> None:
    """Destroy the default process group, if one is initialised (no-op otherwise).

    ``clean=True`` (every rank got here without an error) first waits at a barrier, so that no rank tears its
    connections down while another still uses them (rank 0 also hosts the rendezvous store): the shutdown order
    PyTorch's distributed docs ask for. ``clean=False`` (after an error) skips the barrier, which ranks that failed
    elsewhere would never reach.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def init_from_env(device_type: str = "cpu", *, timeout_s: float = 1800.0) -> tuple[Shard, torch.device]:
    """Initialise the default process group from the ``torchrun`` environment.

    Parameters
    ----------
    device_type : {"cpu", "cuda"}
        ``cuda``: backend ``nccl``, this rank computes on ``cuda:LOCAL_RANK``; ``cpu``: backend ``gloo``.
    timeout_s : float
        Collective timeout (s).

    Returns
    -------
    (shard, device)
        The :class:`TorchShard` (or :class:`LocalShard` for a world of one) and the device this rank computes on.

    Raises
    ------
    DistributedSetupError
        Missing environment variables (naming them and how to launch), or more ranks per node than GPUs.
    """
    need = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in need if k not in os.environ]
    if missing:
        raise DistributedSetupError(
            f"--distributed: the environment lacks {', '.join(missing)}; launch with "
            f"`torchrun --nproc_per_node=N -m ctuq uq RUN_DIR` (which sets them), or set {', '.join(need)} yourself"
        )
    if device_type not in ("cpu", "cuda"):
        raise DistributedSetupError(f"--distributed: device must be cpu or cuda, got {device_type!r}")
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise DistributedSetupError("--distributed --device cuda: torch sees no CUDA device")
        if local >= torch.cuda.device_count():
            raise DistributedSetupError(
                f"--distributed: LOCAL_RANK {local} but this node has "
                f"{torch.cuda.device_count()} GPU(s); use --nproc_per_node <= the GPU count"
            )
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return current_shard(), device
