"""``CheckpointManager`` on a real S3 server (SeaweedFS, see conftest.py).

Rotation deletes every object of a rotated step (counted with s3fs), a save
killed part-way is skipped and its leftovers (objects and incomplete multipart
uploads) go with the next rotation, and a step missing a data object, a
truncated one or a temporary name never counts.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardkit.checkpoint import CheckpointManager, validate_distributed
from shardkit.checkpoint.format.ownership import OWNER_FILE
from shardkit.storage import temp_name


def _key(url: str) -> str:
    return url[len("s3://"):]


def _objects(fs, url: str) -> list[str]:
    """The object keys under ``url``, relative to it."""
    return sorted(k[len(_key(url)) + 1:] for k in fs.find(_key(url)))


def _uploads(fs, url: str) -> list[str]:
    bucket, _, prefix = _key(url).partition("/")
    return [u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])]


def _state(v: float) -> dict:
    return {"w": torch.full((64, 4), v), "opt": {"lr": 0.1 * v}, "step": int(v)}


@pytest.mark.parametrize("async_save", [True, False])
def test_rotation_deletes_every_object_of_the_rotated_steps(s3_url, s3fs_client, async_save):
    mgr = CheckpointManager(s3_url, keep_last=2, best=("loss", "min"), async_save=async_save)
    for step, loss in [(1, 9.0), (2, 1.0), (3, 5.0)]:
        mgr.save(step, _state(step), metrics={"loss": loss})
    mgr.wait()
    per_step = [OWNER_FILE, "metadata.json", "rank_0.safetensors"]
    before = _objects(s3fs_client, s3_url)
    assert before == [f"step-{s}/{n}" for s in (2, 3) for n in per_step]      # 1 rotated: neither last nor best
    mgr.save(4, _state(4), metrics={"loss": 7.0})
    mgr.save(5, _state(5), metrics={"loss": 8.0})
    mgr.close()
    after = _objects(s3fs_client, s3_url)
    assert after == [f"step-{s}/{n}" for s in (2, 4, 5) for n in per_step]    # best (2) and the last two
    assert s3fs_client.ls(_key(s3_url), detail=False) == [f"{_key(s3_url)}/step-{s}" for s in (2, 4, 5)]
    assert mgr.steps() == [2, 4, 5] and mgr.metrics(2) == {"loss": 1.0}
    target = _state(0)
    assert CheckpointManager(s3_url).restore(target) == 5
    assert torch.equal(target["w"], _state(5)["w"]) and target["opt"] == {"lr": 0.5} and target["step"] == 5


@pytest.mark.parametrize("at", ["mid_upload", "before_manifest"])
def test_resume_from_the_latest_complete_step_after_a_killed_save(s3_url, s3fs_client, at):
    child = os.path.join(os.path.dirname(__file__), "kill_child.py")
    proc = subprocess.run([sys.executable, child, s3_url, at, "manager"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == -9, proc.stderr[-2000:]
    step3 = s3_url + "/step-3"
    if at == "mid_upload":   # the data object is an incomplete upload: invisible, but there
        assert _uploads(s3fs_client, s3_url) and not s3fs_client.exists(_key(step3) + "/rank_0.safetensors")
    else:                    # the data object is complete, the commit is not
        assert _objects(s3fs_client, step3) == [OWNER_FILE, "rank_0.safetensors"]
    assert not validate_distributed(step3).ok
    mgr = CheckpointManager(s3_url, keep_last=5, async_save=False)
    assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
    target = {"w": torch.zeros(1000), "step": 0}
    assert mgr.restore(target) == 2
    assert target["step"] == 2 and torch.equal(target["w"], torch.full((1000,), 2.0))
    mgr.save(4, {"w": torch.full((1000,), 4.0), "step": 4})   # the crashed step is older: rotated away
    mgr.close()
    assert mgr.steps() == [1, 2, 4]
    assert not _objects(s3fs_client, step3) and not _uploads(s3fs_client, s3_url)
    assert "step-3" not in [p.rsplit("/", 1)[-1] for p in s3fs_client.ls(_key(s3_url), detail=False)]


def test_saving_the_killed_step_again_clears_its_leftovers(s3_url, s3fs_client):
    child = os.path.join(os.path.dirname(__file__), "kill_child.py")
    proc = subprocess.run([sys.executable, child, s3_url, "mid_upload", "manager"], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert _uploads(s3fs_client, s3_url)
    with CheckpointManager(s3_url, keep_last=5) as mgr:
        mgr.save(3, {"w": torch.full((10,), 3.0), "step": 3})
    assert mgr.steps() == [1, 2, 3] and not _uploads(s3fs_client, s3_url)
    assert _objects(s3fs_client, s3_url + "/step-3") == [OWNER_FILE, "metadata.json", "rank_0.safetensors"]


def test_a_step_missing_a_data_object_or_truncated_or_temporary_is_skipped(s3_url, s3fs_client):
    with CheckpointManager(s3_url, keep_last=10, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    s3fs_client.rm(_key(s3_url) + "/step-3/rank_0.safetensors")                 # missing data object
    data = s3fs_client.cat(_key(s3_url) + "/step-2/rank_0.safetensors")
    s3fs_client.pipe(_key(s3_url) + "/step-2/rank_0.safetensors", data[:-8])    # truncated
    s3fs_client.pipe(f"{_key(s3_url)}/{temp_name('step-9')}/metadata.json", b"{}")
    s3fs_client.pipe(f"{_key(s3_url)}/step-8/{OWNER_FILE}", b"{}")            # a save's mark, then
    s3fs_client.pipe(f"{_key(s3_url)}/step-8/rank_0.safetensors", b"half")     # no commit
    mgr = CheckpointManager(s3_url, keep_last=10, async_save=False)
    assert mgr.steps() == [1] and mgr.latest_step() == 1
    target = _state(0)
    assert mgr.restore(target) == 1 and torch.equal(target["w"], _state(1)["w"])
    mgr.save(10, _state(10))
    mgr.close()
    assert mgr.steps() == [1, 10]
    left = {p.rsplit("/", 1)[-1] for p in s3fs_client.ls(_key(s3_url), detail=False)}
    assert left == {"step-1", "step-10"}    # incomplete steps rotated, the temporary removed as an orphan
    assert _objects(s3fs_client, s3_url) == [f"step-{s}/{n}" for s in (1, 10)
                                             for n in (OWNER_FILE, "metadata.json", "rank_0.safetensors")]


def test_a_root_with_glob_characters_rotates_only_its_own_steps(s3_url, s3fs_client):
    # ``[l]`` is part of the name, not a pattern: the sibling run ``expl`` and its only step stay.
    other = CheckpointManager(f"{s3_url}/runs/expl", keep_last=5, async_save=False)
    other.save(1, _state(1))
    other.wait()
    mgr = CheckpointManager(f"{s3_url}/runs/exp[l]", keep_last=1, async_save=False)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
        mgr.wait()
    assert other.steps() == [1]
    assert mgr.steps() == [3]
    assert _objects(s3fs_client, s3_url) == [f"runs/{run}/step-{s}/{n}" for run, s in (("exp[l]", 3), ("expl", 1))
                                             for n in (OWNER_FILE, "metadata.json", "rank_0.safetensors")]


def test_rotation_at_a_bucket_root_aborts_only_its_own_incomplete_uploads(s3_server, s3fs_client, monkeypatch):
    # Another job's upload in flight in the same bucket stays; the manager's own (a killed save's,
    # under a step and under a temporary name) go, found over several pages of the listing.
    import aiobotocore.client

    from shardkit.bench.seaweedfs import make_bucket

    bucket = f"root-{os.getpid()}-{len(s3fs_client.ls(''))}"
    make_bucket(bucket)
    theirs = ["other-job/run/step-7/rank_0.safetensors", "rank_0.safetensors", "step-x/rank_0.safetensors",
              "step-9/__0_0.distcp"]   # another tool's step-9 (no shardkit mark), being uploaded
    mine = ["step-5/rank_0.safetensors", f"{temp_name('step-6')}/rank_0.safetensors"]
    for key in theirs + mine:
        s3fs_client.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    s3fs_client.pipe(f"{bucket}/step-5/{OWNER_FILE}", b"{}")   # a killed save marked its step before uploading
    pages, original = [], aiobotocore.client.AioBaseClient._make_api_call

    async def two_a_page(self, operation, params):  # the listing must follow NextKeyMarker
        if operation == "ListMultipartUploads":
            params = {**params, "MaxUploads": 2}
            pages.append(params)
        return await original(self, operation, params)

    monkeypatch.setattr(aiobotocore.client.AioBaseClient, "_make_api_call", two_a_page)
    mgr = CheckpointManager(f"s3://{bucket}", keep_last=1, async_save=False)
    for step in (1, 2):
        mgr.save(step, _state(step))
        mgr.wait()
    monkeypatch.undo()
    assert len(pages) >= 3 and mgr.steps() == [2]
    left = [u["Key"] for u in s3fs_client.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])]
    assert sorted(left) == sorted(theirs)
