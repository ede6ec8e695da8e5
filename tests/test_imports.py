"""The package's import graph has no cycle (issue 15), counting imports inside functions too: a lazy import
that closes a cycle only hides it until the day the import moves to the top."""

from __future__ import annotations

import ast
from pathlib import Path

import appliance

ROOT = Path(appliance.__file__).parent


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        parts = ["appliance", *f.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _edges(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of the package that ``mod`` imports anywhere in its body (not its own parent packages)."""
    base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                m = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                m = node.module or ""
            names += [m] + [f"{m}.{a.name}" for a in node.names]
    out = set()
    for m in names:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        if m and m != mod and not mod.startswith(m + "."):
            out.add(m)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as a path of modules, or [] (depth-first search, colouring)."""
    colour: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str]:
        colour[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if colour.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in colour:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        colour[v] = 2
        return []

    for v in sorted(graph):
        if v not in colour:
            found = visit(v)
            if found:
                return found
    return []


def test_the_walk_sees_the_package_edges():
    mods = _modules()
    graph = {m: _edges(m, p, mods) for m, p in mods.items()}
    assert "appliance.audio.port" in graph["appliance.session"]  # a top-level import
    assert "appliance.engine" in graph["appliance.session"]  # an import inside a function
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_no_import_cycle_in_the_package():
    mods = _modules()
    graph = {m: _edges(m, p, mods) for m, p in mods.items()}
    assert _cycle(graph) == []
