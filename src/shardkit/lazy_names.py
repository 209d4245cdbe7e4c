"""A package's public names, each imported from its home module on first use (PEP 562).

For a package whose ``__init__`` should stay light: importing one small
submodule (the CLI's ``--help`` reads ``storage.json_io``) must not import
torch through the package's heavy modules. What it does not do: it imports
nothing until a name is asked for, and it hides no name a module defines.

Example (in a package's ``__init__.py``)::

    __getattr__, __dir__, __all__ = lazy_names(__name__, globals(), {"base": ["open_source"]})
"""

from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["lazy_names"]


def lazy_names(package: str, namespace: dict, homes: dict[str, list[str]]
               ) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose names live in ``homes``
    (``{submodule: [names]}``; a submodule spelled ``shardkit.…`` is a module elsewhere in shardkit, for a
name the package shows but does not own); a name once loaded is cached in ``namespace``."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def getattr_(name: str):
        module = home_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        home = module if module.startswith("shardkit.") else f"{package}.{module}"
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(home_of))

    return getattr_, dir_, sorted(home_of)
