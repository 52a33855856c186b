"""Child processes that do not outlive their parent.

`mqinfer run` and `mqinfer redis` start an embedded server and worker processes. If the parent is
killed with SIGKILL it cannot stop them, so on Linux each child asks the kernel for a signal when
its parent dies (``PR_SET_PDEATHSIG``); elsewhere this is a no-op and the run's lock file check
stops leftovers on the next start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _libc():
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies.

    The parent's pid is taken now, before the fork, so that a parent that died between fork and
    exec is noticed (the child is then already re-parented and kills itself at once).
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = _libc()
    if libc is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def mqinfer_command(*args: str) -> list[str]:
    """The argv that runs ``mqinfer ARGS`` with this interpreter.

    ``-P`` keeps the current folder off the import path, so a folder named ``mqinfer`` where the
    user stands (a clone, run from its parent) cannot hide the installed package.
    """
    return [sys.executable, "-P", "-m", "mqinfer", *args]
