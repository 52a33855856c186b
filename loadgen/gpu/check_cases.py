"""The cases of ``python -m mqinfer.loadgen.gpu.check``: each checks one part that needs CUDA
against its reference and returns an ``Outcome`` (or raises ``Skip``).

Every case takes a ``Setup``. On ``cuda`` it runs at the sizes a GPU check needs; on ``cpu``
(``small``) the same code runs at small sizes, the Triton kernels under ``TRITON_INTERPRET=1``,
so that the script is exercised on machines without a GPU before it first runs on one.

The references: the Triton kernels against the PyTorch path (``gpu_kernels``); ``torch._int_mm``
against exact int64 sums on the CPU; the w8a8 engine, the 8-bit KV cache and swap preemption
against the plain float32 engine on the same device; the float32 engine on the device against
the float32 engine on the CPU. Generated tokens are compared with ``agreement``: the tokens
before each request's first difference must have close logprobs, and a first difference may
only fall on a near tie of the reference (the other token within a stated logprob of its best).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mqinfer.loadgen.gpu import kernels as gpu_kernels


@dataclass(frozen=True)
class Setup:
    """Where and how large the cases run."""

    device: str  # "cuda" or "cpu"
    small: bool  # small shapes (the CPU run of the tests)
    workdir: Path  # checkpoints, inputs and run outputs
    gpu_count: int  # CUDA devices visible
    model: str | None = None  # a real checkpoint (folder or .gguf) for the end-to-end row


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str


class Skip(Exception):
    """A case that did not run: ``result`` is ``skipped`` or ``not built``."""

    def __init__(self, result: str, detail: str) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail


# ---- a small float32 Llama and greedy generation ----------------------------------------------

# GPU: the standard benchmark model's layer shape (head_dim 64, 8 query and 2 KV heads) with 4
# layers; small: a few hundred thousand parameters for the CPU run.
CHECK_SHAPE = {"num_hidden_layers": 4}
SMALL_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 512}


def check_model(setup: Setup) -> tuple[str, int]:
    """(folder, vocabulary size) of the random float32 Llama the engine cases use."""
    from mqinfer.loadgen.checkpoint import make_llama_checkpoint, read_config

    shape = SMALL_SHAPE if setup.small else CHECK_SHAPE
    folder = make_llama_checkpoint(setup.workdir / ("check-llama-small" if setup.small else "check-llama"),
                                   seed=0, dtype="float32", **shape)
    return str(folder), int(read_config(folder)["vocab_size"])


def prompts_for(setup: Setup, vocab: int, n: int | None = None) -> list[list[int]]:
    from mqinfer.loadgen.equivalence import make_prompts

    return make_prompts(n or (6 if setup.small else 16), vocab, seed=1, max_len=48 if setup.small else 96)


Generated = dict[str, tuple[list[int], list[dict]]]


def generate(model: str, prompts: list[list[int]], max_tokens: int, **config: Any) -> tuple[Generated, dict]:
    """Greedy tokens and their logprobs (top 5 alternatives) per request, every prompt in one
    continuous batch, and the engine's counters (preemptions, swaps, prefix-cache hits)."""
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    longest = max(len(p) for p in prompts) + max_tokens
    settings = {"dtype": "float32", "max_num_seqs": len(prompts), "max_num_batched_tokens": 2048,
                "num_kv_blocks": len(prompts) * -(-longest // 16) + 8, **config}
    engine = LLMEngine(EngineConfig(model=model, **settings))
    try:
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", list(prompt), greedy)
        done: Generated = {}
        counts = {"preemptions": 0, "swaps": 0}
        while engine.has_unfinished():
            for out in engine.step().outputs:
                if out.finished:
                    if out.finish_reason != "length":
                        raise RuntimeError(f"request {out.request_id} ended {out.finish_reason}: {out.error}")
                    done[out.request_id] = (list(out.output_token_ids), list(out.logprobs))
                    counts["preemptions"] += out.num_preemptions
                    counts["swaps"] += out.num_swaps
        counts["prefix_hits"] = engine.scheduler.prefix_cache_hits
        counts["device"] = str(engine.device)
    finally:
        engine.close()
    return done, counts


@dataclass(frozen=True)
class Agreement:
    share: float  # tokens before each request's first difference, of all tokens
    worst: float  # largest |logprob difference| over those tokens
    off_tie: int  # first differences that are not near ties of the reference

    def describe(self) -> str:
        return f"{self.share:.0%} of tokens before a first difference, max |dlogprob| {self.worst:.1e}"


def agreement(base: Generated, other: Generated, tie: float) -> Agreement:
    """``other`` against the reference ``base``. A first difference is a near tie when the token
    ``other`` chose is among ``base``'s top alternatives there within ``tie`` of the best."""
    same = total = off_tie = 0
    worst = 0.0
    for rid, (tokens, logprobs) in base.items():
        theirs, their_logprobs = other[rid]
        n = 0
        while n < len(tokens) and n < len(theirs) and tokens[n] == theirs[n]:
            worst = max(worst, abs(logprobs[n]["logprob"] - their_logprobs[n]["logprob"]))
            n += 1
        same += n
        total += len(tokens)
        if n < len(tokens):
            alternatives = dict(zip(logprobs[n]["top_token_ids"], logprobs[n]["top_logprobs"]))
            chosen = alternatives.get(theirs[n]) if n < len(theirs) else None
            if chosen is None or logprobs[n]["logprob"] - chosen > tie:
                off_tie += 1
    return Agreement(same / max(1, total), worst, off_tie)


def judged(name: str, a: Agreement, tol: float, tie: float) -> tuple[bool, str]:
    ok = a.worst <= tol and a.off_tie == 0
    rule = f"tol {tol:g}, ties within {tie:g}"
    off = f", {a.off_tie} first difference(s) off a near tie" if a.off_tie else ""
    return ok, f"{name}: {a.describe()} ({rule}){off}"


# ---- the Triton kernels -----------------------------------------------------------------------

SMALL_KERNEL_CASES = (gpu_kernels.Case("small mixed", (1, 5, 1, 17), (17, 20, 40, 33), 4, 2, 64, 16),)


def triton_kernels(setup: Setup, dtype: torch.dtype) -> Outcome:
    """The Triton KV store (exact) and paged attention (within tolerance) against the PyTorch path."""
    if setup.device == "cpu" and dtype != torch.float32:
        raise Skip("skipped", "the Triton interpreter has no bfloat16: needs a GPU")
    cases = (gpu_kernels.REFERENCE_CASE, *(SMALL_KERNEL_CASES if setup.small else gpu_kernels.GPU_CASES))
    results = [gpu_kernels.check_case(case, dtype, setup.device) for case in cases]
    failed = [r["case"] for r in results if not r["ok"]]
    worst = max(results, key=lambda r: r["err"] / r["tol"])
    detail = (f"{len(results) - len(failed)}/{len(results)} shapes; store exact on "
              f"{sum(r['store_exact'] for r in results)}/{len(results)}; worst |err| {worst['err']:.1e} "
              f"(tol {worst['tol']:.0e}, {worst['case']})")
    if dtype != torch.float32:
        detail += f"; PyTorch path's own bf16 |err| up to {max(r['torch_err'] for r in results):.1e}"
    if failed:
        detail += f"; FAILED: {', '.join(failed)}"
    return Outcome(not failed, detail)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers (float8 and bfloat16 compared exactly, NaN or not)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def triton_kv8(setup: Setup) -> Outcome:
    """An 8-bit cache (int8, fp8): the Triton store writes the PyTorch store's bytes and scales,
    and Triton attention over it agrees with the PyTorch path (float32 and, on a GPU, bf16 queries)."""
    from mqinfer.kernels import attention, triton_attention
    from mqinfer.kernels.kv_quant import quantize_kv

    case = SMALL_KERNEL_CASES[0] if setup.small else gpu_kernels.GPU_CASES[5]
    query_dtypes = (torch.float32,) if setup.device == "cpu" else (torch.float32, torch.bfloat16)
    parts, ok = [], True
    for dtype in (torch.int8, torch.float8_e4m3fn):
        x = gpu_kernels.make_inputs(case, torch.float32, setup.device)
        md = x["metadata"]
        # The random context quantized into the cache, then this step's K/V stored by each store.
        k8, k_scale = quantize_kv(x["k_cache"], dtype)
        v8, v_scale = quantize_kv(x["v_cache"], dtype)
        caches = []
        for store in (attention.store_kv, triton_attention.store_kv):
            cache = (k8.clone(), v8.clone(), k_scale.clone(), v_scale.clone())
            store(x["k"], x["v"], cache[0], cache[1], md.slot_mapping, cache[2], cache[3])
            caches.append(cache)
        exact = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*caches))
        kc, vc, ks, vs = caches[1]
        errs = []
        for qdtype in query_dtypes:
            q = x["q"].to(qdtype)
            out = triton_attention.paged_attention(q, kc, vc, md, x["scale"], k_scale=ks, v_scale=vs)
            ref = attention.paged_attention(q.float(), kc, vc, md, x["scale"], backend="torch",
                                            k_scale=ks, v_scale=vs)
            err = (out.float() - ref).abs().max().item()
            tol = gpu_kernels.FLOAT32_TOL if qdtype == torch.float32 else gpu_kernels.BF16_TOL
            errs.append(f"{_dtype_name(qdtype)} queries |err| {err:.1e} (tol {tol:.0e})")
            ok &= err <= tol
        ok &= exact
        parts.append(f"{'int8' if dtype == torch.int8 else 'fp8'}: store {'exact' if exact else 'DIFFERS'}, "
                     + ", ".join(errs))
    return Outcome(ok, f"{case.name}; " + "; ".join(parts))


