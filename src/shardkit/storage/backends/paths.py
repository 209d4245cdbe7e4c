"""Checks on file names read from an index or manifest, before anything is opened.

A name from a JSON file on disk is untrusted: it must be a plain relative
path inside the checkpoint directory, with one of the expected extensions.
This module only inspects strings; it opens nothing.

Example::

    >>> check_relative_name("model-00001-of-00002.safetensors", (".safetensors",))
    'model-00001-of-00002.safetensors'
    >>> check_relative_name("../etc/passwd", (".safetensors",))
    Traceback (most recent call last):
    MetadataError: ...
"""

from __future__ import annotations

import posixpath

from shardkit.errors import MetadataError

__all__ = ["check_relative_name"]


def check_relative_name(name: object, allowed_suffixes: tuple[str, ...], *, source: str = "index") -> str:
    """Return ``name`` if it is a safe relative file name with an allowed suffix.

    Refuses non-strings, empty names, absolute paths (POSIX or Windows style),
    any ``..`` component, backslashes, NUL bytes and unexpected extensions, by
    raising :class:`MetadataError` that names the offending entry and ``source``.
    """
    if not isinstance(name, str) or not name:
        raise MetadataError(f"{source} names a file {name!r}; expected a non-empty relative file name")
    problem = _path_problem(name)
    if problem is None and not name.endswith(allowed_suffixes):
        problem = f"does not end with one of {', '.join(allowed_suffixes)}"
    if problem is not None:
        raise MetadataError(
            f"{source} names the file {name!r}, which {problem}; only plain relative names inside "
            f"the checkpoint directory are allowed. The {source} may be corrupt or hostile: "
            f"do not load it, or fix the entry by hand."
        )
    return name


def _path_problem(name: str) -> str | None:
    if "\x00" in name:
        return "contains a NUL byte"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "is an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component"
    if posixpath.normpath(name) != name:
        return "is not in normal form"
    return None
