"""Structured output: compiled grammars, each constrained request's matcher, and its token masks.

A request whose ``SamplingParams.grammar`` is set (``response_format``: a JSON Schema, any JSON
object, a regex, a Lark or GBNF grammar) gets an llguidance matcher when it joins the engine. Per
step, for every such request that samples:

1. before the forward pass, :meth:`StructuredOutputs.begin_step` starts filling the request's
   token bitmask (one bit per vocabulary entry: may this token come next?) on a background
   thread; llguidance releases the GIL while it computes, so the mask is ready by the time the
   logits are;
2. the model runner calls :meth:`StepMasks.apply` before sampling: disallowed logits become
   -inf, on the constrained rows only (unconstrained requests in the batch pay nothing, and a
   batch without constrained requests does not even start the thread);
3. after the step, :meth:`StructuredOutputs.advance` feeds the sampled token to the matcher; when
   the grammar can take nothing more the request ends with ``stop``.

EOS (and the request's ``stop_token_ids``) are allowed exactly where the grammar accepts the
output so far. A complete grammar ends its request even before ``min_tokens`` and whatever
``ignore_eos`` says: nothing could follow. The matcher lives here, not in the KV cache, so a preempted request keeps it: the
tokens it already generated stay consumed while their KV is recomputed. Speculative decoding is
off for constrained requests (the engine clears their ``speculative`` flag): their proposals would
need a mask per proposed position.

Compiled grammars are shared: a least-recently-used cache keyed by a digest of the grammar holds
a matcher in its initial state per grammar (and the error of a grammar that does not compile),
and each request starts from a copy of it.

Validity: a finished request's output validated (``schema_valid``) when it ended ``stop`` with
the grammar accepting its text: the grammar completed, or EOS or a stop token came where it
accepted, and no stop string cut the text short. A request cut by ``max_tokens`` ends ``length``
and is not valid.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from mqinfer.kernels.cpu_ops import apply_token_bitmask, unpack_bitmask
from mqinfer.schemas.response_format import GrammarSpec
from mqinfer.workers.engine.grammar_check import (
    COMPILE_STACK_BYTES,
    GrammarChecker,
    check_bounds,
    compile_grammar,
    describe_error,
    first_mask_problem,
    kind_name,
    llg_tokenizer,
    on_stack,
    one_line,
    stack_executor,
)

if TYPE_CHECKING:
    import llguidance

    from mqinfer.scheduler.output import ScheduledRequest
    from mqinfer.scheduler.request import EngineRequest
    from mqinfer.workers.engine.tokenizer import Tokenizer

# Compiled grammars kept (a compiled JSON Schema is tens to hundreds of KiB).
GRAMMAR_CACHE_SIZE = 256
# The largest grammar source accepted (a JSON Schema as JSON text, a regex, a grammar).
MAX_GRAMMAR_BYTES = 256 << 10
# JSON output without free whitespace: one space after ':' and ',' as json.dumps writes it. Small
# models given free whitespace can pad a document with newlines until max_tokens. A schema may
# choose otherwise with llguidance's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(Exception):
    """A grammar that cannot be used, with a message naming the field it came from."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - the worker extra installs it
        raise GrammarError("response_format needs the llguidance package (pip install 'mqinfer[worker]')") from None
    return llguidance


