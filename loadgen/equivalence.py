"""Reference equivalence figures: how often the engine's greedy output equals transformers'.

For each supported family (Llama, Mistral, Qwen2, Qwen3) this makes a tiny random checkpoint
with transformers (``save_pretrained``, float32), then generates greedily from the same
prompts through ``LLMEngine`` (all prompts in one continuous batch, prefix caching on, some
prompts sharing a prefix) and through transformers' ``generate(do_sample=False)`` (one prompt
at a time, no padding), in float32 and in bfloat16, and compares them token for token.

Per family and dtype it prints:

- ``identical``: the share of requests whose output equals the reference's to its last token;
- ``near-tie``: requests whose first difference falls where the reference's two best scores
  (logits) are within 1e-4 of each other, relatively (``|a - b| <= 1e-4 * max(|a|, |b|)``),
  and the engine picked the other of the two: either token counts as a match there, and the
  rest is not compared since the two continue from different contexts;
- ``different``: the rest, and the mean position (0-based index of the generated token) of the
  first difference over the requests that are not identical;
- ``tie positions``: positions of the reference outputs where its two best scores are such a
  near-tie, whatever the engine did.

float32 is expected to be all identical or near-tie; bfloat16 rounds differently in every
implementation and is reported, not held to a rule. Run::

    python -m mqinfer.loadgen.equivalence [--prompts 64] [--max-tokens 32] [--families ...]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mqinfer.loadgen.bench_options import positive_int

FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
DTYPES = ("float32", "bfloat16")
NEAR_TIE_RTOL = 1e-4

# Per-family settings on top of the shared shape: what makes each family itself.
_FAMILY_EXTRA = {
    "Llama": {},
    "Mistral": {"sliding_window": None},
    "Qwen2": {"tie_word_embeddings": True},  # and attention bias, Qwen2's default
    "Qwen3": {"head_dim": 32},  # q/k norm is always on in Qwen3
}


@dataclass(frozen=True)
class Shape:
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 512
    initializer_range: float = 0.1


@dataclass(frozen=True)
class Reference:
    """One prompt's greedy output from transformers, with its two best scores per position."""

    tokens: list[int]
    # (best token, best score, second token, second score) per generated position.
    top2: list[tuple[int, float, int, float]]


@dataclass(frozen=True)
class Comparison:
    verdict: str  # "identical" | "near_tie" | "different"
    # Index of the first generated token that differs (None when identical).
    first_difference: int | None


@dataclass
class Figures:
    family: str
    dtype: str
    num_requests: int = 0
    num_identical: int = 0
    num_near_tie: int = 0
    num_different: int = 0
    num_tie_positions: int = 0
    num_positions: int = 0
    first_differences: list[int] = field(default_factory=list)

    @property
    def identical_share(self) -> float:
        return self.num_identical / self.num_requests if self.num_requests else 0.0

    @property
    def mean_first_difference(self) -> float | None:
        d = self.first_differences
        return sum(d) / len(d) if d else None


def is_near_tie(a: float, b: float, rtol: float = NEAR_TIE_RTOL) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def compare(tokens: Sequence[int], reference: Reference, rtol: float = NEAR_TIE_RTOL) -> Comparison:
    """Compare the engine's output with the reference's under the near-tie rule."""
    ref = reference.tokens
    n = min(len(tokens), len(ref))
    for i in range(n):
        if tokens[i] != ref[i]:
            best, s1, second, s2 = reference.top2[i]
            if tokens[i] in (best, second) and is_near_tie(s1, s2, rtol):
                return Comparison("near_tie", i)
            return Comparison("different", i)
    if len(tokens) != len(ref):
        return Comparison("different", n)
    return Comparison("identical", None)


def make_checkpoint(family: str, folder: Path, shape: Shape = Shape(), seed: int = 0) -> Path:
    """A tiny random ``family`` checkpoint written by transformers in float32.

    Each family draws its own weights from ``seed``: Mistral without a sliding window has
    Llama's architecture, and the same weights would only repeat Llama's figures.
    """
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    config = config_cls(**vars(shape), bos_token_id=1, eos_token_id=2, **_FAMILY_EXTRA[family])
    torch.manual_seed(seed * len(FAMILIES) + FAMILIES.index(family))
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    return Path(folder)


