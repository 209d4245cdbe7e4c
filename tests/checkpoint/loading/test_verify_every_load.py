"""A corrupt byte never loads silently: every load path of shardkit's own format verifies what it returns.

One byte flipped in the middle of a tensor of a checkpoint saved by
``shardkit.checkpoint.save`` (its block checksums intact) must raise
``ChecksumError`` on every load path -- the zero-copy (mapped) ones included --
and load silently only where verification was turned off (``verify=False``,
``knobs.VERIFY_ON_LOAD = False``). The offline tools' paths are in
``tests/cli/test_verify_offline_tools.py``.
"""

import os

import pytest
import torch

from shardkit import knobs
from shardkit.checkpoint import load, load_consolidated, load_distributed, load_region, reshard, save
from shardkit.checkpoint import save_distributed, ShardMetadata, TensorShardSpec
from shardkit.errors import ChecksumError
import shardkit.storage.backends.local as local_storage
from shardkit.storage import read_header, storage_for
from shardkit.storage.checksum import FileRecord

BLOCK = 4096
ROWS, COLS = 64, 256          # model.w: 64 KiB of float32, 16 blocks
BAD_ROW = 40                  # the flipped byte lies in this row of model.w


def _state():
    g = torch.Generator().manual_seed(3)
    return {"model": {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g)}, "step": 3}


def _data_file(directory) -> str:
    [name] = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    return os.path.join(directory, name)


def _flip(path: str, name: str, element: int) -> int:
    """Flip one byte of element ``element`` of tensor ``name`` in the file; returns its file offset."""
    store, _ = storage_for(path)
    with store.open_reader(path) as r:
        entry = read_header(r).tensors[name]
    offset = entry.begin + element * 4 + 1
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    return offset


@pytest.fixture()
def corrupt(tmp_path, monkeypatch):
    """A checkpoint saved by ``save`` (1 process), then one byte of ``model.w`` row BAD_ROW flipped."""
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    state = _state()
    save(state, str(tmp_path / "ck"))
    _flip(_data_file(tmp_path / "ck"), "model.w", BAD_ROW * COLS + 7)
    return str(tmp_path / "ck"), state


@pytest.fixture()
def maps(monkeypatch):
    """The ``(offset, nbytes)`` of every map a load makes: a test sees the zero-copy path was taken."""
    calls = []
    real = local_storage._LocalReader.map_range
    monkeypatch.setattr(local_storage._LocalReader, "map_range",
                        lambda self, o, n: calls.append((o, n)) or real(self, o, n))
    return calls


def _fresh(directory):
    return load_distributed(directory, 0, 1)


def _in_place(directory):
    out = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "step": 0}
    return load_distributed(directory, 0, 1, out=out)


def _api_load(directory):
    state = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)}, "step": 0}
    load(state, directory)
    return state


def _region(directory):
    return load_region(directory, "model.w", (BAD_ROW, 0), (1, COLS))


def _consolidated(directory):
    return load_consolidated(directory)


def _reshard(directory):
    return reshard(directory, 1, 2, 1)


LOADS = {"fresh": _fresh, "in_place": _in_place, "api_load": _api_load, "region": _region,
         "consolidated": _consolidated, "reshard": _reshard}
MAPPED = {"fresh", "region", "consolidated", "reshard"}   # zero-copy by default: silent before issue 32


@pytest.mark.parametrize("path", sorted(LOADS))
def test_a_flipped_byte_raises_on_every_load_path(corrupt, maps, path):
    directory, _ = corrupt
    with pytest.raises(ChecksumError, match="do not match their checksum") as e:
        LOADS[path](directory)
    message = str(e.value)
    assert "rank_0.safetensors" in message and "block " in message and "'model.w'" in message
    assert f"shardkit validate {directory}" in message
    assert bool(maps) == (path in MAPPED)  # the zero-copy paths really mapped (and were verified)


