"""The package's shape: imports run one way between the layers, no module imports itself back
through others, and no module passes ~500 lines. Read statically (imports under TYPE_CHECKING and
inside functions count too), so the layering holds for what a reader sees, not only what runs. A cycle
is one that runs: an import under `if TYPE_CHECKING:` names a type for the checker (a step's `loop:
QueryLoop`, in the module the loop imports), it makes no cycle."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import queryloop

PACKAGE = Path(queryloop.__file__).parent
MAX_LINES = 500

# Each layer may import itself and the layers listed (and what they may import, transitively).
ALLOWED: dict[str, set[str]] = {
    "queryloop.runtime.errors": set(),
    "queryloop.runtime.kernel": {"queryloop.runtime.errors"},
    "queryloop.runtime.loop": {"queryloop.runtime.errors"},
    "queryloop.runtime.providers": {"queryloop.runtime.loop"},
    "queryloop.actors": {"queryloop.runtime.kernel", "queryloop.runtime.loop"},
    "queryloop.runtime.mcp": {"queryloop.runtime.loop"},
    "queryloop.runtime.host": {"queryloop.actors", "queryloop.runtime.providers", "queryloop.runtime.mcp"},
    "queryloop.runtime.cli": {"queryloop.runtime.host"},
    "queryloop.runtime.ray": {"queryloop.runtime.host"},
}


def _reachable(layer: str) -> set[str]:
    seen = {layer}
    todo = [layer]
    while todo:
        for below in ALLOWED[todo.pop()]:
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen


def _modules() -> dict[str, Path]:
    found = {}
    paths = [Path(d, f) for d, _, files in os.walk(PACKAGE, followlinks=True) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The import statements under a module-level `if TYPE_CHECKING:`."""
    guarded: set[ast.AST] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            guarded.update(n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom))
    return guarded


def _imports(name: str, path: Path, *, typing: bool = True) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = set() if typing else _type_checking_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("queryloop")}


def _layer(module: str) -> str | None:
    return max((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), key=len, default=None)


MODULES = _modules()
GRAPH = {name: {m for m in _imports(name, path) if m in MODULES and m != name} for name, path in MODULES.items()}
RUNTIME_GRAPH = {
    name: {m for m in _imports(name, path, typing=False) if m in MODULES and m != name}
    for name, path in MODULES.items()
}


def test_the_package_is_read_whole() -> None:
    assert {"queryloop.actors.query_loop.loop", "queryloop.runtime.kernel.actor", "queryloop.runtime.cli.main"} <= set(
        MODULES
    )


def test_layers_import_only_the_layers_below_them() -> None:
    wrong = []
    for name, targets in GRAPH.items():
        layer = _layer(name)
        if layer is None:
            continue  # `queryloop` itself, and the `runtime` package's docstring: they may re-export anything
        allowed = _reachable(layer)
        wrong += [f"{name} -> {t}" for t in targets if (_layer(t) or "queryloop") not in allowed and _layer(t)]
    assert wrong == []


def test_no_module_imports_itself_back_through_others() -> None:
    # Edges to a package's `__init__` that only re-exports are edges to what it re-exports: skip
    # packages (their own modules import their siblings by full name, never the package).
    graph = {n: {t for t in ts if MODULES[t].name != "__init__.py"} for n, ts in RUNTIME_GRAPH.items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*stack[stack.index(target) :], target]))
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_no_module_passes_500_lines() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_subpackage_says_what_it_owns_and_may_import() -> None:
    packages = [name for name, path in MODULES.items() if path.name == "__init__.py"]
    assert {"queryloop.runtime.kernel", "queryloop.runtime.loop", "queryloop.runtime.host"} <= set(packages)
    for name in packages:
        doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
        assert doc, f"{name} has no docstring"
        if name not in {"queryloop", "queryloop.runtime"}:
            assert "import" in doc.lower(), f"{name}'s docstring does not say what it may import"
