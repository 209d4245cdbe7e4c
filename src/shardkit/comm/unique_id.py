"""The rendezvous token that lets ranks in different processes find each other.

A :class:`UniqueId` is 128 bytes: a magic tag, a format version, the TCP port
and host where rank 0 will serve a ``torch.distributed.TCPStore``, and a random
nonce that names this group inside that store. It carries no tensor data and
opens no socket itself; rank 0 does that in ``Group.init_rank``.

Example::

    uid = UniqueId.new()                      # on one process
    payload = uid.as_bytes()                  # send it to the others any way you like
    Group.init_rank(rank, world_size, UniqueId.from_bytes(payload))
"""

from __future__ import annotations

import os
import socket
import struct

from shardkit.errors import CommArgumentError

__all__ = ["UniqueId", "UNIQUE_ID_BYTES"]

UNIQUE_ID_BYTES = 128
_MAGIC = b"SKID"
_VERSION = 1
_HEADER = struct.Struct(">4sBHB16s")  # magic, version, port, host length, nonce
_MAX_HOST = UNIQUE_ID_BYTES - _HEADER.size


def _free_port(host: str) -> int:
    # The port is free now; a tiny race remains until rank 0 binds it, the same
    # trade torchrun makes with MASTER_PORT.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("" if host != "127.0.0.1" else host, 0))
        return s.getsockname()[1]


def _default_host() -> str:
    """This machine's address as other machines would reach it, loopback if unknown."""
    env = os.environ.get("SHARDKIT_RENDEZVOUS_HOST") or os.environ.get("MASTER_ADDR")
    if env:
        return env
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class UniqueId:
    """A 128-byte, picklable rendezvous token: where rank 0 hosts the store, and a nonce.

    It does not reserve the port (rank 0 binds it when it calls
    ``Group.init_rank``) and it is meant for one group: create a new one per group.

    Example::

        uid = UniqueId.new(host="10.0.0.5")
        assert UniqueId.from_bytes(uid.as_bytes()) == uid
    """

    __slots__ = ("host", "port", "nonce")

    def __init__(self, host: str, port: int, nonce: bytes):
        if not 0 < port < 65536:
            raise CommArgumentError(f"UniqueId port must be in 1..65535, got {port}")
        if len(nonce) != 16:
            raise CommArgumentError(f"UniqueId nonce must be 16 bytes, got {len(nonce)}")
        if len(host.encode()) > _MAX_HOST:
            raise CommArgumentError(
                f"UniqueId host {host!r} is {len(host.encode())} bytes; at most {_MAX_HOST} fit. "
                "Use an IP address instead of a long host name."
            )
        self.host, self.port, self.nonce = host, int(port), bytes(nonce)

    @staticmethod
    def new(host: str | None = None, port: int | None = None) -> "UniqueId":
        """A fresh id: ``host`` defaults to this machine's address, ``port`` to a free one."""
        host = host or _default_host()
        return UniqueId(host, port or _free_port(host), os.urandom(16))

    def as_bytes(self) -> bytes:
        """Exactly 128 bytes, zero-padded."""
        host = self.host.encode()
        head = _HEADER.pack(_MAGIC, _VERSION, self.port, len(host), self.nonce)
        return (head + host).ljust(UNIQUE_ID_BYTES, b"\0")

    @staticmethod
    def from_bytes(b: bytes) -> "UniqueId":
        """Parse what :meth:`as_bytes` wrote; a wrong length or tag raises ``CommArgumentError``."""
        b = bytes(b)
        if len(b) != UNIQUE_ID_BYTES:
            raise CommArgumentError(
                f"a UniqueId is exactly {UNIQUE_ID_BYTES} bytes, got {len(b)}; "
                "pass the whole value of UniqueId.as_bytes()"
            )
        magic, version, port, host_len, nonce = _HEADER.unpack_from(b)
        if magic != _MAGIC or version != _VERSION or host_len > _MAX_HOST:
            raise CommArgumentError(
                f"these 128 bytes are not a shardkit UniqueId (tag {magic!r}, version {version}); "
                "they must come from UniqueId.as_bytes() of the same shardkit version"
            )
        host = b[_HEADER.size:_HEADER.size + host_len].decode()
        return UniqueId(host, port, nonce)

    def store_prefix(self) -> str:
        """The key prefix this group uses inside the shared store."""
        return f"shardkit/{self.nonce.hex()}/"

    def __reduce__(self):
        return (UniqueId.from_bytes, (self.as_bytes(),))

    def __eq__(self, other) -> bool:
        return isinstance(other, UniqueId) and self.as_bytes() == other.as_bytes()

    def __hash__(self) -> int:
        return hash(self.as_bytes())

    def __repr__(self) -> str:
        return f"UniqueId(host={self.host!r}, port={self.port}, nonce={self.nonce.hex()[:8]}…)"
