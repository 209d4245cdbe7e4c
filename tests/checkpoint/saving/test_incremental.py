"""Incremental checkpoints (``save(..., base=)``, format version 3): references, proofs, failures.

One process; the crash, multi-rank and object-store cases are in
``test_incremental_crash.py``, ``tests/multiproc/test_incremental_multirank.py``
and ``tests/s3/test_s3_incremental.py``.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit.checkpoint import CheckpointManager, validate_distributed
from shardkit.checkpoint.format.manifest import read_manifest
from shardkit.errors import ChecksumError, MetadataError, MissingBaseError, MissingShardError
from shardkit.offline.diff import diff_checkpoints
from shardkit.offline.write import export_hf, reshard_checkpoint
from shardkit.storage import storage_for


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"frozen": torch.randn(64, 32, generator=g), "emb": torch.randn(40, 8, generator=g).bfloat16(),
                      "ids": torch.arange(30, dtype=torch.int64)},
            "lora": {"a": torch.zeros(4, 32), "b": torch.zeros(32, 4)}, "step": 0}


def _empty_like(state: dict) -> dict:
    return {k: _empty_like(v) if isinstance(v, dict) else torch.empty_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def _same_bits(a: dict, b: dict) -> None:
    for k, v in b.items():
        if isinstance(v, dict):
            _same_bits(a[k], v)
        elif isinstance(v, torch.Tensor):
            assert a[k].dtype == v.dtype and torch.equal(a[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
        else:
            assert a[k] == v, k


def _meta(d) -> dict:
    with open(os.path.join(d, "metadata.json")) as f:
        return json.load(f)


def _first_chunks(d) -> dict:
    """Each tensor's first chunk entry in ``d``'s metadata.json (``"base"`` in it: a reference)."""
    return {n: t["chunks"][0] for n, t in _meta(d)["tensor_specs"].items()}


def _loads_bit_for_bit(d, state: dict) -> None:
    out = _empty_like(state)
    ck.load(out, str(d))
    _same_bits(out, state)


def _chain(tmp_path, n: int = 3) -> tuple[list[str], list[dict]]:
    """Steps 0..n-1: step 0 full, each later one changes only the LoRA tensors (and step 2 one id)."""
    dirs, states = [], []
    st = _state()
    for i in range(n):
        d = str(tmp_path / f"step-{i}")
        st["lora"]["a"] += 1
        st["step"] = i
        if i == 2:
            st["model"]["ids"][3] = -7
        ck.save(st, d, base=dirs[-1] if dirs else None)
        dirs.append(d)
        states.append({k: ({kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
                           if isinstance(v, dict) else v) for k, v in st.items()})
    return dirs, states


def test_chain_loads_bit_for_bit_and_references_the_file_that_holds_the_bytes(tmp_path):
    dirs, states = _chain(tmp_path, 3)
    for d, expected in zip(dirs, states):
        out = _empty_like(expected)
        ck.load(out, d)
        _same_bits(out, expected)
        assert validate_distributed(d).ok, validate_distributed(d)
    assert _meta(dirs[0])["format_version"] == 3 and "bases" not in _meta(dirs[0])
    m2 = _meta(dirs[2])
    assert m2["format_version"] == 3
    specs = m2["tensor_specs"]
    frozen = specs["model.frozen"]["chunks"][0]
    # flattened: step 2 names step 0's file directly, never step 1's
    assert m2["bases"][frozen["base"]]["dir"] == "step-0"
    assert "base" not in specs["lora.a"]["chunks"][0] and "base" not in specs["model.ids"]["chunks"][0]
    assert m2["bases"][specs["lora.b"]["chunks"][0]["base"]]["dir"] == "step-0"   # never changed
    assert {b["dir"] for b in m2["bases"]} == {"step-0"}     # step 1's own file holds nothing step 2 reads
    # the referenced file's record is copied: every referenced byte is verified on load
    assert m2["bases"][0]["files"]["rank_0.safetensors"] == _meta(dirs[0])["files"]["rank_0.safetensors"]


def test_only_changed_bytes_are_written(tmp_path):
    dirs, states = _chain(tmp_path, 2)
    full = os.path.getsize(os.path.join(dirs[0], "rank_0.safetensors"))
    inc = os.path.getsize(os.path.join(dirs[1], "rank_0.safetensors"))
    lora_a_bytes = 4 * 32 * 4
    assert inc < lora_a_bytes + 1024 < full


def test_unchanged_means_equal_bytes_not_equal_values_or_untouched(tmp_path):
    st = {"z": torch.zeros(16), "n": torch.full((8,), float("nan")), "same": torch.ones(8)}
    ck.save(st, str(tmp_path / "s0"))
    st["z"][5] = -0.0            # == 0.0 as a value, different bytes
    st["n"].view(torch.int32)[0] ^= 1   # another NaN payload: NaN != NaN, bytes differ
    st["same"].mul_(1.0)         # touched (version counter moved), bytes equal
    ck.save(st, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    chunks = _first_chunks(tmp_path / "s1")
    assert "base" not in chunks["z"] and "base" not in chunks["n"] and "base" in chunks["same"]
    _loads_bit_for_bit(tmp_path / "s1", st)


def test_conjugate_and_negative_views_are_compared_as_the_values_they_show(tmp_path):
    # A lazy conj / neg view holds the base's raw bytes but shows other values: it must be written.
    z = torch.randn(64, dtype=torch.complex64)
    x = torch.randn(64)
    ck.save({"z": z, "x": x, "zc": z.conj().resolve_conj()}, str(tmp_path / "s0"))
    st = {"z": z.conj(), "x": torch._neg_view(x), "zc": z.conj()}   # "zc": another view, the same values
    ck.save(st, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    chunks = _first_chunks(tmp_path / "s1")
    assert "base" not in chunks["z"] and "base" not in chunks["x"] and "base" in chunks["zc"]
    out = {"z": torch.zeros(64, dtype=torch.complex64), "x": torch.zeros(64), "zc": torch.zeros(64, dtype=torch.complex64)}
    ck.load(out, str(tmp_path / "s1"))
    assert torch.equal(out["z"], z.conj().resolve_conj()) and torch.equal(out["x"], -x)
    assert torch.equal(out["zc"], z.conj().resolve_conj())


def test_a_base_manifest_range_that_is_not_where_the_header_puts_the_tensor_proves_nothing(tmp_path):
    # The damaged base points "a" at the bytes of "b"; a load would read "a" where the file's header
    # puts it. Comparing at the manifest's range would reference the old "a" for a new "a" equal to "b".
    st = {"a": torch.zeros(1024), "b": torch.ones(1024)}
    ck.save(st, str(tmp_path / "s0"))
    meta = _meta(tmp_path / "s0")
    specs = meta["tensor_specs"]
    specs["a"]["chunks"][0]["byte_range"] = specs["b"]["chunks"][0]["byte_range"]
    (tmp_path / "s0" / "metadata.json").write_text(json.dumps(meta))
    st["a"] = torch.ones(1024)
    ck.save(st, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    chunks = _first_chunks(tmp_path / "s1")
    assert "base" not in chunks["a"] and "base" in chunks["b"]
    _loads_bit_for_bit(tmp_path / "s1", st)


def test_changed_shape_or_dtype_is_written(tmp_path):
    ck.save({"w": torch.ones(4, 4), "v": torch.ones(4)}, str(tmp_path / "s0"))
    st = {"w": torch.ones(2, 8), "v": torch.ones(4, dtype=torch.int32).view(torch.float32)}
    ck.save(st, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    assert "bases" not in _meta(tmp_path / "s1")
    _loads_bit_for_bit(tmp_path / "s1", st)


def test_removed_base_is_a_typed_error_naming_it(tmp_path):
    dirs, states = _chain(tmp_path, 3)
    shutil.rmtree(dirs[0])
    with pytest.raises(MissingBaseError, match="step-0"):
        ck.load(_empty_like(states[2]), dirs[2])
    report = validate_distributed(dirs[2])
    assert not report.ok and "step-0" in str(report)
    # a partial load that needs nothing from the base still works
    out = {"lora": {"a": torch.empty(4, 32)}}
    ck.load(out, dirs[2], strict=False, allow_partial=True)
    assert torch.equal(out["lora"]["a"], states[2]["lora"]["a"])


def test_replaced_base_never_loads_other_bytes(tmp_path):
    dirs, states = _chain(tmp_path, 2)
    other = _state(seed=5)
    shutil.rmtree(dirs[0])
    ck.save(other, dirs[0])      # same name, same sizes, other bytes
    with pytest.raises(MissingBaseError, match="replaced"):
        ck.load(_empty_like(states[1]), dirs[1])
    assert not validate_distributed(dirs[1]).ok


def test_corrupt_base_file_is_caught_by_its_copied_checksums(tmp_path):
    dirs, states = _chain(tmp_path, 2)
    path = os.path.join(dirs[0], "rank_0.safetensors")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\xff")
    with pytest.raises(ChecksumError):
        ck.load(_empty_like(states[1]), dirs[1])   # loads verify by default
    assert "corrupt" in str(validate_distributed(dirs[1]))


def test_missing_base_file_is_missing(tmp_path):
    dirs, states = _chain(tmp_path, 2)
    os.remove(os.path.join(dirs[0], "rank_0.safetensors"))
    with pytest.raises(MissingShardError):
        ck.load(_empty_like(states[1]), dirs[1])


def test_bad_bases_are_refused_before_writing(tmp_path):
    st = _state()
    ck.save(st, str(tmp_path / "a" / "s0"))
    with pytest.raises(MetadataError, match="beside"):
        ck.save(st, str(tmp_path / "b" / "s1"), base=str(tmp_path / "a" / "s0"))
    with pytest.raises(MetadataError, match="beside"):
        ck.save(st, str(tmp_path / "a" / "s0"), base=str(tmp_path / "a" / "s0"))
    with pytest.raises(MissingShardError):
        ck.save(st, str(tmp_path / "a" / "s2"), base=str(tmp_path / "a" / "nothing"))
    assert ck.CheckpointManager(str(tmp_path / "a")).steps() == []   # and nothing was committed
    assert not os.path.exists(tmp_path / "a" / "s2" / "metadata.json")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["bases"][0].update(dir="../x"), "base checkpoint"),
    (lambda m: m["bases"][0].update(dir="/abs"), "base checkpoint"),
    (lambda m: m["bases"][0].update(dir="a/b"), "base checkpoint"),
    (lambda m: m["tensor_specs"]["model.frozen"]["chunks"][0].update(base=7), "base 7"),
    (lambda m: m["tensor_specs"]["model.frozen"]["chunks"][0].update(file="rank_9.safetensors"), "does not record"),
    (lambda m: m["tensor_specs"]["model.frozen"]["chunks"][0].update(file="../rank_0.safetensors"), "'..'"),
    (lambda m: m.update(format_version=2), "references need version 3"),
    (lambda m: m["bases"][0]["files"].update({"x/rank_0.safetensors": m["bases"][0]["files"]["rank_0.safetensors"]}),
     "plain names"),
])
def test_hostile_references_are_refused(tmp_path, edit, message):
    dirs, _ = _chain(tmp_path, 2)
    m = _meta(dirs[1])
    edit(m)
    with open(os.path.join(dirs[1], "metadata.json"), "w") as f:
        json.dump(m, f)
    with pytest.raises(MetadataError, match=message):
        read_manifest(*storage_for(dirs[1]))


def test_reshard_convert_diff_of_a_chain(tmp_path):
    dirs, states = _chain(tmp_path, 3)
    reshard_checkpoint(dirs[2], str(tmp_path / "resharded"), 3)
    export_hf(dirs[2], str(tmp_path / "hf"))
    for d in dirs:
        shutil.move(d, d + ".gone")   # the outputs are self-contained: they need no step any more
    assert "bases" not in _meta(tmp_path / "resharded")
    resharded = _flat_load(tmp_path / "resharded")
    assert torch.equal(resharded["model.frozen"], states[2]["model"]["frozen"])
    assert torch.equal(resharded["lora.a"], states[2]["lora"]["a"])
    from safetensors.torch import load_file
    hf = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert torch.equal(hf["model.frozen"], states[2]["model"]["frozen"])
    assert torch.equal(hf["lora.a"], states[2]["lora"]["a"])
    for d in dirs:
        shutil.move(d + ".gone", d)
    report = diff_checkpoints(dirs[1], dirs[2]).to_json()
    status = {t["name"]: t["status"] for t in report["tensors"]}
    assert status["lora.a"] == "different" and status["model.ids"] == "different"
    assert status["model.frozen"] == "identical" and status["lora.b"] == "identical"


def _flat_load(d) -> dict:
    from shardkit.checkpoint import load_consolidated
    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        else:
            out[prefix[:-1]] = v
    walk("", load_consolidated(str(d)))
    return out


def test_manager_keeps_referenced_steps_and_frees_them(tmp_path):
    root = str(tmp_path / "run")
    st = _state()
    with CheckpointManager(root, keep_last=1, incremental=True, async_save=False) as mgr:
        for step in range(4):
            st["lora"]["a"] += 1
            mgr.save(step, st)
            mgr.wait()
        assert mgr.steps() == [0, 3]          # step 0 holds what step 3 references
        assert _meta(mgr.step_dir(3))["bases"][0]["dir"] == "step-0"
        st["model"]["frozen"] += 1
        st["model"]["emb"] += 1
        st["model"]["ids"] += 1
        st["lora"]["b"] += 1
        st["lora"]["a"] += 1
        mgr.save(4, st)                       # everything changed: references nothing
        mgr.wait()
        assert mgr.steps() == [4]             # nothing references step 0 any more: freed
        out = _empty_like(st)
        assert mgr.restore(out) == 4
        _same_bits(out, st)


def test_manager_full_every_and_restore_after_a_base_is_kept(tmp_path):
    root = str(tmp_path / "run")
    st = _state()
    with CheckpointManager(root, keep_last=2, incremental=True, full_every=3, async_save=True) as mgr:
        for step in range(7):
            st["lora"]["a"] += 1
            mgr.save(step, st)
        mgr.wait()
        full = [s for s in range(7) if os.path.isdir(mgr.step_dir(s)) and "bases" not in _meta(mgr.step_dir(s))]
        assert full == [3, 6], full                 # 0 full, 1-2 incremental, 3 full, 4-5, 6 full
        assert mgr.steps() == [3, 5, 6]            # 3 stays while 5 (kept) references it
        for s in mgr.steps():
            assert validate_distributed(mgr.step_dir(s)).ok
    with CheckpointManager(root, keep_last=2, incremental=True) as mgr:
        out = _empty_like(st)
        assert mgr.restore(out) == 6
        _same_bits(out, st)


def test_async_save_with_a_base(tmp_path):
    st = _state()
    ck.save(st, str(tmp_path / "s0"))
    st["lora"]["a"] += 1
    ck.async_save(st, str(tmp_path / "s1"), base=str(tmp_path / "s0")).wait()
    st["lora"]["a"] += 100          # after the staging copy: the save keeps what was staged
    m = _meta(tmp_path / "s1")
    assert m["format_version"] == 3 and "base" not in m["tensor_specs"]["lora.a"]["chunks"][0]
    assert "base" in m["tensor_specs"]["model.frozen"]["chunks"][0]
    out = _empty_like(st)
    ck.load(out, str(tmp_path / "s1"))
    assert torch.equal(out["lora"]["a"], st["lora"]["a"] - 100)


def test_block_digest_only_ever_proves_a_difference(tmp_path, monkeypatch):
    from shardkit import knobs
    from shardkit.storage.backends.local import LocalStorage
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", 4096)    # many whole blocks inside each chunk
    monkeypatch.setattr(LocalStorage, "renames_directories", False)   # digests first, as on object stores
    st = {"head": torch.arange(8192.0), "tail": torch.arange(8192.0), "same": torch.arange(8192.0)}
    ck.save(st, str(tmp_path / "s0"))
    assert _meta(tmp_path / "s0")["files"]["rank_0.safetensors"]["block_bytes"] == 4096
    st["head"][1024:] = -1.0     # covers the first whole block inside the chunk: its digest differs
    st["tail"][-1] = -1.0        # after it: the first whole block's digest matches, the bytes do not
    ck.save(st, str(tmp_path / "s1"), base=str(tmp_path / "s0"))
    chunks = _first_chunks(tmp_path / "s1")
    assert "base" not in chunks["head"] and "base" not in chunks["tail"] and "base" in chunks["same"]
    _loads_bit_for_bit(tmp_path / "s1", st)


def test_a_base_written_with_grid_entries_is_referenced_through_its_files_headers(tmp_path, monkeypatch):
    # Jobs of COMPACT_MIN_RANKS ranks or more write grid entries, whose byte ranges only the files' headers hold.
    from shardkit import knobs
    monkeypatch.setattr(knobs, "COMPACT_MIN_RANKS", 1)
    state = _state()
    ck.save(state, tmp_path / "step-0")
    assert "grid" in _meta(tmp_path / "step-0")["tensor_specs"]["model.frozen"]
    state["lora"]["a"] = state["lora"]["a"] + 1
    ck.save(state, tmp_path / "step-1", base=tmp_path / "step-0")
    frozen = _meta(tmp_path / "step-1")["tensor_specs"]["model.frozen"]["chunks"]
    assert [c.get("base") for c in frozen] == [0]
    out = _empty_like(state)
    ck.load(out, tmp_path / "step-1")
    _same_bits(out, state)


def test_a_base_on_another_store_is_refused_before_anything_is_written(tmp_path):
    ck.save(_state(), "memory://runs/step-0")
    with pytest.raises(MetadataError, match="beside it"):
        ck.save(_state(), tmp_path / "step-1", base="memory://runs/step-0")
    assert not (tmp_path / "step-1").exists()