# ---- w8a8, the 8-bit KV cache and swap in the engine -----------------------------------------

MATMUL_SHAPES = ((1, 256, 512), (16, 256, 512), (17, 1024, 2048), (64, 1024, 2048), (256, 1024, 1024))
SMALL_MATMUL_SHAPES = ((1, 64, 128), (17, 64, 128), (40, 128, 64))


def w8a8_matmul(setup: Setup) -> Outcome:
    """``int_matmul`` on the device (``torch._int_mm`` above 16 rows) against exact int64 sums on
    the CPU, and the whole w8a8 linear on the device against the same on the CPU (same int8 rows,
    same float32 scaling); its error against the float product is reported."""
    from mqinfer.kernels import linear_int8 as q8

    gen = torch.Generator().manual_seed(0)
    exact = same = 0
    int_mm = []
    worst_rel = worst_quant = 0.0
    shapes = SMALL_MATMUL_SHAPES if setup.small else MATMUL_SHAPES
    for rows, k, n in shapes:
        x = torch.randn(rows, k, generator=gen)
        w = torch.randn(n, k, generator=gen) * 0.02
        qw, w_scale = q8.quantize_weight(w)
        qx, _ = q8.quantize_rows(x)
        sums = q8.int_matmul(qx.to(setup.device), qw.to(setup.device)).cpu()
        exact += bool(torch.equal(sums.long(), qx.long() @ qw.long().t()))
        if setup.device == "cuda" and rows > 16:
            int_mm.append(f"{rows}x{k}x{n}")
        on_device = q8.reference_linear(x.to(setup.device), qw.to(setup.device), w_scale.to(setup.device)).cpu()
        on_cpu = q8.reference_linear(x, qw, w_scale)
        rel = ((on_device - on_cpu).abs().max() / on_cpu.abs().max()).item()
        worst_rel = max(worst_rel, rel)
        same += rel <= 1e-6
        product = x @ w.t()
        worst_quant = max(worst_quant, ((on_cpu - product).abs().max() / product.abs().max()).item())
    n = len(shapes)
    detail = (f"int32 sums exact on {exact}/{n} shapes"
              + (f" (torch._int_mm on {', '.join(int_mm)})" if int_mm else "")
              + f"; linear vs the CPU's: max rel diff {worst_rel:.1e} on {n} shapes (tol 1e-6); "
              f"w8a8 vs float product: max rel err {worst_quant:.1e}")
    return Outcome(exact == n and same == n, detail)


