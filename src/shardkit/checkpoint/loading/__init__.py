"""Reading a shardkit distributed checkpoint: open once, plan, read the planned bytes, check them;
into new tensors (``distributed_load``), into existing ones (``load_into``, ``fill``), and
``validate_distributed``. Other formats are read through ``shardkit.sources``, above this package."""
