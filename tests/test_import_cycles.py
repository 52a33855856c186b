"""No import cycle between the project's modules, counting imports anywhere in a module: at its top
and inside functions. An import inside a function hides a cycle from the import system but not from
the reader: the two modules still depend on each other. Imports under ``if TYPE_CHECKING`` are left
out: they never run, and only name a type for an annotation.

Every module is parsed with ``ast`` (nothing is imported), each ``import mqinfer...`` and ``from
... import`` (relative ones resolved) becomes an edge to the deepest project module it names, and
the strongly connected components of that graph are the cycles."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# mqinfer/ holds links to these folders (README.md, "Where the code lives"); they are read in place.
FOLDERS = ("workers", "scheduler", "kernels", "schemas", "ops", "loadgen")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for folder, prefix in [("mqinfer", "mqinfer"), *((f, f"mqinfer.{f}") for f in FOLDERS)]:
        base = ROOT / folder
        for path in base.rglob("*.py"):
            if path.relative_to(base).parts[0] in FOLDERS:  # the links inside mqinfer/
                continue
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def imported_names(module: str, path: Path, is_package: bool) -> set[str]:
    """Every dotted name the module imports, anywhere in it (relative imports made absolute)."""
    names: set[str] = set()
    for node in _walk_run_time(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "mqinfer" or n.startswith("mqinfer.")}


def _walk_run_time(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(child.orelse)
                continue
            todo.append(child)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports; parsed once for this file's tests (read only)."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_names(name, path, path.name == "__init__.py"):
            while imported not in modules and "." in imported:  # `from pkg import name`: the package
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_sees_a_cycle_through_a_function_level_import():
    graph = {"mqinfer.a": {"mqinfer.b"}, "mqinfer.b": {"mqinfer.c"}, "mqinfer.c": {"mqinfer.a"}, "mqinfer.d": set()}
    assert cycles(graph) == [["mqinfer.a", "mqinfer.b", "mqinfer.c"]]
    source = ("def f():\n    from . import loader\n    from mqinfer.kernels.linear import x\n"
              "if TYPE_CHECKING:\n    from mqinfer.workers.engine.core import LLMEngine\n")
    names = imported_names("mqinfer.workers.engine.parallel", _write(source), is_package=False)
    assert names >= {"mqinfer.workers.engine.loader", "mqinfer.kernels.linear.x"}
    assert "mqinfer.workers.engine.core" not in names


def _write(source: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "m.py"
    path.write_text(source, encoding="utf-8")
    return path


def test_the_graph_covers_the_package():
    graph = import_graph()
    assert {"mqinfer.cli", "mqinfer.workers.engine.core", "mqinfer.scheduler.scheduler", "mqinfer.kernels.attention",
            "mqinfer.ops.report", "mqinfer.loadgen.bench"} <= set(graph)
    assert "mqinfer.scheduler.scheduler" in graph["mqinfer.workers.engine.core"]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(
        " <-> ".join(c) for c in found)
