"""Hold a save inside its data-file write, to test what happens while it is in progress."""


def hold_writes(module, started, release, timeout_s: float) -> None:
    """Make ``module.write_safetensors`` set ``started`` and wait for ``release`` before it writes."""
    real = module.write_safetensors

    def held(*args, **kwargs):
        started.set()
        assert release.acquire(timeout=timeout_s)
        return real(*args, **kwargs)

    module.write_safetensors = held
