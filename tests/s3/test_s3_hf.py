"""Hugging Face checkpoints and checkpoint directories on a real S3 server (SeaweedFS).

The HF round trip through S3 (safetensors and ``.bin``), conversion to and
from distributed checkpoints with both ends on S3, ``from_pretrained`` of a
checkpoint downloaded from it, and the directory functions
(``find_latest_checkpoint``, ``maybe_delete_oldest_checkpoint``) on ``s3://``.
"""

from __future__ import annotations


import torch
from hf_helpers import assert_same_state, tiny_llama

from shardkit.hf import (  # noqa: E402
    distributed_to_hf,
    find_latest_checkpoint,
    hf_to_distributed,
    list_checkpoints,
    load_checkpoint,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    save_checkpoint,
    validate_checkpoint,
)


def test_hf_round_trip_through_s3_and_from_pretrained_of_the_download(s3_url, s3fs_client, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_llama(tied=True).eval()
    url = s3_url + "/model"
    save_checkpoint(url, src, safetensors=True, max_shard_size=20_000)
    assert validate_checkpoint(url)
    back = tiny_llama(tied=True, seed=1)
    load_checkpoint(url, back)
    assert_same_state(src, back)

    local = tmp_path / "download"
    s3fs_client.get(url[len("s3://"):] + "/", str(local), recursive=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(local)).eval()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, src(ids).logits)

    bin_url = s3_url + "/bin"
    save_checkpoint(bin_url, src, safetensors=False, max_shard_size=20_000)
    assert validate_checkpoint(bin_url)
    back = tiny_llama(tied=True, seed=2)
    load_checkpoint(bin_url, back)
    assert_same_state(src, back)


def test_convert_between_distributed_and_hf_with_both_ends_on_s3(s3_url):
    state = {"a.weight": torch.randn(40, 8), "b.bias": torch.arange(5.0)}
    hf_url, dist_url, back_url = s3_url + "/hf", s3_url + "/dist", s3_url + "/hf2"
    save_checkpoint(hf_url, state, safetensors=True)
    hf_to_distributed(hf_url, dist_url, world_size=2)
    distributed_to_hf(dist_url, back_url, max_shard_size=200)
    assert validate_checkpoint(dist_url) and validate_checkpoint(back_url)
    out = load_checkpoint(back_url)
    assert set(out) == set(state) and all(torch.equal(out[n], state[n]) for n in state)


def test_latest_and_rotation_on_s3_skip_incomplete_and_delete_objects(s3_url, s3fs_client):
    for step in (1, 2, 3):
        save_checkpoint(next_checkpoint_path(s3_url, step), {"w": torch.full((10,), float(step))}, safetensors=True)
    # an interrupted save: weights but no index/weights-file name the loaders know
    broken = next_checkpoint_path(s3_url, 4)
    s3fs_client.pipe(broken[len("s3://"):] + "/model-00001-of-00002.safetensors", b"partial")
    assert find_latest_checkpoint(s3_url) == next_checkpoint_path(s3_url, 3)
    maybe_delete_oldest_checkpoint(s3_url, max_checkpoints=2, best_checkpoint=next_checkpoint_path(s3_url, 1))
    assert list_checkpoints(s3_url) == [next_checkpoint_path(s3_url, 1), next_checkpoint_path(s3_url, 3)]
    assert not s3fs_client.exists(next_checkpoint_path(s3_url, 2)[len("s3://"):] + "/model.safetensors")
    assert s3fs_client.exists(broken[len("s3://"):])  # incomplete checkpoints are never touched
