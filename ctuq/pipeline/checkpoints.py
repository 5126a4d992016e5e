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
from ctuq.config.engine import get_value, to_dict
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

# Settings that change the numbers of a run, always in the fingerprint. The solver options among them keep the flat
# names they had before the solvers' config sections (uq.rank is uq.cg.rank: UQConfig.legacy_keys), so that the
# fingerprint of the same settings stays the same dict and checkpoints written before still resume.
_FINGERPRINT_KEYS = (
    "prior",
    "gprior_method",
    "gprior_probes",
    "solver",
    "preconditioner",
    "rank",
    "oversampling",
    "cg_tol",
    "cg_max_iter",
    "em_steps",
    "em_samples",
    "em_tol",
    "prior_precision",
    "noise_variance",
    "learn_noise",
    "samples",
    "sample_chunk",
    "roi",
    "patch_sizes",
)
# Settings added with the first-order solvers: in the fingerprint only when they differ from their defaults, so
# that the checkpoints of runs that never used them still resume.
_LATER_KEYS = (
    "adaptive_rank",
    "rank_threshold",
    "sdd_step",
    "sdd_momentum",
    "sdd_batch",
    "sdd_iterations",
    "sgd_lr",
    "sgd_momentum",
    "sgd_lr_decay",
    "sgd_clip",
    "sgd_iterations",
    "first_order_tol",
    "em_stop_on",
    "em_fixed_probes",
    "em_update",
    "noise",
)
# The value a later key had when it joined the fingerprint, where its default has moved since: a checkpoint written
# then, with that value, still resumes. uq.noise defaulted to homoscedastic; its default is now auto, which the run
# resolves (ctuq.pipeline.uq.resolve_noise) before it fingerprints, so the fingerprint holds the model actually used.
_LATER_BASELINES = {"noise": "homoscedastic"}


def uq_fingerprint(net, op, y: torch.Tensor, scale: float, seed: int, settings: UQConfig) -> dict:
    """What identifies a run of the inference: sizes, sums of the data (``y`` in data units, ``op.measurement_shape``)
    and of the linearisation point ``ṽ`` (``net.params()``), the DIP ``scale``, the ``seed`` and every setting that
    changes the numbers. Enough to catch resuming with other data, another network or other settings."""
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
    for key in _FINGERPRINT_KEYS:
        fp[key] = get_value(settings, key)
    defaults = UQConfig()
    for key in _LATER_KEYS:
        baseline = _LATER_BASELINES.get(key, get_value(defaults, key))
        if get_value(settings, key) != baseline:
            fp[key] = get_value(settings, key)
    fp.update(_other_solver_options(settings))
    return fp


def _other_solver_options(settings: UQConfig) -> dict:
    """The options of the solvers' config sections that no flat key stands for (``uq.cg.initial_rank``, a later
    solver's), as ``"cg.initial_rank": value`` where they differ from their defaults; and a key that an old name
    stands for besides its first (``first_order_tol`` → ``sdd.rtol``, ``sgd.rtol``) where it differs from that name's
    value. Settings that never touch them leave the fingerprint as it was."""
    first: dict[str, str | None] = {}
    for old, targets in UQConfig.legacy_keys.items():
        first[targets[0]] = None
        for target in targets[1:]:
            first[target] = old
    out = {}
    for name, section in settings.solver_sections.items():
        defaults = to_dict(type(section)())
        for key, value in to_dict(section).items():
            path = f"{name}.{key}"
            if path in first and first[path] is None:
                continue  # in the fingerprint under its flat name
            baseline = get_value(settings, first[path]) if path in first else defaults[key]
            if value != baseline:
                out[path] = value
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
