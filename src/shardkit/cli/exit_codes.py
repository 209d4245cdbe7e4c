"""The exit codes of the ``shardkit`` command, and which error gets which: one table for every subcommand.

``diff`` keeps ``diff(1)``'s meaning of 1 ("they differ"), so a damaged
checkpoint there is trouble, 2. Every other subcommand answers a damaged or
incomplete checkpoint with 1, whether it was validating it or reading it to
convert or reshard.

Example::

    exit_code_for(ChecksumError("..."))           # 1: the checkpoint is bad
    exit_code_for(CheckpointExistsError("..."))   # 2: the destination is taken
"""

from __future__ import annotations

from shardkit.errors import (CheckpointBusyError, CheckpointError, CheckpointExistsError, CheckpointIOError,
                             ShardkitError, TensorMismatchError)

__all__ = ["EXIT_OK", "EXIT_BAD_CHECKPOINT", "EXIT_USAGE", "EXIT_INTERNAL", "EXIT_BROKEN_PIPE",
           "EXIT_INTERRUPTED", "EXIT_CODES", "exit_code_for"]

EXIT_OK, EXIT_BAD_CHECKPOINT, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
EXIT_BROKEN_PIPE, EXIT_INTERRUPTED = 141, 130  # as a shell reports SIGPIPE and SIGINT

EXIT_CODES = """exit codes:
  0  success (the checkpoint is complete and intact; diff: they are identical)
  1  the checkpoint is bad: incomplete, corrupt, or it failed validation (diff: they differ)
  2  bad usage, input or environment: a missing path, not a checkpoint, an unreadable file,
     a destination that exists, a refused option value (diff: this, or either side is bad)
  3  an internal error (a bug; set SHARDKIT_DEBUG=1 for the traceback and report it)

Set SHARDKIT_DEBUG=1 to print the traceback of any error."""

#: Checkpoint errors about the destination, the machine or the request (an option or a tensor that does not
#: fit the checkpoint, such as a --prefix no name starts with), not about the checkpoint's content.
_NOT_THE_CHECKPOINT = (CheckpointExistsError, CheckpointBusyError, CheckpointIOError, TensorMismatchError)


def exit_code_for(error: BaseException) -> int:
    """``EXIT_BAD_CHECKPOINT`` for a damaged or incomplete checkpoint, ``EXIT_USAGE`` for any other
    shardkit error or ``OSError``, ``EXIT_INTERNAL`` for the rest (a bug)."""
    if isinstance(error, CheckpointError) and not isinstance(error, _NOT_THE_CHECKPOINT):
        return EXIT_BAD_CHECKPOINT
    if isinstance(error, (ShardkitError, OSError)):
        return EXIT_USAGE
    return EXIT_INTERNAL