def w8a8_engine(setup: Setup) -> Outcome:
    """Greedy generation with --quantization w8a8 against the float32 engine, same device."""
    model, vocab = check_model(setup)
    prompts = prompts_for(setup, vocab)
    max_tokens = 8 if setup.small else 16
    plain, _ = generate(model, prompts, max_tokens, device=setup.device)
    quant, counts = generate(model, prompts, max_tokens, device=setup.device, quantization="w8a8")
    ok, detail = judged("w8a8 vs float32", agreement(plain, quant, tie=0.3), tol=0.15, tie=0.3)
    return Outcome(ok, f"{detail}; {len(prompts)} requests on {counts['device']}")


def kv8_engine(setup: Setup) -> Outcome:
    """Greedy generation with --kv-cache-dtype int8 and fp8 against the model's dtype (float32)."""
    model, vocab = check_model(setup)
    prompts = prompts_for(setup, vocab)
    max_tokens = 8 if setup.small else 16
    base, _ = generate(model, prompts, max_tokens, device=setup.device)
    parts, ok = [], True
    # The bounds of the CPU test of the 8-bit cache (tests/workers/test_kv_cache_dtype.py).
    for kv, tol in (("int8", 0.05), ("fp8", 0.15)):
        other, _ = generate(model, prompts, max_tokens, device=setup.device, kv_cache_dtype=kv)
        good, detail = judged(kv, agreement(base, other, tie=2 * tol), tol=tol, tie=2 * tol)
        ok &= good
        parts.append(detail)
    return Outcome(ok, "; ".join(parts))


