"""Small shared helpers: atomic file output, seeding, device selection, progress bars, array conversion.

Memory budgets and the free memory of a device live in :mod:`ctuq.memory`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import math
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch
from tqdm.auto import tqdm

from ctuq.errors import DeviceError, DiskFullError

__all__ = [
    "atomic_path",
    "atomic_write_json",
    "atomic_torch_save",
    "atomic_write_tiff",
    "json_digest",
    "seed_everything",
    "resolve_device",
    "progress",
    "as_rows",
    "check_fingerprint",
    "to_numpy",
    "derived_seed_words",
    "tune_malloc",
]


# A write that fails for want of space: the file system is full, or the user's quota is.
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _disk_full(exc: OSError, path: Path) -> DiskFullError:
    return DiskFullError(
        f"{path}: no space left on device ({exc.strerror or exc}); this file was not written, the earlier outputs "
        f"in {path.parent} are intact; free some space and run again (with --resume where the command has it)"
    )


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    A crash inside the block leaves any previous ``path`` untouched and no half-written file (the temporary file
    is removed). A full disk (``ENOSPC``, ``EDQUOT``) while creating, writing or renaming it raises
    :class:`~ctuq.errors.DiskFullError` naming ``path`` (a user error: one line).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        if exc.errno in _DISK_FULL_ERRNOS:
            raise _disk_full(exc, path) from exc
        raise
    os.close(fd)
    tmp = Path(tmp)
    try:
        # mkstemp creates 0600 files; give the result the permissions a plain open() would (umask applied).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno in _DISK_FULL_ERRNOS:
            raise _disk_full(exc, path) from exc
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically (NaN written as null-free JSON is not guaranteed)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, torch.Tensor):
        return o.detach().cpu().tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class _RecordingWriter:
    """A binary file for ``torch.save`` that remembers the ``OSError`` of a failed write: torch's zip writer reports
    it as an unspecific ``RuntimeError`` (a full disk reads ``unexpected pos ...``)."""

    def __init__(self, fh) -> None:
        self.fh = fh
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.fh.flush()


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> None:
    """``torch.save`` atomically (checkpoints survive a kill mid-write); a full disk raises
    :class:`~ctuq.errors.DiskFullError` naming ``path``."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        writer = _RecordingWriter(fh)
        try:
            torch.save(obj, writer)
            fh.flush()
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def atomic_write_tiff(path: str | os.PathLike, array: np.ndarray, **imwrite_kwargs: Any) -> None:
    """Write ``array`` as a TIFF (its own dtype) atomically with tifffile; ``imwrite_kwargs`` go to
    ``tifffile.imwrite`` (e.g. ``imagej=True``, ``resolution``, ``metadata``: :func:`ctuq.outputs.write_tiff`)."""
    with atomic_path(path) as tmp:
        tifffile.imwrite(tmp, np.ascontiguousarray(array), **imwrite_kwargs)


