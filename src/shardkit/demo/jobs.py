"""The demo's rank functions (run by ``shardkit.launch.run_local_ranks``) and its one-process reference.

:func:`train_job` is the training loop a user writes: FSDP2 (``fully_shard``
on a CPU device mesh, Gloo), Adam, a :class:`~shardkit.checkpoint.CheckpointManager`
saving in the background every few steps, resuming from its latest complete
step on whatever world size it runs. With ``kill_at`` one rank SIGKILLs itself
in the middle of that step's save (its data file written, the commit not), as
a crash would; the other ranks report what they got instead of raising, so the
demo can show it. Not a general training harness.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from shardkit.demo.model import LR, SEED, build_model, probe_batch, train_step
from shardkit.errors import CommError


def reference_run(steps: int) -> tuple[list[float], dict]:
    """Train ``steps`` steps in this process, no FSDP, no checkpoints: the losses and the final weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # as the ranks run: one thread each
    try:
        model = build_model(SEED)
        optim = torch.optim.Adam(model.parameters(), lr=LR)
        losses = [train_step(model, optim, step) for step in range(steps)]
        return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _fsdp_model(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(SEED)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=LR)


def _state(model, optim, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def train_job(rank: int, world_size: int, root: str, last_step: int, save_every: int,
              kill_at: int | None = None, kill_rank: int | None = None) -> dict:
    """Resume from ``root``'s latest complete step (or start fresh) and train to ``last_step``.

    Returns ``{"resumed": step or None, "losses": {step: loss}, "error": None or
    {...}, "probe_logits": numpy array (rank 0, when training finished)}``.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from shardkit.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    model, optim = _fsdp_model(world_size)
    train_step(model, optim, -2)                  # creates Adam's state, so restore has tensors to fill
    out = {"resumed": None, "losses": {}, "error": None, "probe_logits": None}
    mgr = CheckpointManager(root, keep_last=2)
    sd = _state(model, optim, 0)
    out["resumed"] = mgr.restore(sd)
    if out["resumed"] is None:
        model, optim = _fsdp_model(world_size)    # a fresh run: fresh weights, no Adam state
    else:
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        _say(rank, f"  restored step {out['resumed']} on {world_size} ranks (model + Adam state resharded)")
    start = 0 if out["resumed"] is None else sd["step"]
    try:
        for step in range(start, last_step):
            out["losses"][step] = loss = train_step(model, optim, step)
            _say(rank, f"  step {step:>2}  loss {loss:.4f}  ({world_size} ranks)")
            done = step + 1
            if done % save_every == 0 or done == last_step:
                if done == kill_at and rank == kill_rank:
                    _die_while_writing(root)
                mgr.save(done, _state(model, optim, done), metrics={"loss": loss})
                _say(rank, f"  saving checkpoint step-{done} (after {done} steps) in the background")
        mgr.close()
    except Exception as e:  # noqa: BLE001 - a peer died: reported to the demo, which resumes
        out["error"] = _what_failed(e, mgr)
        return out
    out["probe_logits"] = model(input_ids=probe_batch()).logits.detach().numpy()
    return out


def _die_while_writing(root: str) -> None:
    """Make this rank SIGKILL itself once its data file of the next save is written (before the commit)."""
    import shardkit.checkpoint.saving.chunked_save as chunked_save

    real = chunked_save.write_safetensors

    def write_then_die(*args, **kwargs):
        record = real(*args, **kwargs)
        with open(os.path.join(os.path.dirname(root), "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
        return record

    chunked_save.write_safetensors = write_then_die


def _what_failed(error: BaseException, mgr) -> dict:
    """What stopped this rank: the training error, and the in-flight save's (a CommError), if any."""
    failed_at = time.time()
    save_error = None
    try:
        mgr.close()
    except Exception as e:  # noqa: BLE001 - the save's failure, reported
        save_error = e
    return {"at": failed_at, "training": _one_line(error), "save": _one_line(save_error) if save_error else None,
            "comm_error": any(isinstance(e, CommError) for e in (*_chain(error), *_chain(save_error)))}


def _chain(error: BaseException | None):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _one_line(error: BaseException) -> str:
    root = [e for e in _chain(error) if isinstance(e, CommError)]
    shown = root[0] if root else error
    text = str(shown).strip().splitlines()[0] if str(shown).strip() else "(no message)"
    return f"{type(shown).__name__}: {text.split(' (')[0]}"   # the backend's details follow in parentheses
