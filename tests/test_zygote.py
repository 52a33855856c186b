"""The tests' launcher (tests/zygote.py): a `python -m mqinfer` command forked from the zygote
behaves, as far as a test can see, as the same command started for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import zygote
from tests.helpers import children_of, mqinfer_cmd, rows, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the zygote is Linux-only")


@pytest.fixture
def zygote_on(monkeypatch):
    """These tests are about the zygote: on, whatever MQINFER_TEST_NO_ZYGOTE says for the run."""
    monkeypatch.delenv(zygote.SWITCH, raising=False)


needs_zygote = pytest.mark.usefixtures("zygote_on")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@needs_zygote
def test_a_command_is_forked_and_ends_as_the_real_one():
    forked = zygote.run(mqinfer_cmd("--version"), capture_output=True, text=True, timeout=120)
    real = subprocess.run(mqinfer_cmd("--version"), capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert real.returncode == 0 and real.stdout.startswith("mqinfer ")
    proc = zygote.popen(mqinfer_cmd("--version"), stdout=subprocess.DEVNULL)
    assert isinstance(proc, zygote.ForkedPopen) and proc.wait(timeout=120) == 0


@needs_zygote
def test_environment_and_errors_reach_the_child_as_given():
    env = dict(os.environ, MQINFER_LOG_LEVEL="bogus")
    forked = zygote.run(mqinfer_cmd("compact", "x"), env=env, capture_output=True, text=True, timeout=120)
    real = subprocess.run(mqinfer_cmd("compact", "x"), env=env, capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert real.returncode == 2 and "environment MQINFER_LOG_LEVEL" in real.stderr
    with pytest.raises(FileNotFoundError):
        zygote.popen(mqinfer_cmd("--version"), cwd="/no/such/folder")


@needs_zygote
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 0), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_long_running_command_has_its_own_pid_folder_command_line_and_children(tmp_path, signum, code):
    argv = mqinfer_cmd("redis", "--dir", "data")
    proc = zygote.popen(argv, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    server: list[int] = []
    try:
        assert isinstance(proc, zygote.ForkedPopen)
        assert proc.stdout.readline().startswith("redis://")  # its URL, once the server is up
        assert _parent(proc.pid) != os.getpid()  # the zygote's child, not this process's
        assert Path(f"/proc/{proc.pid}/cwd").resolve() == tmp_path.resolve()
        shown = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert [part.decode() for part in shown if part] == argv
        server = wait_until(lambda: children_of(proc.pid), timeout=30, what="the embedded server")
        assert proc.poll() is None
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == code
        assert proc.returncode == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in server:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_switch_starts_every_command_for_real(monkeypatch):
    monkeypatch.setenv(zygote.SWITCH, "1")
    assert not zygote.servable(mqinfer_cmd("--version"), {})
    proc = zygote.popen(mqinfer_cmd("--version"), stdout=subprocess.DEVNULL)
    assert type(proc) is subprocess.Popen and proc.wait(timeout=120) == 0


@needs_zygote
def test_only_what_a_fork_can_match_is_forked():
    assert zygote.servable(mqinfer_cmd("worker"), {"env": dict(os.environ, OMP_NUM_THREADS="1")})
    # Read where it is used (torch's compiler), which the zygote has not loaded.
    assert zygote.servable(mqinfer_cmd("worker"), {"env": dict(os.environ, TORCHINDUCTOR_CACHE_DIR="/x")})
    assert not zygote.servable([sys.executable, "-P", "-m", "mqinfer"], {})
    assert not zygote.servable([sys.executable, "-c", "pass"], {})
    assert not zygote.servable(mqinfer_cmd("worker"), {"preexec_fn": os.getpid})
    assert not zygote.servable(mqinfer_cmd("worker"), {"env": dict(os.environ, OMP_WAIT_POLICY="passive")})
    seed = os.environ.get("PYTHONHASHSEED", "") + "1"
    assert not zygote.servable(mqinfer_cmd("worker"), {"env": dict(os.environ, PYTHONHASHSEED=seed)})
    assert not zygote.servable(mqinfer_cmd("worker"), {"env": dict(os.environ, OMP_NUM_THREADS="x")})


@needs_zygote
def test_a_forked_worker_runs_torch_on_several_threads(redis_url, tmp_path):
    """The zygote runs no operation on several threads before it forks: OpenMP's team would be
    missing from every child, whose first parallel region would then wait forever."""
    from mqinfer.client import Producer

    Producer(redis_url, stream="zygote-threads").submit_many(
        [{"id": "r0", "prompt_token_ids": [256] + [65] * 40, "max_tokens": 4, "temperature": 0.0}])
    env = dict(os.environ, OMP_NUM_THREADS="2", MQINFER_LOG_LEVEL="warning")
    done = zygote.run(mqinfer_cmd("worker", "--redis", redis_url, "--out", str(tmp_path / "out"), "--stream",
                                  "zygote-threads", "--num-threads", "2", "--idle-exit-s", "0.5"),
                      env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in rows(tmp_path / "out" / "results")] == ["r0"]


def test_a_child_runs_its_own_finalizers_at_exit_and_not_the_zygotes():
    """The zygote's finalizers (torch's operator libraries, after its imports) are its own: a
    forked command does not run them at its exit; those the command makes run as usual."""
    code = (
        "import atexit, os, sys, weakref\n"
        "from tests.zygote_server import _drop_inherited_finalizers\n"
        "class Thing: pass\n"
        "zygotes = Thing()\n"
        "weakref.finalize(zygotes, print, 'the zygote\\'s finalizer', flush=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    _drop_inherited_finalizers()\n"
        "    childs = Thing()\n"
        "    weakref.finalize(childs, print, 'the child\\'s finalizer', flush=True)\n"
        "    print('child exits', flush=True)\n"
        "    atexit._run_exitfuncs()\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent exits', flush=True)\n"
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                          check=True)
    assert proc.stdout.splitlines() == ["child exits", "the child's finalizer", "parent exits",
                                        "the zygote's finalizer"]
