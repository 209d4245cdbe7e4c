"""A process that saves a checkpoint to S3 and SIGKILLs itself part-way (run by test_s3_checkpoint.py, test_s3_manager.py).

Usage: ``python kill_child.py URL AT [manager]``. ``AT``:

- ``mid_upload``: after the first part of ``rank_0.safetensors`` is uploaded
  (its multipart upload is never completed);
- ``before_manifest``: every data object is complete, ``metadata.json`` is not written.

With ``manager``, a ``CheckpointManager`` on ``URL`` (``keep_last=5``, blocking
saves) first saves steps 1 and 2 (1000 floats of value ``step``), then is killed
at ``AT`` while saving step 3 (``rank_0.safetensors`` then lies under ``step-3/``).

Wraps the S3 writer in this process only, so production code carries no test
hooks. Exits with code 3 when the kill point is never reached.
"""

from __future__ import annotations

import os
import signal
import sys

import torch


def _die_at(at: str) -> None:
    import shardkit.storage.backends.s3_upload as s3_upload

    writer = s3_upload.S3MultipartWriter
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


def _big(step: int) -> dict:
    return {"w": torch.full((3 * 1024 * 1024,), float(step)), "step": step}  # 12 MiB: three parts


def main(url: str, at: str, api: str = "save_distributed") -> None:
    from shardkit import knobs
    from shardkit.checkpoint import CheckpointManager, save_distributed

    knobs.OBJECT_PART_BYTES = 5 * 1024 * 1024
    if api == "manager":
        mgr = CheckpointManager(url, keep_last=5, async_save=False)
        for step in (1, 2):
            mgr.save(step, {"w": torch.full((1000,), float(step)), "step": step})
        mgr.wait()
        _die_at(at)
        mgr.save(3, _big(3))
    else:
        _die_at(at)
        save_distributed(_big(2), url, 0, 1, None)
    sys.exit(3)


if __name__ == "__main__":
    main(*sys.argv[1:])
