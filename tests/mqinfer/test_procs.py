"""The OpenMP spin setting of the processes that run the engine (mqinfer.procs.short_openmp_spin)."""

from __future__ import annotations

import os
import subprocess
import sys

from mqinfer.procs import OPENMP_SPIN_COUNT, short_openmp_spin

# Each case runs in a fresh interpreter: the setting only counts before torch is imported.
PROBE = """
import os, sys
{before}
from mqinfer.procs import short_openmp_spin
print(short_openmp_spin(), os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


def _run(code: str, **env: str) -> str:
    """``code``'s output in a fresh interpreter whose environment has no OpenMP setting but ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def _probe(before: str = "", **env: str) -> str:
    return _run(PROBE.format(before=before), **env)


def test_set_before_torch_when_the_user_set_nothing():
    assert _probe() == f"True {OPENMP_SPIN_COUNT} None"


def test_the_users_own_setting_wins():
    assert _probe(GOMP_SPINCOUNT="77") == "False 77 None"
    assert _probe(OMP_WAIT_POLICY="passive") == "False None passive"


def test_too_late_once_torch_is_imported():
    # libgomp has read its environment already: setting it now would only mislead.
    assert _probe(before="import torch") == "False None None"
    import torch  # noqa: F401  (in this test process too)

    assert short_openmp_spin() is False


def test_the_mqinfer_command_sets_it_before_it_dispatches():
    code = ("import os\nfrom mqinfer.cli import main\n"
            "try:\n    main(['worker', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('GOMP_SPINCOUNT=' + str(os.environ.get('GOMP_SPINCOUNT')))")
    assert _run(code).splitlines()[-1] == f"GOMP_SPINCOUNT={OPENMP_SPIN_COUNT}"
