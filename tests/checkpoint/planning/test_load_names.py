"""``checkpoint.planning.load_names.plan_names``: which checkpoint name fills which state leaf (pure, no tensors)."""

from __future__ import annotations

import pytest

from shardkit.checkpoint.planning.load_names import LoadOptions, plan_names
from shardkit.errors import TensorMismatchError


def test_names_map_one_to_one_by_default():
    plan = plan_names(["w", "b"], ["step"], {"w", "b"}, {"step"}, LoadOptions())
    assert plan.tensors == {"w": "w", "b": "b"} and plan.objects == {"step": "step"} and plan.untouched == []


def test_prefix_reads_state_name_n_from_prefix_plus_n_and_ignores_the_rest():
    plan = plan_names(["w"], [], {"model.w", "optim.w.exp_avg"}, {"step"}, LoadOptions(prefix="model."))
    assert plan.tensors == {"w": "model.w"}


def test_rename_maps_and_none_skips():
    options = LoadOptions(rename=lambda n: None if n == "skip" else "net." + n)
    plan = plan_names(["net.w"], [], {"w", "skip"}, set(), options)
    assert plan.tensors == {"net.w": "w"}
    with pytest.raises(TensorMismatchError, match="both map"):
        plan_names(["x"], [], {"a", "b"}, set(), LoadOptions(rename=lambda n: "x"))
    with pytest.raises(TypeError, match="must return a str"):
        plan_names(["x"], [], {"a"}, set(), LoadOptions(rename=lambda n: 3))


def test_aliases_fill_tied_names_from_the_stored_one_and_are_never_unexpected():
    aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    plan = plan_names(["model.embed_tokens.weight", "lm_head.weight"], [], {"model.embed_tokens.weight"}, set(),
                      LoadOptions(), aliases)
    assert plan.tensors == {"model.embed_tokens.weight": "model.embed_tokens.weight",
                            "lm_head.weight": "model.embed_tokens.weight"}
    assert plan_names(["model.embed_tokens.weight"], [], {"model.embed_tokens.weight"}, set(), LoadOptions(),
                      aliases).tensors == {"model.embed_tokens.weight": "model.embed_tokens.weight"}


def test_missing_leaves_need_allow_partial_or_exclude():
    with pytest.raises(TensorMismatchError, match="leaves the checkpoint lacks: extra.*allow_partial=True"):
        plan_names(["w", "extra"], [], {"w"}, set(), LoadOptions())
    assert plan_names(["w", "extra"], [], {"w"}, set(), LoadOptions(allow_partial=True)).untouched == ["extra"]
    assert plan_names(["w", "extra"], [], {"w"}, set(), LoadOptions(exclude=("ex*",))).untouched == ["extra"]


def test_unexpected_leaves_need_strict_false_or_exclude():
    with pytest.raises(TensorMismatchError, match="leaves state_dict lacks: b.*strict=False"):
        plan_names(["w"], [], {"w", "b"}, set(), LoadOptions())
    assert plan_names(["w"], [], {"w", "b"}, set(), LoadOptions(strict=False)).tensors == {"w": "w"}
    assert plan_names(["w"], [], {"w", "b"}, set(), LoadOptions(exclude=["b"])).tensors == {"w": "w"}


def test_a_tensor_where_the_checkpoint_holds_a_value_and_back_are_refused():
    with pytest.raises(TensorMismatchError, match="plain value"):
        plan_names(["step"], [], set(), {"step"}, LoadOptions())
    with pytest.raises(TensorMismatchError, match="is not a tensor"):
        plan_names([], ["w"], {"w"}, set(), LoadOptions())


def test_bad_options_are_type_errors():
    with pytest.raises(TypeError):
        LoadOptions(prefix=3)
    with pytest.raises(TypeError):
        LoadOptions(rename="x")
    with pytest.raises(TypeError):
        LoadOptions(exclude=[1])
    assert LoadOptions(exclude="a*").exclude == ("a*",)
