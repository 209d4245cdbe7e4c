"""Runnable demonstrations (``shardkit demo``); the top layer, beside the CLI."""

from shardkit.demo.reshard import run_demo

__all__ = ["run_demo"]
