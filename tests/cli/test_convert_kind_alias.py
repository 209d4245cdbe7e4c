"""``--to shardkit`` / ``--from shardkit`` name shardkit's own format ("distributed" on disk and in
output), beside DCP's "Distributed Checkpoint": the same bytes as ``--to distributed``."""

import json
import os

import torch

from shardkit.checkpoint import load_consolidated, save_distributed
from shardkit.cli import main


def test_to_shardkit_writes_what_to_distributed_writes(tmp_path, capsys):
    src = str(tmp_path / "src")
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2)}
    save_distributed(state, src, 0, 1, None)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["convert", src, a, "--to", "distributed", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["convert", src, b, "--to", "shardkit", "--from", "shardkit", "--quiet", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["to"] == "distributed"
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        if name != "metadata.json":
            assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read()
    with open(os.path.join(b, "metadata.json")) as f:
        assert json.load(f)["format"] == "shardkit.distributed"
    for out in (a, b):
        loaded = load_consolidated(out)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())
