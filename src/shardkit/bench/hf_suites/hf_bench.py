"""HF-format rows: shardkit.hf save/load side by side with huggingface_hub, safetensors and transformers.

Cases (``docs/benchmarks.md``, suite "hf"), warm cache unless a row says cold:
before timing, every impl's files are evicted and read once sequentially
(``common.warm_files``), so each starts from the same page-cache state
whoever wrote the file (shardkit's fsync'd saves bypass the cache;
``save_pretrained`` leaves its pages cached in the folios its writes made).

- ``hf save``: ``shardkit.hf.save_checkpoint`` vs
  ``huggingface_hub.save_torch_state_dict``, at like durability: shardkit
  fsync'd vs the peer + an fsync of its files, and ``sync_files=False`` vs
  the peer as users run it; limit: a raw write of the same bytes + fsync.
- ``hf load into allocated module``: ``load_checkpoint(dir, model)`` copies
  into the module's own memory, vs ``huggingface_hub.load_torch_model``.
- ``hf load as dict``: ``load_checkpoint(dir, None)`` (zero-copy map by
  default) vs ``safetensors.torch.load_file`` (maps too): lazily, and with
  every page touched (warm; and cold: files evicted before each call, run
  apart from the warm rows); ``mmap=False`` (a copy) vs a raw read.
- Llama (``transformers``, at least ``LLAMA_MIN_BYTES``): ``save_pretrained``
  vs ``save_checkpoint`` (fsync'd vs save_pretrained + fsync; no fsync vs
  save_pretrained); ``from_pretrained`` (builds the model on meta, assigns
  tensors over maps of the files) vs the same done with shardkit: a model
  built under ``torch.device("meta")`` + ``load_checkpoint(dir, model,
  assign=True)`` (default mmap: zero-copy), lazily and with every page
  touched; and the copy into an allocated model vs ``load_torch_model``.

Each save impl writes into a directory of its own and deletes only its own
previous save before each run: the page cache a delete frees is fastest to
reuse from the core that freed it, and a save that always followed another
tool's delete (or a direct-I/O save, which leaves no page cache to reuse)
measured up to 2x slower without fsync than the same save after its own.

Rows that read through maps run in their own interleaved group, before the
rows that copy into fresh memory: on this VM a GiB freed by one call keeps
the kernel busy after the call returns (page reporting to the host,
compaction; the PMD-mapped share of the cached files drops), and a mapped
load timed next pays for it, 10 ms in one rep and 40-90 ms in the next
whichever impl it is. Every pair compared still runs interleaved in one group.

Each figure is the median of ``reps`` interleaved runs (at least
``common.NOISY_MIN_REPS`` for the saves and the dict loads, whose runs swing
most with the VM). Nothing here asserts a time.

Example::

    rows = run_hf_benchmarks(1 << 30, 3, "/tmp/bench")
    print(format_table(rows))
"""

from __future__ import annotations

import os
import shutil

import torch

from shardkit.bench.common import NOISY_MIN_REPS, evict_files, row, time_interleaved, warm_files


def _state(size_bytes: int) -> dict[str, torch.Tensor]:
    try:
        from shardkit.bench.workload import make_state

        return make_state(size_bytes)
    except ImportError:  # the shared workload module is optional here
        gen = torch.Generator().manual_seed(0)
        state, total, i = {}, 0, 0
        while total < size_bytes:
            for name, shape in ((f"layers.{i}.attn", (4096, 4096)), (f"layers.{i}.up", (4096, 1024)),
                                (f"layers.{i}.norm", (4096,))):
                state[name] = torch.randn(shape, generator=gen).to(torch.bfloat16)
                total += state[name].nbytes
            i += 1
        return state


