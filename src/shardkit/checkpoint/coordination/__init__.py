"""The process group a save runs over: pickle-free exchange of small JSON facts, and the one agreement
step (every rank reports, rank 0 decides, every rank hears the verdict). Knows nothing of files."""
