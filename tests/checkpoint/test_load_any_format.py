"""``shardkit.checkpoint.load`` reads every checkpoint shardkit reads: its own, PyTorch DCP and Hugging Face.

One process here (plain tensors: each leaf's box is the whole tensor; a box
read is checked through the source's ``read_boxes``); the DTensor / FSDP2
cases on 1-3 Gloo ranks are in ``tests/multiproc/test_load_any_format_multirank.py``.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardkit.checkpoint as ckpt
from byte_counting import counting_reads
from shardkit.errors import IncompleteCheckpointError, MetadataError, MissingShardError, TensorMismatchError
from shardkit.layout import Box
from shardkit.sources import complete_kind, detect_kind, format_problems, open_source

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _llama(tied=True, seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).to(dtype)


def _hf(tmp_path, tied=True, dtype=torch.bfloat16, **kwargs):
    model = _llama(tied, seed=1, dtype=dtype)
    path = tmp_path / f"hf-{tied}-{str(dtype)[6:]}"
    model.save_pretrained(path, **kwargs)
    return str(path), {n: t.detach().clone() for n, t in model.state_dict().items()}


def _untied_state(model):
    """The model's state with every name its own tensor (what a state loaded leaf by leaf looks like)."""
    return {n: torch.full_like(t, -7.0) for n, t in model.state_dict().items()}


def _digest(path):
    return {n: hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest() for n in sorted(os.listdir(path))}


def test_hf_bf16_into_fp32_needs_cast_and_then_equals_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM

    path, saved = _hf(tmp_path)
    before = _digest(path)
    state = _llama(seed=2).state_dict()
    snapshot = {n: t.clone() for n, t in state.items()}
    with pytest.raises(TensorMismatchError, match="cast=True"):
        ckpt.load(state, path)
    assert all(torch.equal(state[n], snapshot[n]) for n in state)  # refused before a byte was read
    ckpt.load(state, path, cast=True)
    reference = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert set(state) == set(reference)
    for name, t in state.items():
        assert t.dtype == torch.float32 and torch.equal(t, reference[name]), name
    assert _digest(path) == before  # nothing saved is changed by a load


def test_cast_converts_floating_dtypes_only(tmp_path):
    ckpt.save({"n": torch.arange(4), "w": torch.ones(2, dtype=torch.bfloat16)}, tmp_path)
    with pytest.raises(TensorMismatchError, match="only between floating"):
        ckpt.load({"n": torch.zeros(4), "w": torch.zeros(2)}, tmp_path, cast=True)
    state = {"n": torch.zeros(4, dtype=torch.int64), "w": torch.zeros(2, dtype=torch.float64)}
    ckpt.load(state, tmp_path, cast=True)
    assert state["w"].dtype == torch.float64 and torch.equal(state["w"], torch.ones(2, dtype=torch.float64))


