"""Writing a distributed checkpoint: the one chunked save engine (format version 2) and
``save_distributed`` on top of it. Stage-and-write in the background lives in ``background``."""
