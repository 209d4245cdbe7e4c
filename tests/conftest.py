import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


_S3_TESTS = "tests/s3/"


def _start_rank(item) -> int:
    """Longest first: ``slow`` tests, then ``multiproc`` ones, then the rest (a stable sort keeps their order)."""
    return 0 if "slow" in item.keywords else 1 if "multiproc" in item.keywords else 2


def pytest_collection_modifyitems(config, items):
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if skip is not None and "gpu" in item.keywords:
            item.add_marker(skip)
    # Under `pytest -n` a worker takes the next test as it frees up: the long ones start first, so the run
    # does not end on one worker still busy with a long test. (xdist sends the S3 tests, its largest unit,
    # first of all.)
    items.sort(key=_start_rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with every test of ``tests/s3/`` in one unit, so one worker runs them all against
    one S3 server. (An ``xdist_group`` mark does not group them: pytest 9.2 derives a node id from ``_id``,
    and xdist 3.8 writes the group into ``_nodeid``.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class S3TogetherScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "s3" if nodeid.startswith(_S3_TESTS) else super()._split_scope(nodeid)

    return S3TogetherScheduling(config, log)
