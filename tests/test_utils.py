"""ctuq.utils.tune_malloc: glibc keeps freed memory for reuse, and stays untouched when told to."""

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest


def _glibc() -> bool:
    try:
        ctypes.CDLL("libc.so.6").gnu_get_libc_version  # noqa: B018 - AttributeError outside glibc
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


# Sixty-four 1 MB tensors allocated and freed, ten times after a warm-up: untuned, glibc returns the 64 MB to the
# OS on every free (its trim threshold adapts to twice the largest mapped block, 2 MB) and faults it in again
# (measured 33k faults; 0.8k-2.6k tuned).
_CHURN = textwrap.dedent("""
    import resource, torch
    from ctuq.utils import tune_malloc
    tuned = tune_malloc()
    def churn():
        ts = [torch.ones(1 << 18) for _ in range(64)]
        del ts
    churn()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        churn()
    print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
""")


def _run(env_extra: dict) -> tuple[bool, int]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CTUQ_TUNE_MALLOC", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    }
    env.update(env_extra, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True, text=True, check=True)
    tuned, faults = out.stdout.split()
    return tuned == "True", int(faults)


@pytest.mark.slow
@pytest.mark.skipif(not _glibc(), reason="glibc's mallopt only")
def test_tune_malloc_keeps_freed_memory_and_honours_opt_out():
    tuned, faults = _run({})
    untuned, faults_off = _run({"CTUQ_TUNE_MALLOC": "0"})
    assert tuned and not untuned
    # 10 × 64 MB = 164k pages; untuned measured 33k faults, tuned 0.8k-2.6k
    assert faults_off > 15_000, faults_off
    assert faults < faults_off / 5, (faults, faults_off)
    # an environment that tunes malloc itself is left alone
    assert _run({"MALLOC_TRIM_THRESHOLD_": str(1 << 30)})[0] is False