def _module_from_state(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An nn.Module whose state_dict has exactly ``state``'s names, shapes and dtypes."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.empty_like(tensor), requires_grad=False))
    return root


def _fresh(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    # Untimed: flush what an earlier case left dirty (a save without fsync leaves the
    # whole state to be written back), so it is not charged to the next case.
    os.sync()


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _touch(tensors: dict) -> None:
    """Read one byte per page of every tensor, so lazily mapped loads pay for their reads."""
    for t in tensors.values():
        if t.numel():
            flat = t.reshape(-1).view(torch.uint8)
            int(flat[::4096].sum())


def _raw_write(state: dict, path: str) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in state.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def _raw_read(targets: list[torch.Tensor], path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for t in targets:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            done = 0
            while done < len(view):
                done += os.preadv(fd, [view[done:]], offset + done)
            offset += len(view)
    finally:
        os.close(fd)


def _interleaved(impls: dict, reps: int, setup=None) -> dict[str, dict]:
    """:func:`shardkit.bench.common.time_interleaved` where an impl may be ``(fn, own_setup)``;
    ``own_setup`` (or else ``setup``) runs untimed before every call."""
    fns = {name: impl[0] if isinstance(impl, tuple) else impl for name, impl in impls.items()}
    setups = {name: impl[1] if isinstance(impl, tuple) else setup for name, impl in impls.items()}
    return time_interleaved(fns, reps, lambda name: setups[name] and setups[name]())


def _save_rows(state, nbytes, reps, workdir) -> list[dict]:
    from huggingface_hub import save_torch_state_dict

    from shardkit.hf import save_checkpoint

    d = {impl: os.path.join(workdir, f"hf-save-{impl}") for impl in ("ours", "ours_nosync", "hub", "hub_sync", "raw")}
    saves = {
        "ours": lambda: save_checkpoint(d["ours"], state, safetensors=True),
        "ours_nosync": lambda: save_checkpoint(d["ours_nosync"], state, safetensors=True, sync_files=False),
        "hub": lambda: save_torch_state_dict(state, d["hub"]),
        "hub_sync": lambda: (save_torch_state_dict(state, d["hub_sync"]), _fsync_tree(d["hub_sync"])),
        "raw": lambda: _raw_write(state, os.path.join(d["raw"], "raw.bin")),
    }
    t = _interleaved({impl: (save, lambda impl=impl: _fresh(d[impl])) for impl, save in saves.items()},
                     max(reps, NOISY_MIN_REPS))
    for path in d.values():
        shutil.rmtree(path, ignore_errors=True)
    synced, unsynced = "hf save, fsync'd (safetensors)", "hf save, no fsync (safetensors)"
    return [
        row(synced, "shardkit", t["ours"], bytes=nbytes, note="atomic, fsync'd"),
        row(synced, "huggingface_hub.save_torch_state_dict+fsync", t["hub_sync"], bytes=nbytes),
        row(synced, "raw write+fsync", t["raw"], kind="limit", bytes=nbytes),
        row(unsynced, "shardkit", t["ours_nosync"], bytes=nbytes, note="sync_files=False: atomic, no fsync"),
        row(unsynced, "huggingface_hub.save_torch_state_dict", t["hub"], bytes=nbytes, note="no fsync"),
    ]


def _load_rows(state, nbytes, reps, workdir) -> list[dict]:
    from huggingface_hub import load_torch_model, save_torch_state_dict
    from safetensors.torch import load_file

    from shardkit.hf import load_checkpoint, save_checkpoint

    ours_dir, hub_dir = os.path.join(workdir, "hf-load-sk"), os.path.join(workdir, "hf-load-hub")
    _fresh(ours_dir), _fresh(hub_dir)
    save_checkpoint(ours_dir, state, safetensors=True)
    save_torch_state_dict(state, hub_dir)
    _raw_write(state, os.path.join(hub_dir, "raw.bin"))
    model = _module_from_state(state)
    targets = [torch.empty_like(t) for t in state.values()]
    single = os.path.join(hub_dir, "model.safetensors")
    load_torch_model(model, hub_dir, strict=True)  # untimed: first touch of the module's memory
    _raw_read(targets, os.path.join(hub_dir, "raw.bin"))
    warm_files(ours_dir, hub_dir)
    t = _interleaved({  # first, apart from the copies into fresh memory (module docstring)
        "ours_touch": lambda: _touch(load_checkpoint(ours_dir, None)),
        "ours_lazy": lambda: load_checkpoint(ours_dir, None),
        "st_lazy": lambda: load_file(single),
        "st_touch": lambda: _touch(load_file(single)),
    }, max(reps, NOISY_MIN_REPS))  # 3-40 ms each
    t |= _interleaved({
        "ours": lambda: load_checkpoint(ours_dir, model),
        "hub": lambda: load_torch_model(model, hub_dir, strict=True),
        "ours_on_hub": lambda: load_checkpoint(hub_dir, model),
        "raw": lambda: _raw_read(targets, os.path.join(hub_dir, "raw.bin")),
    }, reps)
    t |= _interleaved({
        "ours_copy": lambda: load_checkpoint(ours_dir, None, mmap=False),
        "raw_fresh": lambda: _raw_read([torch.empty_like(t) for t in targets], os.path.join(hub_dir, "raw.bin")),
    }, reps)
    cold = _interleaved({  # apart: these leave each impl's file cached the way its own load read it
        "ours": (lambda: _touch(load_checkpoint(ours_dir, None)), lambda: evict_files(ours_dir)),
        "st": (lambda: _touch(load_file(single)), lambda: evict_files(hub_dir)),
    }, reps)
    shutil.rmtree(ours_dir, ignore_errors=True), shutil.rmtree(hub_dir, ignore_errors=True)
    into, lazy = "hf load into allocated module", "hf load as dict, lazy map"
    touched, copied = "hf load as dict, pages touched", "hf load as dict, copied"
    from_disk = "hf load as dict, cold cache, pages touched"
    return [
        row(into, "shardkit", t["ours"], bytes=nbytes, note="copies into the module's memory"),
        row(into, "huggingface_hub.load_torch_model", t["hub"], bytes=nbytes),
        row(into, "shardkit on huggingface_hub's files", t["ours_on_hub"], bytes=nbytes, note="same files as hub"),
        row(into, "raw read into the same memory", t["raw"], kind="limit", bytes=nbytes),
        row(lazy, "shardkit", t["ours_lazy"], bytes=nbytes, note="default mmap: copy-on-write map"),
        row(lazy, "safetensors.torch.load_file", t["st_lazy"], bytes=nbytes, note="copy-on-write map"),
        row(touched, "shardkit", t["ours_touch"], bytes=nbytes, note="default mmap; one byte per page read"),
        row(touched, "safetensors.torch.load_file + touch", t["st_touch"], bytes=nbytes),
        row(from_disk, "shardkit", cold["ours"], bytes=nbytes, note="files evicted before each call"),
        row(from_disk, "safetensors.torch.load_file + touch", cold["st"], bytes=nbytes),
        row(copied, "shardkit", t["ours_copy"], bytes=nbytes, note="mmap=False: read into fresh memory"),
        row(copied, "raw read into fresh memory", t["raw_fresh"], kind="limit", bytes=nbytes),
    ]


#: The Llama rows use a model of at least this size, whatever ``size_bytes`` (a smoke test lowers it).
LLAMA_MIN_BYTES = 800 << 20


def _llama_config(size_bytes: int):
    """A Llama-style config (untied head) of about ``size_bytes`` in BF16: hidden 1024, MLP 2816, 32000
    vocab from 256 MiB up; a narrow one (hidden 128, 1024 vocab) below, for smoke runs."""
    from transformers import LlamaConfig

    hidden, mlp, vocab = (1024, 2816, 32000) if size_bytes >= 256 << 20 else (128, 352, 1024)
    per_layer = (4 * hidden * hidden + 3 * hidden * mlp) * 2
    layers = max(1, (size_bytes - 2 * vocab * hidden * 2) // per_layer)
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)


def _meta_llama(config):
    """The model as a user builds it to load into: on meta, no memory, no init (BF16 like the files)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def _llama_save_rows(model, nbytes, reps, ours_dir, tf_dir) -> list[dict]:
    from shardkit.hf import save_checkpoint

    ours_nosync_dir, tf_nosync_dir = ours_dir + "-nosync", tf_dir + "-nosync"
    t = _interleaved({
        "ours": (lambda: save_checkpoint(ours_dir, model, safetensors=True), lambda: _fresh(ours_dir)),
        "ours_nosync": (lambda: save_checkpoint(ours_nosync_dir, model, safetensors=True, sync_files=False),
                        lambda: _fresh(ours_nosync_dir)),
        "tf": (lambda: model.save_pretrained(tf_nosync_dir), lambda: _fresh(tf_nosync_dir)),
        "tf_sync": (lambda: (model.save_pretrained(tf_dir), _fsync_tree(tf_dir)), lambda: _fresh(tf_dir)),
    }, max(reps, NOISY_MIN_REPS))
    shutil.rmtree(ours_nosync_dir, ignore_errors=True)
    shutil.rmtree(tf_nosync_dir, ignore_errors=True)
    synced, unsynced = "hf save, Llama, fsync'd", "hf save, Llama, no fsync"
    return [
        row(synced, "shardkit", t["ours"], bytes=nbytes, note="atomic, fsync'd"),
        row(synced, "transformers save_pretrained + fsync", t["tf_sync"], bytes=nbytes, note="fsync of its files"),
        row(unsynced, "shardkit", t["ours_nosync"], bytes=nbytes, note="sync_files=False: atomic, no fsync"),
        row(unsynced, "transformers save_pretrained", t["tf"], bytes=nbytes, note="no fsync"),
    ]


def _llama_load_rows(config, nbytes, reps, ours_dir, tf_dir) -> list[dict]:
    from huggingface_hub import load_torch_model
    from transformers import LlamaForCausalLM

    from shardkit.hf import load_checkpoint

    def ours_assign():
        fresh = _meta_llama(config)
        load_checkpoint(ours_dir, fresh, assign=True)  # default mmap: tensors over maps of the files
        return fresh

    def from_pretrained():
        return LlamaForCausalLM.from_pretrained(tf_dir, dtype=torch.bfloat16)

    allocated = [_meta_llama(config).to_empty(device="cpu") for _ in range(2)]
    load_torch_model(allocated[1], tf_dir, strict=True)  # untimed: first touch of both models' memory
    load_checkpoint(ours_dir, allocated[0])
    warm_files(ours_dir, tf_dir)
    t = _interleaved({
        "ours": ours_assign,
        "tf": from_pretrained,
        "ours_touch": lambda: _touch(ours_assign().state_dict()),
        "tf_touch": lambda: _touch(from_pretrained().state_dict()),
        "ours_copy": lambda: load_checkpoint(ours_dir, allocated[0]),
        "hub_copy": lambda: load_torch_model(allocated[1], tf_dir, strict=True),
    }, reps)
    meta, touched, into = ("hf load, Llama, built on meta", "hf load, Llama on meta, pages touched",
                           "hf load into allocated Llama")
    return [
        row(meta, "shardkit", t["ours"], bytes=nbytes, note="meta init + load_checkpoint(assign=True): mapped"),
        row(meta, "transformers from_pretrained", t["tf"], bytes=nbytes, note="meta init + mapped tensors"),
        row(touched, "shardkit", t["ours_touch"], bytes=nbytes, note="as above + one byte per page read"),
        row(touched, "transformers from_pretrained + touch", t["tf_touch"], bytes=nbytes),
        row(into, "shardkit", t["ours_copy"], bytes=nbytes, note="copies into the model's memory"),
        row(into, "huggingface_hub.load_torch_model", t["hub_copy"], bytes=nbytes, note="copies into the model"),
    ]


def _transformers_rows(size_bytes, reps, workdir) -> list[dict]:
    from transformers import LlamaForCausalLM

    config = _llama_config(max(size_bytes, LLAMA_MIN_BYTES))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    ours_dir, tf_dir = os.path.join(workdir, "tf-sk"), os.path.join(workdir, "tf-tf")
    rows = _llama_save_rows(model, nbytes, reps, ours_dir, tf_dir)
    del model
    rows += _llama_load_rows(config, nbytes, reps, ours_dir, tf_dir)
    shutil.rmtree(ours_dir, ignore_errors=True), shutil.rmtree(tf_dir, ignore_errors=True)
    return rows


def run_hf_benchmarks(size_bytes: int, reps: int, workdir: str) -> list[dict]:
    """All HF rows for a state of about ``size_bytes`` (see the module docstring)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    state = _state(size_bytes)
    nbytes = sum(t.nbytes for t in state.values())
    rows = _save_rows(state, nbytes, reps, workdir)
    rows += _load_rows(state, nbytes, reps, workdir)
    del state
    rows += _transformers_rows(size_bytes, reps, workdir)
    return rows


if __name__ == "__main__":
    import sys
    import tempfile

    from shardkit.bench.common import format_table

    size = int(float(sys.argv[1]) * (1 << 20)) if len(sys.argv) > 1 else 64 << 20
    with tempfile.TemporaryDirectory() as tmp:
        print(format_table(run_hf_benchmarks(size, int(sys.argv[2]) if len(sys.argv) > 2 else 3, tmp)))
