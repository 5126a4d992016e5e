import os

import pytest
import torch

os.environ.setdefault("CTUQ_NO_PROGRESS", "1")
# Two cores on CI: keep torch from oversubscribing them.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