def swap_host_cache(setup: Setup) -> Outcome:
    """KV blocks (bf16, int8 and fp8 with their scales) out to pinned host memory and back into
    other device blocks: every byte as it was."""
    from mqinfer.kernels.kv_quant import quantize_kv
    from mqinfer.workers.engine.swap import HostKVCache

    pinned = setup.device == "cuda"
    gen = torch.Generator(setup.device).manual_seed(0)
    shape = (32, 16, 2, 64)  # blocks, block size, KV heads, head_dim
    parts, ok = [], True
    for kind in ("bfloat16", "int8", "fp8"):
        layers = []
        for _ in range(2):
            k, v = (torch.randn(shape, generator=gen, device=setup.device) for _ in range(2))
            if kind == "bfloat16":
                layers.append((k.bfloat16(), v.bfloat16()))
            else:
                dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
                (k8, ks), (v8, vs) = quantize_kv(k, dtype), quantize_kv(v, dtype)
                layers.append((k8, v8, ks, vs))
        host = HostKVCache(8, 2, shape[1:], layers[0][0].dtype, pin_memory=pinned, quantized=kind != "bfloat16")
        before = [[_bits(t).clone() for t in layer] for layer in layers]
        host.swap_out(layers, [(3, 0), (4, 1), (9, 2), (20, 5)])
        host.swap_in(layers, [(0, 30), (1, 31), (2, 0), (5, 1)])
        if setup.device == "cuda":
            torch.cuda.synchronize()
        moved = [(3, 30), (4, 31), (9, 0), (20, 1)]
        exact = all(torch.equal(_bits(t)[dst], old[src]) for layer, olds in zip(layers, before)
                    for t, old in zip(layer, olds) for src, dst in moved)
        ok &= exact and host.is_pinned == pinned
        parts.append(f"{kind} {'exact' if exact else 'DIFFERS'}")
    return Outcome(ok, f"host pool {'pinned' if pinned else 'not pinned (CPU)'}; " + ", ".join(parts))


