"""Child processes that do not outlive their parent.

`mqinfer run` and `mqinfer redis` start an embedded server and worker processes. If the parent is
killed with SIGKILL it cannot stop them, so on Linux each child asks the kernel for a signal when
its parent dies (``PR_SET_PDEATHSIG``); elsewhere this is a no-op and the run's lock file check
stops leftovers on the next start.

``short_openmp_spin`` sets how long PyTorch's OpenMP threads spin between parallel regions, for
the processes that run the engine (see there). ``freeze_heap`` moves a process's start-up heap out
of the garbage collector's reach, before it serves or forks children, and counts what it froze.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1

# Objects moved out of the collector's reach by this process's freezes and those of the process it
# was forked from (a fork copies this count with the objects).
_frozen_objects = 0

# Iterations libgomp's idle workers spin before they sleep, where the user sets neither
# GOMP_SPINCOUNT nor OMP_WAIT_POLICY (libgomp's own default is 300,000).
OPENMP_SPIN_COUNT = "3000"


@functools.cache
def _libc():
    # Once per process: find_library runs `ldconfig -p` (a fork of this process) each time.
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


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` where it can set the parent-death signal (2.33 and later), else None."""
    path = shutil.which("setpriv")
    if path is None:
        return None
    try:
        text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if "--pdeathsig" in text else None


# Run between setpriv and the command: exits at once if the parent (its pid is $0) died before
# setpriv asked for the death signal, which would then never come. It reads the parent's pid from
# /proc/self/stat without starting a program: the field after the state, after the last ")".
_PARENT_CHECK = 'read -r s < /proc/$$/stat; s=${s##*) }; s=${s#* }; [ "${s%% *}" = "$0" ] || exit 1; exec "$@"'


def with_death_signal(argv: list[str], sig: int = signal.SIGTERM
                      ) -> tuple[list[str], Callable[[], None] | None]:
    """``argv`` and a ``preexec_fn`` for ``subprocess.Popen`` that make the child get ``sig`` when
    this process dies.

    Where util-linux's ``setpriv`` is installed the command runs through ``setpriv --pdeathsig``
    (and a shell that checks the parent is still there once the signal is set, as
    ``die_with_parent`` does), and there is no ``preexec_fn``, so Popen starts the child with
    vfork. A ``preexec_fn`` forces a full fork, which marks every page of this process
    copy-on-write: each page it writes after that faults once, about 0.37 s of CPU per GB it writes
    again (measured), paid for every child that a process holding a model starts. Elsewhere,
    ``argv`` as it is and ``die_with_parent(sig)``.
    """
    setpriv = _setpriv() if sys.platform.startswith("linux") else None
    if setpriv is None:
        return list(argv), die_with_parent(sig)
    return [setpriv, "--pdeathsig", signal.Signals(sig).name, "/bin/sh", "-c", _PARENT_CHECK, str(os.getpid()),
            *argv], None


# The pid of the process a worker forked from a warm template works for (mqinfer.warm_start), which
# is not its parent; None in a process started the usual way.
_owner: int | None = None


def set_owner(pid: int) -> None:
    """In a process forked from a warm template: the process it was started for."""
    global _owner
    _owner = pid


def started_by() -> int:
    """The pid of the process that started this one: its owner where a warm template forked it,
    else its parent (taken once, at start: see :func:`starter_gone`)."""
    return _owner if _owner is not None else os.getppid()


def starter_gone(pid: int) -> bool:
    """Whether the process ``started_by()`` gave is gone."""
    return os.getppid() != pid if _owner is None else process_gone(pid)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has ended (Linux, /proc): a zombie, not yet reaped, counts as ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def mqinfer_command(*args: str) -> list[str]:
    """The argv that runs ``mqinfer ARGS`` with this interpreter.

    ``-P`` keeps the current folder off the import path, so a folder named ``mqinfer`` where the
    user stands (a clone, run from its parent) cannot hide the installed package.
    """
    return [sys.executable, "-P", "-m", "mqinfer", *args]


def short_openmp_spin() -> bool:
    """Let PyTorch's OpenMP workers sleep soon after each parallel region; call it before torch is
    imported (libgomp reads the setting once, when it loads). Returns whether it was set.

    A CPU forward pass alternates PyTorch's matmuls (OpenMP threads, from the libgomp PyTorch
    ships) with the native kernels (their own thread pool, ``kernels/csrc/thread_pool.c``). By
    default libgomp's workers spin for 300,000 iterations after every parallel region, on the
    cores the native kernels' threads are about to need, so every switch costs those kernels
    part of a core. Sleeping after about 3,000 iterations measured 8-12% shorter engine steps
    with two threads on two cores (BENCHMARKS.md); sleeping at once (``OMP_WAIT_POLICY=passive``)
    was slower than the default, as each matmul then waits for its threads to wake. A process with
    one thread has no OpenMP workers and is unaffected. Child processes inherit the setting.
    """
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    return True


def freeze_heap() -> int:
    """A full collection, then ``gc.freeze()``: every object left alive leaves the collector's
    reach for good. Returns how many objects are frozen in all.

    The count is kept as they are frozen: ``gc.get_freeze_count()`` walks the whole frozen list
    each time it is asked (about 16 ms for a worker's 200,000 objects, and in a forked child a
    walk over pages it shares with its parent). After the collection every survivor is in one of
    the three generations, and only those (in a forked child: the objects it made itself) are
    counted here, to within the few objects made or freed between the count and the freeze."""
    global _frozen_objects
    gc.collect()
    count = len(gc.get_objects(0))
    count += len(gc.get_objects(1))
    count += len(gc.get_objects(2))
    gc.freeze()
    _frozen_objects += count
    return _frozen_objects


def frozen_objects() -> int:
    """How many objects :func:`freeze_heap` froze, in this process and the one it was forked from."""
    return _frozen_objects
