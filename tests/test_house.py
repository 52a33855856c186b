"""House rules, checked on the project's source (its packages, not the tests):

* no module imports another module's private name (``from mqinfer.x import _y``, or ``x._y``
  read through an imported module), since a private name may change without notice;
* no function is longer than 80 lines.

Each rule lists today's exceptions by name. The lists may only shrink: a new offender fails, an
exception that grew fails, and an exception that was fixed fails until its entry is removed
here. Private *modules* (``mqinfer._checkout``) are the package's own business: every module here
is inside ``mqinfer``, so only private names are checked.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folder -> the import name pyproject.toml maps it to.
PACKAGES = {"mqinfer": "mqinfer", "schemas": "mqinfer.schemas", "scheduler": "mqinfer.scheduler",
            "kernels": "mqinfer.kernels", "workers": "mqinfer.workers", "ops": "mqinfer.ops",
            "loadgen": "mqinfer.loadgen"}
MAX_FUNCTION_LINES = 80

# "importing file: module.name": imports of another module's private name allowed for now (none).
PRIVATE_IMPORT_EXCEPTIONS: set[str] = set()

# "file::qualified name": its length in lines (def line to last line) when it was listed; none is
# left, and a new long function is split into named steps rather than listed here.
LONG_FUNCTION_EXCEPTIONS: dict[str, int] = {}


@functools.cache
def _sources() -> tuple[tuple[str, str, ast.Module], ...]:
    """(path relative to the root, module name, syntax tree) of every project module."""
    found = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            module = ".".join((package, *parts))
            found.append((path.relative_to(ROOT).as_posix(), module, ast.parse(path.read_text(encoding="utf-8"))))
    return tuple(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The module an ImportFrom names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_imports(path: str, module: str, tree: ast.Module) -> set[str]:
    """What ``module`` takes from other project modules by a private name."""
    found: set[str] = set()
    project: dict[str, str] = {}  # local name -> the project module or object it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node, path.endswith("__init__.py"))
            if source.split(".")[0] != "mqinfer" or source == module:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.add(f"{path}: {source}.{alias.name}")
                else:
                    project[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mqinfer" and alias.asname:
                    project[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in project
                and _private(node.attr)):
            found.add(f"{path}: {project[node.value.id]}.{node.attr}")
    return found


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def _long_functions() -> dict[str, int]:
    return {f"{path}::{name}": fn.end_lineno - fn.lineno + 1
            for path, _, tree in _sources() for name, fn in _functions(tree)
            if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES}


def test_no_module_imports_another_modules_private_name():
    found = set().union(*(_private_imports(*source) for source in _sources()))
    new = sorted(found - PRIVATE_IMPORT_EXCEPTIONS)
    assert not new, ("imports of another module's private name (make the name public in its home module "
                     "and import that):\n  " + "\n  ".join(new))
    fixed = sorted(PRIVATE_IMPORT_EXCEPTIONS - found)
    assert not fixed, ("fixed, so remove from PRIVATE_IMPORT_EXCEPTIONS in tests/test_house.py:\n  "
                       + "\n  ".join(fixed))


def test_no_function_is_longer_than_80_lines():
    found = _long_functions()
    new = sorted(f"{name} ({n} lines)" for name, n in found.items() if name not in LONG_FUNCTION_EXCEPTIONS)
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n  " + "\n  ".join(new)
    grew = sorted(f"{name}: {found[name]} lines, listed at {n}" for name, n in LONG_FUNCTION_EXCEPTIONS.items()
                  if found.get(name, 0) > n)
    assert not grew, "listed long functions may only get shorter:\n  " + "\n  ".join(grew)
    fixed = sorted(name for name in LONG_FUNCTION_EXCEPTIONS if name not in found)
    assert not fixed, (f"now at most {MAX_FUNCTION_LINES} lines (or gone), so remove from LONG_FUNCTION_EXCEPTIONS "
                       "in tests/test_house.py:\n  " + "\n  ".join(fixed))


def test_the_checks_see_what_they_are_meant_to_see():
    # A private name taken by import and through a module, a relative import, a nested function.
    tree = ast.parse("from mqinfer.ops.report import _X, Y\nfrom mqinfer.workers import loader\n"
                     "from .sibling import _z\nfrom mqinfer.ops.report import __all__\n"
                     "def f():\n    return loader._weights(Y) + loader.public\n")
    assert _private_imports("ops/a.py", "mqinfer.ops.a", tree) == {
        "ops/a.py: mqinfer.ops.report._X", "ops/a.py: mqinfer.workers.loader._weights",
        "ops/a.py: mqinfer.ops.sibling._z"}
    body = "\n".join(["class C:", "    def m(self):", "        def inner():"] + ["            pass"] * 90)
    lengths = {name: fn.end_lineno - fn.lineno + 1 for name, fn in _functions(ast.parse(body))}
    assert lengths == {"C.m": 92, "C.m.<locals>.inner": 91}
