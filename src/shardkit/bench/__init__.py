"""Side-by-side benchmarks: shardkit against the tools a user would otherwise pick.

Shipped with the package, so ``shardkit bench`` works from an installed
wheel (``python -m shardkit.bench`` too; ``python -m benchmarks`` in a
checkout is a shim for the same). Suites: save, load, async, multirank,
comm, hf, ddp by default; offline, scale and s3 (checkpoints on a SeaweedFS
server on loopback, ``seaweedfs.py``) when asked for. This package is not imported by the library itself.

Example::

    shardkit bench --size 256MiB --reps 3 --only save,load
"""
