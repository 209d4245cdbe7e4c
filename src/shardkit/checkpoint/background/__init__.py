"""Background saves: stage on the caller's thread into reusable buffers, write on another thread
(``AsyncCheckpointer``, ``CheckpointFuture``), a process group of their own, and a clean exit."""
