"""Multi-node on loopback into S3 (issue 13): two ``torchrun`` launchers save into the SeaweedFS
fixture's bucket, a one-node job resumes from it. The scenario and the workers' script live in
``tests/multiproc/test_multinode.py``; the launchers inherit the fixture's ``AWS_*`` variables."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

_SCENARIO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "multiproc",
                         "test_multinode.py")


def _scenario():
    spec = importlib.util.spec_from_file_location("_shardkit_multinode_scenario", _SCENARIO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_node_save_to_s3_resumes_on_one_node(s3_url):
    _scenario().two_node_save_then_one_node_load(s3_url + "/step-7")
