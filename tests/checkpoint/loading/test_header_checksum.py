"""A data file's header is checked by its own checksum (``header_checksum`` in its record) before any offset
in it is trusted; files recorded without one (older checkpoints) are checked through their first block."""

import json
import os

import pytest
import torch

from shardkit.checkpoint import load, load_distributed, save, validate_distributed
from shardkit.errors import ChecksumError, MetadataError
from shardkit.storage.checksum import FileRecord, block_digest


def _state():
    return {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(3)}


def _flip_header_byte(path: str) -> None:
    """Change one digit inside the header's JSON (still valid JSON, another shape or offset)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = f.read(n)
        at = 8 + header.index(b"64")          # a shape digit of "w"
        f.seek(at)
        f.write(b"3")


def _strip_header_checksums(directory) -> None:
    path = os.path.join(directory, "metadata.json")
    with open(path) as f:
        meta = json.load(f)
    for record in meta["files"].values():
        record.pop("header_checksum")
    with open(path, "w") as f:
        json.dump(meta, f)


def test_every_file_record_carries_its_header_checksum(tmp_path):
    save(_state(), str(tmp_path))
    meta = json.loads((tmp_path / "metadata.json").read_text())
    [record] = meta["files"].values()
    with open(tmp_path / "rank_0.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(0)
        assert record["header_checksum"] == block_digest(f.read(8 + n))


def test_a_changed_header_byte_raises_before_the_header_is_parsed(tmp_path):
    save(_state(), str(tmp_path))
    _flip_header_byte(str(tmp_path / "rank_0.safetensors"))
    with pytest.raises(ChecksumError, match="the file's header"):
        load_distributed(str(tmp_path), 0, 1)
    out = {"w": torch.zeros(64, 64), "b": torch.zeros(3)}
    with pytest.raises(ChecksumError, match="header"):
        load(out, str(tmp_path))
    report = validate_distributed(str(tmp_path))
    assert not report.ok and any("header" in p for p in report.problems)


def test_a_record_without_a_header_checksum_is_checked_through_block_0(tmp_path):
    save(_state(), str(tmp_path))
    _strip_header_checksums(tmp_path)
    assert torch.equal(load_distributed(str(tmp_path), 0, 1)["w"], _state()["w"])
    _flip_header_byte(str(tmp_path / "rank_0.safetensors"))
    with pytest.raises(ChecksumError, match="block 0"):
        load_distributed(str(tmp_path), 0, 1)


def test_a_header_checksum_that_is_not_the_files_is_refused(tmp_path):
    save(_state(), str(tmp_path))
    path = tmp_path / "metadata.json"
    meta = json.loads(path.read_text())
    [record] = meta["files"].values()
    record["header_checksum"] = "0" * 16
    path.write_text(json.dumps(meta))
    with pytest.raises(ChecksumError, match="header"):
        load_distributed(str(tmp_path), 0, 1)


@pytest.mark.parametrize("bad", ["", "xyz", 7, "0" * 15, "0" * 17, "ABCDEF0123456789"])
def test_a_malformed_header_checksum_is_a_metadata_error(bad):
    good = FileRecord(10, "xxh3_64_blocks:" + "0" * 16, 8, ["0" * 16, "1" * 16])
    as_json = {**good.to_json(), "header_checksum": bad}
    with pytest.raises(MetadataError, match="header_checksum"):
        FileRecord.from_json("rank_0.safetensors", as_json)


def test_the_record_round_trips_with_and_without_a_header_checksum():
    plain = FileRecord(10, "xxh3_64_blocks:" + "0" * 16, 8, ["0" * 16, "1" * 16])
    assert "header_checksum" not in plain.to_json()
    assert FileRecord.from_json("f", plain.to_json()) == plain
    with_header = FileRecord(10, plain.checksum, 8, plain.block_checksums, "2" * 16)
    assert FileRecord.from_json("f", with_header.to_json()) == with_header
