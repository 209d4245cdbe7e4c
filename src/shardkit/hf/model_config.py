"""The configs a ``transformers`` model carries, saved beside its weights as ``save_pretrained`` saves them.

``from_pretrained(dir)`` needs ``config.json`` to build the model (without it,
it builds a default config) and ``generation_config.json`` for a model that
generates. :func:`model_config_files` renders them in memory with the
configs' own ``save_pretrained`` -- the same validation and the same JSON as
``PreTrainedModel.save_pretrained``, including its ``architectures`` and
``dtype`` entries -- so the caller publishes them atomically, on any storage.
The module's config is not modified. Nothing is rendered for a plain module
or a state dict; ``transformers`` is never imported here. This module does
not write weights.

Example::

    files = model_config_files(model)   # {"config.json": b"...", "generation_config.json": b"..."}
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Dict, Optional

import torch
from torch.nn import Module

from shardkit.errors import MetadataError

__all__ = ["model_config_files", "write_model_config_files"]


def model_config_files(module: object, *, dtype: Optional[torch.dtype] = None) -> Dict[str, bytes]:
    """``{file name: bytes}`` that ``save_pretrained`` would write for ``module``'s configs; ``{}`` if it has none.

    Only an ``nn.Module`` with a ``config`` that has ``save_pretrained`` (a
    ``transformers`` config) counts; ``generation_config`` is added when the
    module has one and, if it says, ``can_generate()``. The config's
    ``dtype`` is ``dtype`` when given (the weights are saved cast to it),
    else the module's. An FSDP2 module (class ``FSDP<Name>``) is recorded
    as ``<Name>``. Raises ``MetadataError`` when ``transformers`` refuses to
    save the config.
    """
    config = getattr(module, "config", None)
    if not isinstance(module, Module) or not callable(getattr(config, "save_pretrained", None)):
        return {}
    config = copy.deepcopy(config)  # save_pretrained writes these two into the model's config; we do not
    config.architectures = [type(module).__name__.removeprefix("FSDP")]
    dtype = dtype if dtype is not None else getattr(module, "dtype", None)
    if isinstance(dtype, torch.dtype):
        config.dtype = str(dtype).split(".")[1]
    to_save = [config]
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if callable(getattr(generation, "save_pretrained", None)) and (not callable(can_generate) or can_generate()):
        to_save.append(generation)
    with tempfile.TemporaryDirectory(prefix="shardkit-config-") as tmp:
        for item in to_save:
            try:
                item.save_pretrained(tmp)
            except (ValueError, TypeError, AssertionError) as e:
                raise MetadataError(
                    f"{type(item).__name__} of the {type(module).__name__} cannot be saved as save_pretrained "
                    f"would save it ({e}); fix the config, or save module.state_dict() to write weights only"
                ) from e
        return {name: _read(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))
                if os.path.isfile(os.path.join(tmp, name))}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_model_config_files(store, root: str, files: Dict[str, bytes], sync_files: bool) -> None:
    """Publish each of ``files`` in ``root`` atomically (fsync'd when ``sync_files``)."""
    for name, data in files.items():
        with store.atomic_writer(store.join(root, name), sync_files) as f:
            f.write(data)
