"""HF-format rows: shardkit.hf save/load side by side with huggingface_hub and transformers.

Cases (BENCHMARKS.md, "HF save / load"), all on the same synthetic BF16 state:

- ``hf save``: ``shardkit.hf.save_checkpoint`` (fsync'd, atomic; and with
  ``sync_files=False``, atomic without fsync) vs
  ``huggingface_hub.save_torch_state_dict`` as users run it (no fsync) and
  with an fsync of its files (the like-for-like durability), limit: a raw
  write of the same bytes + fsync.
- ``hf load``: ``load_checkpoint`` into a module vs ``huggingface_hub.load_torch_model``
  into the same module; dict mode vs ``safetensors.torch.load_file``; limit:
  reading the same bytes from page cache into memory.
- ``hf save_pretrained`` / ``hf from_pretrained``: a Llama of about the same
  size, vs ``transformers``.

Each figure is the median of ``reps`` runs. Nothing here asserts a time.

Example::

    rows = run_hf_benchmarks(1 << 30, 3, "/tmp/bench")
    print(format_table(rows))
"""

from __future__ import annotations

import os
import shutil

import torch

from shardkit.bench.common import row, time_interleaved


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

    d = os.path.join(workdir, "hf-save")
    case = "hf save (safetensors)"
    t = _interleaved({
        "ours": lambda: save_checkpoint(d, state, safetensors=True),
        "ours_nosync": lambda: save_checkpoint(d, state, safetensors=True, sync_files=False),
        "hub": lambda: save_torch_state_dict(state, d),
        "hub_sync": lambda: (save_torch_state_dict(state, d), _fsync_tree(d)),
        "raw": lambda: _raw_write(state, os.path.join(d, "raw.bin")),
    }, reps, lambda: _fresh(d))
    ours, ours_nosync, hub, hub_sync, raw = t["ours"], t["ours_nosync"], t["hub"], t["hub_sync"], t["raw"]
    shutil.rmtree(d, ignore_errors=True)
    return [
        row(case, "shardkit", ours, bytes=nbytes, note="atomic, fsync'd"),
        row(case, "shardkit sync_files=False", ours_nosync, bytes=nbytes, note="atomic, no fsync"),
        row(case, "huggingface_hub.save_torch_state_dict", hub, bytes=nbytes, note="no fsync"),
        row(case, "huggingface_hub.save_torch_state_dict+fsync", hub_sync, bytes=nbytes),
        row(case, "raw write+fsync", raw, kind="limit", bytes=nbytes),
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
    case, case_dict = "hf load into module (warm cache)", "hf load as dict (warm cache)"
    load_torch_model(model, hub_dir, strict=True)  # untimed: first touch of the module's memory
    load_checkpoint(ours_dir, model)  # untimed: every impl's files are read once before timing
    load_checkpoint(ours_dir, None)
    _raw_read(targets, os.path.join(hub_dir, "raw.bin"))
    t = _interleaved({
        "ours": lambda: load_checkpoint(ours_dir, model),
        "hub": lambda: load_torch_model(model, hub_dir, strict=True),
        "ours_on_hub": lambda: load_checkpoint(hub_dir, model),
        "ours_dict": lambda: load_checkpoint(ours_dir, None, mmap=False),
        "ours_mmap": lambda: _touch(load_checkpoint(ours_dir, None, mmap=True)),
        "ours_default": lambda: load_checkpoint(ours_dir, None),
        "st_lazy": lambda: load_file(single),
        "st": lambda: _touch(load_file(single)),
        "raw": lambda: _raw_read(targets, os.path.join(hub_dir, "raw.bin")),
    }, reps)
    ours, hub, ours_on_hub, ours_dict, ours_mmap, st, raw = (
        t[k] for k in ("ours", "hub", "ours_on_hub", "ours_dict", "ours_mmap", "st", "raw"))
    shutil.rmtree(ours_dir, ignore_errors=True), shutil.rmtree(hub_dir, ignore_errors=True)
    return [
        row(case, "shardkit", ours, bytes=nbytes),
        row(case, "huggingface_hub.load_torch_model", hub, bytes=nbytes),
        row(case, "shardkit on huggingface_hub's files", ours_on_hub, bytes=nbytes, note="same files as hub"),
        row(case, "raw read into memory", raw, kind="limit", bytes=nbytes),
        row(case_dict, "shardkit (default: zero-copy map)", t["ours_default"], bytes=nbytes, note="lazy map"),
        row(case_dict, "safetensors.torch.load_file", t["st_lazy"], bytes=nbytes, note="lazy map"),
        row(case_dict, "shardkit mmap=False", ours_dict, bytes=nbytes, note="read into fresh memory"),
        row(case_dict, "shardkit (default) + touch", ours_mmap, bytes=nbytes, note="lazy map; every page read"),
        row(case_dict, "safetensors.torch.load_file + touch", st, bytes=nbytes, note="lazy map; every page read"),
        row(case_dict, "raw read into memory", raw, kind="limit", bytes=nbytes),
    ]


def _llama_config(size_bytes: int):
    from transformers import LlamaConfig

    hidden = 1024
    per_layer = (4 * hidden * hidden + 3 * hidden * 2816) * 2
    layers = max(1, (size_bytes - 2 * 32000 * hidden * 2) // per_layer)
    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False)


def _transformers_rows(size_bytes, reps, workdir) -> list[dict]:
    from transformers import LlamaForCausalLM

    from shardkit.hf import load_checkpoint, save_checkpoint

    config = _llama_config(size_bytes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    nbytes = sum(t.nbytes for t in model.state_dict().values())
    ours_dir, tf_dir = os.path.join(workdir, "tf-sk"), os.path.join(workdir, "tf-tf")
    t = _interleaved({"ours": (lambda: save_checkpoint(ours_dir, model, safetensors=True), lambda: _fresh(ours_dir)),
                      "tf": (lambda: model.save_pretrained(tf_dir), lambda: _fresh(tf_dir))}, reps)
    ours, tf = t["ours"], t["tf"]
    config.save_pretrained(ours_dir)

    def shardkit_from_config():
        with torch.device("meta"):
            fresh = LlamaForCausalLM(config).to(torch.bfloat16)
        fresh.to_empty(device="cpu")
        load_checkpoint(ours_dir, fresh)

    def shardkit_mapped():
        with torch.device("meta"):
            fresh = LlamaForCausalLM(config).to(torch.bfloat16)
        load_checkpoint(ours_dir, fresh, assign=True, mmap=True)
        return fresh

    def from_pretrained():
        return LlamaForCausalLM.from_pretrained(tf_dir, dtype=torch.bfloat16)

    t = _interleaved({"ours": shardkit_from_config, "tf": from_pretrained,
                      "ours_mmap": lambda: _touch(shardkit_mapped().state_dict()),
                      "tf_touch": lambda: _touch(from_pretrained().state_dict())}, reps)
    ours_load, tf_load, ours_mmap, tf_touch = t["ours"], t["tf"], t["ours_mmap"], t["tf_touch"]
    shutil.rmtree(ours_dir, ignore_errors=True), shutil.rmtree(tf_dir, ignore_errors=True)
    save_case, load_case = "hf save, Llama model", "hf load, Llama model (warm cache)"
    return [
        row(save_case, "shardkit", ours, bytes=nbytes, note="atomic, fsync'd"),
        row(save_case, "transformers save_pretrained", tf, bytes=nbytes, note="no fsync"),
        row(load_case, "shardkit", ours_load, bytes=nbytes, note="meta init + to_empty + load"),
        row(load_case, "transformers from_pretrained", tf_load, bytes=nbytes, note="maps files lazily"),
        row(load_case, "shardkit assign+mmap + touch", ours_mmap, bytes=nbytes, note="meta init; lazy map; every page read"),
        row(load_case, "transformers from_pretrained + touch", tf_touch, bytes=nbytes, note="every page read"),
    ]


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
