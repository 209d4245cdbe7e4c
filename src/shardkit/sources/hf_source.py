"""A Hugging Face checkpoint as a :class:`~shardkit.sources.base.CheckpointSource`: names, shapes, boxes.

Reads the index (or the single file's header) and every safetensors header
once (each file checked as ``shardkit.hf`` checks it: a regular file, a
whole, well-formed header). A box of a safetensors tensor is read through
the checkpoint engine (``checkpoint.planning.plan.plan_load`` + ``execute.run_loads``):
to it a safetensors tensor is one chunk covering the whole tensor, so a rank
reads only the rows (byte ranges) of its box, in parallel, straight into
the caller's tensor when it can. A ``.bin`` file has no byte layout to
read a part of: it is loaded whole through ``torch.load(weights_only=True)``,
one file at a time, and the boxes copied out of it. Tied weights stored
once are given as :meth:`HFSource.aliases` (the index's ``param_sharing``,
and ``lm_head.weight`` for a ``config.json`` that ties word embeddings).
Nothing is written.

Example::

    with HFSource("llama-hf") as src:
        rows = src.read_boxes({"model.embed_tokens.weight": Box((0, 0), (50, 32))})
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from shardkit.checkpoint.format.chunks import Chunk
from shardkit.checkpoint.loading.execute import OpenFiles, check_chunks, run_loads, scratch_elems_of
from shardkit.checkpoint.format.manifest import SavedTensor
from shardkit.checkpoint.planning.plan import plan_load
from shardkit.checkpoint.format.spec import TensorShardSpec
from shardkit.dtypes import from_safetensors_name, to_safetensors_name
from shardkit.errors import MetadataError, TensorMismatchError
from shardkit.layout import Box, whole_box
from shardkit.sources.base import CheckpointSource, TensorInfo
from shardkit.storage import storage_for
from shardkit.storage.plain_values import decode_value

__all__ = ["HFSource", "tied_aliases"]

#: Input-embedding names (their last parts) that ``tie_word_embeddings`` ties ``lm_head.weight`` to.
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight",
               "embed_in.weight")
_OUTPUT = "lm_head.weight"


class HFSource(CheckpointSource):
    """A Hugging Face checkpoint directory (safetensors or ``.bin``, one file or an index)."""

    kind = "hf"
    slab_reads = True   # no checksums: a slab of rows reads exactly its bytes

    def __init__(self, path: str):
        from shardkit.hf.directory import hf_layout
        from shardkit.hf.index import load_shard_index

        super().__init__(path)
        self.meta = hf_layout(path)  # also beside a checkpoint of another kind, when asked for this one
        if self.meta is None:
            raise MetadataError(f"{path} holds no Hugging Face checkpoint: no model.safetensors[.index.json] or "
                                f"pytorch_model.bin[.index.json]")
        self.index = load_shard_index(path, self.meta.file_name) if self.meta.is_index else None
        self.store, self.root = storage_for(path)
        self._infos: dict[str, TensorInfo] | None = None
        self._file_of: dict[str, str] = {}
        self._files: OpenFiles | None = None

    def tensors(self) -> dict[str, TensorInfo]:
        if self._infos is None:
            self._infos = self._build_infos()
        return self._infos

    def _build_infos(self) -> dict[str, TensorInfo]:
        from shardkit.hf.bin_io import read_bin_shard
        from shardkit.hf.shard_io import shard_header

        weight_map = dict(self.index["weight_map"]) if self.index is not None else None
        files = dict.fromkeys(weight_map.values()) if weight_map is not None else [self.meta.file_name]
        infos = {}
        for file_name in files:
            path = self.store.join(self.root, file_name)
            if file_name.endswith(".safetensors"):
                found = {n: (from_safetensors_name(e.dtype), tuple(e.shape))
                         for n, e in shard_header(self.store, path).tensors.items()}
            else:  # a .bin has no header: load it (one file at a time) for dtypes and shapes
                found = {n: (t.dtype, tuple(t.shape)) for n, t in read_bin_shard(self.store, path).items()}
            wanted = [n for n, f in weight_map.items() if f == file_name] if weight_map is not None else list(found)
            for n in wanted:
                if n not in found:
                    raise MetadataError(f"the index places {n!r} in {file_name}, which does not hold it; "
                                        f"the checkpoint in {self.path} is inconsistent")
                infos[n] = TensorInfo(*found[n])
                self._file_of[n] = file_name
        return infos

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``, read into fresh memory."""
        return self.read_boxes({name: whole_box(self._info(name).shape)})[name]

    def read_into(self, name: str, out: torch.Tensor, offsets: tuple[int, ...] | None = None) -> None:
        self.read_boxes({name: Box(tuple(offsets or (0,) * out.dim()), tuple(out.shape))}, {name: out})

    def aliases(self) -> dict[str, str]:
        groups = list((self.index or {}).get("metadata", {}).get("param_sharing", []) or [])
        return tied_aliases(self.tensors(), groups, self._ties_word_embeddings())

    def _ties_word_embeddings(self) -> bool:
        from shardkit.hf.untrusted import read_json_file

        path = self.store.join(self.root, "config.json")
        if not self.store.exists(path):
            return False
        config = read_json_file(self.store, path, fix="config.json is the model's configuration; re-save it")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        return config.get("tie_word_embeddings", text.get("tie_word_embeddings")) is True

    def check_boxes(self, want: Mapping[str, Box]) -> None:
        """The safetensors headers that hold ``want`` (name, dtype, shape: what the index says), before any read."""
        chosen = self._safetensors(want)
        if chosen:
            check_chunks(self._open_files(), self._saved(chosen), chosen, self._dtypes(chosen))

    def read_boxes(self, want: Mapping[str, Box], out: Mapping[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
        out = dict(out or {})
        chosen = self._safetensors(want)
        result: dict[str, torch.Tensor] = {}
        if chosen:
            dtypes = self._dtypes(chosen)
            plans = plan_load(self._saved(chosen), chosen, scratch_elems_of(dtypes))
            result.update(run_loads(self._open_files(), plans, dtypes.__getitem__,
                                    {n: out[n] for n in chosen if n in out}))
        result.update(self._read_bin_boxes({n: b for n, b in want.items() if n not in chosen}, out))
        return result

    def _info(self, name: str) -> TensorInfo:
        infos = self.tensors()
        if name not in infos:
            raise TensorMismatchError(f"{self.path} has no tensor {name!r}; it holds "
                                      f"{', '.join(sorted(infos)[:8]) or 'none'}")
        return infos[name]

    def _safetensors(self, want: Mapping[str, Box]) -> dict[str, Box]:
        for name in want:
            self._info(name)
        return {n: b for n, b in want.items() if self._file_of[n].endswith(".safetensors")}

    def _dtypes(self, names) -> dict[str, torch.dtype]:
        return {n: self.tensors()[n].dtype for n in names}

    def _saved(self, names) -> dict[str, SavedTensor]:
        """Each tensor as the engine sees a saved tensor: one chunk, the whole tensor, in its file."""
        infos = self.tensors()
        return {n: SavedTensor(TensorShardSpec(infos[n].shape, None, ()), to_safetensors_name(infos[n].dtype), None,
                               (Chunk(self._file_of[n], (0,) * len(infos[n].shape), infos[n].shape, 0, 0),))
                for n in names}

    def _open_files(self) -> OpenFiles:
        if self._files is None:  # no records: HF files carry no checksums; never mapped (read into place)
            self._files = OpenFiles(self.store, self.root, {}, verify=False)
        return self._files

    def _read_bin_boxes(self, want: Mapping[str, Box], out: dict) -> dict[str, torch.Tensor]:
        from shardkit.hf.bin_io import read_bin_shard

        by_file: dict[str, list[str]] = {}
        for name in want:
            by_file.setdefault(self._file_of[name], []).append(name)
        result = {}
        for file_name, names in by_file.items():
            loaded = read_bin_shard(self.store, self.store.join(self.root, file_name))  # whole: no byte layout
            for name in names:
                box = want[name]
                region = loaded[name][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
                target = out.get(name)
                result[name] = region.clone() if target is None else target.copy_(region)
            del loaded
        return result

    def objects(self) -> dict[str, Any]:
        if self.index is None:
            return {}
        saved = (self.index.get("metadata") or {}).get("shardkit_objects") or {}
        if not isinstance(saved, dict):
            raise MetadataError(f"{self.path}: the index's metadata.shardkit_objects is a "
                                f"{type(saved).__name__}, not an object of plain values by name")
        return {name: decode_value(raw, f"shardkit_objects.{name}") for name, raw in saved.items()}

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None


def tied_aliases(stored, sharing_groups: list, ties_word_embeddings: bool) -> dict[str, str]:
    """``{name: stored name}`` for the names of tied groups the checkpoint does not store.

    ``sharing_groups``: the index's ``param_sharing`` (each name of a group
    reads the group's stored one). ``ties_word_embeddings`` (``config.json``):
    ``lm_head.weight``, when not stored, reads the one stored input embedding
    (``*embed_tokens.weight``, ``*wte.weight``, ...), as ``save_pretrained``
    drops it. Pure. Example:
    ``tied_aliases({"model.embed_tokens.weight"}, [], True) == {"lm_head.weight": "model.embed_tokens.weight"}``.
    """
    aliases: dict[str, str] = {}
    for group in sharing_groups:
        source = next((n for n in group if n in stored), None)
        if source is not None:
            aliases.update({n: source for n in group if n not in stored})
    embeddings = [n for n in stored if n.endswith(_EMBEDDINGS)]
    if ties_word_embeddings and _OUTPUT not in stored and len(embeddings) == 1:
        aliases.setdefault(_OUTPUT, embeddings[0])
    return aliases
