"""Test helper: a nested state's leaves by dotted name, written independently of shardkit's own code.

``leaves({"m": {"w": t}, "opt": [1, 2]})`` is ``{"m.w": t, "opt.0": 1, "opt.1": 2}``
(the naming rule of ``docs/format.md``), so tests can compare a loaded state
with the saved one leaf by leaf without trusting ``shardkit.checkpoint.format.nested``.
"""


def leaves(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        return {prefix: node}
    out = {}
    for k, v in items:
        out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
