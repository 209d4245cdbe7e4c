"""``shardkit demo``: train, crash mid-save, resume on fewer ranks, export to Hugging Face, check it all.

The story, one line per step or phase as it runs, then a summary:

1. **reference** -- a tiny Llama (``transformers`` ``LlamaForCausalLM`` from a
   config built in code, ~0.85M parameters, nothing downloaded) trains 24
   steps with Adam in this one process, uninterrupted: the losses to match.
2. **train** -- the same training on 4 ranks (processes, Gloo), FSDP2
   (``fully_shard`` on a CPU device mesh), a ``CheckpointManager`` saving in
   the background every 4 steps. Rank 3 is SIGKILLed in the middle of the
   save of step 12 (its data file written, nothing committed); the other
   ranks get a ``CommError`` at once instead of hanging.
3. **resume** -- 2 ranks restore the latest *complete* checkpoint (step 8;
   the half-written step 12 is ignored), model and Adam state resharded 4 -> 2,
   and train on to step 24.
4. **export** -- the final checkpoint's model becomes a Hugging Face checkpoint
   (``export_hf``, as ``shardkit convert --to hf`` does, with ``config.json``),
   ``from_pretrained`` loads it (``HF_HUB_OFFLINE=1``).

Checks (exit 0 when all pass, else 1 naming the failed ones): every survivor
of the crash got a ``CommError``; the resume started from step 8; every loss
of the 4-rank and of the resumed 2-rank run equals the reference's **bit for
bit** (float32; every rank trains on the same batch each step, so the math
does not depend on the world size); the exported weights equal the
reference's final weights bit for bit, and ``from_pretrained``'s logits on a
probe batch equal those of the trained FSDP model bit for bit.

Example: ``shardkit demo`` (a temp dir, removed after) or ``shardkit demo DIR``
(keeps the checkpoints and the Hugging Face export in ``DIR``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

STEPS = 24
SAVE_EVERY = 4
KILL_AT = 12
KILL_RANK = 3
TRAIN_RANKS = 4
RESUME_RANKS = 2


def run_demo(path: str | None = None) -> int:
    """Run the demo in ``path`` (a new or empty directory; default a temp dir); 0 when every check passed."""
    os.environ["HF_HUB_OFFLINE"] = "1"       # nothing is downloaded, ever
    if path is not None:
        os.makedirs(path, exist_ok=True)
        return _run(os.path.abspath(path))
    with tempfile.TemporaryDirectory(prefix="shardkit-demo-") as tmp:
        return _run(tmp)


def _run(work: str) -> int:
    from shardkit.demo.report import Summary

    start = time.perf_counter()
    _warm_rank_server()
    summary = Summary()
    print(f"shardkit demo: FSDP2 training on {TRAIN_RANKS} CPU ranks, a rank killed mid-save, resume on "
          f"{RESUME_RANKS}, export to Hugging Face (in {work})", flush=True)
    reference, ref_weights = _reference(summary)
    root = os.path.join(work, "checkpoints")
    if _guarded(summary, "train", _train, summary, root, reference) is not None:
        resumed = _guarded(summary, "resume", _resume, summary, root, reference)
        if resumed is not None:
            _guarded(summary, "export", _export, summary, work, root, resumed, ref_weights)
    for line in summary.lines(time.perf_counter() - start):
        print(line)
    return 1 if summary.failed() else 0


def _guarded(summary, name: str, phase, *args):
    """``phase(*args)``; an exception becomes the failed check ``<name>-ran`` (and None), not a traceback."""
    try:
        return phase(*args)
    except Exception as e:  # noqa: BLE001 - a phase that broke is a failed check, named in the summary
        summary.check(f"{name}-ran", False, f"{type(e).__name__}: {_first_line(e)}")
        return None


def _warm_rank_server() -> None:
    """Start the ranks' forkserver now, importing torch and transformers once, while the reference runs.

    ``shardkit.launch.run_local_ranks`` forks its ranks from this server;
    preloaded there, each rank starts without importing ``transformers``
    itself (seconds each on a small machine). Harmless if a server already runs.
    """
    from multiprocessing import forkserver

    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "transformers.models.llama.modeling_llama", "shardkit.demo.jobs"])
    forkserver.ensure_running()


def _reference(summary):
    from shardkit.demo.jobs import reference_run

    print(f"[1/4] reference: {STEPS} steps in one process, no checkpoints ...", flush=True)
    t = time.perf_counter()
    losses, weights = reference_run(STEPS)
    n_params = sum(w.numel() for w in weights.values())
    summary.phase("reference", f"{STEPS} steps, 1 process, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
                               f"({n_params / 1e6:.2f}M-parameter Llama)", time.perf_counter() - t)
    print(f"      losses {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return losses, weights


def _train(summary, root: str, reference: list):
    from shardkit.checkpoint import CheckpointManager
    from shardkit.demo.jobs import train_job
    from shardkit.demo.report import first_mismatch, step_dirs, steps_text
    from shardkit.launch import run_local_ranks

    print(f"[2/4] train: {TRAIN_RANKS} ranks, FSDP2, a checkpoint every {SAVE_EVERY} steps in the background; "
          f"rank {KILL_RANK} will be killed (SIGKILL) in the middle of the save of step {KILL_AT}", flush=True)
    t = time.perf_counter()
    results = run_local_ranks(train_job, TRAIN_RANKS, root, STEPS, SAVE_EVERY, KILL_AT, KILL_RANK,
                              may_die={KILL_RANK}, timeout_s=300)
    elapsed = time.perf_counter() - t
    killed_at = _read_time(os.path.join(os.path.dirname(root), "killed_at"))
    survivors = {r: res for r, res in enumerate(results) if r != KILL_RANK}
    for rank, res in survivors.items():
        err = res["error"] or {}
        after = f"{err['at'] - killed_at:.2f} s after the kill: " if err and killed_at else ""
        got = err.get("save") or err.get("training") or "no error: it finished?"
        print(f"      rank {rank}: stopped {after}{got}", flush=True)
    complete = CheckpointManager(root).steps()
    on_disk = [f"{d} ({'complete' if int(d[5:]) in complete else 'incomplete: ignored'})" for d in step_dirs(root)]
    print(f"      on disk: {', '.join(on_disk)}", flush=True)
    losses = survivors[0]["losses"]
    summary.phase("train", f"{TRAIN_RANKS} ranks, steps {steps_text(sorted(losses))}, rank {KILL_RANK} killed "
                           f"while writing step {KILL_AT}; on disk: {', '.join(on_disk)}", elapsed)
    delays = [res["error"]["at"] - killed_at for res in survivors.values() if res["error"] and killed_at]
    summary.check("crash-detected", all(res["error"] and res["error"]["comm_error"] for res in survivors.values()),
                  f"ranks {', '.join(map(str, survivors))} got a CommError"
                  + (f" within {max(delays):.1f} s of the kill" if delays and len(delays) == len(survivors) else ""))
    bad = first_mismatch(losses, reference)
    summary.check("losses-4-ranks", bad is None and losses,
                  f"{len(losses)} losses on {TRAIN_RANKS} ranks equal the reference's bit for bit" if bad is None
                  else f"step {bad[0]}: {bad[1]!r} on {TRAIN_RANKS} ranks, reference {bad[2]!r}")
    return results


def _resume(summary, root: str, reference: list):
    from shardkit.demo.jobs import train_job
    from shardkit.demo.report import first_mismatch, steps_text
    from shardkit.launch import run_local_ranks

    print(f"[3/4] resume: {RESUME_RANKS} ranks restore the latest complete checkpoint and train to step {STEPS}",
          flush=True)
    t = time.perf_counter()
    results = run_local_ranks(train_job, RESUME_RANKS, root, STEPS, SAVE_EVERY, timeout_s=300)
    elapsed = time.perf_counter() - t
    res = results[0]
    expected = (KILL_AT // SAVE_EVERY - 1) * SAVE_EVERY
    summary.phase("resume", f"{RESUME_RANKS} ranks from step {res['resumed']} (model + Adam resharded "
                            f"{TRAIN_RANKS} -> {RESUME_RANKS}), steps {steps_text(sorted(res['losses']))} "
                            f"(steps {res['resumed']}-{KILL_AT - 1} redone: lost with the crash)", elapsed)
    summary.check("resumed-from-complete", res["resumed"] == expected,
                  f"resumed from step {res['resumed']}, the latest complete checkpoint (expected {expected})")
    if res["error"]:
        summary.check("resume-ran", False, f"the resumed run failed: {res['error']}")
        return None
    bad = first_mismatch(res["losses"], reference)
    summary.check("resumed-losses", bad is None and len(res["losses"]) == STEPS - expected,
                  f"the {len(res['losses'])} resumed losses equal the uninterrupted reference's bit for bit"
                  if bad is None else f"step {bad[0]}: resumed {bad[1]!r}, reference {bad[2]!r}")
    return res


def _export(summary, work: str, root: str, resumed: dict, ref_weights: dict) -> None:
    import torch

    from shardkit.demo.model import llama_config, probe_batch
    from shardkit.offline.write import export_hf

    print(f"[4/4] export: step {STEPS}'s model -> Hugging Face checkpoint; from_pretrained; compare", flush=True)
    t = time.perf_counter()
    hf_dir = os.path.join(work, "hf")
    config_path = os.path.join(work, "config.json")
    llama_config().to_json_file(config_path)
    export_hf(os.path.join(root, f"step-{STEPS}"), hf_dir, prefix="model.", config=config_path)
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    if not sys.stdout.isatty():
        hf_logging.disable_progress_bar()        # progress bars only on a terminal
    model = LlamaForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        logits = model(input_ids=probe_batch()).logits
    trained = torch.from_numpy(resumed["probe_logits"])
    exported = model.state_dict()
    files = sorted(os.listdir(hf_dir))
    summary.phase("export", f"{len(files)} files in {hf_dir}: {', '.join(files)}", time.perf_counter() - t)
    same = sorted(exported) == sorted(ref_weights) and all(torch.equal(exported[n], ref_weights[n]) for n in exported)
    summary.check("hf-weights", same, f"the {len(exported)} exported tensors equal the reference's final weights "
                                      f"bit for bit" if same else "the exported weights differ from the reference's")
    max_diff = (logits - trained).abs().max().item() if logits.shape == trained.shape else float("inf")
    summary.check("hf-logits", torch.equal(logits, trained),
                  f"from_pretrained logits {tuple(logits.shape)} equal the trained FSDP model's bit for bit"
                  if torch.equal(logits, trained) else f"logits differ (max abs difference {max_diff:.3g})")
    print(f"      from_pretrained({hf_dir}): logits {'match' if torch.equal(logits, trained) else 'DIFFER'}",
          flush=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def _read_time(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None
