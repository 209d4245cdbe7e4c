"""shardkit: state and communication for distributed PyTorch training.

Subpackages, lowest layer first: ``shardkit.layout`` (pure shard math),
``shardkit.dtypes``, ``shardkit.errors``; ``shardkit.storage`` (bytes and
files) and ``shardkit.comm`` (groups and collectives); ``shardkit.checkpoint``
(distributed checkpoints); ``shardkit.hf`` (Hugging Face shards) and
``shardkit.ddp``; ``shardkit.cli``.
"""

from shardkit.errors import *  # noqa: F401,F403

__version__ = "0.1.0"
