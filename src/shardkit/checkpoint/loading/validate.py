"""``validate_distributed``: is a checkpoint directory complete and intact?

It collects every problem it finds as a readable line instead of stopping at
the first: a missing or unreadable ``metadata.json`` or rank manifest, an
unknown version, shard sizes that do not sum, a missing, short or corrupt
data file (every byte is re-hashed against its block checksums), and a
header that does not match the metadata. An incremental checkpoint (version
3) is checked with the base files it references: each base must still be the
checkpoint referenced, and the referenced files are hashed like its own.
Seed-format directories have no
checksums: their headers and sizes are still checked. It never modifies
the directory.

Example::

    report = validate_distributed("/ckpt/step-10")
    if not report.ok:
        print("\\n".join(report.problems))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardkit import knobs
from shardkit.checkpoint.logs import logged
from shardkit.checkpoint.format.manifest import Manifest, data_file_name, file_records
from shardkit.checkpoint.format.compact_manifest import GridChunks, derived_ranges
from shardkit.checkpoint.planning.plan import chunks_by_file
from shardkit.checkpoint.loading.read_path import open_checkpoint
from shardkit.checkpoint.format.references import check_base, data_path, split_key
from shardkit.errors import CheckpointError
from shardkit.layout import Box
from shardkit.storage import FileRecord, Reader, SafetensorsHeader, new_block_hasher, read_header, storage_for

__all__ = ["ValidationReport", "validate_distributed", "data_problems"]


@dataclass
class ValidationReport:
    """``ok`` is True when ``problems`` is empty; each problem is one readable line."""

    directory: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            return f"{self.directory}: complete and intact"
        return f"{self.directory}: {len(self.problems)} problem(s)\n" + "\n".join(f"- {p}" for p in self.problems)


@logged("validate")
def validate_distributed(dir, *, hash_bytes: bool = True, progress=None) -> ValidationReport:
    """Check a checkpoint directory end to end; see the module docstring.

    ``hash_bytes=False`` checks everything but the data bytes themselves
    (metadata, manifests, file sizes against their records, headers): for a
    writer that has just hashed the bytes it wrote and recorded those hashes.
    ``progress(advance_bytes, total_bytes)``, if given, is called after each
    data file is checked (the CLI draws a progress bar with it).

    A damaged or hostile directory gives problems, never an exception, and so
    does a storage failure (an unreachable object store, a refused permission:
    the ``CheckpointIOError`` message becomes the problem); time
    and memory are linear in the metadata and the data files' real sizes
    (blocks are hashed through a buffer of at most ``knobs.IO_CHUNK_BYTES``).

    >>> validate_distributed("/ckpt/step-10").ok
    True
    """
    storage, directory = storage_for(dir)
    report = ValidationReport(directory)
    try:
        with open_checkpoint(dir) as ck:   # the manifest, read and checked as every load reads it
            m = ck.manifest
    except (CheckpointError, OSError) as e:
        report.problems.append(str(e))
        return report
    try:
        records = file_records(storage, directory, m)
    except (CheckpointError, OSError) as e:
        report.problems.append(str(e))
        records = dict(m.files)
    present = _present_names(storage, directory)
    chunks = chunks_by_file(m.tensors, present)
    total_bytes = sum(r.bytes for r in records.values())
    missing = []
    dtypes: dict[str, tuple[str, str]] = {}  # tensor -> (dtype, file) first seen: files must agree
    for rank in range(m.num_ranks):
        name = data_file_name(rank)
        if _missing(storage, directory, name, present):
            missing.append(rank)
            continue
        _check_file(storage, directory, m, rank, records.get(name), chunks.get(name, []), report.problems,
                    hash_bytes, dtypes)
        if progress is not None and name in records:
            progress(records[name].bytes, total_bytes)
    _check_bases(storage, directory, m, records, report.problems, hash_bytes, dtypes, progress, total_bytes)
    report.problems += [f"{data_file_name(r)} is missing (rank {r}'s data file)" for r in missing[:_LISTED]]
    if len(missing) > _LISTED:
        report.problems.append(f"{len(missing) - _LISTED} more of the {m.num_ranks} data files are missing (ranks "
                               f"that never finished their save, or deleted files); load an earlier checkpoint")
    return report


_LISTED = 5


def _check_bases(storage, directory: str, m: Manifest, records: dict[str, FileRecord], problems: list[str],
                 hash_bytes: bool, dtypes: dict, progress, total_bytes: int) -> None:
    """Version 3: each base still the one referenced, and every base file referenced checked as an own one."""
    if not m.bases:
        return
    chunks = chunks_by_file(m.tensors)
    for base in m.bases:
        try:
            check_base(storage, directory, base)
        except (CheckpointError, OSError) as e:
            problems.append(str(e))
            continue
        for key in sorted(k for k in records if split_key(k)[0] == base.dir):
            digits = split_key(key)[1][len("rank_"):-len(".safetensors")]
            rank = int(digits) if digits.isdigit() else -1   # for messages only
            _check_file(storage, directory, m, rank, records[key], chunks.get(key, []), problems, hash_bytes,
                        dtypes, name=key)
            if progress is not None:
                progress(records[key].bytes, total_bytes)


def _present_names(storage, directory: str) -> set[str] | None:
    """The names in the directory, listed once (None where listing fails: check file by file instead)."""
    try:
        return set(storage.listdir(directory))
    except (OSError, NotImplementedError):
        return None


def _missing(storage, directory: str, name: str, present: set[str] | None) -> bool:
    """Whether ``name`` is known to be absent; a failed look-up says no (checking the file reports the failure)."""
    if present is not None:
        return name not in present
    try:
        return not storage.exists(storage.join(directory, name))
    except OSError:
        return False


def _check_file(storage, directory: str, m: Manifest, rank: int, record: FileRecord | None,
                chunks: list[tuple[str, Box]], problems: list[str], hash_bytes: bool = True,
                dtypes: dict | None = None, *, name: str | None = None) -> None:
    name = data_file_name(rank) if name is None else name   # a base's file: its key, "<dir>/rank_<r>..."
    path = data_path(storage, directory, name)
    try:
        with storage.open_reader(path) as reader:
            if record is not None and hash_bytes:
                _check_bytes(reader, name, record, problems)
            elif record is not None and reader.size_bytes != record.bytes:
                problems.append(f"{name} is {reader.size_bytes} bytes, the manifest records {record.bytes}")
            header = read_header(reader, record)     # its own checksum, where the record has one
            _check_header(name, rank, header, m, chunks, problems, {} if dtypes is None else dtypes)
    except (CheckpointError, OSError, EOFError) as e:
        problems.append(f"{name}: {e}")


def data_problems(reader: Reader, name: str, record: FileRecord) -> list[str]:
    """What is wrong with the bytes of data file ``name`` (open as ``reader``) against its ``record``:
    its size, then each block's checksum (the first bad block); [] when every byte matches."""
    problems: list[str] = []
    _check_bytes(reader, name, record, problems)
    return problems


