"""DcpCheckpoint refuses metadata that would make it allocate past the bytes on disk or that has the wrong
types, bounds its open files, and reads an ``io.BytesIO`` value as its bytes."""

from __future__ import annotations

import io
import pickle
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from shardkit import knobs
from shardkit.errors import MetadataError
from shardkit.sources import DcpCheckpoint


def _rewrite_metadata(path, change) -> None:
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own file: trusted
    change(meta)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _claim_huge(meta) -> None:
    """Tensor 'a' claims 2 x 2**36 float32 elements, over the two tiny records of 'a' and 'b'."""
    (ka, va), = [(k, v) for k, v in meta.storage_data.items() if k.fqn == "a"]
    (_, vb), = [(k, v) for k, v in meta.storage_data.items() if k.fqn == "b"]
    n = 2**36
    entry = meta.state_dict_metadata["a"]
    entry.size = torch.Size([2 * n])
    entry.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([n])),
                    ChunkStorageMetadata(torch.Size([n]), torch.Size([n]))]
    del meta.storage_data[ka]
    meta.storage_data[MetadataIndex("a", torch.Size([0]))] = va
    meta.storage_data[MetadataIndex("a", torch.Size([n]))] = vb


def test_a_chunk_larger_than_its_record_is_refused_on_open_naming_the_tensor(tmp_path):
    dcp.save({"a": torch.ones(4), "b": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    _rewrite_metadata(tmp_path, _claim_huge)
    with pytest.raises(MetadataError, match=r"tensor 'a' .* needs 274877906944 bytes.* record .* bytes long"):
        DcpCheckpoint(str(tmp_path))  # was: opened, then torch.empty of 512 GiB raised a bare RuntimeError


def test_a_record_claimed_past_its_file_is_refused_before_the_allocation(tmp_path, monkeypatch):
    from shardkit.errors import IncompleteCheckpointError

    dcp.save({"a": torch.ones(4), "b": torch.ones(4)}, checkpoint_id=str(tmp_path), no_dist=True)

    def long_records(meta):
        _claim_huge(meta)
        for info in meta.storage_data.values():
            info.length = 2**40
    _rewrite_metadata(tmp_path, long_records)
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    with DcpCheckpoint(str(tmp_path)) as ck, pytest.raises(IncompleteCheckpointError, match="truncated"):
        ck.read("a")
    assert not [a for a in allocated if a and a[0] == (2 * 2**36,)]


def _set_chunk_offset_int(meta):
    (key, info), = [(k, v) for k, v in meta.storage_data.items() if k.fqn == "w"]
    bad = MetadataIndex("w", torch.Size([0]))
    object.__setattr__(bad, "offset", 5)
    meta.storage_data = {**{k: v for k, v in meta.storage_data.items() if k is not key}, bad: info}


MALFORMED = {
    "storage_data with str keys": (lambda m: setattr(m, "storage_data", {"w": 1}), "storage_data key is a value of type str"),
    "storage_data a list": (lambda m: setattr(m, "storage_data", [1, 2]), "storage_data is a value of type list"),
    "a chunk that is an int": (lambda m: setattr(m.state_dict_metadata["w"], "chunks", [1]),
                               "a chunk is a value of type int"),
    "a key offset that is an int": (_set_chunk_offset_int, "offset of 'w' is a value of type int"),
    "a state_dict_metadata key that is an int": (
        lambda m: m.state_dict_metadata.__setitem__(7, m.state_dict_metadata.pop("w")), "has the key 7"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_metadata_of_the_wrong_types_is_a_metadata_error_saying_what_was_found(tmp_path, case):
    change, found = MALFORMED[case]
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    _rewrite_metadata(tmp_path, change)
    with pytest.raises(MetadataError, match=found):  # was: a bare AttributeError / TypeError
        DcpCheckpoint(str(tmp_path))


class _CountingStorage:
    """Wraps the checkpoint's storage: how many readers are open at once, at most."""

    def __init__(self, storage):
        self._storage, self.open_now, self.most = storage, 0, 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def open_reader(self, path):
        reader = self._storage.open_reader(path)
        real_close = reader.close
        with self._lock:
            self.open_now += 1
            self.most = max(self.most, self.open_now)

        def close():
            with self._lock:
                self.open_now -= 1
            real_close()
        reader.close = close
        return reader


def _many_files(path, n):
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    state = {f"t{i}": torch.full((4,), float(i)) for i in range(n)}
    dcp.save(state, storage_writer=FileSystemWriter(str(path), single_file_per_rank=False), no_dist=True)
    return state


def test_at_most_the_knob_s_files_are_open_and_every_tensor_still_reads(tmp_path, monkeypatch):
    state = _many_files(tmp_path, 24)
    monkeypatch.setattr(knobs, "DCP_OPEN_FILES", 4, raising=False)
    ck = DcpCheckpoint(str(tmp_path))
    counting = ck.storage = _CountingStorage(ck.storage)
    assert len({c.file_name for t in ck.tensors.values() for c in t.chunks}) == 24
    for _ in range(2):
        for name, t in state.items():
            assert ck.read(name).equal(t)
    assert counting.most <= 4  # was 24: every reader stayed open until close()
    ck.close()
    assert counting.open_now == 0


def test_reads_on_many_threads_never_lose_their_file_to_eviction(tmp_path, monkeypatch):
    state = _many_files(tmp_path, 12)
    monkeypatch.setattr(knobs, "DCP_OPEN_FILES", 1, raising=False)
    errors = []
    with DcpCheckpoint(str(tmp_path)) as ck:
        def work(k):
            try:
                for i in range(60):
                    name = f"t{(i * 5 + k) % 12}"
                    out = torch.empty(4)
                    ck.read_into(name, out)
                    assert out.equal(state[name])
            except Exception as e:  # a closed file under a read shows up here
                errors.append(e)
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


def test_an_io_bytesio_value_reads_as_its_bytes(tmp_path):
    dcp.save({"w": torch.ones(3), "blob": io.BytesIO(b"state-A"), "step": 7}, checkpoint_id=str(tmp_path),
             no_dist=True)
    with DcpCheckpoint(str(tmp_path)) as ck:
        assert ck.read_value("blob") == b"state-A"  # was: refused by torch.load(weights_only=True)
        assert ck.read_value("step") == 7
