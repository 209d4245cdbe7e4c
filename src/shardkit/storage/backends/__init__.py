"""Where bytes live: the :class:`Storage` interface and :class:`Reader` (``base.py``), local files (``local.py``,
atomic publish, writer locks, name checks), fsspec stores and S3 uploads, and ``storage_for`` (``choose.py``),
which picks one for a path. Knows files, never tensors."""
