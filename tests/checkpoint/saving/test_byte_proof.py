"""The byte-for-byte proof of incremental saves (``saving/byte_proof.py``) and the overlapped write around it.

Pieces are made small (``FIRST_PIECE_BYTES``, ``COMPARE_PIECE_BYTES``) so
that a tensor of a few hundred KiB spans many of them: a difference in the
last byte, in a middle piece, or past the first piece of one tensor while
another differs at once is written, never referenced, and the save loads
bit for bit. A base file shorter than its record is refused before anything
is committed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardkit.checkpoint as ck
from shardkit.checkpoint.saving import byte_proof, chunked_save
from shardkit.checkpoint.saving.byte_proof import ByteProof, Candidate
from shardkit.errors import MetadataError
from shardkit.storage import BufferReader, run_parallel

ELEMENTS = 64 * 1024          # 256 KiB of float32: 32 pieces of 8 KiB after a first piece of 1 KiB


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(byte_proof, "FIRST_PIECE_BYTES", 1024)
    monkeypatch.setattr(byte_proof, "COMPARE_PIECE_BYTES", 8 * 1024)


@pytest.fixture
def writes(monkeypatch):
    """The tensor names of each data file written, in order."""
    calls: list[list[str]] = []
    real = chunked_save.write_data_file

    def counting(storage, directory, rank, world_size, named, **options):
        calls.append(sorted(n for n, _ in named))
        return real(storage, directory, rank, world_size, named, **options)

    monkeypatch.setattr(chunked_save, "write_data_file", counting)
    return calls


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(ELEMENTS, generator=g) for i in range(4)} | {"empty": torch.empty(0, 3)}


def _refs(directory) -> dict[str, bool]:
    with open(os.path.join(directory, "metadata.json")) as f:
        specs = json.load(f)["tensor_specs"]
    return {n: "base" in s["chunks"][0] for n, s in specs.items() if s.get("chunks")}


def _loads_bit_for_bit(directory, state) -> None:
    out = {n: torch.empty_like(t) for n, t in state.items()}
    ck.load(out, str(directory))
    for n, t in state.items():
        assert torch.equal(out[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), n


def _flip_byte(t: torch.Tensor, index: int) -> None:
    t.view(torch.uint8)[index] ^= 1


@pytest.mark.parametrize("where", ["last byte", "middle piece", "first byte"])
def test_a_difference_anywhere_in_a_large_tensor_is_written(tmp_path, small_pieces, writes, where):
    state = _state()
    ck.save(state, tmp_path / "s0")
    nbytes = state["w2"].numel() * 4
    _flip_byte(state["w2"], {"last byte": nbytes - 1, "middle piece": nbytes // 2 + 3, "first byte": 0}[where])
    writes.clear()
    ck.save(state, tmp_path / "s1", base=tmp_path / "s0")
    refs = _refs(tmp_path / "s1")
    assert not refs["w2"] and refs["w0"] and refs["w1"] and refs["w3"]
    assert writes[-1] == ["w2"]       # the file committed holds exactly what is not referenced
    # found in the first piece: written once; past it: the file is written again with it
    assert len(writes) == (1 if where == "first byte" else 2)
    _loads_bit_for_bit(tmp_path / "s1", state)


def test_late_and_early_differences_together_end_in_one_file(tmp_path, small_pieces, writes):
    state = _state()
    ck.save(state, tmp_path / "s0")
    _flip_byte(state["w0"], 5)                          # seen by the probe
    _flip_byte(state["w3"], state["w3"].numel() * 4 - 1)   # seen only by the full compare
    writes.clear()
    ck.save(state, tmp_path / "s1", base=tmp_path / "s0")
    assert writes == [["w0"], ["w0", "w3"]]
    refs = _refs(tmp_path / "s1")
    assert refs == {**refs, "w0": False, "w3": False, "w1": True, "w2": True}
    _loads_bit_for_bit(tmp_path / "s1", state)


def test_zero_size_tensors_are_written_not_compared(tmp_path, small_pieces):
    state = {"empty": torch.empty(0, 3), "none": torch.empty(0, dtype=torch.int64), "w": torch.ones(300)}
    ck.save(state, tmp_path / "s0")
    ck.save(state, tmp_path / "s1", base=tmp_path / "s0")
    assert _refs(tmp_path / "s1")["w"]
    _loads_bit_for_bit(tmp_path / "s1", state)


def test_a_base_file_shorter_than_recorded_is_refused_before_the_commit(tmp_path, small_pieces):
    state = _state()
    ck.save(state, tmp_path / "s0")
    path = tmp_path / "s0" / "rank_0.safetensors"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(MetadataError, match="damaged"):
        ck.save(state, tmp_path / "s1", base=tmp_path / "s0")
    assert not (tmp_path / "s1" / "metadata.json").exists()


def test_conjugate_views_are_compared_as_they_are_written(tmp_path):
    c = torch.randn(64, dtype=torch.complex64)
    ck.save({"c": c.conj().resolve_conj(), "d": c.clone()}, tmp_path / "s0")
    state = {"c": c.conj(), "d": c.conj()}      # c: the same bytes once resolved; d: other bytes
    ck.save(state, tmp_path / "s1", base=tmp_path / "s0")
    assert _refs(tmp_path / "s1") == {"c": True, "d": False}
    out = {"c": torch.empty(64, dtype=torch.complex64), "d": torch.empty(64, dtype=torch.complex64)}
    ck.load(out, str(tmp_path / "s1"))
    assert torch.equal(out["c"], c.conj()) and torch.equal(out["d"], c.conj())


def _proof(data: bytes, tensors: dict[str, tuple[int, torch.Tensor]]) -> ByteProof:
    reader = BufferReader("base", bytearray(data))        # cannot map: pieces are read into scratch
    return ByteProof([Candidate(n, reader, b, b + t.numel() * t.element_size(), t) for n, (b, t) in tensors.items()],
                     digest_first=False)


def test_pieces_cover_every_byte_after_the_probe_once_and_lanes_take_each_once(small_pieces, monkeypatch):
    sizes = [1, 1024, 1025, 50_000, 200_000, 7]
    data = bytes(range(256)) * (sum(sizes) // 256 + 1)
    tensors, begin = {}, 0
    for i, n in enumerate(sizes):
        tensors[f"t{i}"] = (begin, torch.frombuffer(bytearray(data[begin:begin + n]), dtype=torch.uint8))
        begin += n
    proof = _proof(data, tensors)
    proof.probe()
    assert proof.changed() == []
    pieces = proof.pieces()
    assert all(n <= 8 * 1024 for _, _, n in pieces)
    for i, n in enumerate(sizes):           # exactly [first piece, end) of each, in order, once
        covered = [(s, s + k) for j, s, k in pieces if j == i]
        if n <= 1024:
            assert covered == []
            continue
        assert covered[0][0] == 1024 and covered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    compared = []
    real = ByteProof._compare
    monkeypatch.setattr(ByteProof, "_compare", lambda self, i, s, n, scratch: compared.append((i, s, n)) or
                        real(self, i, s, n, scratch))
    lanes = proof.jobs(lanes=3)
    assert len(lanes) == 3
    run_parallel(lanes)
    assert sorted(compared) == sorted(pieces)
    assert proof.equal() == list(range(len(sizes)))


def test_lanes_default_to_the_cpus_where_maps_are_compared(tmp_path, monkeypatch, small_pieces):
    from shardkit import knobs
    from shardkit.storage import LocalStorage

    monkeypatch.setattr(knobs, "IO_THREADS", 8)
    monkeypatch.setattr(byte_proof, "usable_cpus", lambda: 3)
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(1 << 20))
    with LocalStorage().open_reader(str(path)) as reader:
        proof = ByteProof([Candidate("z", reader, 0, 1 << 20, torch.zeros(1 << 20, dtype=torch.uint8))],
                          digest_first=False)
        proof.probe()
        assert len(proof.jobs()) == 3
        run_parallel(proof.jobs())
        assert proof.equal() == [0]
        proof.close()
    read = _proof(bytes(1 << 20), {"z": (0, torch.zeros(1 << 20, dtype=torch.uint8))})
    read.probe()
    assert len(read.jobs()) == 8            # read, not mapped: a lane per I/O thread


def test_reads_where_no_map_is_offered_and_out_of_range_candidates_differ(small_pieces):
    data = bytearray(os.urandom(100_000))
    same = torch.frombuffer(bytearray(data[:40_000]), dtype=torch.uint8)
    late = torch.frombuffer(bytearray(data[40_000:90_000]), dtype=torch.uint8)
    late[-1] ^= 1
    past = torch.frombuffer(bytearray(20_000), dtype=torch.uint8)
    proof = _proof(bytes(data), {"same": (0, same), "late": (40_000, late), "past": (90_000, past)})
    proof.probe()
    assert proof.changed() == [2]          # past the end of the file: different without a read
    run_parallel(proof.jobs(lanes=3))
    assert proof.equal() == [0] and proof.changed() == [1, 2]
    proof.close()


def test_no_candidate_is_equal_before_the_probe_compared_its_first_piece(small_pieces):
    data = bytes(range(256)) * 64
    proof = _proof(data, {"t": (0, torch.frombuffer(bytearray(data), dtype=torch.uint8))})
    run_parallel(proof.jobs(lanes=2))      # the pieces after the first one only
    with pytest.raises(RuntimeError, match="probe"):
        proof.equal()
    proof.probe()
    assert proof.equal() == [0]
    proof.close()
