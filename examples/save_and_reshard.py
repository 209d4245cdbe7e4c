"""Save a sharded state as 2 ranks would, load it as 3 ranks would, in one process.

Without a process group (``group=None``), each call to ``save_distributed``
writes one rank's shard; rank 0 also writes ``metadata.json``. Real jobs call
it once per rank process and pass ``group=`` so that ``metadata.json`` is
written only after every rank has finished.

    python examples/save_and_reshard.py /tmp/ckpt-step-100
"""

import sys
import tempfile

import torch

from shardkit.checkpoint import (
    ShardMetadata,
    TensorShardSpec,
    compute_shard_sizes,
    load_distributed,
    save_distributed,
    validate_distributed,
)

# A new directory per save: without a group, saving over an existing checkpoint is refused.
path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="shardkit-example-ckpt-")
weight = torch.randn(10, 4)                                     # the full tensor, for checking
old_sizes = compute_shard_sizes(10, 2)                          # [5, 5]
spec = ShardMetadata(2, {"model.weight": TensorShardSpec((10, 4), 0, tuple(old_sizes))})

for rank in range(2):
    rows = weight[sum(old_sizes[:rank]) : sum(old_sizes[: rank + 1])]
    state = {"model": {"weight": rows, "bias": torch.zeros(4)}, "step": 100}
    save_distributed(state, path, rank, 2, spec)

print("valid:", validate_distributed(path).ok)
new_sizes = compute_shard_sizes(10, 3)                          # [4, 3, 3]
for rank in range(3):
    state = load_distributed(path, rank, 3)
    start = sum(new_sizes[:rank])
    assert torch.equal(state["model"]["weight"], weight[start : start + new_sizes[rank]])
    print(f"rank {rank} of 3: weight rows {start}..{start + new_sizes[rank] - 1}, step {state['step']}")
