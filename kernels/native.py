"""The native CPU kernels' loader: builds ``kernels/csrc/*.c`` into one shared library, caches
it, loads it and gives every exported function a ctypes signature.

Owns the compiler flags (``FLAGS``, the one place they are written), the cache of built
libraries, the ctypes mirrors of the C argument records declared in
``csrc/mqinfer_native.h`` (checked field by field against the layouts the library reports, so
a record changed on one side only is an error at load time, not garbage at run time), and the
``auto`` / ``native`` / ``torch`` switches of the kernels' callers.

Build. The system C compiler (``$CC``, else ``cc``, else ``gcc``) compiles every source at
once with ``-O3 -march=native`` and ``-ffp-contract=off``: the compiler never fuses a multiply
and an add on its own, the sources write out every fused multiply-add they use (the header
states the rule; the bit-exact tests depend on it). No ``-ffast-math``: loading a library
built with it turns on flush-to-zero for the whole process. The library lands in the cache
folder (``$MQINFER_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME/mqinfer/kernels``, else
``~/.cache/mqinfer/kernels``) under a name keyed by a hash of the sources, the flags, the
compiler and its version, and the CPU's features (``-march=native`` code runs only on a CPU
with the same ones); a second process finds it there. When there is no compiler or the build
fails, ``load()`` returns None and the callers run their PyTorch paths.

Environment:

``MQINFER_NATIVE_CFLAGS``
    Extra compiler flags, appended to ``FLAGS`` (split like a shell command line). They are
    part of the cache key, so such a build never replaces the normal one. ``.ci/native-checks``
    uses it for ``-Werror`` and for a sanitizer build (``-fsanitize=address,undefined
    -fno-omit-frame-pointer``); a library built with AddressSanitizer only loads into a
    process that has the sanitizer runtime preloaded (``LD_PRELOAD=$(cc
    -print-file-name=libasan.so)``).
``MQINFER_CPU_ATTENTION``, ``MQINFER_CPU_OPS``, ``MQINFER_CPU_LINEAR``, ``MQINFER_CPU_LAYERS``
    The switches of the attention kernel, of the fused ops, of the dense layers and of the
    decoder layers' native loop (workers/engine/models/decoder_chain.py)
    (``switched_library``):
    ``auto`` (default) uses the library when it builds, ``torch`` never uses it, ``native``
    makes a library that cannot be built an error.
``CC``
    The C compiler.

``python -m mqinfer.kernels.native`` builds (or finds) the library, loads it (checking its
records) and prints its path; ``--no-load`` only builds (a sanitizer build cannot be loaded
without its runtime preloaded). It exits with status 1 and the compiler's message when the
build fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
FLAGS = (
    "-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-Wall", "-Wextra",
    "-Werror=implicit-function-declaration",
)
EXTRA_FLAGS_ENV = "MQINFER_NATIVE_CFLAGS"
_MODES = ("auto", "native", "torch")

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


# ------------------------------------------------------------------ argument records
# Mirrors of the records in csrc/mqinfer_native.h, field for field, in order. Tensor data
# goes in as the integer from Tensor.data_ptr().
class AttentionArgs(ctypes.Structure):
    _fields_ = [
        ("q", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("out", _ptr),
        ("block_tables", _ptr), ("seq_of_token", _ptr), ("positions", _ptr),
        ("num_tokens", _i64), ("q_token_stride", _i64), ("num_heads", _i64),
        ("num_kv_heads", _i64), ("head_dim", _i64), ("block_size", _i64),
        ("max_blocks", _i64), ("max_len", _i64), ("scale", _f32), ("is_bf16", _i32),
        ("k_scale", _ptr), ("v_scale", _ptr), ("kv_quant", _i32),
    ]


class ArgmaxArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("out", _ptr), ("rows", _i64), ("cols", _i64), ("row_stride", _i64),
        ("is_bf16", _i32),
    ]


class GumbelArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("keys", _ptr), ("gumbel", _ptr), ("bucket_max", _ptr), ("out", _ptr),
        ("rows", _i64), ("cols", _i64), ("row_stride", _i64),
    ]


class BitmaskArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("bitmask", _ptr), ("rows", _ptr), ("n", _i64), ("cols", _i64), ("row_stride", _i64),
        ("words", _i64), ("is_bf16", _i32),
    ]


class RmsNormArgs(ctypes.Structure):
    _fields_ = [
        ("residual", _ptr), ("delta", _ptr), ("weight", _ptr), ("out", _ptr),
        ("rows", _i64), ("hidden", _i64), ("residual_stride", _i64), ("delta_stride", _i64),
        ("eps", _f32), ("is_bf16", _i32),
    ]


class SiluMulArgs(ctypes.Structure):
    _fields_ = [
        ("gate_up", _ptr), ("out", _ptr), ("rows", _i64), ("inter", _i64), ("stride", _i64),
        ("vector_chunk", _i64), ("is_bf16", _i32),
    ]


class RotaryArgs(ctypes.Structure):
    _fields_ = [
        ("qk", _ptr), ("v", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("cos", _ptr),
        ("sin", _ptr), ("positions", _ptr), ("slots", _ptr), ("rows", _i64),
        ("qk_stride", _i64), ("v_stride", _i64), ("num_q_heads", _i64),
        ("num_kv_heads", _i64), ("head_dim", _i64), ("is_bf16", _i32),
        ("k_scale", _ptr), ("v_scale", _ptr), ("kv_quant", _i32),
    ]


class LinearArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("packed", _ptr), ("bias", _ptr), ("out", _ptr), ("rows", _i64),
        ("in_features", _i64), ("out_features", _i64), ("x_stride", _i64), ("out_stride", _i64),
        ("swiglu", _i64), ("vector_chunk", _i64),
    ]


class QLinearArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("packed", _ptr), ("scales", _ptr), ("bias", _ptr), ("out", _ptr),
        ("scratch", _ptr), ("rows", _i64), ("in_features", _i64), ("out_features", _i64),
        ("x_stride", _i64), ("out_stride", _i64), ("swiglu", _i64), ("vector_chunk", _i64), ("is_bf16", _i64),
    ]


class W8A16Args(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("packed", _ptr), ("scales", _ptr), ("bias", _ptr), ("out", _ptr),
        ("rows", _i64), ("in_features", _i64), ("out_features", _i64), ("x_stride", _i64),
        ("out_stride", _i64), ("swiglu", _i64), ("vector_chunk", _i64),
    ]


class DecoderArgs(ctypes.Structure):
    _fields_ = [
        ("h", _ptr), ("x", _ptr), ("qkv", _ptr), ("attn", _ptr), ("o", _ptr), ("act", _ptr), ("down", _ptr),
        ("final_out", _ptr), ("input_norm", _ptr), ("post_norm", _ptr), ("final_norm", _ptr),
        ("qkv_packed", _ptr), ("qkv_bias", _ptr), ("o_packed", _ptr), ("gate_up_packed", _ptr), ("down_packed", _ptr),
        ("k_cache", _ptr), ("v_cache", _ptr), ("rotary", RotaryArgs), ("attention", AttentionArgs),
        ("num_layers", _i64), ("rows", _i64), ("hidden", _i64), ("q_size", _i64), ("kv_size", _i64),
        ("inter", _i64), ("vector_chunk", _i64), ("norm_threads", _i64), ("rotary_threads", _i64),
        ("eps", _f32),
    ]


class AmxLinearArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("packed", _ptr), ("bias", _ptr), ("out", _ptr), ("rows", _i64),
        ("in_features", _i64), ("out_features", _i64), ("x_stride", _i64), ("out_stride", _i64),
    ]


class AmxSwigluArgs(ctypes.Structure):
    _fields_ = [
        ("x", _ptr), ("packed", _ptr), ("out", _ptr), ("rows", _i64), ("in_features", _i64),
        ("inter", _i64), ("x_stride", _i64), ("out_stride", _i64), ("vector_chunk", _i64),
    ]


# Record -> the name of its layout table in the library (abi.c).
_RECORDS = {
    AttentionArgs: "mqinfer_layout_attention_args",
    ArgmaxArgs: "mqinfer_layout_argmax_args",
    GumbelArgs: "mqinfer_layout_gumbel_args",
    BitmaskArgs: "mqinfer_layout_bitmask_args",
    RmsNormArgs: "mqinfer_layout_rms_norm_args",
    SiluMulArgs: "mqinfer_layout_silu_mul_args",
    RotaryArgs: "mqinfer_layout_rotary_args",
    LinearArgs: "mqinfer_layout_linear_args",
    QLinearArgs: "mqinfer_layout_qlinear_args",
    W8A16Args: "mqinfer_layout_w8a16_args",
    DecoderArgs: "mqinfer_layout_decoder_args",
    AmxLinearArgs: "mqinfer_layout_amx_linear_args",
    AmxSwigluArgs: "mqinfer_layout_amx_swiglu_args",
}

# Exported function -> (result type, argument types).
_SIGNATURES = {
    "mqinfer_paged_attention": (ctypes.c_int, [ctypes.POINTER(AttentionArgs), ctypes.c_int]),
    "mqinfer_attention_selftest": (ctypes.c_int, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr]),
    "mqinfer_attention_use_amx": (ctypes.c_int, [ctypes.c_int]),
    "mqinfer_argmax": (None, [ctypes.POINTER(ArgmaxArgs), ctypes.c_int]),
    "mqinfer_gumbel_argmax": (None, [ctypes.POINTER(GumbelArgs), ctypes.c_int]),
    "mqinfer_apply_bitmask": (None, [ctypes.POINTER(BitmaskArgs), ctypes.c_int]),
    "mqinfer_add_rms_norm": (ctypes.c_int, [ctypes.POINTER(RmsNormArgs), ctypes.c_int]),
    "mqinfer_silu_mul": (None, [ctypes.POINTER(SiluMulArgs), ctypes.c_int]),
    "mqinfer_rotary_store_kv": (ctypes.c_int, [ctypes.POINTER(RotaryArgs), ctypes.c_int]),
    "mqinfer_linear_available": (ctypes.c_int, []),
    "mqinfer_linear_packed_size": (_i64, [_i64, _i64]),
    "mqinfer_linear_pack": (None, [_ptr, _i64, _i64, _ptr]),
    "mqinfer_linear_swiglu_packed_size": (_i64, [_i64, _i64]),
    "mqinfer_linear_pack_swiglu": (None, [_ptr, _i64, _i64, _ptr]),
    "mqinfer_linear": (ctypes.c_int, [ctypes.POINTER(LinearArgs), ctypes.c_int]),
    "mqinfer_qlinear_available": (ctypes.c_int, []),
    "mqinfer_qlinear_takes_bf16": (ctypes.c_int, []),
    "mqinfer_qlinear_packed_size": (_i64, [_i64, _i64, ctypes.c_int]),
    "mqinfer_qlinear_pack": (None, [_ptr, _i64, _i64, ctypes.c_int, _ptr]),
    "mqinfer_qlinear_scratch_size": (_i64, [_i64, _i64]),
    "mqinfer_qlinear": (ctypes.c_int, [ctypes.POINTER(QLinearArgs), ctypes.c_int]),
    "mqinfer_w8a16_available": (ctypes.c_int, []),
    "mqinfer_w8a16_packed_size": (_i64, [_i64, _i64, ctypes.c_int]),
    "mqinfer_w8a16_pack": (None, [_ptr, _i64, _i64, ctypes.c_int, _ptr]),
    "mqinfer_w8a16": (ctypes.c_int, [ctypes.POINTER(W8A16Args), ctypes.c_int]),
    "mqinfer_decoder_layers": (ctypes.c_int, [ctypes.POINTER(DecoderArgs), _i64, _i64, ctypes.c_int]),
    "mqinfer_amx_linear_available": (ctypes.c_int, []),
    "mqinfer_amx_linear_packed_size": (_i64, [_i64, _i64]),
    "mqinfer_amx_linear_pack": (None, [_ptr, _i64, _i64, _ptr]),
    "mqinfer_amx_linear": (ctypes.c_int, [ctypes.POINTER(AmxLinearArgs), ctypes.c_int]),
    "mqinfer_amx_swiglu": (ctypes.c_int, [ctypes.POINTER(AmxSwigluArgs), ctypes.c_int]),
    "mqinfer_amx_qlinear_available": (ctypes.c_int, []),
    "mqinfer_amx_qlinear_packed_size": (_i64, [_i64, _i64, ctypes.c_int]),
    "mqinfer_amx_qlinear_pack": (None, [_ptr, _i64, _i64, ctypes.c_int, _ptr]),
    "mqinfer_amx_qlinear_scratch_size": (_i64, [_i64, _i64]),
    "mqinfer_amx_qlinear": (ctypes.c_int, [ctypes.POINTER(QLinearArgs), ctypes.c_int]),
    "mqinfer_pool_starts": (_i64, []),
    "mqinfer_pool_workers": (ctypes.c_int, []),
}


# ------------------------------------------------------------------ build and cache
def cache_dir() -> Path:
    explicit = os.environ.get("MQINFER_CACHE_DIR")
    if explicit:
        return Path(explicit) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mqinfer" / "kernels"


def build_flags() -> tuple[str, ...]:
    """``FLAGS`` plus the ones ``$MQINFER_NATIVE_CFLAGS`` adds."""
    return FLAGS + tuple(shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    return compiler


def _compiler_version(compiler: str) -> str:
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise RuntimeError(f"cannot run the C compiler {compiler!r}: {exc}") from exc
    return result.stdout


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"


def _sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def library_path(flags: tuple[str, ...] | None = None) -> Path:
    """Where the library built with ``flags`` (default ``build_flags()``) is cached: the name
    is keyed by the sources, the flags, the compiler and its version, and the CPU."""
    flags = build_flags() if flags is None else flags
    compiler = _compiler()
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".c", ".h"):
            digest.update(f"{path.name}\0".encode() + path.read_bytes() + b"\0")
    for part in (" ".join(flags), compiler, _compiler_version(compiler), _cpu_signature()):
        digest.update(part.encode() + b"\0")
    return cache_dir() / f"mqinfer_native_{digest.hexdigest()[:16]}.so"


def build(flags: tuple[str, ...] | None = None) -> Path:
    """Compile the sources (unless the cache has them) and return the library's path.

    Raises RuntimeError with the compiler's message when there is no compiler or it fails."""
    flags = build_flags() if flags is None else flags
    library = library_path(flags)
    if library.exists():
        return library
    folder = library.parent
    folder.mkdir(parents=True, exist_ok=True)
    # One process builds; the others (workers of one machine starting together) wait for it and
    # load its library, instead of each compiling a copy at once on the same cores.
    with _build_lock(library.with_suffix(".lock")):
        if not library.exists():
            _compile_library(library, flags)
    return library


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` between processes (none where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile_library(library: Path, flags: tuple[str, ...]) -> None:
    """Compile the sources into ``library`` (written to a temporary name, then renamed)."""
    compiler = _compiler()
    sources = _sources()
    if not sources:
        raise RuntimeError(f"no C sources in {CSRC}")
    folder = library.parent
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / library.name
        # Each source to an object file, as many at once as there are cores (the attention
        # kernels take most of the time), then one link.
        objects = [Path(tmp) / f"{source.stem}.o" for source in sources]
        compile_flags = [f for f in flags if f != "-shared"]
        commands = [[compiler, *compile_flags, "-I", str(CSRC), "-c", str(source), "-o", str(obj)]
                    for source, obj in zip(sources, objects)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(commands), os.cpu_count() or 1))) as pool:
            for result in pool.map(_compile, commands):
                if result:
                    raise RuntimeError(result)
        error = _compile([compiler, *flags, "-o", str(built), *map(str, objects), "-lm", "-lpthread"])
        if error:
            raise RuntimeError(error)
        os.replace(built, library)  # atomic: readers see the whole library or none


def _compile(command: list[str]) -> str | None:
    """Runs one compiler command: None, or what went wrong."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{command[0]} could not run: {exc}"
    if result.returncode != 0:
        return f"{command[0]} failed: {result.stderr.strip()[-4000:]}"
    return None


def _check_layouts(lib: ctypes.CDLL) -> None:
    for record, table in _RECORDS.items():
        fields = [name for name, _ in record._fields_]
        header = (ctypes.c_int64 * 2).in_dll(lib, table)
        reported = list((ctypes.c_int64 * (2 + 2 * header[1])).in_dll(lib, table))
        expected = [ctypes.sizeof(record), len(fields)]
        for f in fields:
            expected += [getattr(record, f).offset, getattr(record, f).size]
        if reported != expected:
            raise RuntimeError(
                f"{record.__name__} does not match its C record ({table}: size, fields, then "
                f"offset and size of each: {reported} in the library, {expected} in Python)"
            )


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    _check_layouts(lib)
    return lib


_lock = threading.Lock()
_state: dict[str, object] = {}


def load() -> ctypes.CDLL | None:
    """The library, built and loaded on first call; None when it cannot be (the reason is
    logged once and kept for ``build_error``)."""
    lib = _state.get("lib", False)
    if lib is not False:
        return lib  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _open(build())
            except (OSError, RuntimeError) as exc:
                _state["lib"] = None
                _state["error"] = str(exc)
                log.warning("native CPU kernels unavailable, using the PyTorch paths: %s", exc)
        return _state["lib"]  # type: ignore[return-value]


def build_error() -> str | None:
    """Why ``load()`` returned None (None when it has not, or has not been called)."""
    return _state.get("error")  # type: ignore[return-value]


# While a forward pass runs (``switches_held``): each switch's value as first read in it.
_held: dict[str, str] | None = None


@contextlib.contextmanager
def switches_held() -> Iterator[None]:
    """Within, each kernel switch is read from the environment once, at its first use: a forward
    pass asks the switches a few hundred times per step, and each read of ``os.environ`` costs
    about a microsecond. Nested uses share the outer one's values."""
    global _held
    if _held is not None:
        yield
        return
    _held = {}
    try:
        yield
    finally:
        _held = None


def switch_mode(variable: str) -> str:
    """The value of a kernel switch (``auto`` when unset); a bad value is a ValueError."""
    held = _held
    if held is not None:
        mode = held.get(variable)
        if mode is not None:
            return mode
    mode = os.environ.get(variable, "auto")
    if mode not in _MODES:
        raise ValueError(f"{variable} must be auto, native or torch, got {mode!r}")
    if held is not None:
        held[variable] = mode
    return mode


def switched_library(variable: str) -> ctypes.CDLL | None:
    """The library for a caller whose switch is ``variable``: None when the switch says
    ``torch`` or the library cannot be built; with ``native``, a library that cannot be built
    is a RuntimeError."""
    mode = switch_mode(variable)
    if mode == "torch":
        return None
    lib = load()
    if lib is None and mode == "native":
        raise RuntimeError(
            f"{variable}=native but the native CPU kernels could not be built: {build_error()}"
        )
    return lib


def pool_starts() -> int:
    """How many times this process's kernel thread pool has (re)started its workers."""
    lib = load()
    return 0 if lib is None else int(lib.mqinfer_pool_starts())


def pool_workers() -> int:
    """Worker threads the pool holds now (the calling thread is not counted)."""
    lib = load()
    return 0 if lib is None else int(lib.mqinfer_pool_workers())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--no-load"]):
        print("usage: python -m mqinfer.kernels.native [--no-load]", file=sys.stderr)
        return 2
    try:
        path = build()
        if not args:
            _open(path)
    except (OSError, RuntimeError) as exc:
        print(f"native CPU kernels: build failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
