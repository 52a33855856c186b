"""Shared fixtures: a real embedded Redis-compatible server for the whole session."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

from mqinfer.server import EmbeddedServer

# Compiled bytecode is cached, even where the environment turns that off (PYTHONDONTWRITEBYTECODE):
# the test modules as pytest rewrites their asserts (each test process rewrites every one of them
# at collection otherwise: 8 s of CPU per process on 2 cores, under 3 s from the cache) and the
# package's modules, which each worker process the tests start would otherwise compile again.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _lean_test_process() -> None:
    """What `mqinfer` sets for its own processes, set here for the test processes, which run torch
    beside each other on the same cores: PyTorch's OpenMP workers sleep soon after each parallel
    region instead of spinning on a core another test process needs (mqinfer.procs.short_openmp_spin;
    the kernel tests run two threads). And glibc keeps the memory that tests' large tensors free
    for their next ones instead of giving it back to the kernel and faulting it in again."""
    from mqinfer.procs import short_openmp_spin

    short_openmp_spin()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None)
            libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB come from the heap
            libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        except (OSError, AttributeError):  # not glibc: its defaults
            pass


_lean_test_process()


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject.toml): one test process per core, plus two. Many tests spend part of
    their time waiting on worker subprocesses and sockets; the extra processes keep the cores busy
    meanwhile (on 2 cores, the whole suite: 5m49s-5m58s with four processes against 6m08s-6m19s
    with three, for 2% more CPU). ``--maxprocesses`` still caps it, and
    PYTEST_XDIST_AUTO_NUM_WORKERS still sets it."""
    from mqinfer.layout import usable_cores

    explicit = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    return int(explicit) if explicit else usable_cores() + 2


