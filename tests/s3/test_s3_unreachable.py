"""An S3 endpoint nobody listens on: every storage call raises ``CheckpointIOError``, never botocore's error.

No server: a port is bound, closed and used as ``AWS_ENDPOINT_URL``, so each
request is refused at once; ``AWS_MAX_ATTEMPTS=1`` turns botocore's retries
off (s3fs does not retry a refused connection), so each test takes well under
a second instead of 7-18 s of back-off.
"""

from __future__ import annotations

import errno
import socket

import pytest
import torch

from shardkit.checkpoint import load, save, validate_distributed
from shardkit.errors import CheckpointIOError
from shardkit.storage import storage_for

s3fs = pytest.importorskip("s3fs", reason="s3fs is in requirements-dev.txt")
botocore_exceptions = pytest.importorskip("botocore.exceptions")

from shardkit.bench.seaweedfs import CLEARED_ENV, client_env  # noqa: E402

URL = "s3://shardkit-down/run/ck"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_endpoint(monkeypatch):
    """Point clients at a closed port on loopback, with botocore's retries off; cached clients dropped around it."""
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**client_env(endpoint), "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield endpoint
    s3fs.S3FileSystem.clear_instance_cache()


def _assert_unreachable(e: CheckpointIOError, url: str) -> None:
    assert isinstance(e, OSError)
    assert url in str(e) and "could not be reached" in str(e) and "AWS_ENDPOINT_URL" in str(e)
    assert isinstance(e.__cause__, botocore_exceptions.EndpointConnectionError)
    assert e.errno == errno.ECONNREFUSED


def test_load_from_an_unreachable_endpoint_raises_checkpoint_io_error(dead_endpoint):
    with pytest.raises(CheckpointIOError) as caught:
        load({"w": torch.ones(2)}, URL)
    _assert_unreachable(caught.value, URL)


def test_save_to_an_unreachable_endpoint_raises_checkpoint_io_error(dead_endpoint):
    with pytest.raises(CheckpointIOError) as caught:
        save({"w": torch.ones(2)}, URL)
    _assert_unreachable(caught.value, URL)


def test_validate_reports_an_unreachable_endpoint_as_a_problem(dead_endpoint):
    report = validate_distributed(URL)
    assert not report.ok
    assert len(report.problems) == 1 and URL in report.problems[0] and "could not be reached" in report.problems[0]


@pytest.mark.parametrize("call", [
    lambda store, p: store.exists(p),
    lambda store, p: store.size_bytes(p),
    lambda store, p: store.listdir(p),
    lambda store, p: store.isdir(p),
    lambda store, p: store.modified_time(p),
    lambda store, p: store.open_reader(p),
    lambda store, p: store.open_file(p),
    lambda store, p: store.makedirs(p),
    lambda store, p: store.remove(p),
    lambda store, p: store.remove_files([p]),
    lambda store, p: store.remove_tree(p),
    lambda store, p: store.clear_directory(p),
    lambda store, p: store.remove_orphans(p),
], ids=["exists", "size_bytes", "listdir", "isdir", "modified_time", "open_reader", "open_file", "makedirs",
        "remove", "remove_files", "remove_tree", "clear_directory", "remove_orphans"])
def test_every_storage_call_raises_checkpoint_io_error(dead_endpoint, call):
    store, path = storage_for(URL + "/metadata.json")
    with pytest.raises(CheckpointIOError) as caught:
        call(store, path)
    assert isinstance(caught.value.__cause__, botocore_exceptions.EndpointConnectionError)


@pytest.mark.parametrize("nbytes", [10, 12 * 2**20], ids=["one-put", "multipart"])
def test_an_upload_to_an_unreachable_endpoint_raises_checkpoint_io_error(dead_endpoint, nbytes):
    store, path = storage_for(URL + "/rank_0.safetensors")
    with pytest.raises(CheckpointIOError) as caught:
        with store.atomic_writer(path) as f:
            f.write(b"x" * nbytes)
    _assert_unreachable(caught.value, path)
    assert "Nothing was published" in str(caught.value)


def test_a_ranged_read_from_an_unreachable_endpoint_raises_checkpoint_io_error(dead_endpoint):
    # A reader opened while the store answered, then the store went away: its reads fail typed.
    from shardkit.storage.backends.fsspec_store import S3RangeReader

    store, path = storage_for(URL + "/rank_0.safetensors")
    reader = S3RangeReader(path, store.fs, store.fs._strip_protocol(path), 1000)
    with pytest.raises(CheckpointIOError) as caught:
        reader.read_into(0, memoryview(bytearray(100)))
    _assert_unreachable(caught.value, path)


def test_a_bucket_name_s3_refuses_is_a_metadata_error(dead_endpoint):
    from shardkit.errors import MetadataError

    store, path = storage_for("s3://Bad_Bucket!/ck/metadata.json")
    with pytest.raises(MetadataError, match="not a valid object-store location"):
        store.size_bytes(path)
