"""A process that saves a checkpoint to S3 and SIGKILLs itself part-way (run by test_s3_checkpoint.py).

Usage: ``python kill_child.py URL AT``. ``AT``:

- ``mid_upload``: after the first part of ``rank_0.safetensors`` is uploaded
  (its multipart upload is never completed);
- ``before_manifest``: every data object is complete, ``metadata.json`` is not written.

Wraps the S3 writer in this process only, so production code carries no test
hooks. Exits with code 3 when the kill point is never reached.
"""

from __future__ import annotations

import os
import signal
import sys

import torch


def main(url: str, at: str) -> None:
    from shardkit import knobs
    from shardkit.checkpoint import save_distributed
    from shardkit.storage import fsspec_store

    knobs.OBJECT_PART_BYTES = 5 * 1024 * 1024
    writer = fsspec_store._S3MultipartWriter
    real_upload, real_commit = writer._upload_part, writer.commit

    def upload_part(self, number, body):
        out = real_upload(self, number, body)
        if at == "mid_upload" and self._key.endswith("rank_0.safetensors"):
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    def commit(self):
        if at == "before_manifest" and self._key.endswith("metadata.json"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_commit(self)

    writer._upload_part, writer.commit = upload_part, commit
    state = {"w": torch.full((3 * 1024 * 1024,), 2.0), "step": 2}  # 12 MiB: three parts
    save_distributed(state, url, 0, 1, None)
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