@pytest.mark.parametrize("path", sorted(MAPPED))
@pytest.mark.parametrize("off", ["verify=False", "knob"])
def test_turning_verification_off_loads_the_flipped_value(corrupt, monkeypatch, path, off):
    directory, state = corrupt
    if off == "knob":
        monkeypatch.setattr(knobs, "VERIFY_ON_LOAD", False)
        got = LOADS[path](directory)
    else:
        call = {"fresh": lambda: load_distributed(directory, 0, 1, verify=False),
                "region": lambda: load_region(directory, "model.w", (BAD_ROW, 0), (1, COLS), verify=False),
                "consolidated": lambda: load_consolidated(directory, verify=False),
                "reshard": lambda: reshard(directory, 1, 2, 1, verify=False)}[path]
        got = call()
    w = got if path == "region" else got["model.w"] if path == "reshard" else got["model"]["w"]
    want = state["model"]["w"][BAD_ROW:BAD_ROW + 1] if path == "region" else state["model"]["w"]
    assert w.shape == want.shape and not torch.equal(w, want)   # loaded, and wrong: what was asked for


def test_an_intact_block_of_a_damaged_file_still_loads(corrupt, maps):
    # Verification is per block: a region whose blocks are intact loads, mapped and correct.
    directory, state = corrupt
    got = load_region(directory, "model.w", (0, 0), (4, COLS))
    assert torch.equal(got, state["model"]["w"][:4]) and maps


def test_verify_true_copies_and_verifies(corrupt, maps):
    directory, _ = corrupt
    with pytest.raises(ChecksumError):
        load_distributed(directory, 0, 1, verify=True)
    assert not maps   # verify=True: private copies, never a map


def test_a_mapped_output_is_a_zero_copy_view_of_verified_pages(tmp_path, monkeypatch, maps):
    # Clean checkpoint: the mapped tensors equal the saved ones, and writing them never reaches the file.
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    state = _state()
    save(state, str(tmp_path / "ck"))
    before = open(_data_file(tmp_path / "ck"), "rb").read()
    got = load_distributed(str(tmp_path / "ck"), 0, 1)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and torch.equal(got["model"]["b"], state["model"]["b"])
    assert maps
    got["model"]["w"].zero_()
    assert open(_data_file(tmp_path / "ck"), "rb").read() == before


def test_a_sharded_checkpoint_resharded_within_a_chunk_is_verified(tmp_path, monkeypatch, maps):
    # Saved on 2 ranks (dim 0); rank 1 of 4 wants rows 16..31, inside rank 0's chunk: mapped, verified.
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1))
    meta = ShardMetadata(2, {"w": TensorShardSpec((ROWS, COLS), 0, (32, 32))})
    for rank in range(2):
        save_distributed({"w": w[rank * 32:(rank + 1) * 32]}, str(tmp_path), rank, 2, meta)
    assert torch.equal(reshard(str(tmp_path), 2, 4, 1)["w"], w[16:32])
    _flip(str(tmp_path / "rank_0.safetensors"), "w", 20 * COLS)
    maps.clear()
    with pytest.raises(ChecksumError, match="'w'"):
        reshard(str(tmp_path), 2, 4, 1)
    assert maps
    assert torch.equal(reshard(str(tmp_path), 2, 4, 3)["w"], w[48:])   # rank 1's file: intact


def test_each_block_is_hashed_once_however_many_mapped_tensors_share_it(tmp_path, monkeypatch, maps):
    # 64 tensors of 256 bytes: 4 KiB blocks hold 16 each; one hash per block, not one per tensor.
    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(64)}
    save(state, str(tmp_path))
    checked = []
    real = FileRecord.verify_digest
    monkeypatch.setattr(FileRecord, "verify_digest",
                        lambda self, index, *a, **kw: checked.append(index) or real(self, index, *a, **kw))
    got = load_distributed(str(tmp_path), 0, 1)
    assert all(torch.equal(got[n], t) for n, t in state.items()) and len(maps) == 64
    blocks = -(-os.path.getsize(_data_file(tmp_path)) // BLOCK)
    assert sorted(checked) == list(range(blocks))   # the header is checked by its own checksum, not block 0


def test_the_dtensor_load_raises_on_a_flipped_byte(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(2))
        save({"w": distribute_tensor(w, mesh, [Shard(0)])}, str(tmp_path / "ck"))
        _flip(_data_file(tmp_path / "ck"), "w", BAD_ROW * COLS)
        target = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])}
        with pytest.raises(ChecksumError, match="'w'"):
            load(target, str(tmp_path / "ck"))
    finally:
        dist.destroy_process_group()


