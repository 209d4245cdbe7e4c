"""Runnable demonstrations (``shardkit demo``); the top layer, beside the CLI."""


def run_demo(path=None) -> int:
    """Run the training demo (see :mod:`shardkit.demo.story`); 0 when every check passed."""
    from shardkit.demo.story import run_demo as run

    return run(path)


__all__ = ["run_demo"]
