"""Where KV tier blobs live: host memory and a directory, behind one small interface.

A store maps a key (32 bytes: the model identity, which names the prefix cache scope too, and the
block's chained hash, which starts from the request's cache partition) to a blob
(``workers/engine/kv_codec.py``): ``put``, ``get``, ``contains``, ``discard``. Each has a size limit in
bytes and evicts least recently used first; each counts what it does in a :class:`StoreStats`
(read by the metrics thread: plain numbers only).

``HostStore``: an ordered dict in this process's memory.

``DirectoryStore``: one file per block, ``<key hex>.kv``, in a directory that several worker
processes share (the workers of one machine, or of several machines on shared storage) and that
outlives them. Writes are atomic (a temporary file in the same directory, then a rename), so a
reader sees a whole blob or none; a blob torn some other way fails its checksum. Recency is the
file's modification time, which a hit refreshes; a store that finds the directory over its limit
(its own writes counted as it goes, everyone's by a rescan now and then) deletes the oldest files.
The directory must be safe to trust: one that is a symlink, not owned by this user, or writable by
others is refused at start (``UnsafeDirectory``), and every file is opened without following
links and used only if it is a regular file of this user. A failed write (a full disk) is counted
and dropped: the tier is a cache, and the worker goes on.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from mqinfer.schemas import faults

SUFFIX = ".kv"
_TEMP_PREFIX = ".tmp-"
# A temporary file this old is left over from a writer that died: removed by the next rescan.
_STALE_TEMP_S = 600.0
# After eviction the directory is brought down to this share of its limit, so that eviction runs
# once per many writes rather than once per write.
_LOW_WATER = 0.9
_RESCAN_S = 30.0


class UnsafeDirectory(ValueError):
    """A tier directory that others could tamper with; the message says why."""


@dataclass
class StoreStats:
    """Counters of one tier (blocks and bytes), for the metrics and the benchmark."""

    hits: int = 0
    misses: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    read_bytes: int = 0
    written_bytes: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    evicted: int = 0
    write_errors: int = 0
    stored_bytes: int = 0
    stored_blocks: int = 0
    # Prompt tokens whose KV this tier served (counted by the tiers, per request admitted).
    prefix_tokens: int = 0

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


class HostStore:
    """Blobs in this process's memory, at most ``max_bytes``, least recently used evicted first."""

    kind = "host"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a host KV tier needs a positive size, got {max_bytes} bytes")
        self.max_bytes = int(max_bytes)
        self.stats = StoreStats()
        self._blobs: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, key: bytes) -> bool:
        return key in self._blobs

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._blobs.move_to_end(key)
        return blob

    def put(self, key: bytes, blob: bytes) -> bool:
        if len(blob) > self.max_bytes:
            return False
        with self._lock:
            old = self._blobs.pop(key, None)
            if old is not None:
                self.stats.stored_bytes -= len(old)
            self._blobs[key] = blob
            self.stats.stored_bytes += len(blob)
            self.stats.written_bytes += len(blob)
            while self.stats.stored_bytes > self.max_bytes:
                _, dropped = self._blobs.popitem(last=False)
                self.stats.stored_bytes -= len(dropped)
                self.stats.evicted += 1
            self.stats.stored_blocks = len(self._blobs)
        return True

    def discard(self, key: bytes) -> None:
        with self._lock:
            blob = self._blobs.pop(key, None)
            if blob is not None:
                self.stats.stored_bytes -= len(blob)
                self.stats.stored_blocks = len(self._blobs)

    def close(self) -> None:
        pass


