"""Where a CPU forward pass spends its time, op by op: the model's native kernels timed one call
at a time while the engine runs (``python -m mqinfer.loadgen.profile_engine --ops``).

torch.profiler cannot see inside the native kernels (ctypes calls appear as the time of the step
itself), so this wraps the functions the model calls (the dense layers by their weight's role,
natively on AMX tiles or vector kernels or through PyTorch's matmul, SwiGLU, rotary + KV store,
attention, residual + RMSNorm) with a clock, for one run, and puts them back afterwards. Dense
layers also report their multiply-add rate, to set against the machine's matmul rate at large
sizes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Iterator

# The switch of the one-call native layer loop (workers/engine/models/decoder_chain.py).
LAYERS_SWITCH = "MQINFER_CPU_LAYERS"


class OpTimes:
    """Each op's wall seconds and the process's CPU seconds, all its threads (on a shared machine
    the second holds still where the first grows with other processes' load; with several model
    threads, CPU over wall seconds says how many of them the op kept busy)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.flops: dict[str, float] = defaultdict(float)
        # Bytes a bandwidth-bound op must move; rows and the weight's (K, N) of a dense op (for
        # their roofs: loadgen/op_roofs.py).
        self.bytes: dict[str, float] = defaultdict(float)
        self.rows: dict[str, int] = defaultdict(int)
        self.rows_squared: dict[str, int] = defaultdict(int)  # for the FLOP-weighted mean of rows
        self.shapes: dict[str, tuple[int, int]] = {}

    def add(self, name: str, seconds: float, flops: float = 0.0, cpu_seconds: float = 0.0, nbytes: float = 0.0,
            shape: tuple[int, int, int] | None = None) -> None:
        """``shape``: a dense op's (rows, K, N)."""
        self.seconds[name] += seconds
        self.cpu_seconds[name] += cpu_seconds
        self.calls[name] += 1
        self.flops[name] += flops
        self.bytes[name] += nbytes
        if shape is not None:
            self.rows[name] += shape[0]
            self.rows_squared[name] += shape[0] * shape[0]
            self.shapes[name] = shape[1:]

    def table(self, forward_s: float) -> str:
        """Ops by wall time, with their share of the forward pass; GFLOP/s over CPU time."""
        lines = [f"{'op':<30} {'calls':>7} {'seconds':>9} {'of forward':>10} {'CPU s':>8} {'GFLOP/s':>8}",
                 "-" * 77]
        for name in sorted(self.seconds, key=self.seconds.get, reverse=True):
            s, cpu = self.seconds[name], self.cpu_seconds[name]
            rate = f"{self.flops[name] / cpu / 1e9:8.1f}" if self.flops[name] and cpu > 0 else f"{'':>8}"
            lines.append(f"{name:<30} {self.calls[name]:>7} {s:>9.3f} {s / forward_s:>10.1%} {cpu:>8.3f} {rate}")
        rest = forward_s - sum(self.seconds.values())
        lines.append(f"{'everything else':<30} {'':>7} {rest:>9.3f} {rest / forward_s:>10.1%}")
        return "\n".join(lines)


def _timed(times: OpTimes, name, fn, flops=None, native: dict | None = None, nbytes=None, shape=None):
    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        label = name(*args) if callable(name) else name
        times.add(label, wall, flops(*args) if flops else 0.0, cpu, nbytes(*args) if nbytes else 0.0,
                  shape(*args) if shape else None)
        if native is not None:
            native["ran"] = True
        return out
    return wrapper


def _timed_module(times: OpTimes, roles: dict[int, str], fn, native: dict):
    """A dense module's ``forward`` (``Linear``, ``LMHead``) clocked as ``dense <role> (torch)``
    when it ran PyTorch's matmul: a call that went to a native kernel is clocked by that kernel's
    wrapper instead (``native["ran"]``), and not twice."""
    def forward(module, x, *args, **kwargs):
        native["ran"] = False
        t, c = time.perf_counter(), time.process_time()
        out = fn(module, x, *args, **kwargs)
        if not native["ran"]:
            rows, (out_features, in_features) = x.shape[0], module.weight.shape
            times.add(f"dense {roles.get(id(module.weight), '?')} (torch)", time.perf_counter() - t,
                      2.0 * rows * in_features * out_features, time.process_time() - c,
                      shape=(rows, in_features, out_features))
        return out
    return forward


# What each op's roof needs (loadgen/op_roofs.py): a dense op's (rows, K, N), the bytes a
# bandwidth-bound op must move.
def _linear_shape(x, packed, *_):
    return x.shape[0], packed.in_features, packed.out_features


def _swiglu_shape(x, packed, *_):  # gate and up: twice the output columns
    return x.shape[0], packed.in_features, 2 * packed.out_features


def _attention_bytes(q, k_cache, v_cache, metadata, *_):
    # Every key and value of every sequence's context once, the queries read, the output written.
    per_token = k_cache[0].numel() * k_cache.element_size() // metadata.block_size
    return 2.0 * int(metadata.seq_lens.sum()) * per_token + 2.0 * q.numel() * q.element_size()


def _rotary_bytes(qk, v, *_):  # q and k read and written (q in place, k to the cache), v copied
    return 2.0 * (qk.numel() * qk.element_size() + v.numel() * v.element_size())


def _norm_bytes(residual, delta, *_):  # residual (and delta) read, the sum and the normalised rows written
    reads = residual.numel() * (2 if delta is not None else 1)
    return (reads + 2 * residual.numel()) * residual.element_size()


