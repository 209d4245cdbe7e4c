"""Drive the groups of ``Group.local(n)`` from one thread each, like real ranks."""

from __future__ import annotations

import threading


def on_threads(groups, fn, *args, join_timeout_s=60):
    """Call ``fn(group, *args)`` for every group on its own thread; results by rank, errors re-raised."""
    results, errors = [None] * len(groups), []

    def run(g):
        try:
            results[g.rank] = fn(g, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(g,), daemon=True) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout_s)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"a rank thread did not finish within {join_timeout_s} s")
    if errors:
        raise errors[0]
    return results
