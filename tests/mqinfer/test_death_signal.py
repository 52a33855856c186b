"""Children that get a signal when their parent dies (mqinfer.procs.with_death_signal): through
util-linux's setpriv where it is installed, else through a preexec_fn."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mqinfer import procs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux-only")

PARENT = """
import signal, subprocess, sys, time
from mqinfer import procs
if sys.argv[1] == "preexec_fn":
    procs._setpriv = lambda: None  # as on a machine without setpriv
argv, preexec = procs.with_death_signal(["sleep", "120"], signal.SIGKILL)
assert (preexec is None) == (sys.argv[1] == "setpriv"), (argv, preexec)
child = subprocess.Popen(argv, preexec_fn=preexec)
print(child.pid, flush=True)
time.sleep(120)
"""


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever inherited it to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return any(line.startswith("State:") and "Z" in line for line in status.splitlines())


@pytest.mark.parametrize("through", ["setpriv", "preexec_fn"])
def test_a_child_gets_its_signal_when_its_parent_is_killed(through):
    if through == "setpriv" and procs._setpriv() is None:
        pytest.skip("util-linux's setpriv with --pdeathsig is not installed")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, through], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not _dead(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while not _dead(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(child)


def test_a_child_started_through_setpriv_leaves_this_processs_pages_as_they_were():
    """No fork of this process: its pages are not made copy-on-write, so writing them again after
    starting a child costs no page faults (a fork costs one per page written)."""
    if procs._setpriv() is None:
        pytest.skip("util-linux's setpriv with --pdeathsig is not installed")
    buffer = bytearray(64 << 20)

    def write_every_page() -> None:
        for i in range(0, len(buffer), 4096):
            buffer[i] = (buffer[i] + 1) & 0xFF

    write_every_page()
    argv, preexec = procs.with_death_signal(["true"], signal.SIGKILL)
    assert preexec is None and argv[1:3] == ["--pdeathsig", "SIGKILL"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    subprocess.run(argv, preexec_fn=preexec, check=True)
    write_every_page()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < len(buffer) // 4096 // 8, faults


def test_a_child_whose_parent_died_before_setpriv_set_the_signal_exits_at_once(tmp_path):
    """setpriv asks for the signal after the exec: a parent that died in between would leave the
    child running for good, so the child checks its parent once the signal is set."""
    if procs._setpriv() is None:
        pytest.skip("util-linux's setpriv with --pdeathsig is not installed")
    marker = tmp_path / "ran"
    argv, _ = procs.with_death_signal(["touch", str(marker)], signal.SIGKILL)
    assert subprocess.run(argv, timeout=30).returncode == 0 and marker.exists()
    marker.unlink()
    # The same command as a process whose parent is no longer this one sees it (its pid argument
    # names another process).
    stale = [str(1) if a == str(os.getpid()) else a for a in argv]
    assert stale != argv
    assert subprocess.run(stale, timeout=30).returncode == 1 and not marker.exists()
