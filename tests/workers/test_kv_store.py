"""The KV tiers' stores: size limits with least-recently-used eviction, atomic files shared by two
processes' stores, a full disk that only costs the write, and directories that are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mqinfer.workers.engine.kv_store import DirectoryStore, HostStore, UnsafeDirectory, check_directory


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_host_store_evicts_least_recently_used_by_bytes():
    store = HostStore(max_bytes=300)
    for i in range(3):
        assert store.put(key(i), bytes([i]) * 100)
    assert store.get(key(0)) == b"\x00" * 100  # 0 is now the most recently used
    store.put(key(3), b"\x03" * 100)
    assert not store.contains(key(1)) and all(store.contains(key(i)) for i in (0, 2, 3))
    assert store.stats.evicted == 1 and store.stats.stored_bytes == 300 and store.stats.stored_blocks == 3
    assert not store.put(key(9), b"x" * 301)  # larger than the whole tier
    store.discard(key(0))
    assert store.get(key(0)) is None and store.stats.stored_bytes == 200


def test_directory_store_writes_whole_files_and_evicts_the_oldest(tmp_path):
    store = DirectoryStore(tmp_path / "kv", max_bytes=1000)
    assert oct(os.stat(tmp_path / "kv").st_mode & 0o777) == "0o700"
    for i in range(5):
        assert store.put(key(i), bytes([i]) * 150)
        # Distinct modification times, oldest first (key 0 is touched again below).
        os.utime(tmp_path / "kv" / f"{key(i).hex()}.kv", (1000 + i, 1000 + i))
    assert store.get(key(0)) == b"\x00" * 150  # a hit makes it the most recent
    for i in range(5, 9):
        store.put(key(i), bytes([i]) * 150)
    names = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert all(n.endswith(".kv") for n in names), names  # no temporary file left behind
    assert sum(p.stat().st_size for p in (tmp_path / "kv").iterdir()) <= 1000
    assert store.contains(key(0)), "the block read last must outlive older ones"
    assert not store.contains(key(1)) and store.stats.evicted >= 2
    # A second store on the same directory (another worker, or the same one after a restart) sees it.
    other = DirectoryStore(tmp_path / "kv", max_bytes=1000)
    assert other.get(key(8)) == b"\x08" * 150
    assert other.stats.stored_blocks == store.stats.stored_blocks


def test_two_processes_writing_the_same_blocks_never_leave_a_torn_file(tmp_path):
    folder = tmp_path / "kv"
    DirectoryStore(folder, max_bytes=1 << 30)
    script = (
        "import sys; from mqinfer.workers.engine.kv_store import DirectoryStore\n"
        "s = DirectoryStore(sys.argv[1], 1 << 30)\n"
        "for round in range(20):\n"
        "    for i in range(30):\n"
        "        s.discard(i.to_bytes(32, 'big')) if round % 2 else None\n"
        "        s.put(i.to_bytes(32, 'big'), bytes([i]) * 50_000)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(folder)]) for _ in range(2)]
    reader = DirectoryStore(folder, max_bytes=1 << 30)
    while any(p.poll() is None for p in procs):
        for i in range(30):
            blob = reader.get(key(i))
            assert blob is None or blob == bytes([i]) * 50_000
    assert [p.returncode for p in procs] == [0, 0]


def test_a_full_disk_costs_the_write_only(tmp_path, monkeypatch):
    script = (
        "import sys; from mqinfer.workers.engine.kv_store import DirectoryStore\n"
        "s = DirectoryStore(sys.argv[1], 1 << 20)\n"
        "ok = [s.put(i.to_bytes(32, 'big'), b'x' * 1000) for i in range(5)]\n"
        "print(ok, s.stats.write_errors, len(list(__import__('os').scandir(sys.argv[1]))))\n"
    )
    env = dict(os.environ, MQINFER_FAULTS="kv_tier.disk_write=enospc@*")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "kv")], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["[False,", "False,", "False,", "False,", "False]", "5", "0"]


def test_unsafe_directories_are_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        DirectoryStore(link, 1000)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeDirectory, match="writable by every user"):
        check_directory(open_dir)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UnsafeDirectory, match="not a directory"):
        check_directory(afile)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, -1)
        with pytest.raises(UnsafeDirectory, match="belongs to uid 4242"):
            check_directory(theirs)


def test_a_planted_symlink_or_foreign_file_is_never_read(tmp_path):
    store = DirectoryStore(tmp_path / "kv", max_bytes=1 << 20)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a KV block")
    (tmp_path / "kv" / f"{key(1).hex()}.kv").symlink_to(secret)
    assert not store.contains(key(1)) and store.get(key(1)) is None
    if os.geteuid() == 0:
        planted = tmp_path / "kv" / f"{key(2).hex()}.kv"
        planted.write_bytes(b"planted")
        os.chown(planted, 4242, -1)
        assert store.get(key(2)) is None and store.stats.rejected == {"foreign": 1}


def test_stale_temporary_files_are_cleaned_up(tmp_path):
    folder = tmp_path / "kv"
    DirectoryStore(folder, max_bytes=1 << 20)
    stale = folder / ".tmp-1-abc"
    stale.write_bytes(b"half a block")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = folder / ".tmp-2-def"
    fresh.write_bytes(b"being written")
    DirectoryStore(folder, max_bytes=1 << 20)
    assert not stale.exists() and fresh.exists()
