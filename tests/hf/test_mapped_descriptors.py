"""A mapped load holds one descriptor per file: past the process's limit it is a typed error that says so."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from shardkit.hf import save_checkpoint

CHILD = """
import os, resource, sys
import torch
from shardkit.errors import CheckpointIOError
from shardkit.hf import load_checkpoint

open_now = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 12, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
copied = load_checkpoint(sys.argv[1], mmap=False)          # copies: no descriptor kept per file
assert len(copied) == 40 and all(float(t[0]) == int(n[1:]) for n, t in copied.items())
try:
    kept = load_checkpoint(sys.argv[1])                    # maps: one descriptor per shard while the tensors live
except CheckpointIOError as e:
    print("refused:", e)
else:
    print("loaded", len(kept))
"""


def test_mapping_more_files_than_the_descriptor_limit_is_a_typed_error_and_mmap_false_works(tmp_path):
    save_checkpoint(str(tmp_path), {f"t{i}": torch.full((256,), float(i)) for i in range(40)}, safetensors=True,
                    max_shard_size=1024)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 40
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "too many open files" in done.stdout and "mmap=False" in done.stdout, done.stdout
