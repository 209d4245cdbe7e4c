"""The requests one save makes to a real S3 server (SeaweedFS, see conftest.py).

Every S3 API call of the client is recorded (aiobotocore's ``_make_api_call``):
a save asks nothing it does not need (no HEAD / LIST to see whether a file
is there), copies or renames nothing (a rename on S3 is the whole object
again), withdraws the old commit in one request before any data goes out,
and puts ``metadata.json`` last, after the data object is complete.
"""

from __future__ import annotations

import pytest
import torch

import shardkit.checkpoint as ckpt
from shardkit import knobs
from shardkit.storage import storage_for

MIB = 1024 * 1024


@pytest.fixture
def s3_calls(monkeypatch, s3_server) -> list[tuple[str, str]]:
    """``(operation, key)`` of every S3 call this process makes while the test runs."""
    import aiobotocore.client

    calls: list[tuple[str, str]] = []
    original = aiobotocore.client.AioBaseClient._make_api_call

    async def recorded(self, operation, params):
        calls.append((operation, params.get("Key", "")))
        return await original(self, operation, params)

    monkeypatch.setattr(aiobotocore.client.AioBaseClient, "_make_api_call", recorded)
    return calls


def _state() -> dict:
    # Big tensors with tiny ones between them (as a model's norms and biases): parts cut
    # from the tensors' memory and small ones joined.
    g = torch.Generator().manual_seed(3)
    return {"a.big": torch.randn(3 * MIB, generator=g), "a.norm": torch.randn(7, generator=g),
            "b.big": torch.randn(2 * MIB + 5, generator=g), "b.scale": torch.tensor(2.5),
            "c.mid": torch.randn(MIB // 3, generator=g).to(torch.bfloat16), "step": 7}


def test_a_save_asks_nothing_copies_nothing_and_puts_the_manifest_last(s3_url, s3_calls, monkeypatch):
    monkeypatch.setattr(knobs, "OBJECT_PART_BYTES", 8 * MIB)
    state = _state()
    ckpt.save(state, s3_url)
    ops = [op for op, _ in s3_calls]
    assert not {"CopyObject", "UploadPartCopy", "HeadObject", "ListObjectsV2", "ListObjects"} & set(ops), ops
    assert ops.count("DeleteObjects") == 1 and ops.count("HeadBucket") <= 1, ops
    first_data = ops.index("CreateMultipartUpload")
    assert ops.index("DeleteObjects") < first_data  # the old commit is withdrawn before any data
    assert ops[-1] == "PutObject" and s3_calls[-1][1].endswith("/metadata.json")
    assert ops[-2] == "CompleteMultipartUpload" and s3_calls[-2][1].endswith("/rank_0.safetensors")
    assert ops.count("PutObject") == 1  # the manifest: no lock, marker or temporary object
    parts = ops.count("UploadPart")
    assert 3 <= parts <= 4  # 22 MiB in parts of 5..13 MiB
    assert len(ops) == parts + 5, ops  # HeadBucket (makedirs), DeleteObjects, create, complete, manifest

    restored = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    ckpt.load(restored, s3_url)
    assert all(torch.equal(restored[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
    assert ckpt.validate_distributed(s3_url).ok


def test_an_overwrite_withdraws_the_old_manifest_first_in_one_request(s3_url, s3_calls, s3fs_client):
    ckpt.save({"w": torch.ones(4)}, s3_url)
    s3_calls.clear()
    ckpt.save({"w": torch.full((4,), 2.0)}, s3_url)
    ops = [op for op, _ in s3_calls]
    assert ops.index("DeleteObjects") < ops.index("PutObject")
    assert [op for op in ops if op == "PutObject"] == ["PutObject"] * 2  # small data file, then the manifest
    assert s3_calls[-1][1].endswith("/metadata.json")
    out = {"w": torch.zeros(4)}
    ckpt.load(out, s3_url)
    assert torch.equal(out["w"], torch.full((4,), 2.0))


def test_remove_files_deletes_what_is_there_and_ignores_what_is_not(s3_url, s3fs_client, s3_calls):
    storage, directory = storage_for(s3_url)
    there = storage.join(directory, "there.json")
    s3fs_client.pipe_file(there, b"{}")
    s3_calls.clear()
    storage.remove_files([there, storage.join(directory, "missing.json")])
    assert [op for op, _ in s3_calls] == ["DeleteObjects"]
    assert not s3fs_client.exists(there)
