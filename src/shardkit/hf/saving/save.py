"""Save a module or a state dict as a Hugging Face sharded checkpoint.

Order is what makes a save safe to interrupt: an existing index is removed
first (the directory stops counting as a checkpoint), then stale shards, then
each new shard is written whole-or-not-at-all, and the index is written last.
:func:`save_checkpoint` holds the directory's writer lock for all of it
(``Storage.writer_lock``, the slot rank 0 of a distributed save also takes):
a second save into the same directory meanwhile fails at once with
:class:`~shardkit.errors.CheckpointBusyError` naming the first, and a killed
writer leaves no stuck lock. Tied parameters are stored once and recorded as ``param_sharing``. This
module does not load, and does not manage a directory of checkpoints.

Example::

    save_checkpoint("out/model", model, safetensors=True)           # module mode
    save_checkpoint("out/sd", {"w": torch.ones(3)}, safetensors=True)  # dict mode
"""

from __future__ import annotations

from typing import Dict, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module

from shardkit.errors import TensorMismatchError
from shardkit.hf.saving.export_plan import out_dtype
from shardkit.hf.saving.export_write import cast_lazy, remove_previous, write_export, write_files
from shardkit.hf.index import (
    ShardIndex,
    SharingMetadataT,
    StateDictLike,
    alias_to_source,
    files_to_names,
    index_file_name,
    index_json,
    make_shard_index,
    shard_size_bytes,
    sharing_for,
    sharing_of,
)
from shardkit.hf.saving.job_save import holds_dtensors, save_in_job
from shardkit.hf.model_config import model_config_files
from shardkit.hf.saving.save_checks import RESERVED_TENSOR_NAME, check_export_dtype, check_savable_tensors
from shardkit.hf.sharing import create_sharing_metadata
from shardkit.storage import storage_for

__all__ = ["save_checkpoint", "save_sharded_checkpoint", "state_dict_of"]


def state_dict_of(module: StateDictLike) -> Dict[str, Tensor]:
    """``module.state_dict()`` for a module; a checked copy of the mapping for a dict.

    Refuses (``TensorMismatchError``) entries that are not str -> tensor, and
    the name ``__metadata__``, which safetensors reserves for its header's
    metadata. Does not check dtypes or devices (see ``check_savable_tensors``).
    """
    sd = module.state_dict() if isinstance(module, Module) else dict(module)
    for name, value in sd.items():
        if not isinstance(name, str) or not isinstance(value, Tensor):
            raise TensorMismatchError(
                f"state dict entry {name!r} is a {type(value).__name__}; only str -> torch.Tensor "
                f"entries can be saved in a Hugging Face checkpoint. Move other values to `metadata`."
            )
    if RESERVED_TENSOR_NAME in sd:
        raise TensorMismatchError(
            f"a tensor is named {RESERVED_TENSOR_NAME!r}, the key a safetensors header reserves for its "
            f"metadata: the file would not load. Rename the tensor before saving. Nothing was written."
        )
    return sd


