"""``python -m shardkit.bench``: see :mod:`shardkit.bench.runner`."""

import sys

from shardkit.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
