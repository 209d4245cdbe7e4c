"""``python -m shardkit``: the ``shardkit`` command (:func:`shardkit.cli.main`), for an environment without its script."""

import sys

from shardkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
