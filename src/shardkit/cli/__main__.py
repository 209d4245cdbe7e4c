import sys

from shardkit.cli import main

sys.exit(main())
