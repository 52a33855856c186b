"""Seeded synthetic workloads: lists of token-id generation requests for benchmarks.

Owns the length distributions (uniform, log-normal, shared-prefix), the fixed workload (every
request exactly P prompt tokens and G generated, the shape ``llama-batched-bench -npp P -ntg G -npl
N`` measures) and the standard benchmark workload (256 requests, prompts uniform in 16..256
tokens, outputs uniform in 16..128). Every request is greedy with ``ignore_eos``, a plain dict
in the public request format, so the same list can go to ``Producer.submit_many`` and to the
Hugging Face baselines. The same seed always gives the same requests (numpy's PCG64 generator);
no torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Ids below this are left out of prompts: Llama-style vocabularies keep unk/bos/eos at 0..2.
MIN_TOKEN_ID = 3
FIXED_PROMPT_LEN = 128  # the fixed workload's lengths when none are given
FIXED_OUTPUT_LEN = 128

from mqinfer.loadgen.bench_options import WORKLOADS


@dataclass(frozen=True)
class WorkloadStats:
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # what the requests ask for (max_tokens, generated in full: ignore_eos)
    max_prompt_len: int
    max_output_len: int


def _check_range(name: str, bounds: tuple[int, int], low: int = 1) -> tuple[int, int]:
    lo, hi = int(bounds[0]), int(bounds[1])
    if lo < low or hi < lo:
        raise ValueError(f"{name} must be a range lo..hi with {low} <= lo <= hi, got {bounds!r}")
    return lo, hi


def _check_common(n: int, vocab_size: int, min_token_id: int = MIN_TOKEN_ID) -> None:
    if n < 1:
        raise ValueError(f"a workload needs at least 1 request, got n={n}")
    if min_token_id < 0:
        raise ValueError(f"min_token_id must be >= 0, got {min_token_id}")
    if vocab_size <= min_token_id:
        raise ValueError(f"vocab_size must be > {min_token_id} (ids below it are special), got {vocab_size}")


def _tokens(rng: np.random.Generator, length: int, vocab_size: int, min_token_id: int = MIN_TOKEN_ID) -> list[int]:
    return rng.integers(min_token_id, vocab_size, size=length).tolist()


def _request(prefix: str, index: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{index:06d}",
        "prompt_token_ids": prompt,
        "max_tokens": int(max_tokens),
        "ignore_eos": True,
        "temperature": 0.0,
    }


def uniform_workload(n: int = 256, *, prompt_len: tuple[int, int] = (16, 256),
                     output_len: tuple[int, int] = (16, 128), vocab_size: int = 32000, seed: int = 0,
                     id_prefix: str = "uniform", min_token_id: int = MIN_TOKEN_ID) -> list[dict[str, Any]]:
    """Prompt and output lengths drawn uniformly from the inclusive ranges."""
    _check_common(n, vocab_size, min_token_id)
    p_lo, p_hi = _check_range("prompt_len", prompt_len)
    o_lo, o_hi = _check_range("output_len", output_len)
    rng = np.random.default_rng(seed)
    # Lengths first, then tokens: changing vocab_size keeps the lengths of a seed.
    p_lens = rng.integers(p_lo, p_hi + 1, size=n)
    o_lens = rng.integers(o_lo, o_hi + 1, size=n)
    return [_request(id_prefix, i, _tokens(rng, int(p_lens[i]), vocab_size, min_token_id), int(o_lens[i]))
            for i in range(n)]


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float,
                       bounds: tuple[int, int]) -> np.ndarray:
    lo, hi = bounds
    draws = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(draws), lo, hi).astype(np.int64)


def lognormal_workload(n: int = 256, *, prompt_median: float = 96.0, prompt_sigma: float = 0.8,
                       prompt_len: tuple[int, int] = (4, 1024), output_median: float = 48.0,
                       output_sigma: float = 0.7, output_len: tuple[int, int] = (4, 512),
                       vocab_size: int = 32000, seed: int = 0, id_prefix: str = "lognormal",
                       min_token_id: int = MIN_TOKEN_ID) -> list[dict[str, Any]]:
    """Log-normal prompt and output lengths (long-tailed, like real traffic), clipped to the ranges."""
    _check_common(n, vocab_size, min_token_id)
    p_bounds = _check_range("prompt_len", prompt_len)
    o_bounds = _check_range("output_len", output_len)
    for name, value in (("prompt_median", prompt_median), ("output_median", output_median)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    for name, value in (("prompt_sigma", prompt_sigma), ("output_sigma", output_sigma)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    rng = np.random.default_rng(seed)
    p_lens = _lognormal_lengths(rng, n, prompt_median, prompt_sigma, p_bounds)
    o_lens = _lognormal_lengths(rng, n, output_median, output_sigma, o_bounds)
    return [_request(id_prefix, i, _tokens(rng, int(p_lens[i]), vocab_size, min_token_id), int(o_lens[i]))
            for i in range(n)]


def shared_prefix_workload(n: int = 256, *, num_prefixes: int = 8, prefix_len: int | tuple[int, int] = 128,
                           suffix_len: tuple[int, int] = (8, 64), output_len: tuple[int, int] = (16, 128),
                           vocab_size: int = 32000, seed: int = 0, id_prefix: str = "shared",
                           min_token_id: int = MIN_TOKEN_ID, shuffle: bool = False) -> list[dict[str, Any]]:
    """``num_prefixes`` distinct prefixes (a system prompt, a few-shot header, a document), each
    ``prefix_len`` tokens long or drawn from a LO,HI range, each request one of them (round robin, so
    every prefix is used) plus a random suffix. ``shuffle`` puts the requests in random order
    instead, as a bulk job's rows come when nobody sorted them; the ids keep their round-robin
    numbering, so request ``i`` has prefix ``i % num_prefixes`` either way."""
    _check_common(n, vocab_size, min_token_id)
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    p_lo, p_hi = (prefix_len, prefix_len) if isinstance(prefix_len, int) else _check_range("prefix_len", prefix_len)
    if p_lo < 1:
        raise ValueError(f"prefix_len must be >= 1, got {prefix_len}")
    s_lo, s_hi = _check_range("suffix_len", suffix_len, low=0)
    o_lo, o_hi = _check_range("output_len", output_len)
    rng = np.random.default_rng(seed)
    p_lens = [p_lo] * num_prefixes if p_lo == p_hi else rng.integers(p_lo, p_hi + 1, size=num_prefixes)
    prefixes = [_tokens(rng, int(length), vocab_size, min_token_id) for length in p_lens]
    s_lens = rng.integers(s_lo, s_hi + 1, size=n)
    o_lens = rng.integers(o_lo, o_hi + 1, size=n)
    reqs = [
        _request(id_prefix, i, prefixes[i % num_prefixes] + _tokens(rng, int(s_lens[i]), vocab_size, min_token_id),
                 int(o_lens[i]))
        for i in range(n)
    ]
    if shuffle:
        reqs = [reqs[int(i)] for i in rng.permutation(n)]
    return reqs


# The bench's shared-prefix workload: a bulk job whose distinct prefixes are long and many, each
# asked SHARED_PREFIX_PER_PREFIX short questions, in shuffled order.
SHARED_PREFIX_PER_PREFIX = 16
SHARED_PREFIX_LEN = (256, 1024)
SHARED_PREFIX_OUTPUT_LEN = (16, 64)


def standard_workload(vocab_size: int = 32000, n: int = 256, seed: int = 0,
                      min_token_id: int = MIN_TOKEN_ID) -> list[dict[str, Any]]:
    """The standard workload: prompts uniform in 16..256 tokens, outputs uniform in 16..128."""
    return uniform_workload(n, prompt_len=(16, 256), output_len=(16, 128), vocab_size=vocab_size, seed=seed,
                            id_prefix="std", min_token_id=min_token_id)


def fixed_workload(n: int = 64, *, prompt_len: int = FIXED_PROMPT_LEN, output_len: int = FIXED_OUTPUT_LEN,
                   vocab_size: int = 32000, seed: int = 0, id_prefix: str = "fixed",
                   min_token_id: int = MIN_TOKEN_ID) -> list[dict[str, Any]]:
    """``n`` requests of exactly ``prompt_len`` random prompt tokens and ``output_len`` generated
    ones: what ``llama-batched-bench -npp prompt_len -ntg output_len -npl n`` runs (no prompt shared)."""
    _check_common(n, vocab_size, min_token_id)
    for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the fixed workload's {name} must be one integer >= 1, got {value!r}")
    rng = np.random.default_rng(seed)
    return [_request(id_prefix, i, _tokens(rng, prompt_len, vocab_size, min_token_id), output_len) for i in range(n)]


def make_workload(name: str, *, n: int = 256, seed: int = 0, vocab_size: int = 32000,
                  max_model_len: int | None = None, prompt_len: tuple[int, int] | int | None = None,
                  output_len: tuple[int, int] | int | None = None,
                  min_token_id: int = MIN_TOKEN_ID, num_prefixes: int | None = None,
                  prefix_len_range: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """A named workload (the ``--workload`` flag of the bench), prompt ids drawn from
    ``min_token_id`` up to, not including, ``vocab_size``.

    ``prompt_len`` / ``output_len`` replace the default ranges: the uniform ranges, the
    log-normal clip bounds, or (``output_len`` only) the shared-prefix output range; the standard
    workload is fixed. The shared-prefix workload has ``num_prefixes`` prefixes (default: one per
    16 requests) of ``prefix_len_range`` tokens (default 256..1024), shuffled. For ``fixed`` each is one integer, the exact length of every request.
    ``max_model_len`` (the model's context) trims lengths so that prompt + output fits; it only
    matters for small models, since the defaults stay under 1,600 tokens. A fixed workload is
    never trimmed: one that does not fit is an error.
    """
    if name == "fixed":
        lengths = {k: v for k, v in (("prompt_len", prompt_len), ("output_len", output_len)) if v is not None}
        reqs = fixed_workload(n, vocab_size=vocab_size, seed=seed, min_token_id=min_token_id, **lengths)
        total = len(reqs[0]["prompt_token_ids"]) + reqs[0]["max_tokens"]
        if max_model_len is not None and total > max_model_len:
            raise ValueError(f"the fixed workload's prompt + output ({total} tokens) exceeds the model's context "
                             f"({max_model_len})")
        return reqs
    for value in (prompt_len, output_len):
        if value is not None and not isinstance(value, tuple):
            raise ValueError(f"the {name} workload takes lengths as ranges (LO, HI), got {value!r}")
    ranges: dict[str, tuple[int, int]] = {}
    if prompt_len is not None:
        ranges["prompt_len"] = prompt_len
    if output_len is not None:
        ranges["output_len"] = output_len
    ids = {"vocab_size": vocab_size, "seed": seed, "min_token_id": min_token_id}
    if name == "standard":
        if ranges:
            raise ValueError("the standard workload has fixed lengths; use --workload uniform to choose them")
        reqs = standard_workload(n=n, **ids)
    elif name == "uniform":
        reqs = uniform_workload(n, **ids, **ranges)
    elif name == "lognormal":
        reqs = lognormal_workload(n, **ids, **ranges)
    elif name == "shared-prefix":
        if prompt_len is not None:
            raise ValueError("shared-prefix prompts are a fixed prefix plus a suffix; prompt_len does not apply")
        reqs = shared_prefix_workload(n, num_prefixes=num_prefixes or max(1, n // SHARED_PREFIX_PER_PREFIX),
                                      prefix_len=prefix_len_range or SHARED_PREFIX_LEN,
                                      output_len=ranges.get("output_len", SHARED_PREFIX_OUTPUT_LEN), shuffle=True,
                                      id_prefix="sp", **ids)
    else:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if max_model_len is not None:
        # A shared prefix is the point of that workload: cut its prompts at the end instead.
        keep = "start" if name == "shared-prefix" else "end"
        reqs = [fit_to_context(r, max_model_len, keep=keep) for r in reqs]
    return reqs


def fit_to_context(request: dict[str, Any], max_model_len: int, keep: str = "end") -> dict[str, Any]:
    """The request with its prompt cut so prompt + max_tokens <= max_model_len, keeping the
    prompt's ``end`` (cut from the front) or its ``start``."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    max_tokens = min(request["max_tokens"], max_model_len - 1)
    room = max_model_len - max_tokens
    prompt = request["prompt_token_ids"]
    if len(prompt) <= room and max_tokens == request["max_tokens"]:
        return request
    kept = prompt[-room:] if keep == "end" else prompt[:room]
    return {**request, "prompt_token_ids": kept, "max_tokens": max_tokens}


def workload_stats(requests: Sequence[dict[str, Any]]) -> WorkloadStats:
    if not requests:
        raise ValueError("empty workload")
    p = [len(r["prompt_token_ids"]) for r in requests]
    o = [int(r["max_tokens"]) for r in requests]
    return WorkloadStats(len(requests), sum(p), sum(o), max(p), max(o))


