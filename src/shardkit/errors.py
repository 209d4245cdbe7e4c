"""The shardkit exception tree.

Every error shardkit raises derives from :class:`ShardkitError`, and also from
the builtin that fits, so ``except ValueError`` or ``except FileNotFoundError``
keep working in code that does not know shardkit.

Messages say what was found, what was allowed, and how to fix it; callers
chain the cause with ``raise ... from e``.

Example::

    try:
        load_distributed(path, rank=0, world_size=2)
    except MissingShardError as e:      # also a FileNotFoundError
        print(e)
"""

from __future__ import annotations

__all__ = [
    "ShardkitError",
    "CheckpointError",
    "MetadataError",
    "MissingShardError",
    "MissingBaseError",
    "ChecksumError",
    "IncompleteCheckpointError",
    "TensorMismatchError",
    "AsyncCheckpointError",
    "CommError",
    "UnsupportedOpError",
    "InvalidRankError",
    "CommTimeoutError",
    "CommAbortedError",
    "CommArgumentError",
    "CheckpointExistsError",
    "CheckpointBusyError",
    "CheckpointIOError",
    "AsyncCheckpointIOError",
    "AsyncWaitTimeout",
]


class ShardkitError(Exception):
    """Root of every error shardkit raises."""


class CheckpointError(ShardkitError):
    """A checkpoint could not be saved, read or checked."""


class MetadataError(CheckpointError, ValueError):
    """Bad or unknown metadata, index or file header."""


class MissingShardError(CheckpointError, FileNotFoundError):
    """A file a checkpoint needs is not there."""


class MissingBaseError(MissingShardError):
    """An incremental checkpoint's base (a sibling checkpoint it reads unchanged chunks from) is gone or
    was replaced; the message names the base."""


class ChecksumError(CheckpointError):
    """Bytes read back do not match the checksum recorded when they were saved."""


class IncompleteCheckpointError(CheckpointError):
    """A save that never finished: no manifest, or files shorter than recorded."""


class TensorMismatchError(CheckpointError, ValueError):
    """A shape, dtype or key does not match what was expected."""


class AsyncCheckpointError(CheckpointError):
    """A background save failed, or was used wrongly (e.g. two in flight)."""


class CommError(ShardkitError):
    """A collective or process-group operation failed."""


class UnsupportedOpError(CommError):
    """The operation is not supported on this group, backend or device."""


class InvalidRankError(CommError, ValueError):
    """A rank, root or world size is out of range."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not finish within the group's timeout (a peer may be dead)."""


class CommAbortedError(CommError):
    """The group was aborted; the operation was interrupted or refused."""


class CommArgumentError(CommError, ValueError):
    """Tensors passed to a collective do not fit it (count, shape, dtype or device)."""


class InputError(ShardkitError, ValueError):
    """Bad usage or input the command line finds itself (exit code 2): a path that is missing,
    unreadable or not a checkpoint, an option value it refuses."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """Something already exists where a checkpoint, one of its files or a link would go (an earlier
    save's files of this rank, a real file where a link goes), and overwriting was not asked for."""


class CheckpointBusyError(CheckpointError):
    """Another save is writing the same checkpoint directory right now (one writer at a time)."""


class CheckpointIOError(CheckpointError, OSError):
    """Saving hit the disk's or the system's limits: disk full or quota (``ENOSPC``,
    ``EDQUOT``), a read-only file system (``EROFS``), no permission (``EACCES``, ``EPERM``);
    or an object store's client failed a save or a load: unreachable endpoint, access
    denied, a broken transfer (``storage.backends.store_errors``; the client's exception is the
    ``__cause__``, ``errno`` is the underlying one where there is one, e.g. ``ECONNREFUSED``).

    An ``OSError`` too, with ``errno``, ``strerror`` and ``filename`` of the
    failure, so ``except OSError`` and ``e.errno == errno.ENOSPC`` keep working.
    The message says what happened, where, that files already saved are
    untouched, and what to do.

    Example::

        try:
            save_distributed(state, "/ckpt/step-10", rank, world_size, spec)
        except CheckpointIOError as e:
            if e.errno == errno.ENOSPC:
                prune_old_checkpoints()
    """

    def __init__(self, message: str, errno: int | None = None, strerror: str | None = None,
                 filename: str | None = None):
        super().__init__(message)
        self.errno, self.strerror, self.filename = errno, strerror, filename

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        return type(self), (str(self), self.errno, self.strerror, self.filename)


class AsyncCheckpointIOError(AsyncCheckpointError, CheckpointIOError):
    """A background save failed with a :class:`CheckpointIOError`: ``except AsyncCheckpointError``,
    ``except CheckpointIOError`` and ``except OSError`` all catch it, with the same ``errno``."""


class AsyncWaitTimeout(CheckpointError, TimeoutError):
    """``CheckpointFuture.wait(timeout)`` ran out of time; the save is still running.

    Not an :class:`AsyncCheckpointError`: nothing failed. The future stays
    valid; call ``wait()`` again.
    """