def pytest_configure(config):
    """One warm template (mqinfer.warm_start) for the whole session, which the runs, benches and
    parallel workers the tests start fork their workers and ranks from, instead of each run
    importing the engine once more in a template of its own; and one test zygote
    (tests/zygote.py). The xdist controller starts both before the test processes, which inherit
    their paths (each importing the engine in a template and a zygote of its own cost about 5 s of
    CPU more per process). Off, like the test zygote, with MQINFER_TEST_NO_ZYGOTE=1."""
    from mqinfer.warm_start import SHARED
    from tests import zygote

    if hasattr(config, "workerinput") and os.environ.get(SHARED):
        return  # a test process of xdist's: the controller's template serves it
    if not zygote.enabled():
        return
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # Likewise the test zygote (tests/zygote.py), which a single test process starts at its
        # first command.
        zygote.start_shared()
    import atexit
    import signal
    import subprocess
    import tempfile

    from mqinfer.procs import mqinfer_command, with_death_signal
    from mqinfer.warm_start import ARGV_ROOM

    folder = tempfile.mkdtemp(prefix="mqinfer-template-")
    path = os.path.join(folder, "socket")
    argv, preexec = with_death_signal(
        # --tiny: the runs the tests start load the built-in tiny model, made once in the template.
        [*mqinfer_command()[:-1], "mqinfer.warm_template", "--tiny", "--listen", path, "." * ARGV_ROOM],
        signal.SIGKILL)
    template = subprocess.Popen(argv, stdin=subprocess.DEVNULL, preexec_fn=preexec)
    os.environ[SHARED] = path

    def stop() -> None:
        template.terminate()
        try:
            template.wait(timeout=10)
        except subprocess.TimeoutExpired:
            template.kill()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Build the native CPU kernels (or find them in their cache) once, before the test processes
    start. Each process that finds no library for the current sources compiles its own copy (a
    minute of CPU on two cores): every test process would, at collection, and every worker they
    start meanwhile. The xdist controller runs this before it starts its processes."""
    if hasattr(session.config, "workerinput"):
        return
    from mqinfer.kernels import native

    try:
        native.build()
    except (OSError, RuntimeError):
        pass  # no compiler, or the build fails: native.load() says why where a test needs it
    if getattr(session.config.option, "numprocesses", None):
        _rewrite_test_modules(session.config)


def _rewrite_test_modules(config) -> None:
    """The test modules with their asserts rewritten, compiled once into pytest's bytecode cache
    before the test processes start. In a fresh checkout each test process would otherwise rewrite
    every one of them itself, at the same time as the others: 8.6 s of CPU per process (15.5 s to
    collect against 6.9 s from the cache). A module whose cached file is at least as new as its
    source is left alone, and each process still checks every file it loads against its source,
    so nothing stale is run. This reads pytest's own rewriter; should that ever change, the test
    processes rewrite the modules themselves, as before."""
    try:
        from _pytest.assertion import rewrite
    except ImportError:
        return
    needed = ("assertstate_key", "PYC_TAIL", "_rewrite_test", "_write_pyc", "get_cache_dir", "try_makedirs")
    if not all(hasattr(rewrite, name) for name in needed) or sys.dont_write_bytecode:
        return
    state = config.stash.get(rewrite.assertstate_key, None)
    if state is None:  # assertion rewriting is off (--assert=plain)
        return
    patterns = config.getini("python_files")
    # The files and folders this run collects (its arguments, or testpaths without any).
    here = config.invocation_params.dir
    paths = set()
    for arg in config.args:
        target = here / arg.split("::")[0]
        paths.update(target.rglob("*.py") if target.is_dir() else [target] if target.suffix == ".py" else [])
    for path in sorted(paths):
        if path.name != "conftest.py" and not any(path.match(pattern) for pattern in patterns):
            continue
        cache = rewrite.get_cache_dir(path)
        pyc = cache / (path.name[:-3] + rewrite.PYC_TAIL)
        try:
            if pyc.stat().st_mtime >= path.stat().st_mtime:
                continue
        except OSError:
            pass
        try:
            source_hash, code = rewrite._rewrite_test(path, config)
        except (OSError, SyntaxError):
            continue  # its test process reports it, as it would have
        if rewrite.try_makedirs(cache):
            rewrite._write_pyc(state, code, source_hash, pyc)


_KERNEL_TESTS = Path(__file__).parent / "kernels"
_torch_default_threads: list[int] = []


def pytest_collection_finish(session):
    """The imported modules and the collected tests (a couple of hundred thousand objects that
    live until the session ends) out of the garbage collector's reach: its full collections then
    walk only what the tests make (measured on three test files: 8.9 s of collections to 4.9 s)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test process runs torch on one thread, as the worker subprocesses the tests start do.
    Test processes share the cores with each other and with those workers; with torch's default
    (a thread per core) each small operation of a test's model or reference code waits for
    threads that another process holds, which made such tests many times slower on two cores.

    The kernel tests keep torch's default: the native kernels split their work over
    ``torch.get_num_threads()`` threads, and those tests check the kernels as they run. A test
    that needs another number of threads sets it itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if not _torch_default_threads:
        _torch_default_threads.append(torch.get_num_threads())
    in_kernels = _KERNEL_TESTS in Path(str(item.path)).parents
    torch.set_num_threads(_torch_default_threads[0] if in_kernels else 1)


@pytest.fixture(scope="session", autouse=True)
def prepared_models_in_a_session_folder(tmp_path_factory):
    """Models that engines prepare and keep for their next start (workers/engine/prepared.py) go to this
    test session's own folder, not the user's cache (worker subprocesses inherit the setting)."""
    os.environ.setdefault("MQINFER_PREPARED_CACHE_DIR", str(tmp_path_factory.mktemp("prepared")))
    yield


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = EmbeddedServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The server's URL, emptied for this test."""
    client = redis_server.client()
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture
def redis_client(redis_url, redis_server):
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def s3(monkeypatch):
    """An S3-compatible server (moto's) on a free port, with a bucket ``fleet`` and the AWS
    variables set for it in this process (and the processes it starts): (its endpoint, a pyarrow
    filesystem on it)."""
    pytest.importorskip("moto", reason="moto is not installed (pip install 'moto[server]')")
    from moto.server import ThreadedMotoServer
    from pyarrow import fs

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                            ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true")):
            monkeypatch.setenv(name, value)
        endpoint = f"{host}:{port}"
        filesystem = fs.S3FileSystem(access_key="test", secret_key="test", region="us-east-1", scheme="http",
                                     endpoint_override=endpoint, allow_bucket_creation=True)
        filesystem.create_dir("fleet")
        yield endpoint, filesystem
    finally:
        server.stop()
