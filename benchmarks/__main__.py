"""``python -m benchmarks`` from a checkout: a shim for ``python -m shardkit.bench`` (the code lives in the package)."""

import sys

from shardkit.bench.runner import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main(prog="python -m benchmarks"))
