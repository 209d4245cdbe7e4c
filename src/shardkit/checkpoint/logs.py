"""What the checkpoint API did, through ``logging`` (logger ``shardkit.checkpoint``).

Each public save, load and validation logs its start at DEBUG and its end at
INFO with the directory and the time it took (or its failure and the error's
type). Nothing is printed unless the application configures logging (the CLI's
``-v`` does). This module does not time parts of an operation.

Example::

    logging.basicConfig(level=logging.INFO)
    shardkit.checkpoint.save(state, "ckpt/step-1")
    # INFO:shardkit.checkpoint:save ckpt/step-1 (rank 0 of 1): done in 0.012 s
"""

from __future__ import annotations

import functools
import inspect
import logging
import time

__all__ = ["log", "logged"]

log = logging.getLogger("shardkit.checkpoint")


def logged(action: str):
    """Decorate a function whose ``dir`` argument names the checkpoint, to log ``action`` on it."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not log.isEnabledFor(logging.INFO):
                return fn(*args, **kwargs)
            target = _describe(signature, args, kwargs)
            log.debug("%s %s: started", action, target)
            start = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                log.info("%s %s: failed after %.3f s (%s)", action, target, time.perf_counter() - start,
                         type(e).__name__)
                raise
            log.info("%s %s: done in %.3f s", action, target, time.perf_counter() - start)
            return result
        return run
    return wrap


def _describe(signature: inspect.Signature, args, kwargs) -> str:
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return "(bad arguments)"
    text = str(bound.get("dir", "?"))
    if "rank" in bound and "world_size" in bound:
        text += f" (rank {bound['rank']} of {bound['world_size']})"
    return text
