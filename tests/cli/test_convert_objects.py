"""shardkit convert of a real model + AdamW DCP checkpoint, and the exit codes of bad options and of bugs.

In this process (``in_process``: ``shardkit.cli.main``), one-process DCP saves (``no_dist=True``).
"""

from __future__ import annotations

import pytest
import torch

from cli_helpers import assert_one_line_error, dcp_state, in_process, save_sharded, training_state
from shardkit.checkpoint import load_consolidated, load_distributed, read_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _model_and_adamw():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.fixture(scope="module")
def adamw_dcp(tmp_path_factory):
    state = _model_and_adamw()
    return state, _dcp_save(state, tmp_path_factory.mktemp("adamw") / "dcp")


# -- an optimizer's lists and tuples ----------------------------------------------------------------

def test_convert_to_distributed_keeps_adamw_s_betas_and_params(adamw_dcp, tmp_path):
    state, src = adamw_dcp
    code, _, err = in_process("convert", src, tmp_path / "dist", "--to", "distributed", "-q")
    assert code == 0, err
    # DCP names (its flattening), each value as it was: the tuple a tuple (as shardkit's own save gives
    # one back), the list a list; the manifest holds plain leaves only (betas.0, betas.1)
    group = state["optim"]["param_groups"][0]
    objects = read_metadata(str(tmp_path / "dist")).objects
    assert objects["optim.param_groups.0.betas.0"] == 0.9 and "optim.param_groups.0.betas" not in objects
    for loaded in (load_consolidated(str(tmp_path / "dist")), load_distributed(str(tmp_path / "dist"), 1, 2)):
        assert loaded["optim.param_groups.0.betas"] == (0.9, 0.95)
        assert type(loaded["optim.param_groups.0.betas"]) is tuple
        assert loaded["optim.param_groups.0.params"] == group["params"] == [0, 1]
        for key in ("lr", "eps", "weight_decay", "amsgrad", "foreach", "maximize"):
            assert loaded[f"optim.param_groups.0.{key}"] == group[key], key
        for name, t in state["model"].items():
            assert loaded[f"model.{name}"].equal(t)
        for pid, per in state["optim"]["state"].items():
            for key, t in per.items():
                assert loaded[f"optim.state.{pid}.{key}"].equal(t), (pid, key)
    only = load_distributed(str(tmp_path / "dist"), 0, 1, keys="optim.param_groups.0.betas")
    assert only == {"optim.param_groups.0.betas": (0.9, 0.95)}
    # and it travels on: reshard keeps the values
    assert in_process("reshard", tmp_path / "dist", tmp_path / "ws2", "--world-size", "2", "-q")[0] == 0
    assert load_consolidated(str(tmp_path / "ws2"))["optim.param_groups.0.betas"] == (0.9, 0.95)
    # diff compares a value the DCP keeps whole with the converted one's leaves, leaf by leaf
    code, out, err = in_process("diff", src, tmp_path / "ws2")
    assert code == 0 and "identical" in out, out + err
    changed = _model_and_adamw()
    changed["optim"]["param_groups"][0]["betas"] = (0.9, 0.999)
    code, out, _ = in_process("diff", _dcp_save(changed, tmp_path / "changed"), tmp_path / "ws2")
    assert code == 1 and "optim.param_groups.0.betas.1" in out and "0.999" in out, out


def test_a_nested_plain_value_comes_back_nested_and_a_non_finite_one_as_it_was(tmp_path):
    src = _dcp_save({**dcp_state(), "cfg": {"sizes": [1, (2, 3)], "name": "x"}}, tmp_path / "dcp")
    assert in_process("convert", src, tmp_path / "dist", "--to", "distributed", "-q")[0] == 0
    assert load_consolidated(str(tmp_path / "dist"))["cfg.sizes"] == [1, (2, 3)]
    # an inf is kept (metadata.json holds it as {"float": "Infinity"}); tests/cli/test_convert_plain_values.py
    src = _dcp_save({**dcp_state(), "best": float("inf")}, tmp_path / "inf")
    assert in_process("convert", src, tmp_path / "o", "--to", "distributed", "-q")[0] == 0
    assert load_consolidated(str(tmp_path / "o"))["best"] == float("inf")


# -- bad options: exit 2, before the source is opened ---------------------------------------------

@pytest.mark.parametrize("size", ["0", "abc", "1.5GB", "-5"])
def test_a_bad_max_shard_size_is_bad_input(tmp_path, size):
    ckpt = save_sharded(training_state(), tmp_path / "ck")
    (ckpt / "metadata.json").unlink()  # read first, this would be 1 (never finished): the option is checked first
    line = assert_one_line_error(*in_process("convert", ckpt, tmp_path / "o", "--to", "hf",
                                             f"--max-shard-size={size}"))
    assert "--max-shard-size" in line and repr(size) in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("from_kind", ["hf", "distributed"])
def test_from_a_format_src_does_not_hold_says_what_it_holds(adamw_dcp, tmp_path, from_kind):
    _, src = adamw_dcp
    line = assert_one_line_error(*in_process("convert", src, tmp_path / "o", "--to", "hf", "--from", from_kind))
    assert "PyTorch DCP" in line and "--from dcp" in line
    assert not (tmp_path / "o").exists()


def test_from_picks_a_format_a_directory_holds_beside_another(tmp_path):
    from safetensors.torch import save_file

    src = _dcp_save(dcp_state(), tmp_path / "both")
    save_file({"w": torch.ones(2)}, str(src / "model.safetensors"), metadata={"format": "pt"})  # detected: HF
    assert in_process("convert", src, tmp_path / "hf", "--to", "distributed", "-q")[0] == 0
    assert set(load_consolidated(str(tmp_path / "hf"))) == {"w"}
    assert in_process("convert", src, tmp_path / "dcp", "--to", "distributed", "--from", "dcp", "-q")[0] == 0
    assert set(load_consolidated(str(tmp_path / "dcp"))) == set(dcp_state())


# -- a bug is 3 in every subcommand, not bad input -------------------------------------------------

@pytest.mark.parametrize("error", [ValueError, TypeError])
@pytest.mark.parametrize("command", ["convert", "reshard", "diff"])
def test_a_bare_value_or_type_error_is_an_internal_error(tmp_path, monkeypatch, command, error):
    import shardkit.offline

    def bug(*args, **kwargs):
        raise error("boom")

    for name in ("export_distributed", "reshard_checkpoint", "diff_checkpoints"):
        monkeypatch.setattr(shardkit.offline, name, bug)
    ckpt = save_sharded(training_state(), tmp_path / "ck")
    argv = {"convert": ("convert", ckpt, tmp_path / "o", "--to", "distributed"),
            "reshard": ("reshard", ckpt, tmp_path / "o", "--world-size", "3"),
            "diff": ("diff", ckpt, ckpt)}[command]
    line = assert_one_line_error(*in_process(*argv, "-q"), expected_code=3)
    assert "boom" in line and "internal error" in line
