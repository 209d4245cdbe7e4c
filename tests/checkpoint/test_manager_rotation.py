"""The rotation policy alone (``manager_rotation.steps_to_remove``): step numbers in, step numbers out."""

from __future__ import annotations

from hypothesis import given, strategies as st

from shardkit.checkpoint.manager_rotation import owned_name, steps_to_remove


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


def test_owned_names_are_step_dirs_and_temporaries_only():
    assert owned_name("step-0") and owned_name("step-12")
    assert not owned_name("step-012") and not owned_name("other-run") and not owned_name("step-1x")
