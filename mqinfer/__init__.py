"""mqinfer: message-queue batch inference for large language models.

The repository keeps the subpackages (workers/, scheduler/, kernels/, schemas/, ops/,
loadgen/) in top-level folders; pyproject.toml maps them into this namespace. When this source
folder is imported straight from a checkout (it sits first on ``sys.path`` when Python runs from
the repository root), the mapping of an install does not apply, so the checkout's root joins
this package's search path and ``mqinfer.workers`` resolves to ``workers/`` all the same.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

_SUBPACKAGES = ("workers", "scheduler", "kernels", "schemas", "ops", "loadgen")


def _extend_path_for_checkout() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    if all(_os.path.isdir(_os.path.join(here, name)) for name in _SUBPACKAGES):
        return  # an installed wheel: the subpackages live inside this folder
    root = _os.path.dirname(here)
    marker = _os.path.join(root, "pyproject.toml")
    if not _os.path.isfile(marker):
        return
    with open(marker, encoding="utf-8") as f:
        if 'name = "mqinfer"' not in f.read():
            return
    if root not in __path__:
        __path__.append(root)  # type: ignore[name-defined]


_extend_path_for_checkout()