def save_checkpoint(
    output_dir: str,
    module: StateDictLike,
    metadata: Optional[Dict] = None,
    safetensors: bool = False,
    max_shard_size: Union[int, str] = 2**31,
    debug: bool = False,
    include_param_sharing: bool = True,
    param_sharing_metadata: Optional[SharingMetadataT] = None,
    *,
    sync_files: bool = True,
    dtype: Optional[torch.dtype] = None,
    group=None,
) -> None:
    """Write ``module`` (an ``nn.Module`` or a name -> tensor dict) to ``output_dir``.

    Always writes an index (``model.safetensors.index.json`` or
    ``pytorch_model.bin.index.json``) and ``model-0000i-of-0000n`` shards of at
    most ``max_shard_size`` bytes (more only when one tensor alone is larger;
    an int, or a string such as ``"5GB"`` or ``"2GiB"`` read as ``transformers``
    reads it). Tied parameters are found automatically unless
    ``param_sharing_metadata`` is given or ``include_param_sharing`` is False
    (then every name is written separately). A ``transformers`` model's
    ``config.json`` and ``generation_config.json`` are written too, as
    ``save_pretrained`` writes them, so ``from_pretrained(output_dir)`` loads
    the checkpoint; nothing else is (no tokenizer, no optimizer state).
    ``dtype`` (e.g. ``torch.bfloat16``) casts every floating tensor on the
    way out (integer tensors keep theirs; the module is not changed) and is
    recorded as the config's ``dtype``.

    **In a job.** When the state holds DTensors (an FSDP2, HSDP or
    tensor-parallel module, or ``get_state_dict``'s dict of one) the save is
    a collective over ``group`` (None: the default process group), which
    every rank must call: each rank writes the whole tensors assigned to it
    (balanced by bytes), gathering the parts it lacks from the ranks holding
    them, and rank 0 writes the index once every rank's files are complete.
    No rank ever holds the whole model (see ``hf/saving/job_save.py`` for the memory
    bound). All ranks must see ``output_dir`` (a shared file system or URL).
    A state without DTensors is saved by the calling process alone, as before.

    Every file is published atomically (written under a temporary name, then
    renamed; the index last). ``sync_files`` (default) also fsyncs each file
    and the directory, so a power loss never leaves a checkpoint that looks
    complete but is not; ``sync_files=False`` skips that, like
    ``save_pretrained`` and ``huggingface_hub`` (and DCP's ``sync_files=False``).

    Raises, before touching anything in ``output_dir``:
    :class:`~shardkit.errors.CheckpointBusyError` while another save writes
    it; :class:`~shardkit.errors.TensorMismatchError` for a tensor the format
    cannot store (meta device, sparse, a dtype such as complex128 in
    safetensors) or named ``__metadata__``, or a ``dtype`` that is not a
    floating dtype; :class:`~shardkit.errors.MetadataError` for ``metadata``
    the index cannot hold and read back (a numpy scalar, NaN, an infinity).
    In a job, the same error on every rank.

    Example (on every rank of an FSDP2 job, or in one process)::

        save_checkpoint("export/hf", model, safetensors=True, dtype=torch.bfloat16)
        AutoModelForCausalLM.from_pretrained("export/hf")
    """
    # Everything that can be refused is refused before the lock: the previous checkpoint stays whole.
    sd = state_dict_of(module)
    check_savable_tensors(sd, safetensors)
    check_export_dtype(dtype, safetensors)
    sharing = sharing_for([sd], _sharing(module, include_param_sharing, param_sharing_metadata))

    def configs_of() -> Dict[str, bytes]:  # a config transformers refuses stops the save before any write
        return model_config_files(module, dtype=dtype)

    if holds_dtensors(sd):
        aliases = alias_to_source(sharing)
        save_in_job(output_dir, sd, stored=[n for n in sd if n not in aliases], sharing=sharing, metadata=metadata,
                    safetensors=safetensors, max_shard_bytes=shard_size_bytes(max_shard_size), dtype=dtype,
                    configs_of=configs_of, group=group, durable=sync_files, debug=debug)
        return
    cast = {n: out_dtype(t.dtype, dtype) for n, t in sd.items()}
    shapes = {n: torch.empty(t.shape, dtype=cast[n], device="meta") for n, t in sd.items()}
    index = make_shard_index([shapes], metadata, safetensors, max_shard_size, sharing)
    index_data = index_json(index, index_file_name(safetensors))
    configs = configs_of()
    weight_map = index["weight_map"]
    store, root = storage_for(output_dir)
    with store.writer_lock(root, holder="shardkit.hf.save_checkpoint"):
        remove_previous(store, root)
        write_export(store, root, list(files_to_names(weight_map, weight_map).items()),
                     lambda n: cast_lazy(sd[n], cast[n]), index_data, configs, safetensors, durable=sync_files,
                     debug=debug)


def _sharing(module, include: bool, explicit: Optional[SharingMetadataT]) -> Optional[SharingMetadataT]:
    if explicit is not None:
        return explicit
    if not include:
        return []
    return create_sharing_metadata(module) if isinstance(module, Module) else None


def save_sharded_checkpoint(
    output_dir: str,
    shard_index: ShardIndex,
    module: StateDictLike,
    safetensors: bool = False,
    debug: bool = False,
    *,
    sync_files: bool = True,
) -> None:
    """Write the shard files of ``shard_index`` whose tensors ``module`` holds.

    For one rank of many: files whose tensors are all elsewhere are skipped;
    a file whose tensors are split between this state and another raises
    ``TensorMismatchError`` (it would be written incomplete), as does a
    tensor the format cannot store, before any file is written. Does not write
    the index: call :func:`save_shard_index` once every rank is done. Takes
    no writer lock (it is one rank's part of a save, and ranks writing their
    own files must not exclude each other); :func:`save_checkpoint` does.
    """
    sd = state_dict_of(module)
    check_savable_tensors(sd, safetensors)
    weight_map = shard_index["weight_map"]
    aliases = alias_to_source(sharing_of(shard_index))
    unknown = [n for n in sd if n not in weight_map and n not in aliases]
    if unknown:
        raise TensorMismatchError(
            f"{len(unknown)} tensors are not in the shard index (e.g. {unknown[:5]}); they would be "
            f"lost. Build the index from this state (make_shard_index) or drop them first."
        )
    mine = []
    for file_name, names in files_to_names(weight_map, weight_map).items():
        held = [n for n in names if n in sd]
        if not held:
            continue
        if len(held) != len(names):
            missing = [n for n in names if n not in sd]
            raise TensorMismatchError(
                f"shard {file_name} needs {len(names)} tensors, this state holds {len(held)} "
                f"(missing e.g. {missing[:5]}); every shard must be written by one rank. Build the "
                f"index with one state dict per rank so each rank gets its own files."
            )
        mine.append((file_name, names))
    store, root = storage_for(output_dir)
    store.makedirs(root)
    write_files(store, root, mine, sd.__getitem__, safetensors, durable=sync_files, debug=debug)
