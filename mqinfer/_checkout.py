"""The repository's top-level folders under their bare names.

A checkout keeps the subpackages in top-level folders (``kernels/``, ``ops/``, ...), and whenever
the checkout's root is on ``sys.path`` (pytest's ``pythonpath``, ``python -m`` run from the root)
those folders are also importable under their bare names. Some of those names belong to other
distributions: transformers, for one, imports the ``kernels`` package from PyPI. Each folder's
``__init__`` calls :func:`defer_if_bare`, which, when the folder is imported under its bare name,
gives the import the installed package of that name instead, or fails as it would without the
checkout. Under ``mqinfer.*`` (the only names this project uses) nothing changes. README.md ("Where
the code lives") describes the whole mapping.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _checkout_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def defer_if_bare(name: str) -> None:
    """What each folder's ``__init__`` calls with its ``__name__``: nothing under ``mqinfer.*``;
    under a bare name, :func:`defer_to_installed`."""
    if "." not in name:
        defer_to_installed(name)


def defer_to_installed(name: str) -> None:
    """Replace the module being imported as ``name`` with what ``sys.path`` holds by that name
    outside this checkout; raise ModuleNotFoundError when nothing else has the name.

    The import system returns whatever ``sys.modules[name]`` holds once the module's code has run,
    so the caller's import statement receives the installed package.
    """
    root = _checkout_root()
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"No module named {name!r} (this checkout's {name}/ folder is mqinfer.{name}, not a "
            f"top-level package)", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