def json_digest(obj: Any) -> str:
    """The SHA-256 (hex) of ``obj`` (JSON values: dicts, lists, strings, numbers, ``None``) written as canonical JSON
    (sorted keys, no spaces): what a state file records of its own content, so that a file edited by hand is
    refused (:func:`check_fingerprint` catches only a file of another run)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, numpy and torch; return a CPU ``torch.Generator`` seeded with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` → CUDA when available else CPU; ``"cuda"`` without CUDA raises
    :class:`ctuq.errors.DeviceError` (a ``RuntimeError``) saying so."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(
            f"device {str(device)!r}: requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use --device cpu"
        )
    return dev


def progress(iterable=None, *, total=None, desc: str = "", disable: bool | None = None, **kw):
    """A tqdm progress bar writing to stderr; silenced when ``CTUQ_NO_PROGRESS=1`` or ``disable``."""
    if disable is None:
        disable = os.environ.get("CTUQ_NO_PROGRESS", "") == "1"
    return tqdm(iterable, total=total, desc=desc, disable=disable, dynamic_ncols=True, leave=False, **kw)


def as_rows(
    X: torch.Tensor, width: int, where: str, what: str, *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """``X`` checked to be a ``(batch, width)`` tensor and moved to ``device``/``dtype``.

    ``where`` (e.g. ``"LinearizedNetwork.jvp"``) and ``what`` (the argument's name) go into the error, which
    names the shape received and the one expected.
    """
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"{where}: {what} must be a torch.Tensor, got {type(X).__name__}")
    if X.ndim != 2 or X.shape[1] != width:
        raise ValueError(f"{where}: {what} has shape {tuple(X.shape)}; expected (batch, {width})")
    return X.to(device=device, dtype=dtype)


def check_fingerprint(
    saved: dict,
    now: dict,
    *,
    what: str,
    error: type[Exception] = ValueError,
    hint: str = "",
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-12,
) -> None:
    """Raise ``error`` naming the first key where a checkpoint's fingerprint ``saved`` differs from ``now``.

    Every checkpoint in ctuq (DIP fit, linearised inference, EM) stores a small dict of what determines its
    numbers (shapes, data checksums, settings) and refuses to resume another run's state through this one check.
    Floats compare with ``math.isclose(rel_tol, abs_tol)`` (checksums of float data move in the last bits across
    devices); everything else with ``==``.

    Parameters
    ----------
    saved, now : dict
        The checkpoint's fingerprint and this run's.
    what : str
        Names the checkpoint in the message, e.g. ``"cannot resume from runs/demo/uq_state.pt"``.
    error : exception type
        Raised on the first mismatch.
    hint : str
        Appended to the message (how to start afresh).
    """
    for key, value in now.items():
        old = saved.get(key) if isinstance(saved, dict) else None
        if isinstance(value, float) and isinstance(old, (int, float)) and not isinstance(old, bool):
            same = math.isclose(float(old), value, rel_tol=rel_tol, abs_tol=abs_tol)
        else:
            same = old == value
        if not same:
            raise error(f"{what}: its {key} is {old!r} but this run has {value!r}" + (f" ({hint})" if hint else ""))


def to_numpy(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A float32 numpy copy of an image tensor (any device, autograd detached) or array (same shape)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float32).numpy()
    return np.asarray(x, dtype=np.float32)


# glibc mallopt(3) parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_TUNED: bool | None = None


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed host memory for reuse instead of handing it back to the OS after every large tensor (glibc).

    glibc's ``malloc`` serves blocks above an adaptive threshold with ``mmap`` and returns free memory at the top of
    its heap once it exceeds twice that threshold, so a loop that allocates and frees tensors of a few MB (every
    chunk of Jacobian products, every batch of samples) page-faults all of its memory in again on each pass. This
    sets ``M_MMAP_THRESHOLD`` to ``mmap_threshold`` bytes (32 MiB, glibc's maximum: larger blocks are still mapped
    and unmapped) and ``M_TRIM_THRESHOLD`` to ``trim_threshold`` bytes (the most free heap memory kept, 1 GiB), for
    the whole process, from now on. Measured on 2 CPU cores: assembling the ``tiny`` U-Net's Jacobian (5008 JVPs at
    128²) 11.4 s instead of 15.6 s, with 0.28 M instead of 3.7 M page faults and 1.1 s instead of 7.3 s of system
    time; peak memory +40 MB. Setting only one of the two makes it worse (either disables glibc's adaptation).

    The ``ctuq`` command and the scripts call it; library users may call it once at start-up. It does nothing (and
    returns ``False``) outside Linux/glibc, when ``CTUQ_TUNE_MALLOC=0``, or when the environment already tunes
    malloc (``GLIBC_TUNABLES`` with ``glibc.malloc``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``).
    Returns ``True`` when both thresholds were set (or already had been: a later call changes nothing).
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED is not None:
        return _MALLOC_TUNED
    env = os.environ
    if (
        not sys.platform.startswith("linux")
        or env.get("CTUQ_TUNE_MALLOC", "1") == "0"
        or "glibc.malloc" in env.get("GLIBC_TUNABLES", "")
        or "MALLOC_MMAP_THRESHOLD_" in env
        or "MALLOC_TRIM_THRESHOLD_" in env
    ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - raises AttributeError outside glibc: musl's mallopt ignores these
    except (OSError, AttributeError):
        _MALLOC_TUNED = False
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _MALLOC_TUNED = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
        mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
    )
    return _MALLOC_TUNED


def derived_seed_words(seed: int, index: int) -> tuple[int, int]:
    """Two 32-bit words from numpy's ``SeedSequence([seed, index])``: the per-chunk (per-pass) seeds of every
    resumable random stream in ctuq, so a chunk's draws depend only on ``(seed, index)``, not on how many chunks
    ran before (resuming reproduces the uninterrupted run)."""
    if int(seed) < 0 or int(index) < 0:
        raise ValueError(f"derived_seed_words: seed and index must be >= 0, got {seed}, {index}")
    w = np.random.SeedSequence([int(seed), int(index)]).generate_state(2, dtype=np.uint32)
    return int(w[0]), int(w[1])
