"""Offline tools over whole checkpoints: reshard, convert (export / import), diff; all-or-nothing output.

Beside :mod:`shardkit.hf` and :mod:`shardkit.sources` (it reads through
:func:`shardkit.sources.open_source` and writes with the storage and
checkpoint writers), below the CLI. Every writer streams one tensor (or
slice) at a time into a temporary sibling directory, reading the next one
while it writes the current one (:mod:`~shardkit.offline.write_overlap`; memory:
two reused buffers of about the largest chunk it moves), checks the result
without re-reading the data (the block checksums are those of the bytes
written), and renames it into place: the destination is complete or absent,
never half written.

Example::

    from shardkit.offline import reshard_checkpoint, export_hf, diff_checkpoints

    reshard_checkpoint("ckpt/step-100", "ckpt/step-100-ws3", world_size=3)
    export_hf("dcp_ckpt", "hf_out", prefix="model.")
    report = diff_checkpoints("a", "b")
"""

from shardkit.offline.diff import DiffReport, diff_checkpoints
from shardkit.offline.publish import publish_directory
from shardkit.offline.write import export_distributed, export_hf, reshard_checkpoint

__all__ = ["DiffReport", "diff_checkpoints", "publish_directory", "export_distributed", "export_hf",
           "reshard_checkpoint"]
