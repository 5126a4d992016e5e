import os

import pytest
import torch

from ctuq.data.simulate import simulate_scan

os.environ.setdefault("CTUQ_NO_PROGRESS", "1")
# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny problems: OpenMP hand-offs cost ~10 ms per operation when the two CI
    cores are shared (measured: 1.2 s vs 32 s for the same EM), and gloo subprocesses must not oversubscribe the
    cores; restored afterwards. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_scan(tmp_path_factory):
    """A simulated walnut-layout scan at the ``tiny`` preset, written once per test session; tests read it and copy
    it before they damage anything."""
    path = tmp_path_factory.mktemp("scan") / "Walnut1"
    simulate_scan(path, preset="tiny", progress=False)
    return path


@pytest.fixture(scope="session")
def tiny_uq_args():
    """``ctuq reconstruct`` arguments for a seconds-long run with uncertainty on :func:`tiny_scan`: 32² image, every
    2nd angle used (the other half held out for the held-out check), 60 DIP iterations without TV, 64 posterior
    samples, 3 EM steps."""
    settings = (
        "data.image_shape=[32, 32]",
        "data.angular_subsampling=2",
        "data.detector_subsampling=3",
        "dip.iterations=60",
        "tv.enabled=false",
        "uq.samples=64",
        "uq.em_steps=3",
    )
    return [arg for setting in settings for arg in ("--set", setting)] + ["--no-progress"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
