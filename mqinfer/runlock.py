"""One `mqinfer run` per output folder, and no processes left over from a run that was killed.

The lock is ``OUT/.mqinfer/run.lock``: an exclusive ``flock`` taken by the run and inherited by
its worker processes (they get the open file), so the folder stays locked while any of them
lives. The file holds the owner's pid and its children's pids as JSON. A run that finds the lock
held reads it: if the owner is alive, it refuses, naming it; if the owner is dead, the holders
are its orphaned workers, which are stopped before the new run takes the folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

LOCK_NAME = "run.lock"


class RunLockError(RuntimeError):
    """Another live run holds the output folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_mqinfer(pid: int, out: Path | None = None) -> bool:
    """Whether ``pid`` runs mqinfer (and names ``out`` when given): pids are reused, so a pid in
    a stale lock file is only signalled when it is still one of ours."""
    argv = _cmdline(pid)
    if not argv or not any("mqinfer" in part for part in argv):
        return False
    if out is None:
        return True
    target = str(out.resolve())
    return any(os.path.abspath(part) == target for part in argv if part and not part.startswith("-"))


class RunLock:
    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        self.path = self.out / ".mqinfer" / LOCK_NAME
        self.fd: int | None = None
        self._info: dict = {}

    def acquire(self, *, stale_grace_s: float = 5.0, timeout_s: float = 30.0) -> list[int]:
        """Take the folder; returns the pids of orphans that had to be stopped first."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        stopped: list[int] = []
        try:
            if not self._try_lock(fd):
                info = self._read(fd)
                owner = int(info.get("pid") or 0)
                if owner and owner != os.getpid() and _alive(owner) and _is_mqinfer(owner):
                    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
                    raise RunLockError(
                        f"another `mqinfer run` (pid {owner}, started {since}) is using {self.out}; "
                        f"wait for it to finish, or stop it (kill {owner}) and run again to resume")
                stopped = stop_orphans([int(p) for p in info.get("children", [])], self.out, stale_grace_s)
                deadline = time.monotonic() + timeout_s
                while not self._try_lock(fd):
                    if time.monotonic() > deadline:
                        raise RunLockError(
                            f"{self.path} is still locked by processes of a run that is gone "
                            f"(owner pid {owner or 'unknown'}); stop them and run again")
                    time.sleep(0.1)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._info = {"pid": os.getpid(), "started": time.time(), "children": []}
        self._write()
        return stopped

    def add_children(self, pids: list[int]) -> None:
        self._info["children"] = sorted(set(self._info["children"]) | set(pids))
        self._write()

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @staticmethod
    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            data = os.read(fd, 1 << 16)
            info = json.loads(data.decode() or "{}")
            return info if isinstance(info, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self) -> None:
        assert self.fd is not None
        data = json.dumps(self._info).encode()
        os.lseek(self.fd, 0, os.SEEK_SET)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, data)


def stop_orphans(pids: list[int], out: Path, grace_s: float) -> list[int]:
    """SIGTERM the live mqinfer processes among ``pids`` that work on ``out``, SIGKILL them after
    ``grace_s``; returns the pids that were signalled."""
    targets = [p for p in pids if p != os.getpid() and _alive(p) and _is_mqinfer(p, out)]
    for pid in targets:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in targets):
        time.sleep(0.1)
    for pid in targets:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return targets
