"""The repository's top-level folders do not take over other distributions' import names.

With the checkout's root on sys.path, ``import kernels`` would find this repository's kernels/
folder (it is ``mqinfer.kernels``) where transformers wants the PyPI package ``kernels``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "ops", "workers", "scheduler", "schemas", "loadgen")


def _run(code: str, extra_path: Path | None, *, site: bool = True) -> subprocess.CompletedProcess:
    # The checkout's root first on sys.path, as with `python -m` run from it; a site folder after it.
    # Without site (-S), no installed distribution can answer to the name.
    path = [str(ROOT)] + ([str(extra_path)] if extra_path else [])
    script = f"import sys; sys.path[:0] = {path!r}\n" + code
    flags = [] if site else ["-S"]
    return subprocess.run([sys.executable, *flags, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("name", FOLDERS)
def test_bare_name_gives_the_installed_package(tmp_path, name):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("ORIGIN = 'installed'\n")
    (pkg / "sub.py").write_text("VALUE = 42\n")
    code = (f"import {name}, {name}.sub\n"
            f"assert {name}.ORIGIN == 'installed', {name}.__file__\n"
            f"assert {name}.sub.VALUE == 42\n"
            f"import mqinfer.{name} as ours\n"
            f"assert not hasattr(ours, 'ORIGIN') and ours is not {name}\n"
            "print('ok')\n")
    proc = _run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_bare_name_without_an_installed_package_is_not_found():
    code = ("try:\n"
            "    import kernels\n"
            "except ModuleNotFoundError as e:\n"
            "    print('missing', e.name)\n"
            "else:\n"
            "    print('found', kernels.__file__)\n")
    proc = _run(code, None, site=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "missing kernels"


def test_subpackages_still_import_under_mqinfer():
    proc = _run("import mqinfer.kernels.attention, mqinfer.workers.config, mqinfer.ops\nprint('ok')\n", None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
