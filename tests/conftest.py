import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    s3_tests = os.path.join(os.path.dirname(__file__), "s3") + os.sep
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if str(item.path).startswith(s3_tests):
            item.add_marker(pytest.mark.xdist_group("s3"))    # one S3 server per run under `pytest -n`
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