def check_directory(path: str | os.PathLike) -> str:
    """``path`` made absolute, created (mode 0700) if missing; ``UnsafeDirectory`` when it is a
    symlink, not a directory, not this user's, or writable by others."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirectory(f"KV tier directory {path} is a symbolic link; give the real directory")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"KV tier directory {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(f"KV tier directory {path} belongs to uid {st.st_uid}, not to this user "
                              f"(uid {os.geteuid()}): its blocks could have been written by someone else")
    if st.st_mode & stat.S_IWOTH:
        raise UnsafeDirectory(f"KV tier directory {path} is writable by every user (mode "
                              f"{stat.S_IMODE(st.st_mode):o}); make it 0700 or 0750")
    return path


class DirectoryStore:
    """Blobs as files in a directory shared by processes (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, max_bytes: int, kind: str = "disk",
                 clock=time.monotonic) -> None:
        if max_bytes < 1:
            raise ValueError(f"a KV tier directory needs a positive size, got {max_bytes} bytes")
        self.kind = kind
        self.path = check_directory(path)
        self.max_bytes = int(max_bytes)
        self.stats = StoreStats()
        self.clock = clock
        flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0)
        self._dir = os.open(self.path, flags)
        st, lst = os.fstat(self._dir), os.lstat(self.path)
        if (st.st_dev, st.st_ino) != (lst.st_dev, lst.st_ino):
            os.close(self._dir)
            raise UnsafeDirectory(f"KV tier directory {self.path} changed while it was opened")
        self._lock = threading.Lock()
        self._last_scan = float("-inf")
        self._rescan()

    @staticmethod
    def _name(key: bytes) -> str:
        return key.hex() + SUFFIX

    def contains(self, key: bytes) -> bool:
        try:
            st = os.stat(self._name(key), dir_fd=self._dir, follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    def get(self, key: bytes) -> bytes | None:
        """The blob, or None (missing, or not a regular file of this user: counted as rejected)."""
        name = self._name(key)
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=self._dir)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                self.stats.reject("foreign")
                return None
            chunks, size = [], st.st_size
            while size > 0:
                chunk = os.read(fd, size)
                if not chunk:
                    break
                chunks.append(chunk)
                size -= len(chunk)
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            os.utime(name, dir_fd=self._dir, follow_symlinks=False)  # recently used
        except OSError:
            pass
        return b"".join(chunks)

    def put(self, key: bytes, blob: bytes) -> bool:
        """Write the blob unless the file is there already; False when the write failed."""
        name = self._name(key)
        if self.contains(key):
            try:
                os.utime(name, dir_fd=self._dir, follow_symlinks=False)
            except OSError:
                pass
            return True
        temp = f"{_TEMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(temp, flags, 0o600, dir_fd=self._dir)
            try:
                view = memoryview(blob)
                while view:
                    faults.hit("kv_tier.disk_write")
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(temp, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError:
            self.stats.write_errors += 1
            try:
                os.unlink(temp, dir_fd=self._dir)
            except OSError:
                pass
            return False
        with self._lock:
            self.stats.written_bytes += len(blob)
            self.stats.stored_bytes += len(blob)
            self.stats.stored_blocks += 1
            over = self.stats.stored_bytes > self.max_bytes
        if over or self.clock() - self._last_scan > _RESCAN_S:
            self._rescan()
        return True

    def discard(self, key: bytes) -> None:
        try:
            os.unlink(self._name(key), dir_fd=self._dir)
        except OSError:
            pass

    def _rescan(self) -> None:
        """Count the directory's blocks (every writer's), drop stale temporary files, and evict the
        least recently used blocks down to the low-water mark when over the limit."""
        now_wall = time.time()
        entries = []
        total = 0
        with os.scandir(self._dir) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.startswith(_TEMP_PREFIX):
                    if now_wall - st.st_mtime > _STALE_TEMP_S:
                        self._unlink(entry.name)
                    continue
                if not entry.name.endswith(SUFFIX) or not stat.S_ISREG(st.st_mode):
                    continue
                entries.append((st.st_mtime, st.st_size, entry.name))
                total += st.st_size
        kept = len(entries)
        if total > self.max_bytes:
            entries.sort()
            target = self.max_bytes * _LOW_WATER
            for _, size, name in entries:
                if total <= target:
                    break
                if self._unlink(name):
                    total -= size
                    kept -= 1
                    self.stats.evicted += 1
        with self._lock:
            self.stats.stored_bytes = total
            self.stats.stored_blocks = kept
        self._last_scan = self.clock()

    def _unlink(self, name: str) -> bool:
        try:
            os.unlink(name, dir_fd=self._dir)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1


__all__ = ["DirectoryStore", "HostStore", "StoreStats", "UnsafeDirectory", "check_directory"]