def _silu_bytes(gate_up, *_):  # [T, 2I] read, [T, I] written
    return 1.5 * gate_up.numel() * gate_up.element_size()


@contextlib.contextmanager
def timing_ops(model) -> Iterator[OpTimes]:
    """Clock the model's kernels until the block ends (then the originals are restored).

    While the block runs, the decoder layers run one kernel call at a time from Python
    (``MQINFER_CPU_LAYERS=torch``): the one-call native layer loop that a bfloat16 step takes on
    an AMX CPU (workers/engine/models/decoder_chain.py) calls the same kernels from C, where no
    clock here can see them, and its time would all count as outside the ops."""
    from mqinfer.kernels import cpu_ops
    from mqinfer.kernels import linear as dense
    from mqinfer.kernels import linear_amx as amx
    from mqinfer.kernels import linear_onednn as onednn
    from mqinfer.kernels import linear_int8 as q8
    from mqinfer.kernels import linear_w8a16 as w16
    from mqinfer.workers.engine.models.layers import Linear, LMHead
    from mqinfer.workers.engine.models.llama import Attention
    from mqinfer.workers.engine.models.quant import Int8Linear

    roles: dict[int, str] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (Linear, LMHead)):
            roles[id(module.weight)] = module_name.rsplit(".", 1)[-1]
        elif isinstance(module, Int8Linear):
            roles[id(module.qweight)] = module_name.rsplit(".", 1)[-1] + " (int8)"

    def linear_name(x, packed, *_):
        return f"dense {roles.get(id(packed.source), '?')}"

    def amx_name(x, packed, *_):
        return f"dense {roles.get(id(packed.source), '?')} (AMX)"

    def onednn_name(x, packed, *_):
        return f"dense {roles.get(id(packed.source), '?')} (oneDNN)"

    def linear_flops(x, packed, *_):
        return 2.0 * x.shape[0] * packed.in_features * packed.out_features

    def swiglu_flops(x, packed, *_):
        return 4.0 * x.shape[0] * packed.in_features * packed.out_features

    times = OpTimes()
    native = {"ran": False}
    saved = [(dense, "linear", dense.linear), (dense, "swiglu", dense.swiglu),
             (q8, "linear", q8.linear), (q8, "swiglu", q8.swiglu),
             (w16, "linear", w16.linear), (w16, "swiglu", w16.swiglu), (amx, "linear", amx.linear),
             (amx, "swiglu", amx.swiglu), (onednn, "linear", onednn.linear),
             (cpu_ops, "rotary_store_kv", cpu_ops.rotary_store_kv), (cpu_ops, "add_rms_norm", cpu_ops.add_rms_norm),
             (cpu_ops, "silu_mul", cpu_ops.silu_mul), (Linear, "forward", Linear.forward),
             (LMHead, "forward", LMHead.forward)]
    attentions = [(m, m.paged_attention) for m in model.modules() if isinstance(m, Attention)]
    dense.linear = _timed(times, linear_name, dense.linear, linear_flops, native, shape=_linear_shape)
    dense.swiglu = _timed(times, "dense gate_up + SwiGLU", dense.swiglu, swiglu_flops, native, shape=_swiglu_shape)
    q8.linear = _timed(times, linear_name, q8.linear, linear_flops, native, shape=_linear_shape)
    q8.swiglu = _timed(times, "dense gate_up + SwiGLU (int8)", q8.swiglu, swiglu_flops, native, shape=_swiglu_shape)
    w16.linear = _timed(times, linear_name, w16.linear, linear_flops, native, shape=_linear_shape)
    w16.swiglu = _timed(times, "dense gate_up + SwiGLU (int8)", w16.swiglu, swiglu_flops, native, shape=_swiglu_shape)
    amx.linear = _timed(times, amx_name, amx.linear, linear_flops, native, shape=_linear_shape)
    # The AMX kernel's SwiGLU weight is the whole [2 * I, K] gate/up projection.
    amx.swiglu = _timed(times, "dense gate_up + SwiGLU (AMX)", amx.swiglu, linear_flops, native, shape=_linear_shape)
    onednn.linear = _timed(times, onednn_name, onednn.linear, linear_flops, native, shape=_linear_shape)
    cpu_ops.rotary_store_kv = _timed(times, "rotary + KV store", cpu_ops.rotary_store_kv, nbytes=_rotary_bytes)
    cpu_ops.add_rms_norm = _timed(times, "residual + RMSNorm", cpu_ops.add_rms_norm, nbytes=_norm_bytes)
    cpu_ops.silu_mul = _timed(times, "SwiGLU (silu * up)", cpu_ops.silu_mul, nbytes=_silu_bytes)
    Linear.forward = _timed_module(times, roles, Linear.forward, native)
    LMHead.forward = _timed_module(times, roles, LMHead.forward, native)
    for m, fn in attentions:
        m.paged_attention = _timed(times, "attention", fn, nbytes=_attention_bytes)
    layers_switch = os.environ.get(LAYERS_SWITCH)
    os.environ[LAYERS_SWITCH] = "torch"
    try:
        yield times
    finally:
        if layers_switch is None:
            os.environ.pop(LAYERS_SWITCH, None)
        else:
            os.environ[LAYERS_SWITCH] = layers_switch
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
        for m, fn in attentions:
            m.paged_attention = fn


__all__ = ["OpTimes", "timing_ops"]