def _check_bytes(reader: Reader, name: str, record: FileRecord, problems: list[str]) -> None:
    if reader.size_bytes != record.bytes:
        kind = "short (truncated)" if reader.size_bytes < record.bytes else "longer than recorded"
        problems.append(f"{name} is {kind}: {reader.size_bytes} bytes, the manifest records {record.bytes}")
        return
    buf = memoryview(bytearray(min(record.block_bytes, record.bytes, knobs.IO_CHUNK_BYTES)))
    for index, start in enumerate(range(0, record.bytes, record.block_bytes)):
        stop = min(start + record.block_bytes, record.bytes)
        hasher = new_block_hasher()
        for position in range(start, stop, len(buf)):
            view = buf[: min(len(buf), stop - position)]
            reader.read_into(position, view)
            hasher.update(view)
        if hasher.hexdigest() != record.block_checksums[index]:
            problems.append(f"{name} is corrupt: bytes {start}..{stop} do not match their "
                            f"checksum (block {index}); restore the file or use an earlier checkpoint")
            return


def _check_header(name: str, rank: int, header: SafetensorsHeader, m: Manifest,
                  chunks: list[tuple[str, Box]], problems: list[str], dtypes: dict) -> None:
    derived = {}   # version-3 grid entries store no byte ranges: they follow from what the file holds
    if any(isinstance(m.tensors[t].chunks, GridChunks) for t, _ in chunks):
        derived = derived_ranges([(t, m.tensors[t].dtype, box.sizes) for t, box in chunks], header.data_start)
    for tensor_name, chunk in chunks:
        saved = m.tensors[tensor_name]
        entry = header.tensors.get(tensor_name)
        if entry is None:
            problems.append(f"{name} lacks tensor {tensor_name!r}, which metadata.json places there")
            continue
        if tuple(entry.shape) != tuple(chunk.sizes):
            problems.append(f"{name}: tensor {tensor_name!r} has shape {list(entry.shape)}, metadata.json "
                            f"gives rank {rank} the shape {list(chunk.sizes)}")
        byte_range = derived.get(tensor_name) if isinstance(saved.chunks, GridChunks) else \
            next(((c.begin, c.end) for c in saved.chunks or () if c.file == name), None)
        if byte_range is not None and byte_range != (entry.begin, entry.end):
            problems.append(f"{name}: tensor {tensor_name!r} is at bytes {entry.begin}..{entry.end}, metadata.json "
                            f"records {byte_range[0]}..{byte_range[1]}")
        if saved.dtype is not None and entry.dtype != saved.dtype:
            problems.append(f"{name}: tensor {tensor_name!r} is {entry.dtype}, metadata.json says {saved.dtype}")
        first = dtypes.setdefault(tensor_name, (entry.dtype, name))  # seed format: no dtype in metadata.json
        if saved.dtype is None and first[0] != entry.dtype:
            problems.append(f"{name}: tensor {tensor_name!r} is {entry.dtype}, but {first[1]} holds it as {first[0]}")
