"""A shim: the benchmarks live in :mod:`shardkit.bench` (shipped with the package). Run ``python -m benchmarks``."""