def make_prompts(n: int, vocab_size: int, seed: int = 0, max_len: int = 96) -> list[list[int]]:
    """Random prompts of 2..max_len tokens; every fourth shares a 40-token prefix (cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(40)]
    prompts = []
    for i in range(n):
        if i % 4 == 0:
            prompts.append(shared + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, max_len - 40))])
        else:
            prompts.append([rng.randrange(3, vocab_size) for _ in range(rng.randint(2, max_len))])
    return prompts


def reference_outputs(folder: Path, dtype: str, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[Reference]:
    """transformers' greedy generation, one prompt at a time, EOS off."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            result = model.generate(
                torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                output_logits=True, return_dict_in_generate=True,
            )
            tokens = result.sequences[0, len(prompt):].tolist()
            top2 = []
            for step in result.logits:
                values, ids = step[0].float().topk(2)
                top2.append((int(ids[0]), float(values[0]), int(ids[1]), float(values[1])))
            out.append(Reference(tokens, top2))
    return out


def engine_outputs(folder: Path, dtype: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                   num_threads: int | None = None) -> list[list[int]]:
    """The engine's greedy outputs, every prompt in one continuous batch."""
    from mqinfer.scheduler.request import SamplingParams
    from mqinfer.workers.config import EngineConfig
    from mqinfer.workers.engine.core import LLMEngine

    longest = max(len(p) for p in prompts) + max_tokens
    engine = LLMEngine(EngineConfig(
        model=str(folder), dtype=dtype, num_threads=num_threads, max_num_seqs=len(prompts),
        max_num_batched_tokens=max(2048, len(prompts)), num_kv_blocks=len(prompts) * (-(-longest // 16)) + 1,
    ))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), list(prompt), sampling)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                if out.finish_reason != "length":
                    raise RuntimeError(f"request {out.request_id} ended with {out.finish_reason}: {out.error}")
                done[out.request_id] = out.output_token_ids
    return [done[str(i)] for i in range(len(prompts))]


def figures_for(family: str, dtype: str, outputs: Sequence[Sequence[int]], references: Sequence[Reference],
                rtol: float = NEAR_TIE_RTOL) -> Figures:
    figures = Figures(family, dtype)
    for tokens, ref in zip(outputs, references, strict=True):
        figures.num_requests += 1
        figures.num_positions += len(ref.top2)
        figures.num_tie_positions += sum(1 for _, a, _, b in ref.top2 if is_near_tie(a, b, rtol))
        result = compare(tokens, ref, rtol)
        if result.verdict == "identical":
            figures.num_identical += 1
            continue
        figures.first_differences.append(result.first_difference)
        if result.verdict == "near_tie":
            figures.num_near_tie += 1
        else:
            figures.num_different += 1
    return figures


def run_family(family: str, dtypes: Sequence[str], prompts: Sequence[Sequence[int]], max_tokens: int,
               workdir: Path, shape: Shape = Shape(), seed: int = 0, num_threads: int | None = None) -> list[Figures]:
    folder = make_checkpoint(family, workdir / family.lower(), shape, seed)
    results = []
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        references = reference_outputs(folder, dtype, prompts, max_tokens)
        outputs = engine_outputs(folder, dtype, prompts, max_tokens, num_threads)
        results.append(figures_for(family, dtype, outputs, references))
    return results


def format_table(rows: Sequence[Figures]) -> str:
    header = ("family", "dtype", "requests", "identical", "near-tie", "different", "mean 1st diff",
              "tie positions")
    lines = [header]
    for f in rows:
        mean = f.mean_first_difference
        lines.append((
            f.family, f.dtype, str(f.num_requests),
            f"{f.identical_share:.1%} ({f.num_identical})", str(f.num_near_tie), str(f.num_different),
            "-" if mean is None else f"{mean:.1f}", f"{f.num_tie_positions}/{f.num_positions}",
        ))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines)


def _choices(allowed: Sequence[str]):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)} (comma-separated), got {text!r}")
        return items
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mqinfer.loadgen.equivalence", description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=positive_int, default=64, help="prompts per family (64)")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="tokens generated per prompt (32)")
    parser.add_argument("--families", type=_choices(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--dtypes", type=_choices(DTYPES), default=list(DTYPES))
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed (0)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = Shape()
    prompts = make_prompts(args.prompts, shape.vocab_size, args.seed)
    rows: list[Figures] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mqinfer-equivalence-") as tmp:
        for family in args.families:
            rows.extend(run_family(family, args.dtypes, prompts, args.max_tokens, Path(tmp), shape, args.seed,
                                   args.threads))
            print(f"... {family} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    print(f"greedy equivalence vs transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{args.prompts} prompts x {args.max_tokens} tokens, near-tie rtol {NEAR_TIE_RTOL:g}, "
          f"shape {vars(shape)}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
