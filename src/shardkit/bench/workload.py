"""The synthetic transformer-like state the benchmarks save and load.

Large matrices (32000x1024 embedding, 4096x4096, 4096x1024 pairs), vectors
and a scalar per layer, BF16 by default, repeated until ``size_bytes``. For
smoke sizes the matrix sides shrink by powers of two so the mix stays the same.
Values come from a generator seeded by the tensor's name, so any process can
rebuild exactly the same tensor (or just its shard) without a transfer.
"""

from __future__ import annotations

import zlib

import torch


def _scale(size_bytes: int) -> int:
    scale = 1
    while scale < 64 and size_bytes < (512 << 20) // (scale * scale):
        scale *= 2
    return scale


def tensor_shapes(size_bytes: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the workload, adding layers until ``size_bytes`` is reached."""
    s = _scale(size_bytes)
    item = torch.empty((), dtype=dtype).element_size()
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (32000 // s, 1024 // s)}
    total = 32000 // s * 1024 // s * item
    layer = 0
    while total < size_bytes:
        block = {
            f"layers.{layer}.attn.qkvo": (4096 // s, 4096 // s),
            f"layers.{layer}.mlp.up": (4096 // s, 1024 // s),
            f"layers.{layer}.mlp.down": (4096 // s, 1024 // s),
            f"layers.{layer}.norm1.weight": (4096 // s,),
            f"layers.{layer}.norm2.weight": (4096 // s,),
            f"layers.{layer}.mlp.bias": (1024 // s,),
            f"layers.{layer}.scale": (),
        }
        for name, shape in block.items():
            shapes[name] = shape
            n = 1
            for d in shape:
                n *= d
            total += n * item
        layer += 1
    return shapes


def make_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def make_state(size_bytes: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return {name: make_tensor(name, shape, dtype) for name, shape in tensor_shapes(size_bytes, dtype).items()}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())
