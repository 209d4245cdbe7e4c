"""Hold a save inside its data-file write, to test what happens while it is in progress."""

import contextlib


def hold_writes(module, started, release, timeout_s: float) -> None:
    """Make ``module.write_safetensors`` set ``started`` and wait for ``release`` before it writes."""
    real = module.write_safetensors

    def held(*args, **kwargs):
        started.set()
        assert release.acquire(timeout=timeout_s)
        return real(*args, **kwargs)

    module.write_safetensors = held


@contextlib.contextmanager
def held_writer_process(ctx, target, directory: str, value, timeout_s: float, what: str):
    """Start ``target(directory, value, started, release)`` in a process of ``ctx`` and yield
    ``(process, directory, release)`` once it is inside its data-file write; always let it go.

    A semaphore, not an Event, releases it: setting an Event whose waiter was SIGKILLed blocks forever.
    """
    started, release = ctx.Event(), ctx.Semaphore(0)
    p = ctx.Process(target=target, args=(directory, value, started, release))
    p.start()
    try:
        assert started.wait(timeout_s), f"the {what} never reached its data file"
        yield p, directory, release
    finally:
        release.release()
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