def swap_prompts(vocab: int) -> list[list[int]]:
    """Eight prompts of 40 tokens (3 blocks of 16 each), the first three sharing 32 tokens."""
    import random

    rng = random.Random(2)
    shared = [rng.randrange(3, vocab) for _ in range(32)]
    return [(shared if i < 3 else [rng.randrange(3, vocab) for _ in range(32)])
            + [rng.randrange(3, vocab) for _ in range(8)] for i in range(8)]


def swap_engine(setup: Setup) -> Outcome:
    """A KV cache too small for every request: swap preemption (over pinned memory on a GPU) and
    prefix-cache hits give the tokens of a roomy cache, logprobs to rounding."""
    model, vocab = check_model(setup)
    prompts = swap_prompts(vocab)
    max_tokens = 32  # 72 tokens in the end: 5 blocks a request
    roomy, _ = generate(model, prompts, max_tokens, device=setup.device)
    # Room for the prompts of four requests: they run out of blocks as they grow past 48 tokens.
    tight_blocks = 12
    tight, counts = generate(model, prompts, max_tokens, device=setup.device, num_kv_blocks=tight_blocks,
                             preemption_mode="swap", swap_space_gib=0.25, enable_prefix_caching=True)
    ok, detail = judged("swap vs roomy", agreement(roomy, tight, tie=2e-3), tol=1e-3, tie=2e-3)
    ok &= counts["swaps"] > 0
    return Outcome(ok, f"{detail}; {counts['preemptions']} preemptions, {counts['swaps']} swaps, "
                       f"{counts['prefix_hits']} prefix-cache hits, {tight_blocks} blocks of 16")


def kv_tiers_engine(setup: Setup) -> Outcome:
    """Prefix blocks evicted from a small 8-bit device cache come back from host-memory and disk
    tiers, and a fresh engine reads them from the disk tier: the tokens of the run without tiers,
    logprobs to rounding (the tiers keep the 8-bit blocks as they were)."""
    import random
    import shutil

    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    model, vocab = check_model(setup)
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(5)]
    prompts = [prefixes[i % 5] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))] for i in range(15)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)

    def run(**tiers: Any) -> tuple[Generated, int]:
        # 14 blocks of 16: two requests at a time fit, the five prefixes' blocks do not stay.
        eng = LLMEngine(EngineConfig(model=model, device=setup.device, dtype="float32", kv_cache_dtype="int8",
                                     num_kv_blocks=14, max_num_seqs=2, max_model_len=256, **tiers))
        try:
            done: Generated = {}
            for start in range(0, len(prompts), 2):
                for i in range(start, min(start + 2, len(prompts))):
                    eng.add_request(f"r{i}", prompts[i], greedy)
                while eng.has_unfinished():
                    for out in eng.step().outputs:
                        if out.finished:
                            done[out.request_id] = (list(out.output_token_ids), list(out.logprobs))
            hits = sum(int(s["hits"]) for s in eng.kv_tiers.snapshot()) if eng.kv_tiers is not None else 0
        finally:
            eng.close()
        return done, hits

    folder = setup.workdir / "kv-tiers"
    shutil.rmtree(folder, ignore_errors=True)
    base, _ = run()
    tiered, hits = run(kv_host_cache_gib=0.01, kv_disk_cache=str(folder))
    again, disk_hits = run(kv_disk_cache=str(folder))
    ok1, d1 = judged("tiers vs none", agreement(base, tiered, tie=2e-3), tol=1e-3, tie=2e-3)
    ok2, d2 = judged("restarted from disk vs none", agreement(base, again, tie=2e-3), tol=1e-3, tie=2e-3)
    return Outcome(ok1 and ok2 and hits > 0 and disk_hits > 0,
                   f"{d1}; {d2}; tier hits {hits}, {disk_hits} after a restart")


