"""Side-by-side benchmarks: shardkit against the tools a user would otherwise pick.

The one home of every benchmark, shipped with the package, so ``shardkit bench`` works from an installed
wheel (``python -m shardkit.bench`` and ``make bench`` run the same). Suites: save, load, async, multirank,
comm, hf, ddp by default; offline, scale, s3 (checkpoints on a SeaweedFS server on loopback,
``seaweedfs.py``), comm-gpu, load-any, gil, fsdp2 and hf-in-job when asked for (``--only``). The runner,
shared timing and workload live here; the suites by subject in ``checkpoint_suites/``, ``comm_suites/``
and ``hf_suites/``. This package is not imported by the library itself.

Example::

    shardkit bench --size 256MiB --reps 3 --only save,load
"""
