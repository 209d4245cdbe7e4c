"""Untrusted checkpoint files: refuse what is not a regular file, and type every parsing failure.

Every file under a checkpoint directory may be damaged or hostile. Before
``shardkit.hf`` opens one it checks that the path is a regular file (a FIFO
blocks every reader forever; a directory or device fails in odd ways);
while it parses one, a builtin failure of the parser (``KeyError``,
``TypeError``, ``RecursionError``, ``NotImplementedError`` from a damaged
``.bin``, ...) becomes a :class:`MetadataError` that names the file. Errors
from the environment (``PermissionError``) pass through unchanged. This
module reads no file contents itself.

Example::

    require_regular_file(store, path)          # MetadataError for a FIFO, MissingShardError if absent
    with hostile_input(path, fix="re-save the checkpoint"):
        header = read_header(reader)
    index = read_json_file(store, path, fix="re-save the checkpoint")
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import zipfile
from typing import Iterator

from shardkit import knobs
from shardkit.errors import MetadataError, MissingShardError, ShardkitError
from shardkit.storage import LocalStorage, Storage, parse_json_object

__all__ = [
    "PARSE_FAILURES",
    "check_limits",
    "hostile_input",
    "non_regular_problems",
    "read_json_file",
    "require_regular_file",
]

#: What a parser of hostile bytes raises besides our own errors. MemoryError is
#: left out on purpose: limits keep allocations bounded, and hiding one would
#: mask a real shortage.
PARSE_FAILURES = (
    KeyError, TypeError, AttributeError, IndexError, ValueError, OverflowError, RecursionError,
    NotImplementedError, struct.error, zipfile.BadZipFile, EOFError, AssertionError,
)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)

#: Names in a checkpoint directory that some reader opens.
_READ_SUFFIXES = (".json", ".safetensors", ".bin")


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def require_regular_file(store: Storage, path: str) -> None:
    """Raise unless ``path`` (after symlinks) is a regular file; never opens it.

    ``MissingShardError`` when nothing is there, ``MetadataError`` for a FIFO,
    directory, socket, device, symlink loop or a parent that is a file.
    Remote storage has no such files: nothing is checked there.
    """
    if not isinstance(store, LocalStorage):
        return
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise MissingShardError(f"{path} does not exist; the checkpoint is incomplete or was moved") from e
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise
        raise MetadataError(f"{path} cannot be a checkpoint file ({e.strerror}); fix or remove it") from e
    if not stat.S_ISREG(st.st_mode):
        raise MetadataError(
            f"{path} is {_kind(st.st_mode)}, not a regular file; a checkpoint holds only regular files "
            f"(reading this one could block forever or fail). Remove it, or restore the file it replaced."
        )


def non_regular_problems(store: Storage, directory: str) -> list[str]:
    """One line per entry of ``directory`` a reader would open (``*.json``, ``*.safetensors``,
    ``*.bin``) that is not a regular file. Never raises for a bad entry."""
    if not isinstance(store, LocalStorage):
        return []
    problems = []
    try:
        names = [n for n in store.listdir(directory) if n.endswith(_READ_SUFFIXES)]
    except OSError as e:
        return [f"{directory} cannot be listed: {e}"]
    for name in names:
        try:
            require_regular_file(store, store.join(directory, name))
        except (MetadataError, MissingShardError, OSError) as e:
            problems.append(str(e))
    return problems


@contextlib.contextmanager
def hostile_input(source: str, *, fix: str) -> Iterator[None]:
    """Turn a builtin failure (see ``PARSE_FAILURES``) inside the block into ``MetadataError``.

    shardkit's own errors and ``OSError`` (permissions, I/O) pass through
    unchanged.
    """
    try:
        yield
    except ShardkitError:
        raise
    except PARSE_FAILURES as e:
        raise MetadataError(f"{source} is malformed or corrupt ({type(e).__name__}: {str(e)[:300]}); {fix}") from e


def read_json_file(store: Storage, path: str, *, fix: str) -> dict:
    """The JSON object in the regular file ``path`` (at most ``knobs.MAX_INDEX_BYTES``)."""
    require_regular_file(store, path)
    raw = store.read_bytes(path, max_bytes=knobs.MAX_INDEX_BYTES)
    # parse_json_object types decoding errors; a nesting too deep for the
    # parser (RecursionError) or an integer too long (ValueError) it may not.
    with hostile_input(path, fix=fix):
        return parse_json_object(path, raw, fix=fix)


def check_limits(source: str, what: str, names, *, max_count: int) -> None:
    """``MetadataError`` if ``names`` holds more than ``max_count`` entries or one longer than
    ``knobs.MAX_NAME_CHARS`` characters (non-strings are left to the caller)."""
    if len(names) > max_count:
        raise MetadataError(
            f"{source} has {len(names):,} {what}, over the limit of {max_count:,}; it is corrupt or hostile "
            f"(raise shardkit.knobs limits only for a file you trust)"
        )
    limit = knobs.MAX_NAME_CHARS
    long = next((n for n in names if isinstance(n, str) and len(n) > limit), None)
    if long is not None:
        raise MetadataError(
            f"{source} has a name of {len(long):,} characters ({long[:40]!r}...), over the limit of "
            f"{limit:,} (knobs.MAX_NAME_CHARS); it is corrupt or hostile"
        )