def test_tied_weights_stored_once_fill_both_names(tmp_path):
    path, saved = _hf(tmp_path, dtype=torch.float32)
    assert "lm_head.weight" not in open_source(path).tensors()   # save_pretrained keeps the embedding only
    state = _untied_state(_llama(seed=3))
    ckpt.load(state, path)
    assert torch.equal(state["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(state["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    tied_model = _llama(seed=3)                                   # one tensor under both names: read once
    ckpt.load(tied_model.state_dict(), path)
    assert tied_model.lm_head.weight is tied_model.model.embed_tokens.weight
    assert torch.equal(tied_model.lm_head.weight, saved["model.embed_tokens.weight"])


def test_prefix_and_rename_map_checkpoint_names_to_state_names(tmp_path):
    from transformers import LlamaModel

    path, saved = _hf(tmp_path, tied=False, dtype=torch.float32)
    base = LlamaModel(_llama(tied=False).config).state_dict()       # names without "model."
    ckpt.load(base, path, prefix="model.")                          # lm_head.weight: outside the prefix
    assert all(torch.equal(t, saved["model." + n]) for n, t in base.items())
    wrapped = {"net": _untied_state(_llama(tied=False)), "step": 0}
    with pytest.raises(TensorMismatchError, match="prefix=/rename="):
        ckpt.load(wrapped, path, allow_partial=False, exclude=["step"])
    ckpt.load(wrapped, path, rename=lambda n: "net." + n, exclude=["step"])
    assert all(torch.equal(wrapped["net"][n], t) for n, t in saved.items()) and wrapped["step"] == 0
    dropped = _untied_state(_llama(tied=False))
    ckpt.load(dropped, path, rename=lambda n: None if n.startswith("lm_head") else n, allow_partial=True)
    assert (dropped["lm_head.weight"] == -7).all()                 # rename -> None: skipped


def test_prefix_selects_part_of_a_shardkit_checkpoint(tmp_path):
    w, b = torch.randn(3, 4), torch.randn(3)
    ckpt.save({"model": {"w": w, "b": b}, "optim": {"lr": 0.1}, "step": 5}, tmp_path)
    bare = {"w": torch.zeros(3, 4), "b": torch.zeros(3)}
    ckpt.load(bare, tmp_path, prefix="model.")                     # optim.* and step are outside: not unexpected
    assert torch.equal(bare["w"], w) and torch.equal(bare["b"], b)


def test_allow_partial_and_exclude(tmp_path):
    ckpt.save({"w": torch.ones(3), "b": torch.full((2,), 2.0)}, tmp_path)
    state = {"w": torch.zeros(3), "b": torch.zeros(2), "extra": torch.full((1,), 9.0), "tag": "x"}
    with pytest.raises(TensorMismatchError, match="allow_partial=True"):
        ckpt.load(state, tmp_path)
    ckpt.load(state, tmp_path, allow_partial=True)
    assert state["w"].sum() == 3 and state["extra"].item() == 9 and state["tag"] == "x"
    state = {"w": torch.zeros(3), "b": torch.zeros(2)}
    ckpt.load(state, tmp_path, exclude=["b*"])                    # neither read nor "unexpected"
    assert state["w"].sum() == 3 and state["b"].sum() == 0
    with pytest.raises(TensorMismatchError, match="strict=False"):
        ckpt.load({"w": torch.zeros(3)}, tmp_path)


def test_dcp_checkpoint_loads_like_dcp_load(tmp_path):
    state = {"model": {"w": torch.randn(6, 4), "b": torch.randn(4).to(torch.bfloat16)},
             "optim": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.99)}]}, "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    ours = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
            "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}, "step": 0}
    theirs = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
              "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}, "step": 0}
    ckpt.load(ours, tmp_path)
    dcp.load(theirs, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(ours["model"]["w"], theirs["model"]["w"])
    assert torch.equal(ours["model"]["b"], state["model"]["b"])
    assert ours["step"] == theirs["step"] == 7
    assert ours["optim"]["param_groups"][0] == {"lr": 0.5, "betas": (0.9, 0.99)}


def test_hf_bin_and_sharded_safetensors_load(tmp_path):
    path, saved = _hf(tmp_path, tied=False, dtype=torch.float32, max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    state = _untied_state(_llama(tied=False))
    ckpt.load(state, path)
    assert all(torch.equal(state[n], t) for n, t in saved.items())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save({n: t.to(torch.bfloat16) for n, t in saved.items()}, bin_dir / "pytorch_model.bin")
    state = _untied_state(_llama(tied=False))
    ckpt.load(state, bin_dir, cast=True)
    assert all(torch.equal(state[n], t.to(torch.bfloat16).float()) for n, t in saved.items())


def test_a_box_read_reads_only_its_rows(tmp_path):
    from safetensors.torch import save_file

    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    save_file({"w": w, "other": torch.zeros(1000)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with counting_reads() as counted, open_source(str(tmp_path)) as src:
        src.tensors()
        header = counted.total()
        got = src.read_boxes({"w": Box((16, 0), (8, 32))})["w"]
    assert torch.equal(got, w[16:24])
    assert counted.total() - header <= 8 * 32 * 4 + 8 + 4096   # the rows (and the engine's own header read)
    with counting_reads() as counted, open_source(str(tmp_path)) as src:
        state = {"w": torch.zeros(64, 32)}
        ckpt.load(state, str(tmp_path), strict=False)
    assert counted.total() < w.numel() * 4 + 1000 * 4           # "other" is never read


def test_a_directory_without_a_checkpoint_says_what_it_holds(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "weights.pt").write_bytes(b"\0")
    with pytest.raises(MetadataError, match=r"is not a checkpoint: it holds 2 entries: notes.txt, weights.pt"):
        ckpt.load({"w": torch.zeros(1)}, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MetadataError, match="is not a checkpoint: it is empty"):
        ckpt.load({"w": torch.zeros(1)}, tmp_path / "empty")
    with pytest.raises(MissingShardError):
        ckpt.load({"w": torch.zeros(1)}, tmp_path / "absent")
    (tmp_path / "rank_0.safetensors").write_bytes(b"")
    with pytest.raises(IncompleteCheckpointError, match="never finished"):
        ckpt.load({"w": torch.zeros(1)}, tmp_path)


def test_one_detector_for_a_directory_with_both_metadata_json_and_an_hf_index(tmp_path):
    from shardkit.cli.target import checkpoint_kind
    from shardkit.hf import get_checkpoint_metadata, load_checkpoint, save_checkpoint

    mixed = str(tmp_path / "mixed")
    ckpt.save({"w": torch.ones(3)}, mixed)
    save_checkpoint(mixed, {"w": torch.full((3,), 2.0)}, safetensors=True)   # beside it: an HF index
    assert {"metadata.json", "model.safetensors.index.json"} <= set(os.listdir(mixed))
    assert detect_kind(mixed) == checkpoint_kind(mixed) == "distributed"
    assert get_checkpoint_metadata(mixed).distributed
    state = {"w": torch.zeros(3)}
    ckpt.load(state, mixed)
    assert torch.equal(state["w"], torch.ones(3)) and torch.equal(load_checkpoint(mixed, None)["w"], torch.ones(3))


def test_complete_kind_says_which_complete_format(tmp_path):
    ckpt.save({"w": torch.ones(3)}, tmp_path / "sk")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    hf_path, _ = _hf(tmp_path, dtype=torch.float32)
    assert [complete_kind(p) for p in (tmp_path / "sk", tmp_path / "dcp", hf_path)] == ["distributed", "dcp", "hf"]
    distcp = next(n for n in os.listdir(tmp_path / "dcp") if n.endswith(".distcp"))
    with open(tmp_path / "dcp" / distcp, "r+b") as f:
        f.truncate(10)
    kind, problems = format_problems(tmp_path / "dcp")
    assert kind == "dcp" and "never finished" in problems[0] and complete_kind(tmp_path / "dcp") is None
    os.remove(tmp_path / "sk" / "rank_0.safetensors")
    assert complete_kind(tmp_path / "sk") is None and complete_kind(tmp_path / "nothing") is None
    os.remove(os.path.join(hf_path, "model.safetensors"))
    assert complete_kind(hf_path) is None


def test_damaged_or_hostile_files_get_typed_errors(tmp_path):
    path, _ = _hf(tmp_path, dtype=torch.float32)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 16)                                    # the header length: garbage
    with pytest.raises(MetadataError):
        ckpt.load(_llama().state_dict(), path)
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(MetadataError, match="restricted unpickler"):
        ckpt.load({"w": torch.zeros(3)}, tmp_path / "dcp")
    assert not (tmp_path / "pwned").exists()
    (tmp_path / "binhf").mkdir()
    with open(tmp_path / "binhf" / "pytorch_model.bin", "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(MetadataError, match="weights_only"):
        ckpt.load({"w": torch.zeros(3)}, tmp_path / "binhf")
    assert not (tmp_path / "pwned").exists()


def test_seed_format_checkpoints_load_with_options(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(7, 3, dtype=torch.float64)
    (tmp_path / "metadata.json").write_text(json.dumps(
        {"num_ranks": 2, "tensor_specs": {"net.w": {"full_shape": [7, 3], "shard_dim": 0, "shard_sizes": [4, 3]}}}))
    save_file({"net.w": w[:4].contiguous()}, str(tmp_path / "rank_0.safetensors"))
    save_file({"net.w": w[4:].contiguous()}, str(tmp_path / "rank_1.safetensors"))
    state = {"w": torch.zeros(7, 3)}
    ckpt.load(state, tmp_path, prefix="net.", cast=True)
    assert torch.equal(state["w"], w.float())


def test_non_contiguous_and_overlapping_targets_are_staged(tmp_path):
    w = torch.randn(3, 4)
    dcp.save({"w": w, "v": torch.arange(6.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    base = torch.zeros(4, 3)
    buffer = torch.zeros(8)
    state = {"w": base.t(), "v": buffer[:6]}                      # a transposed view; a view of a bigger buffer
    ckpt.load(state, tmp_path)
    assert torch.equal(base.t(), w) and torch.equal(buffer, torch.cat([torch.arange(6.0), torch.zeros(2)]))


def test_a_cast_into_cpu_tensors_stages_at_most_cpu_stage_bytes_at_once(monkeypatch):
    import shardkit.checkpoint.loading.fill as fill_module

    monkeypatch.setattr(fill_module, "CPU_STAGE_BYTES", 64)       # 32 bf16 elements
    saved = {f"t{i}": torch.full((16,), float(i), dtype=torch.bfloat16) for i in range(5)}
    targets = {n: torch.zeros(16) for n in saved}                   # fp32: staged, then cast by copy_
    groups = []

    def read(names, outputs):
        groups.append(list(names))
        return {n: saved[n].clone() for n in names}

    fill_module.fill(targets, {n: torch.bfloat16 for n in saved}, read, apart=set())
    assert groups == [["t0", "t1"], ["t2", "t3"], ["t4"]]             # was: one group of all five
    assert all(torch.equal(targets[n], saved[n].float()) for n in saved)


def test_with_read_rows_a_cast_goes_slab_by_slab_through_one_scratch(monkeypatch):
    import shardkit.checkpoint.loading.fill as fill_module

    monkeypatch.setattr(fill_module, "SLAB_BYTES", 3 * 8 * 2)      # three bf16 rows of 8
    saved = {"a": torch.randn(7, 8).to(torch.bfloat16), "s": torch.tensor(2.5, dtype=torch.bfloat16)}
    targets = {"a": torch.zeros(7, 8), "s": torch.zeros(())}
    calls, buffers = [], set()

    def read_rows(name, first, count, out):
        calls.append((name, first, count))
        buffers.add(out.untyped_storage().data_ptr())
        out.copy_(saved[name][first:first + count])

    fill_module.fill(targets, {n: torch.bfloat16 for n in saved},
                     lambda names, outputs: {n: saved[n].clone() for n in names}, apart=set(), read_rows=read_rows)
    assert calls == [("a", 0, 3), ("a", 3, 3), ("a", 6, 1)] and len(buffers) == 1
    assert torch.equal(targets["a"], saved["a"].float()) and targets["s"].item() == 2.5   # a scalar: staged whole
