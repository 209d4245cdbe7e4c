import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _start_rank(item) -> int:
    """Longest first: ``slow`` tests, then ``multiproc`` ones, then the rest (a stable sort keeps their order)."""
    return 0 if "slow" in item.keywords else 1 if "multiproc" in item.keywords else 2


def pytest_collection_modifyitems(config, items):
    s3_tests = os.path.join(os.path.dirname(__file__), "s3") + os.sep
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if str(item.path).startswith(s3_tests):
            item.add_marker(pytest.mark.xdist_group("s3"))    # one S3 server per run under `pytest -n`
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
    # Under `pytest -n` a worker takes the next test as it frees up: the long ones start first, so the run
    # does not end on one worker still busy with a long test. (xdist sends the S3 group, its largest unit,
    # first of all.)
    items.sort(key=_start_rank)
