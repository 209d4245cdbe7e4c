"""``CheckpointManager``: a run's checkpoints, one directory per step; its metrics and rotation."""
