"""Plans as plain data: who writes which box of a chunked save, which saved bytes a load reads, which saved
name fills which state leaf. No I/O and no collectives here (habit 1: plan first, then do I/O)."""