def tokenizer_spec(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> dict:
    """The engine's tokenizer as plain data that llguidance's tokenizer is built from, here and in
    the grammar checker process (:func:`mqinfer.workers.engine.grammar_check.llg_tokenizer`): the byte
    tokenizer of the tiny model, or a ``tokenizers`` tokenizer (a checkpoint's tokenizer.json, or
    one rebuilt from a GGUF file) as its JSON. ``vocab_size`` is the model's (the logits' width);
    ``eos_token_ids`` all end the text."""
    from mqinfer.workers.engine.tokenizer import ByteTokenizer, HFTokenizer

    eos = sorted(eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "bytes", "vocab_size": max(vocab_size, tokenizer.vocab_size), "eos": eos,
                "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    if isinstance(tokenizer, HFTokenizer):
        return {"kind": "hf", "json": tokenizer.to_json(), "vocab_size": max(vocab_size, tokenizer.vocab_size),
                "eos": eos}
    raise GrammarError(f"response_format: no grammar support for a {type(tokenizer).__name__}")


def build_tokenizer(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the engine's tokenizer (see :func:`tokenizer_spec`)."""
    _llguidance()
    return llg_tokenizer(tokenizer_spec(tokenizer, vocab_size, eos_token_ids))


class GrammarCompiler:
    """Grammars compiled against one tokenizer, the most recently used ``capacity`` of them kept.

    A grammar not seen before is bounded (:func:`~mqinfer.workers.engine.grammar_check.check_bounds`),
    then checked by ``checker`` (a :class:`~mqinfer.workers.engine.grammar_check.GrammarChecker`, the
    child process where a crash or a hang costs nothing), then compiled here on a thread with a
    large stack. Without a checker (tests of the compiler alone) the first-mask check runs here."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, capacity: int = GRAMMAR_CACHE_SIZE,
                 checker: GrammarChecker | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.tokenizer = tokenizer
        self.capacity = capacity
        self.checker = checker
        # key -> a matcher in its initial state, or the message of a grammar that failed.
        self._cache: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._cache)

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for ``spec``; GrammarError naming the problem and ``spec.path``."""
        key = spec.key
        compiled = self._cache.get(key)
        if compiled is None:
            self.misses += 1
            compiled = self._compile(spec)
            self._cache[key] = compiled
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        else:
            self.hits += 1
            self._cache.move_to_end(key)
        if isinstance(compiled, str):
            raise GrammarError(f"{compiled} - at `{spec.path}`")
        return compiled.deep_copy()

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _compile(self, spec: GrammarSpec) -> llguidance.LLMatcher | str:
        size = len(spec.source.encode("utf-8"))
        what = kind_name(spec.kind)
        if size > MAX_GRAMMAR_BYTES:
            return f"response_format: {what} is {size} bytes, over the limit of {MAX_GRAMMAR_BYTES} bytes"
        over = check_bounds(spec.kind, spec.source)
        if over is not None:
            return over
        _llguidance()
        if self.checker is not None:
            refused = self.checker.check(spec.kind, spec.source)
            if refused is not None:
                return refused
        if self._executor is None:
            self._executor = stack_executor(COMPILE_STACK_BYTES, "grammar-compile")

        def build() -> llguidance.LLMatcher | str:
            try:
                matcher = compile_grammar(self.tokenizer, spec.kind, spec.source, JSON_OPTIONS)
            except ValueError as exc:
                return f"response_format: {what} cannot be compiled: {one_line(str(exc))}"
            if self.checker is None:
                problem = first_mask_problem(matcher)
                if problem is not None:
                    return f"response_format: {what} cannot be used: {problem}"
            return matcher

        return on_stack(self._executor, build)


@dataclass
class _State:
    """One constrained request: its matcher and what ends its text besides the grammar."""

    spec: GrammarSpec
    matcher: llguidance.LLMatcher
    # Tokens that may end the request where the grammar accepts: its EOS and stop_token_ids.
    end_token_ids: tuple[int, ...]
    # Those of them the mask does not already allow with llguidance's EOS.
    extra_end_ids: tuple[int, ...] = ()
    # Tokens sampled that are part of the text (all but a final stop token), fed to the matcher.
    num_consumed: int = 0
    # The grammar accepts the text so far.
    accepting: bool = False


@dataclass
class MaskStats:
    """Running totals of the token masks: how many were filled, the seconds filling them took, and
    the seconds sampling waited for them (the part the forward pass did not hide)."""

    masks: int = 0
    steps: int = 0
    fill_seconds: float = 0.0
    wait_seconds: float = 0.0


class StepMasks:
    """One step's token masks: filled (in the background, or at once) from the constrained
    requests' matchers, applied to their logits rows before sampling."""

    def __init__(self, rows: dict[int, int], extra_ends: list[tuple[int, tuple[int, ...]]], eos_token_id: int,
                 bitmask: torch.Tensor, fill: Future | None, stats: MaskStats) -> None:
        # Index into the step's scheduled requests -> row of ``bitmask``.
        self.rows = rows
        # (row, tokens) that take the row's EOS bit: stop tokens and EOS ids beyond llguidance's.
        self._extra_ends = extra_ends
        self._eos = eos_token_id
        self.bitmask = bitmask
        self._fill = fill
        self._stats = stats
        self._ready = False

    def wait(self) -> None:
        """Until the masks are filled (re-raises what the filling raised)."""
        if self._ready:
            return
        fill, self._fill = self._fill, None
        if fill is not None:
            t0 = time.perf_counter()
            fill.result()
            self._stats.wait_seconds += time.perf_counter() - t0
        self._end_where_eos()
        self._ready = True

    def _end_where_eos(self) -> None:
        """Give each row's extra end tokens the row's EOS bit: they may come exactly where EOS may."""
        words = self.bitmask.shape[1]
        eos_word, eos_bit = divmod(self._eos, 32)
        for row, ends in self._extra_ends:
            on = (int(self.bitmask[row, eos_word]) >> eos_bit) & 1
            for token in ends:
                word, bit = divmod(token, 32)
                if word >= words:
                    continue
                value = int(self.bitmask[row, word]) & 0xFFFFFFFF
                value = value | (1 << bit) if on else value & ~(1 << bit)
                self.bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """``[n, vocab_size]`` bool: which tokens each masked row may sample."""
        self.wait()
        return unpack_bitmask(self.bitmask, vocab_size)

    def apply(self, logits: torch.Tensor, sample_of: Sequence[int], in_place: bool = False) -> torch.Tensor:
        """``logits`` (one row per sampling row; ``sample_of[j]`` is the scheduled request of row
        ``j``) with -inf wherever a constrained row's grammar forbids the token, in place or (to
        keep the raw logits for logprobs) in a copy. Unconstrained rows are untouched."""
        picked = [(j, self.rows[i]) for j, i in enumerate(sample_of) if i in self.rows]
        self.wait()
        if not picked:
            return logits
        out = logits if in_place else logits.clone()
        mask_rows = [r for _, r in picked]
        bitmask = self.bitmask if mask_rows == list(range(self.bitmask.shape[0])) else self.bitmask[mask_rows]
        apply_token_bitmask(out, bitmask, torch.tensor([j for j, _ in picked], dtype=torch.int64))
        return out


class StructuredOutputs:
    """The engine's constrained requests: their matchers, each step's masks, their validity.

    ``background`` False fills the masks on the calling thread when the step begins (the same
    computation, for tests and measurements). ``mask_threads``: threads llguidance uses to fill
    a step's masks (on a CPU engine the forward pass has the cores, so one is enough).
    ``isolate`` (the default) checks each new grammar in the grammar checker process before this
    process compiles it (workers/engine/grammar_check.py); False compiles here at once.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 background: bool = True, mask_threads: int = 1, cache_size: int = GRAMMAR_CACHE_SIZE,
                 isolate: bool = True) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = tuple(sorted(eos_token_ids))
        self.background = background
        self._mask_threads = mask_threads
        self._cache_size = cache_size
        self._isolate = isolate
        self._compiler: GrammarCompiler | None = None
        self._executor: Any = None
        self._thread: ThreadPoolExecutor | None = None
        self._states: dict[str, _State] = {}
        self.stats = MaskStats()

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on the first constrained request (a large vocabulary takes about a second)."""
        if self._compiler is None:
            llg = _llguidance()
            spec = tokenizer_spec(self._tokenizer, self.vocab_size, self._eos_ids)
            checker = GrammarChecker(spec, JSON_OPTIONS) if self._isolate else None
            self._compiler = GrammarCompiler(llg_tokenizer(spec), self._cache_size, checker)
            self._executor = llg.LLExecutor(num_threads=self._mask_threads)
        return self._compiler

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def add(self, request: EngineRequest) -> None:
        """Start ``request``'s matcher; GrammarError when its grammar cannot be used."""
        sampling = request.sampling
        spec = sampling.grammar
        if spec is None:
            raise ValueError(f"request {request.request_id!r} has no grammar")
        matcher = self.compiler.matcher(spec)
        ends = tuple(sorted(set(request.eos_token_ids) | set(sampling.stop_token_ids)))
        eos = self.compiler.tokenizer.eos_token
        extra = tuple(t for t in ends if t != eos and t < self.vocab_size)
        self._states[request.request_id] = _State(spec, matcher, ends, extra, accepting=matcher.is_accepting())

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._compiler is not None:
            self._compiler.close()

    # -- one step -----------------------------------------------------------------------------
    def begin_step(self, scheduled: Sequence[ScheduledRequest]) -> StepMasks | None:
        """Start filling the masks of the constrained requests that sample in this step; None
        when none does. The caller must ``wait()`` on the result before the matchers move on."""
        if not self._states:
            return None
        rows: dict[int, int] = {}
        matchers: list[tuple[Any, int]] = []
        extra_ends: list[tuple[int, tuple[int, ...]]] = []
        for i, sr in enumerate(scheduled):
            state = self._states.get(sr.request.request_id)
            if state is None or not sr.needs_sample:
                continue
            if state.extra_end_ids:
                extra_ends.append((len(matchers), state.extra_end_ids))
            rows[i] = len(matchers)
            matchers.append((state.matcher, len(matchers)))
        if not matchers:
            return None
        words = -(-self.compiler.tokenizer.vocab_size // 32)
        bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
        eos = self.compiler.tokenizer.eos_token
        self.stats.steps += 1
        self.stats.masks += len(matchers)
        if not self.background:
            self._fill(matchers, bitmask)
            return StepMasks(rows, extra_ends, eos, bitmask, None, self.stats)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return StepMasks(rows, extra_ends, eos, bitmask, self._thread.submit(self._fill, matchers, bitmask),
                         self.stats)

    def _fill(self, matchers: list[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        # Row k of the bitmask for the matcher paired with k; llguidance writes the rows in place.
        # One fill runs at a time (the step waits for it), so the total needs no lock.
        t0 = time.perf_counter()
        rows, words = bitmask.shape
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows)
        self.stats.fill_seconds += time.perf_counter() - t0

    def advance(self, request: EngineRequest, new_token_ids: Sequence[int]) -> tuple[str, str | None] | None:
        """Feed a step's new tokens to the request's matcher. Returns None while the request may go
        on, ``("done", None)`` when the grammar is complete (nothing but EOS may follow), or
        ``("error", message)`` when the matcher failed (a parser limit reached)."""
        state = self._states.get(request.request_id)
        if state is None or not new_token_ids:
            return None
        matcher = state.matcher
        tokens = list(new_token_ids)
        if request.is_finished and tokens[-1] in state.end_token_ids and _ended_by_token(request, tokens[-1]):
            tokens.pop()  # the token that ended the request is not text
        for token in tokens:
            if not matcher.consume_token(token):
                return "error", (f"response_format: the grammar rejected output token {state.num_consumed}"
                                 f" ({token}): {one_line(matcher.get_error())} - at `{state.spec.path}`")
            state.num_consumed += 1
        state.accepting = matcher.is_accepting()
        if matcher.is_error():
            problem = describe_error(matcher.get_error(), state.num_consumed)
            return "error", f"response_format: {problem} - at `{state.spec.path}`"
        if matcher.is_stopped():
            return "done", None
        return None

    def finish(self, request_id: str, finish_reason: str | None, text_cut: bool) -> bool | None:
        """Whether the finished request's text validated (see the module docstring), forgetting
        it; None for an unconstrained request, or one that ended in an error (it has no text)."""
        state = self._states.pop(request_id, None)
        if state is None or finish_reason == "error":
            return None
        return finish_reason == "stop" and state.accepting and not text_cut


def _ended_by_token(request: EngineRequest, token: int) -> bool:
    """The request ended because ``token`` is one of its stop tokens (not by a length limit)."""
    from mqinfer.scheduler.request import RequestStatus

    sampling = request.sampling
    if request.status is not RequestStatus.FINISHED_STOPPED:
        return False
    return token in sampling.stop_token_ids or (token in request.eos_token_ids and not sampling.ignore_eos)


def default_mask_threads(device: torch.device) -> int:
    """Threads for filling masks: one beside a CPU forward pass (which has the cores); on a GPU,
    half the cores, at most 8, so that a large batch's masks are ready before its logits."""
    if device.type == "cpu":
        return 1
    return max(1, min(8, (os.cpu_count() or 2) // 2))


__all__ = [
    "GRAMMAR_CACHE_SIZE",
    "GrammarCompiler",
    "GrammarError",
    "MAX_GRAMMAR_BYTES",
    "StepMasks",
    "StructuredOutputs",
    "build_tokenizer",
    "tokenizer_spec",
    "default_mask_threads",
]
