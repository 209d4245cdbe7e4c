"""The on-disk format of a distributed checkpoint: ``metadata.json`` and the per-rank manifests.

Also chunks (boxes of a tensor at byte ranges of a file), nested state to dotted names, the split specs,
per-rank state and what proves a directory is shardkit's own. Pure data and its checks; no collectives."""
