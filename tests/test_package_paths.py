"""The folders' mapping into the ``mqinfer`` namespace is plain (README.md, "Where the code lives"):
``mqinfer/`` holds a relative symlink to each top-level folder, so every module's file, as the
import system reports it, is its dotted name as a path, in a checkout with or without an install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("workers", "scheduler", "kernels", "schemas", "ops", "loadgen")


def test_mqinfer_holds_a_relative_link_to_each_folder():
    for name in FOLDERS:
        link = ROOT / "mqinfer" / name
        assert link.is_symlink(), f"mqinfer/{name} should link to ../{name}"
        assert os.readlink(link) == f"../{name}"
        assert (link / "__init__.py").resolve() == (ROOT / name / "__init__.py").resolve()


def test_every_module_file_is_its_dotted_name():
    """Run from another folder with no site packages (no install, no finder of an install): the
    package alone resolves its subpackages, and each module's ``__file__`` names it."""
    modules = ["mqinfer.schemas.keys", "mqinfer.scheduler.block_pool", "mqinfer.kernels", "mqinfer.ops",
               "mqinfer.workers", "mqinfer.loadgen"]
    code = ("import importlib, sys, mqinfer\n"
            f"sys.stdout.write(repr(list(mqinfer.__path__)) + '\\n')\n"
            f"for name in {modules!r}:\n"
            "    sys.stdout.write(name + ' ' + importlib.import_module(name).__file__ + '\\n')\n")
    proc = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + code],
                          cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, *rest = proc.stdout.splitlines()
    # The package's search path is its own folder only: no checkout root appended to it.
    assert first == repr([str(ROOT / "mqinfer")])
    for line in rest:
        name, path = line.split(" ", 1)
        relative = Path(path).relative_to(ROOT)
        expected = Path(*name.split("."))
        assert relative in (expected.with_suffix(".py"), expected / "__init__.py"), (name, path)


def test_pyproject_lists_every_package():
    """A wheel holds only the packages pyproject.toml lists: each folder with an ``__init__.py``
    must be there (a new subpackage left out installs without its modules)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"mqinfer"}
    for folder in FOLDERS:
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            found.add(".".join(("mqinfer", *parts)))
    assert found == listed, f"not listed: {sorted(found - listed)}; listed but not a package: {sorted(listed - found)}"
