"""The layout docs/architecture.md describes, checked on the code itself: imports only point down the layers,
there is no import cycle, only the commands import click, and the engine names no vendor library (what only a
device can do lives in its plugin, behind the contract)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "llmc_cli"

# bottom to top; a module may import from its own layer or any layer below it
LAYERS = [
    ("contract", {"kernels", "registry", "naming"}),
    ("domain", {"models", "formats", "data", "optim", "parallel"}),
    ("workflows", {"training", "inference", "evals", "bench", "tokenizing", "charts", "testing"}),
    ("commands", {"commands", "entry", "__main__", "__init__"}),
]
LAYER_OF = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The llmc_cli modules `name` imports (any depth: function-level imports count too)."""
    found = set()
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else (node.module or "")
            subs = [mod + "." + a.name for a in node.names]
            # `from pkg import sub` imports the submodule; the package itself only when a name is not a submodule
            targets = subs + ([mod] if any(t not in modules for t in subs) else [])
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("llmc_cli") and t != name and t != "llmc_cli":
                found.add(t)
    return found


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_has_a_layer():
    missing = sorted({_top(m) for m in _modules()} - set(LAYER_OF))
    assert not missing, f"modules outside the layers of docs/architecture.md: {missing}"


def test_imports_point_down_and_never_cycle():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    upward = [f"{m} ({LAYERS[LAYER_OF[_top(m)]][0]}) imports {t} ({LAYERS[LAYER_OF[_top(t)]][0]})"
              for m, ts in graph.items() for t in ts if LAYER_OF[_top(t)] > LAYER_OF[_top(m)]]
    assert not upward, "\n".join(upward)
    seen, stack = {}, []  # depth-first search for a cycle, reporting its path

    def visit(m: str) -> list[str] | None:
        seen[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if seen.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t not in seen and (cycle := visit(t)):
                return cycle
        seen[m] = "done"
        stack.pop()
        return None
    for m in sorted(graph):
        if m not in seen:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_only_the_commands_import_click_or_print():
    offenders = []
    for name, path in _modules().items():
        if LAYER_OF[_top(name)] == LAYER_OF["commands"]:
            continue
        text = path.read_text()
        if re.search(r"^\s*(import click|from click\b)", text, re.M):
            offenders.append(f"{name} imports click")
    assert not offenders, offenders


def test_the_engine_names_no_vendor_library():
    """CuPy, NCCL, PyOpenCL, cuDNN and cuBLAS belong to the plugins (backends/*); the engine asks the contract."""
    pattern = re.compile(r"cupy|nccl|pyopencl|cudnn|cublas|__cuda_array_interface__", re.I)
    offenders = [f"{p.relative_to(PKG.parent)}:{i}: {line.strip()}"
                 for p in PKG.rglob("*.py") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert not offenders, "\n".join(offenders)
