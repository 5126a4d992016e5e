import os

# One thread in every thread pool (torch's, and numpy's/scipy's OpenBLAS, which read these variables when they load,
# after this file; subprocesses inherit them). The tests' problems are tiny, so a second thread gains nothing on an
# idle machine, while on the two shared CI cores its hand-offs cost ~10 ms per operation (measured: 1.2 s vs 32 s
# for the same EM) and a spinning OpenBLAS thread can take several times a test's own CPU time.
for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_pool, "1")
os.environ.setdefault("CTUQ_NO_PROGRESS", "1")

import shutil  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import NO_FIGURES, sets, tiny_args  # noqa: E402

from ctuq.cli import main  # noqa: E402
from ctuq.data.simulate import simulate_scan  # noqa: E402


@pytest.fixture(scope="session")
def tiny_scan(tmp_path_factory):
    """A simulated walnut-layout scan at the ``tiny`` preset, written once per test session; tests read it and copy
    it before they damage anything."""
    path = tmp_path_factory.mktemp("scan") / "Walnut1"
    simulate_scan(path, preset="tiny", progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_run(tiny_scan, tmp_path_factory):
    """``ctuq reconstruct`` with uncertainty on :func:`tiny_scan` with the default settings otherwise (per-ray noise,
    the held-out bias model applied, figures), finished once per session. Read it; copy it to change it."""
    out = tmp_path_factory.mktemp("tiny_run") / "run"
    assert main(["reconstruct", "--data", str(tiny_scan), "--out", str(out), *tiny_args()]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_run_none(tiny_run, tmp_path_factory):
    """:func:`tiny_run` with its uncertainty phase rerun (``ctuq uq``) under ``uq.calibration: none`` and without
    figures: the posterior's own std map, every calibration method scored beside it. Read it; copy it to change it;
    reruns on a copy write no figures unless asked."""
    out = tmp_path_factory.mktemp("tiny_run_none") / "run"
    shutil.copytree(tiny_run, out)
    assert main(["uq", str(out), *sets("uq.calibration=none", *NO_FIGURES), "--no-progress"]) == 0
    return out


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
