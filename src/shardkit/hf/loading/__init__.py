"""Loading Hugging Face checkpoints into a module or a dict: ``load_checkpoint`` (``load.py``), the
reads of the shard files (``shard_reads.py``) and the checks on what a load asks for (``load_checks.py``)."""
