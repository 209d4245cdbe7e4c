"""Checkpoint suites: single-rank save/load/async (``checkpoint_bench``, ``async_first``), multi-rank and
FSDP2 (``multirank_bench``, ``dtensor_bench``), training under a background save (``gil_bench``), load-any,
offline tools, S3 and scale."""
