"""Conjugate and negative views keep their sign in a bit, not in their bytes: saves resolve them.

Found by review: a synchronous save of ``x.conj()`` or ``torch._neg_view(x)``
raised torch's "view is not supported for conjugate view tensors" (the
background save resolved them already).
"""

from __future__ import annotations

import pytest
import torch

import shardkit.checkpoint as ckpt
from shardkit.hf import load_checkpoint, save_checkpoint

VIEWS = {
    "conj": lambda: torch.complex(torch.arange(6.0).reshape(2, 3), torch.ones(2, 3)).conj(),
    "neg": lambda: torch._neg_view(torch.arange(4.0)),
}


@pytest.mark.parametrize("kind", VIEWS)
@pytest.mark.parametrize("background", [False, True])
def test_a_view_is_saved_with_its_values(tmp_path, kind, background):
    view = VIEWS[kind]()
    if background:
        ckpt.async_save({"t": view}, tmp_path / "c").wait()
    else:
        ckpt.save({"t": view}, tmp_path / "c")
    out = {"t": torch.zeros_like(view.resolve_conj().resolve_neg())}
    ckpt.load(out, tmp_path / "c")
    assert torch.equal(out["t"], view.resolve_conj().resolve_neg())


def test_a_negative_view_is_saved_with_its_values_in_hugging_face_files(tmp_path):
    view = VIEWS["neg"]()  # (safetensors has no complex dtype for the conjugate one)
    save_checkpoint(str(tmp_path / "hf"), {"t": view}, safetensors=True)
    assert torch.equal(load_checkpoint(str(tmp_path / "hf"))["t"], view.resolve_neg())
