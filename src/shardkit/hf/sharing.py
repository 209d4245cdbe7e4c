"""Tied parameters: find names that share memory, and tie them again after a load.

safetensors cannot hold two names over one storage, so shardkit stores the
first name of each group once and records the groups (``param_sharing``) in
the index metadata. This module finds the groups and reties a module; it
reads and writes no files.

Example::

    groups = create_sharing_metadata(model)   # [["model.embed_tokens.weight", "lm_head.weight"]]
    retie_parameters(fresh_model, groups)     # lm_head.weight is embed_tokens.weight again
"""

from __future__ import annotations

from typing import List

from torch import Tensor
from torch.nn import Module

from shardkit.checkpoint.planning.dtensor_layout import is_dtensor
from shardkit.errors import TensorMismatchError
from shardkit.storage.fast_io.destinations import memory_identity

__all__ = [
    "create_sharing_metadata", "retie_parameters", "find_shared_groups", "alias_to_source", "tensor_names",
    "check_ties",
]


def find_shared_groups(named_tensors: list[tuple[str, Tensor]]) -> List[List[str]]:
    """Groups (in first-seen order) of names whose tensors are the same view of the same memory.

    Tensors that merely overlap (a slice of another) are not grouped; they
    are written as separate copies. A DTensor (FSDP2, TP) is compared by its
    local part (``to_local()``): it has no memory of its own to ask about.
    """
    by_identity: dict[tuple, list[str]] = {}
    for name, tensor in named_tensors:
        by_identity.setdefault(_identity(tensor), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def _identity(tensor: Tensor) -> tuple:
    if not is_dtensor(tensor):
        return memory_identity(tensor)
    local = tensor.to_local()
    if local.numel() == 0 and local.device.type != "meta" and local.untyped_storage().nbytes():
        # a rank's empty shard still lies in its parameter's padded storage: tied names share that
        return ("dtensor", str(local.device), local.untyped_storage().data_ptr(), local.storage_offset(), local.dtype)
    return ("dtensor", *memory_identity(local))


def create_sharing_metadata(model: Module) -> List[List[str]]:
    """The groups of parameter/buffer names of ``model`` that share one tensor.

    Only names in ``model.state_dict()`` are reported. Example: a GPT-2 with
    tied embeddings gives ``[["transformer.wte.weight", "lm_head.weight"]]``.
    """
    state_names = set(model.state_dict().keys())
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if n in state_names]
    named += [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in state_names]
    return find_shared_groups(named)


def alias_to_source(sharing_metadata: List[List[str]]) -> dict[str, str]:
    """``{alias: stored_name}``: every name of a group but the first maps to the first."""
    return {alias: group[0] for group in sharing_metadata for alias in group[1:]}


def retie_parameters(module: Module, sharing_metadata: List[List[str]]) -> None:
    """Make the names of each group that ``module`` has refer to the first of them again.

    Does not copy values: after this, writing one name writes them all.
    Names the module does not have are skipped, as forgather does: a pipeline
    stage that holds one side of a tie (or neither) keeps what it has, and a
    group with fewer than two names in the module changes nothing. A name
    whose shape differs from its group's first raises ``TensorMismatchError``
    before anything is tied (such a tie would silently swap in a tensor of
    another shape). Dtypes may differ here: an ``assign=True`` load gives the
    first name the checkpoint's dtype, and the tie passes it on, as
    ``transformers``' ``tie_weights`` does; loaders check dtypes on the module
    before they load (:func:`check_ties`). Example::

        retie_parameters(stage0, [["embed.weight", "lm_head.weight"]])  # stage0 has no lm_head: no-op
    """
    check_ties(module, sharing_metadata, dtypes=False)
    have = tensor_names(module)
    for group in sharing_metadata:
        present = [n for n in group if n in have]
        if len(present) < 2:
            continue
        source = _lookup(module, present[0])
        for alias in present[1:]:
            owner, attr = _owner(module, alias)
            if attr in owner._buffers:
                owner._buffers[attr] = source
            else:
                setattr(owner, attr, source)


def check_ties(module: Module, sharing_metadata: List[List[str]], *, dtypes: bool = True, source: str = "") -> None:
    """Raise ``TensorMismatchError`` if a group ties names of ``module`` whose shapes (or dtypes) differ.

    Compares each name the module has with the first of its group that the
    module has, as :func:`retie_parameters` would tie them; names the module
    lacks are skipped. Reads no tensor data and changes nothing. ``source``
    says where the groups come from, for the message (e.g. "the index in out/model"). Example::

        check_ties(model, sharing_of(index), source="the index in out/model")  # before loading into model
    """
    have = tensor_names(module)
    for group in sharing_metadata:
        present = [n for n in group if n in have]
        for alias in present[1:]:
            _check_tie(_lookup(module, present[0]), _lookup(module, alias), present[0], alias, dtypes, source)


def _check_tie(first: Tensor, other: Tensor, first_name: str, other_name: str, dtypes: bool, source: str) -> None:
    if tuple(first.shape) == tuple(other.shape) and (not dtypes or first.dtype == other.dtype):
        return
    raise TensorMismatchError(
        f"{source or 'the sharing metadata'} ties {other_name!r} to {first_name!r}, but in the module "
        f"{other_name!r} is {list(other.shape)} {other.dtype} and {first_name!r} is {list(first.shape)} "
        f"{first.dtype}; tying them would replace {other_name!r} with a tensor of another shape or dtype. "
        f"The ties are for a different model: build the module with the checkpoint's configuration, or "
        f"load with module=None and pick the tensors yourself."
    )


def tensor_names(module: Module) -> set:
    """Every parameter and buffer name of ``module``, tied and non-persistent ones included."""
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    return names | {n for n, _ in module.named_buffers(remove_duplicate=False)}


def _owner(module: Module, name: str) -> tuple[Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _lookup(module: Module, name: str) -> Tensor:
    owner, attr = _owner(module, name)
    return getattr(owner, attr)