def engine_vs_cpu(setup: Setup) -> Outcome:
    """The float32 engine on the device (Triton attention, cuBLAS) against the float32 engine on
    the CPU; the device's bfloat16 run is reported against its float32 run (not judged)."""
    model, vocab = check_model(setup)
    prompts = prompts_for(setup, vocab)
    max_tokens = 8 if setup.small else 16
    on_cpu, _ = generate(model, prompts, max_tokens, device="cpu")
    on_device, counts = generate(model, prompts, max_tokens, device=setup.device)
    ok, detail = judged(f"float32 {counts['device']} vs cpu", agreement(on_cpu, on_device, tie=1e-3),
                        tol=1e-3, tie=1e-3)
    if setup.device == "cuda":
        half, _ = generate(model, prompts, max_tokens, device=setup.device, dtype="bfloat16")
        detail += f"; bfloat16 vs float32 (reported): {agreement(on_device, half, tie=0.1).describe()}"
    return Outcome(ok, detail)


# ---- `mqinfer run` end to end ------------------------------------------------------------------

def _has_tokenizer(model: str) -> bool:
    path = Path(model)
    return path.suffix.lower() == ".gguf" or (path / "tokenizer.json").is_file()


def _run_requests(model: str, n: int, max_tokens: int) -> list[dict]:
    """Greedy requests: text prompts where the model has a tokenizer, else token ids."""
    if model == "tiny" or _has_tokenizer(model):
        return [{"id": f"q{i}", "prompt": f"Request {i}: say something about queues.", "max_tokens": max_tokens,
                 "temperature": 0, "ignore_eos": True} for i in range(n)]
    from mqinfer.loadgen.checkpoint import read_config

    vocab = int(read_config(model)["vocab_size"])
    return [{"id": f"q{i}", "prompt_token_ids": [(7 + 31 * i + 17 * j) % (vocab - 3) + 3 for j in range(20 + i % 40)],
             "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} for i in range(n)]


def _read_rows(folder: Path) -> list[dict]:
    import pyarrow.dataset as ds

    if not folder.is_dir():
        return []
    dataset = ds.dataset(folder, format="parquet", partitioning="hive")
    return dataset.to_table().to_pylist() if dataset.files else []


def mqinfer_run(setup: Setup, model: str, label: str, n: int = 32, max_tokens: int = 32) -> Outcome:
    """``mqinfer run`` (embedded server, worker processes, Parquet) on the device: exit 0, one
    result row of ``max_tokens`` tokens and one request cost row per request, and the worker's
    log naming the device."""
    if setup.small:
        n, max_tokens = 6, 8
    folder = setup.workdir / f"run-{label}"
    folder.mkdir(parents=True, exist_ok=True)
    requests = _run_requests(model, n, max_tokens)
    source = folder / "requests.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = folder / "out"
    argv = [sys.executable, "-P", "-m", "mqinfer", "run", str(source), "--out", str(out), "--model", model,
            "--device", setup.device, "--fresh"]
    if setup.device == "cpu":
        argv += ["--workers", "1", "--num-threads", "1"]  # on a GPU: --workers auto, one per device
    env = dict(os.environ, MQINFER_LOG_LEVEL="info")
    began = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        return Outcome(False, f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")
    results = _read_rows(out / "results")
    costs = [c for c in _read_rows(out / "costs") if c["kind"] == "request"]
    complete = [r for r in results if r["finish_reason"] == "length" and r["output_tokens"] == max_tokens]
    on_device = f" on {setup.device}" in proc.stderr
    layout = next((line for line in proc.stderr.splitlines() if " worker" in line and "sets it)" in line), "")
    ok = len(results) == n and len(complete) == n and len(costs) == n and on_device
    detail = (f"{model if model == 'tiny' else Path(model).name}: {len(complete)}/{n} rows of {max_tokens} tokens, "
              f"{len(costs)} cost rows, worker on {setup.device}: {'yes' if on_device else 'NOT SEEN in its log'}, "
              f"{seconds:.1f}s")
    if layout:
        detail += f"; layout: {layout.strip()}"
    return Outcome(ok, detail)


def run_tiny(setup: Setup) -> Outcome:
    return mqinfer_run(setup, "tiny", "tiny")


def run_checkpoint(setup: Setup) -> Outcome:
    """The end-to-end run on a checkpoint read from disk: ``Setup.model`` where given (a real
    one), else the standard benchmark checkpoint (random Llama weights, bf16, about 55M parameters)."""
    if setup.model:
        outcome = mqinfer_run(setup, setup.model, "checkpoint")
        return Outcome(outcome.ok, f"given checkpoint; {outcome.detail}")
    if setup.small:
        model, _ = check_model(setup)
    else:
        from mqinfer.loadgen.checkpoint import make_standard_checkpoint

        model = str(make_standard_checkpoint(setup.workdir / "standard-llama"))
    outcome = mqinfer_run(setup, model, "checkpoint")
    return Outcome(outcome.ok, f"random-weight Llama written by loadgen/checkpoint.py (no real weights here); "
                               f"{outcome.detail}")


# ---- tensor and pipeline parallelism (2+ GPUs) -------------------------------------------------

def _needs_two(setup: Setup) -> None:
    if setup.device == "cuda" and setup.gpu_count < 2:
        raise Skip("skipped", f"{setup.gpu_count} GPU: needs 2")


def _layouts_agree(setup: Setup, what: str, **split: Any) -> Outcome:
    """Greedy float32 tokens of one rank against ``split`` (tensor or pipeline ranks)."""
    model, vocab = check_model(setup)
    prompts = prompts_for(setup, vocab, n=4 if setup.small else 16)
    max_tokens = 4 if setup.small else 16
    one, _ = generate(model, prompts, max_tokens, device=f"{setup.device}:0" if setup.device == "cuda" else "cpu",
                      num_threads=1 if setup.device == "cpu" else None)
    devices = None if setup.device == "cpu" else ",".join(str(i) for i in range(2))
    many, counts = generate(model, prompts, max_tokens, device=setup.device, devices=devices,
                            num_threads=1 if setup.device == "cpu" else None, **split)
    a = agreement(one, many, tie=1e-3)
    ok, detail = judged(f"{what} vs one rank", a, tol=1e-3, tie=1e-3)
    return Outcome(ok, f"{detail}; {len(prompts)} requests, float32, {'NCCL' if setup.device == 'cuda' else 'gloo'}")


def tensor_parallel(setup: Setup) -> Outcome:
    _needs_two(setup)
    return _layouts_agree(setup, "T=2", tensor_parallel_size=2)


def pipeline_built() -> bool:
    from mqinfer.workers.config import EngineConfig

    return "pipeline_parallel_size" in {f.name for f in dataclasses.fields(EngineConfig)}


def pipeline_parallel(setup: Setup) -> Outcome:
    if not pipeline_built():
        raise Skip("not built", "this build has no --pipeline-parallel-size")
    _needs_two(setup)
    return _layouts_agree(setup, "P=2", pipeline_parallel_size=2)


__all__ = ["Agreement", "Outcome", "Setup", "Skip", "agreement", "check_model", "engine_vs_cpu", "generate",
           "kv8_engine", "mqinfer_run", "pipeline_built", "pipeline_parallel", "run_checkpoint", "run_tiny",
           "swap_engine", "swap_host_cache", "tensor_parallel", "triton_kernels", "triton_kv8", "w8a8_engine",
           "w8a8_matmul"]