# --- object stores: a block read only in part is downloaded whole and verified while the allowance lasts


def _remote(url_name: str, monkeypatch):
    """``{"a": 100 floats, "w": ROWS x COLS}`` on ``memory://``; w's first block also holds the header and a."""
    import fsspec

    monkeypatch.setattr(knobs, "CHECKSUM_BLOCK_BYTES", BLOCK)
    url = f"memory://shardkit-verify-{url_name}/ck"
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(4))
    save_distributed({"a": torch.arange(100, dtype=torch.float32), "w": w}, url, 0, 1, None)
    fs = fsspec.filesystem("memory")
    data_file = max(fs.find(url), key=lambda p: fs.size(p))
    return url, w, fs, data_file


def _flip_remote(fs, data_file: str, offset: int) -> None:
    data = bytearray(fs.cat_file(data_file))
    data[offset] ^= 0x10
    fs.pipe_file(data_file, bytes(data))


def _begin(fs, data_file: str, name: str) -> int:
    from shardkit.storage import BufferReader

    return read_header(BufferReader(data_file, fs.cat_file(data_file))).tensors[name].begin


def test_object_store_verifies_a_partly_read_block_within_the_allowance(monkeypatch):
    from shardkit.storage import fetched_bytes

    url, w, fs, data_file = _remote("partial", monkeypatch)
    begin = _begin(fs, data_file, "w")
    assert begin % BLOCK  # w's first block also holds bytes no keys=["w"] load wants
    before = fetched_bytes()
    assert torch.equal(load_distributed(url, 0, 1, keys=["w"])["w"], w)
    fetched = fetched_bytes() - before
    assert fetched <= 1.1 * w.nbytes + 2 * begin   # the header is read at open (checked, then parsed)
    _flip_remote(fs, data_file, begin + 5)          # inside w's first block, which w covers only in part
    with pytest.raises(ChecksumError, match="'w'"):
        load_distributed(url, 0, 1, keys=["w"])
    monkeypatch.setattr(knobs, "VERIFY_EXTRA_READ_FRACTION", 0.0)   # no allowance: the old behaviour
    assert not torch.equal(load_distributed(url, 0, 1, keys=["w"])["w"], w)
    fs.rm(url, recursive=True)


def test_object_store_reads_a_small_box_unverified_rather_than_download_its_blocks(monkeypatch):
    # What remains unverified: a box far smaller than its blocks (1 row of 1 KiB in 4 KiB blocks) would
    # cost 4x its bytes to verify; it is read as is (validate hashes every byte).
    from shardkit.checkpoint import validate_distributed
    from shardkit.storage import fetched_bytes

    url, w, fs, data_file = _remote("small-box", monkeypatch)
    row = 21
    _flip_remote(fs, data_file, _begin(fs, data_file, "w") + row * COLS * 4 + 9)
    fetched = []
    for verify in (False, None):
        before = fetched_bytes()
        got = load_region(url, "w", (row, 0), (1, COLS), verify=verify)
        fetched.append(fetched_bytes() - before)
        assert not torch.equal(got, w[row:row + 1])
    assert fetched[1] <= fetched[0] + 2 * _begin(fs, data_file, "w")   # the header's own check: no data block
    assert not validate_distributed(url).ok
    fs.rm(url, recursive=True)
