"""No import cycle in llmc_cli or in any backend package (backends/*/llmc_*): every import counts, at module top
or inside a function, since a lazy import only moves a cycle to the first call that reaches it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "llmc_cli"] + sorted(ROOT.glob("backends/*/llmc_*"))


def modules(packages: list[Path]) -> dict[str, Path]:
    """{dotted name: file} of every module under `packages` (a package by its __init__.py)."""
    out = {}
    for pkg in packages:
        for p in sorted(pkg.rglob("*.py")):
            parts = list(p.relative_to(pkg.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` imports. `from pkg import sub` imports the submodule; the
    package itself only when a name is not a submodule."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{mod}.{a.name}" for a in node.names]
            targets = subs + ([mod] if any(t not in known for t in subs) else [])
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm), sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def import_cycles(packages: list[Path]) -> list[str]:
    known = modules(packages)
    graph = {m: imported(m, p, known) for m, p in known.items()}
    return ["; ".join(f"{m} imports {', '.join(sorted(graph[m] & set(group)))}" for m in group)
            for group in cycles(graph)]


def test_no_import_cycle_in_llmc_cli_or_the_backends():
    assert len(PACKAGES) >= 4, PACKAGES  # llmc_cli and the cpu, cuda and opencl plugins
    found = import_cycles(PACKAGES)
    assert not found, "import cycles:\n" + "\n".join(found)


@pytest.mark.parametrize("files, want", [
    ({"__init__.py": "from .b import x\n", "b.py": "from . import y\n"}, ["pkg imports pkg.b; pkg.b imports pkg"]),
    ({"__init__.py": "", "a.py": "def f():\n    from pkg import b\n", "b.py": "import pkg.a\n"},
     ["pkg.a imports pkg.b; pkg.b imports pkg.a"]),
    ({"__init__.py": "from . import a, b\n", "a.py": "from .b import f\n", "b.py": "import json\n"}, []),
])
def test_the_checker_finds_a_cycle_through_any_import(tmp_path, files, want):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name, text in files.items():
        (pkg / name).write_text(text)
    assert import_cycles([pkg]) == want
