"""The rotation policy alone (``manager_rotation.steps_to_remove``): step numbers in, step numbers out."""

from __future__ import annotations

from hypothesis import given, strategies as st

from shardkit.checkpoint.manager.rotation import steps_to_remove
from shardkit.checkpoint.format.ownership import foreign_names, is_own_name
from shardkit.storage import temp_name


def test_keeps_the_newest_and_the_best_and_removes_old_crashes():
    assert steps_to_remove([1, 2, 3, 4, 5], [1, 2, 4, 5], keep_last=2, best=1, writing=None) == [2, 3]
    assert steps_to_remove([1, 2, 9], [1, 2], keep_last=1, best=None, writing=9) == [1]  # 9 is being written
    assert steps_to_remove([3, 7], [], keep_last=1, best=None, writing=None) == []       # nothing complete yet
    assert steps_to_remove([4, 8], [4], keep_last=1, best=None, writing=None) == []      # 8 crashed, newer: kept


@given(st.sets(st.integers(0, 40), max_size=12), st.data())
def test_never_removes_what_a_restore_or_a_save_needs(steps, data):
    all_steps = sorted(steps)
    complete = sorted(data.draw(st.sets(st.sampled_from(all_steps))) if all_steps else [])
    keep_last = data.draw(st.integers(1, 4))
    best = data.draw(st.sampled_from(complete)) if complete else None
    writing = data.draw(st.sampled_from([None, *all_steps]))
    gone = steps_to_remove(all_steps, complete, keep_last=keep_last, best=best, writing=writing)
    assert set(gone) <= set(all_steps) and gone == sorted(set(gone))
    assert writing not in gone and best not in gone
    assert not set(complete[-keep_last:]) & set(gone)
    if complete:
        assert not [s for s in gone if s not in complete and s > complete[-1]]  # newer crashes: maybe in flight
        kept_complete = {s for s in complete if s not in gone}
        assert kept_complete == set(complete[-keep_last:]) | {best} | ({writing} & set(complete))
    else:
        assert gone == []


def test_own_names_are_the_files_a_save_writes_only():
    for name in ("metadata.json", ".shardkit-checkpoint", "rank_0.safetensors", "rank_12.json",
                 ".shardkit-writer.lock", ".shardkit-writer-3.lock", temp_name("rank_0.safetensors")):
        assert is_own_name(name), name
    for name in (".metadata", "__0_0.distcp", "model.safetensors.index.json", "NOTES.txt", "rank_01.safetensors",
                 "rank_0.safetensors.bak", "config.json"):
        assert not is_own_name(name), name
    assert foreign_names(["rank_0.safetensors", "NOTES.txt", ".metadata"]) == [".metadata", "NOTES.txt"]
