"""The machine's compute ceiling for a workload: measured bf16 matrix rate and the workload's FLOPs.

Owns ``measure_matmul_rate`` (best-of-N timing of a square bf16 matmul, FLOP/s) and
``workload_flops`` (the matrix work a decoder-only transformer must do for a workload). The
ceiling ``rate / flops * requested_output_tokens`` is the throughput a system would reach if it
did nothing but that matrix work at the measured rate; the share of it a system reaches says
how much is left on the table.

FLOP counting (matmuls only, 2 FLOPs per multiply-add): every prompt token runs the decoder
layers (q/k/v/o projections, MLP) but not the output head; every generated token runs the layers
and the head. Attention adds 4 * heads * head_dim FLOPs per layer per (query, key) pair, with
each token attending to itself and everything before it. The embedding lookup is a gather, not a
matmul, so the embedding table counts nothing (the "2 x all parameters per token" rule of thumb
counts it and gives a larger figure: see ``FlopCount.params_convention``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MatmulRate:
    flops_per_s: float  # best run
    median_flops_per_s: float
    size: int
    dtype: str
    device: str
    threads: int


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        """From a Hugging Face config dict (config.json of a Llama-family checkpoint)."""
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab_size=int(config["vocab_size"]),
            )
        except KeyError as exc:
            raise ValueError(f"model config lacks {exc.args[0]!r}, needed to count FLOPs") from None

    @property
    def layer_params(self) -> int:
        """Matmul weights of the decoder layers (all of them)."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        o = self.num_heads * self.head_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (q + kv + o + mlp)

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size


@dataclass(frozen=True)
class FlopCount:
    prompt_tokens: int
    output_tokens: int
    layers: float  # decoder-layer matmuls, prompt and generated tokens
    head: float  # output head, generated tokens only
    attention: float
    embedding_equivalent: float  # 2 x embedding table per token: what "2 x params" would add

    @property
    def total(self) -> float:
        return self.layers + self.head + self.attention

    @property
    def params_convention(self) -> float:
        """The total under "2 x parameters per token" (embedding table included), for comparison."""
        return self.total + self.embedding_equivalent


def _causal_pairs(start: int, count: int) -> int:
    """Sum of (position + 1) for positions start .. start+count-1: (query, key) pairs attended."""
    # sum_{p=start}^{start+count-1} (p + 1)
    return count * (2 * start + count + 1) // 2


def workload_flops(config: Mapping[str, Any] | ModelShape, workload: Sequence[Mapping[str, Any]]) -> FlopCount:
    """Matmul FLOPs to serve ``workload`` (requests with ``prompt_token_ids`` and ``max_tokens``)."""
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    prompt_tokens = output_tokens = 0
    pairs = 0
    for req in workload:
        p = len(req["prompt_token_ids"])
        n = int(req["max_tokens"])
        prompt_tokens += p
        output_tokens += n
        pairs += _causal_pairs(0, p) + _causal_pairs(p, n)
    attn_per_pair = 4 * shape.num_heads * shape.head_dim * shape.num_layers
    return FlopCount(
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        layers=2.0 * shape.layer_params * (prompt_tokens + output_tokens),
        head=2.0 * shape.head_params * output_tokens,
        attention=float(attn_per_pair) * pairs,
        embedding_equivalent=2.0 * shape.vocab_size * shape.hidden_size * (prompt_tokens + output_tokens),
    )


def compute_ceiling(flops: FlopCount, flops_per_s: float) -> float:
    """Requested output tokens per second if only the matrix work ran, at ``flops_per_s``."""
    if flops_per_s <= 0:
        raise ValueError(f"matrix rate must be > 0, got {flops_per_s}")
    if flops.total <= 0:
        raise ValueError("the workload has no work")
    return flops.output_tokens * flops_per_s / flops.total


def measure_matmul_rate(size: int = 2048, *, dtype: str = "bfloat16", device: str = "cpu", repeats: int = 8,
                        best_of: int = 5, warmup: int = 2) -> MatmulRate:
    """FLOP/s of ``size x size @ size x size`` matmuls: ``repeats`` back to back, best of ``best_of``.

    Best-of rather than mean because other load on the machine only ever makes a run slower.
    """
    import torch

    if size < 1 or repeats < 1 or best_of < 1 or warmup < 0:
        raise ValueError("size, repeats and best_of must be >= 1, warmup >= 0")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=torch_dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=torch_dtype)
    out = torch.empty(size, size, dtype=torch_dtype, device=device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.inference_mode():
        for _ in range(warmup):
            torch.matmul(a, b, out=out)
        sync()
        rates = []
        for _ in range(best_of):
            t0 = time.perf_counter()
            for _ in range(repeats):
                torch.matmul(a, b, out=out)
            sync()
            rates.append(2.0 * size ** 3 * repeats / (time.perf_counter() - t0))
    rates.sort()
    return MatmulRate(flops_per_s=rates[-1], median_flops_per_s=rates[len(rates) // 2], size=size, dtype=dtype,
                      device=device, threads=torch.get_num_threads())
