"""The requests a plan is for: a JSONL or Parquet file of requests, or a named synthetic workload
(the bench's), and their arrival times (a seeded Poisson process at a rate, or all at once).

Requests become ``SimRequest``s: prompt token ids as given, or text and chat prompts tokenized by
the model's own tokenizer (estimated at 4 bytes a token when the model has none here); a request
with ``n`` choices is ``n`` sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from mqinfer.loadgen.plan.sim import SimRequest


@dataclass
class Workload:
    name: str  # the workload's name or the input file
    requests: list[SimRequest]  # without arrival times
    notes: list[str] = field(default_factory=list)


def _tokenizer(model: str):
    from mqinfer.workers.engine.tokenizer import ByteTokenizer, load_tokenizer

    if model == "tiny":
        return ByteTokenizer()
    try:
        return load_tokenizer(model)
    except (OSError, ValueError):
        return None


def read_workload_file(path: str, model: str) -> Workload:
    """The valid requests of a JSONL or Parquet file as simulated requests: prompt ids as given, or
    text and chat prompts tokenized by the model's tokenizer (estimated at 4 bytes a token when the
    model has none); a request with ``n`` choices is ``n`` sequences."""
    from mqinfer.schemas.files import iter_input

    if not Path(path).is_file():
        raise FileNotFoundError(f"no such input file: {path}")
    tokenizer = None
    invalid = estimated = 0
    requests: list[SimRequest] = []
    for item in iter_input(path):
        req = item.request
        if req is None:
            invalid += 1
            continue
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
        else:
            tokenizer = tokenizer or _tokenizer(model)
            if req.messages:
                messages = [{"role": m.role, "content": m.content} for m in req.messages]
                text = "".join(f"{m['role']}\n{m['content']}\n" for m in messages)
            else:
                messages, text = None, req.prompt or ""
            if tokenizer is not None:
                ids = tokenizer.encode_chat(messages) if messages else tokenizer.encode(text)
            else:
                estimated += 1
                ids = [3 + (b % 250) for b in text.encode()[::4]] or [3]
        for choice in range(getattr(req, "n", 1) or 1):
            rid = req.id if choice == 0 else f"{req.id}#{choice}"
            requests.append(SimRequest(rid, tuple(ids), int(req.max_tokens), priority=int(req.priority),
                                       tenant=req.tenant, slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms))
    if not requests:
        raise ValueError(f"{path}: no valid request to plan for ({invalid} invalid lines)")
    notes = []
    if invalid:
        notes.append(f"{invalid} invalid lines of {path} left out (they would be error rows)")
    if estimated:
        notes.append(f"{estimated} text prompts estimated at 4 bytes a token: model {model} has no tokenizer here")
    return Workload(Path(path).name, requests, notes)


def with_tenant_slos(requests: Sequence[SimRequest], tenant_slos: dict[str, tuple[int, int]]) -> list[SimRequest]:
    """The requests with their tenant's ``--tenant-slos`` targets where they set none of their own,
    as a worker gives them (workers/queue/slo.py)."""
    out = []
    for r in requests:
        if r.slo_ttft_ms is None and r.slo_tpot_ms is None and r.tenant in tenant_slos:
            ttft, tpot = tenant_slos[r.tenant]
            r = replace(r, slo_ttft_ms=ttft, slo_tpot_ms=tpot)
        out.append(r)
    return out


def named_workload(name: str, num_requests: int, seed: int, model: str, max_model_len: int) -> Workload:
    from mqinfer.loadgen.bench_model import resolve_model
    from mqinfer.loadgen.workload import make_workload

    spec = resolve_model(model)
    reqs = make_workload(name, n=num_requests, seed=seed, vocab_size=spec.vocab_size,
                         max_model_len=min(max_model_len, spec.max_model_len), min_token_id=spec.min_token_id)
    return Workload(name, [SimRequest(r["id"], tuple(r["prompt_token_ids"]), int(r["max_tokens"])) for r in reqs])


def with_arrivals(requests: Sequence[SimRequest], rate: float | None, count: int, seed: int) -> list[SimRequest]:
    """``count`` requests (the given ones in turn, repeated as needed, each repeat under a new id)
    arriving at ``rate`` per second (seeded Poisson), or all at time 0 without a rate."""
    from mqinfer.loadgen.bench_online import poisson_arrivals

    arrivals = poisson_arrivals(count, rate, seed) if rate else [0.0] * count
    out = []
    for i, at in enumerate(arrivals):
        r = requests[i % len(requests)]
        rid = r.id if i < len(requests) else f"{r.id}~{i // len(requests)}"
        out.append(replace(r, id=rid, arrival_s=float(at)))
    return out
