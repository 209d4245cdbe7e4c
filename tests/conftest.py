import os
import sys

import pytest
import torch

# tests/ on the path so test modules can `from ranks import run_ranks`.
sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

# the repository root, for `benchmarks` and `examples`
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
