import io
import os

import pytest

from shardkit.errors import MetadataError
from shardkit.storage import atomic_local_writer, check_relative_name, is_temp_name
from shardkit.storage.checksum import BlockHasher, FileRecord, block_digest


@pytest.mark.parametrize("name", ["a.safetensors", "sub/dir/ü.safetensors", "model-00001-of-00002.safetensors"])
def test_good_names_pass(name):
    assert check_relative_name(name, (".safetensors",)) == name


@pytest.mark.parametrize(
    "name, why",
    [
        ("/etc/passwd.safetensors", "absolute"),
        ("../x.safetensors", "'..'"),
        ("a/../../x.safetensors", "'..'"),
        ("C:\\x.safetensors", "backslash"),
        ("c:x.safetensors", "absolute"),
        ("x.pkl", "does not end"),
        ("a//b.safetensors", "empty"),
        ("", "non-empty"),
        (None, "non-empty"),
    ],
)
def test_bad_names_refused(name, why):
    with pytest.raises(MetadataError, match=why):
        check_relative_name(name, (".safetensors",))


def test_atomic_writer_publishes_whole(tmp_path):
    target = tmp_path / "m.json"
    with atomic_local_writer(str(target)) as f:
        f.write(b"hello")
        assert not target.exists()
    assert target.read_bytes() == b"hello"
    assert os.listdir(tmp_path) == ["m.json"]


class _ShortWrites:
    """A raw file whose writes take at most ``cap`` bytes, as Linux's take at most ~2 GiB."""

    def __init__(self, raw, cap):
        self._raw, self._cap = raw, cap

    def write(self, data):
        return self._raw.write(memoryview(data).cast("B")[:self._cap])

    def __getattr__(self, name):
        return getattr(self._raw, name)


def test_atomic_writer_retries_short_writes_so_torch_save_files_are_whole(tmp_path, monkeypatch):
    # torch.save hands each storage over in one write and ignores the count a short write returns
    import builtins

    import torch

    import shardkit.storage.backends.atomic as atomic

    monkeypatch.setattr(atomic, "open", lambda *a, **k: _ShortWrites(builtins.open(*a, **k), 4096), raising=False)
    tensors = {"w": torch.arange(100_000, dtype=torch.float32).reshape(1000, 100), "s": torch.tensor(7)}
    target = tmp_path / "w.bin"
    with atomic_local_writer(str(target)) as f:
        torch.save(tensors, f)
        assert f.write(torch.arange(6, dtype=torch.int16).numpy()) == 12  # any buffer: its length in bytes
    with open(target, "rb") as f:
        data = f.read()
    loaded = torch.load(io.BytesIO(data[:-12]), weights_only=True)
    assert loaded["w"].equal(tensors["w"]) and loaded["s"].equal(tensors["s"])
    assert data[-12:] == torch.arange(6, dtype=torch.int16).numpy().tobytes()


def test_atomic_writer_failure_keeps_old_file(tmp_path):
    target = tmp_path / "m.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_local_writer(str(target)) as f:
            f.write(b"new, half")
            raise RuntimeError("crash")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["m.json"]
    assert is_temp_name(".m.json.abcd.tmp") and not is_temp_name("m.json")


def test_block_hasher_matches_one_shot_digests():
    data = bytes(range(256)) * 10
    hasher = BlockHasher(block_bytes=100)
    for piece in (data[:7], data[7:300], data[300:]):
        hasher.update(piece)
    record = hasher.finish()
    assert record.bytes == len(data)
    assert record.block_checksums == [block_digest(data[i : i + 100]) for i in range(0, len(data), 100)]
    assert FileRecord.from_json("f", record.to_json()) == record


def test_record_with_wrong_block_count_is_refused():
    bad = {"bytes": 1000, "checksum": "xxh3_64_blocks:00", "block_bytes": 100, "block_checksums": ["0"]}
    with pytest.raises(MetadataError, match="need 10 block checksums"):
        FileRecord.from_json("rank_0.safetensors", bad)
