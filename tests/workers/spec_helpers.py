"""Shared by the draft-model and self-speculation tests: small random Llama checkpoints, a loop
that runs requests to the end while checking block usage, random prompts, output comparison."""

from __future__ import annotations

import json
import random
from pathlib import Path

from safetensors.torch import load_file, save_file

from mqinfer.workers.engine.loader import make_random_checkpoint

LAYERS = 3
VOCAB = 300


def random_checkpoint(folder: Path, seed: int = 0, damp_last: float = 1.0, keep_layers: int | None = None,
                      **shape) -> str:
    """A random Llama checkpoint (3 layers, hidden 64, unless ``shape`` says otherwise), the last
    layer's output projections scaled by ``damp_last``; with ``keep_layers`` only the first that
    many layers are saved."""
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 512, **shape}
    make_random_checkpoint(folder, dtype="float32", seed=seed, **config)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    for name in (last + "self_attn.o_proj.weight", last + "mlp.down_proj.weight"):
        tensors[name] = tensors[name] * damp_last
    if keep_layers is not None:
        tensors = {k: v for k, v in tensors.items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep_layers}
        hf = json.loads((folder / "config.json").read_text())
        hf["num_hidden_layers"] = keep_layers
        (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(folder)


def run(engine, items, add_after: dict[int, list] | None = None):
    """Run (id, prompt, sampling, speculative) items to the end; ``add_after[step]`` join later.
    After every step, each running request holds only the blocks its tokens need (the blocks of
    rejected proposals went back)."""
    ids = [item[0] for item in items]
    for rid, prompt, sampling, spec in items:
        engine.add_request(rid, prompt, sampling, speculative=spec)
    finished, deltas = {}, {}
    step = 0
    kv = engine.scheduler.kv_cache_manager
    while engine.has_unfinished() or (add_after and any(s >= step for s in add_after)):
        for rid, prompt, sampling, spec in (add_after or {}).get(step, []):
            engine.add_request(rid, prompt, sampling, speculative=spec)
            ids.append(rid)
        for out in engine.step().outputs:
            deltas.setdefault(out.request_id, []).append(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
        for rid in ids:
            request = engine.scheduler.get_request(rid)
            if request is not None:
                assert len(request.block_ids) <= kv.num_blocks_for(request.num_tokens), rid
        step += 1
        assert step < 2000
    return finished, deltas


def prompts(n: int, seed: int = 0, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(length // 2, length))] for _ in range(n)]


def same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for rid in a:
        assert (a[rid].output_token_ids, a[rid].finish_reason) == (b[rid].output_token_ids, b[rid].finish_reason), rid
