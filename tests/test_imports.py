"""The tlt package has no import circle among its modules' top-level imports.

A circle between modules (the engine importing its decoders and the decoders importing the engine)
works only as long as the import order happens to be right, and ties the modules into one. Only
imports that run when a module is loaded count: those at module level (in `if`/`try` blocks too, but
not under `if TYPE_CHECKING`), not those inside functions, which run after every module is loaded.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import tlt

ROOT = Path(tlt.__file__).parent


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("tlt",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def load_time_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements a module runs when it is loaded."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        else:
            todo += list(ast.iter_child_nodes(node))
    return found


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tlt modules `name` (a package when its file is __init__.py) imports at load time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in load_time_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            # `from a.b import c` loads a.b.c when c is a module, else it takes c from a.b
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out |= {t for t in targets if t in modules and t != name}
    return out


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search, colouring visited nodes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_tlt():
    graph = import_graph()
    assert "tlt.rollout.engine" in graph and graph["tlt.rollout.engine"], "the graph finds the engine's imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_reports_a_circle():
    """Guards the test above: a circle is found and named, a chain is not a circle."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_only_load_time_imports_count():
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\ndef f():\n    import c\ntry:\n    import d\n"
                     "except ImportError:\n    pass\nclass K:\n    import e\n")
    names = sorted(alias.name for node in load_time_imports(tree) for alias in node.names)
    assert names == ["a", "d", "e"]
