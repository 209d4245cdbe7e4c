"""Side-by-side benchmarks (see ../shared/design/BENCHMARKS.md). Run: ``python -m benchmarks``."""
