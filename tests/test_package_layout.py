"""The shape of ``src/shardkit``: no import cycle, no private name imported across modules, small folders
and files, and no submodule of ``shardkit.checkpoint`` named like one of its public names.

The import graph is built with ``ast`` over every source file, imports inside functions included: a
``from pkg import name`` where ``pkg.name`` is a module counts as importing that module, any other as
importing ``pkg`` (its ``__init__``). Nothing is imported to build it. (``tests/test_layout.py`` is about
``shardkit.layout``, the shard math.)
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULES_PER_FOLDER = 15
MAX_LINES_PER_FILE = 400


def _modules() -> dict[str, tuple[Path, bool]]:
    """``dotted name -> (file, is a package __init__)`` for every ``.py`` under ``src/shardkit``."""
    out = {}
    for path in sorted((SRC / "shardkit").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    """A Python module or package, or a compiled extension built from a C file of that name."""
    if name in MODULES:
        return True
    folder = SRC / Path(*name.split(".")[:-1])
    base = name.rsplit(".", 1)[-1]
    return (folder / f"{base}.c").exists() or any(folder.glob(f"{base}.*.so"))


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")[: None if is_package else -1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _walk(module: str):
    """``(imported module, the private name it takes or None, line)`` for every import in ``module``."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # local name -> module it is bound to (`import a.b as m`, `from a import b`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shardkit"):
                    yield alias.name, None, node.lineno
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            if not base.startswith("shardkit"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if _is_module(full):
                    yield full, None, node.lineno
                    bound[alias.asname or alias.name] = full
                else:
                    yield base, alias.name if _private(alias.name) else None, node.lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if _private(node.attr) and not _is_module(f"{bound[node.value.id]}.{node.attr}"):
                yield bound[node.value.id], node.attr, node.lineno


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _graph() -> dict[str, set[str]]:
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for target, _, _ in _walk(module):
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_shardkit():
    cycle = _find_cycle(_graph())
    assert cycle is None, ("import cycle (imports inside functions count): " + " -> ".join(cycle)
                           + "; move what both need below both, or import the module that defines the name")


def test_no_private_name_is_imported_across_modules():
    found = []
    for module in MODULES:
        for target, name, line in _walk(module):
            if name is not None and target != module:
                found.append(f"{MODULES[module][0].relative_to(SRC)}:{line} takes {target}.{name}")
    assert not found, "private names used outside their module (make them public, or move them):\n" + "\n".join(found)


def test_private_modules_are_used_inside_their_package_only():
    found = []
    for module in MODULES:
        for target, _, line in _walk(module):
            parts = target.split(".")
            private_at = next((i for i, p in enumerate(parts) if _private(p)), None)
            package = ".".join(parts[:private_at])
            if private_at is not None and module != package and not module.startswith(package + "."):
                found.append(f"{MODULES[module][0].relative_to(SRC)}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_no_folder_holds_more_than_15_modules():
    big = {}
    for folder, _, files in os.walk(SRC / "shardkit"):
        count = sum(f.endswith(".py") and f != "__init__.py" for f in files)
        if count > MAX_MODULES_PER_FOLDER:
            big[os.path.relpath(folder, SRC)] = count
    assert not big, f"folders over {MAX_MODULES_PER_FOLDER} modules (split them by job): {big}"


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p, _ in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES_PER_FILE}
    assert not long, f"files over {MAX_LINES_PER_FILE} lines (split them by concern): {long}"


@pytest.mark.parametrize("package", ["shardkit.checkpoint", "shardkit.storage", "shardkit.hf", "shardkit.sources"])
def test_no_submodule_is_named_like_a_public_name_of_its_package(package):
    """``shardkit.checkpoint.load`` must be the function, whichever submodule was imported first."""
    import importlib

    public = set(importlib.import_module(package).__all__)
    folder = SRC / Path(*package.split("."))
    children = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert not (public & children), f"{package}: submodules named like public names: {sorted(public & children)}"


ENGINE = ("shardkit.checkpoint.format", "shardkit.checkpoint.planning", "shardkit.checkpoint.coordination",
          "shardkit.checkpoint.saving", "shardkit.checkpoint.loading", "shardkit.storage", "shardkit.format_detect")
ABOVE_THE_ENGINE = ("shardkit.sources", "shardkit.checkpoint.api", "shardkit.checkpoint.manager", "shardkit.cli")


def test_the_checkpoint_engine_and_storage_never_reach_up():
    """``docs/architecture.md``: the engine sits below ``sources/`` and the public entry points above it."""
    graph = _graph()
    found = []
    for module in (m for m in graph if m.startswith(ENGINE)):
        seen, stack = set(), [module]
        while stack:
            for nxt in graph[stack.pop()] - seen:
                seen.add(nxt)
                stack.append(nxt)
        up = sorted(m for m in seen if m.startswith(ABOVE_THE_ENGINE) or m == "shardkit.checkpoint")
        if up:
            found.append(f"{module} reaches {up[:3]}")
    assert not found, "\n".join(found)
