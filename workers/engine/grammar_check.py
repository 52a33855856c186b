"""Grammars checked where a crash cannot take the worker with it.

A request's ``response_format`` reaches llguidance's grammar compiler, native code that recurses
over the grammar: a grammar built to be deep enough (a chain of thousands of rules) overflows the
native stack, and a stack overflow is a segmentation fault that ends the whole worker process,
with every request it held. So a grammar the worker has not compiled before goes through three
gates before the worker's own process compiles it:

1. **Bounds** (:func:`check_bounds`): the source's rules, nesting depth, alternatives and regex
   groups are counted without parsing, and a grammar over a bound is refused with a message that
   names the bound. This is cheap and catches the shapes known to recurse deeply.
2. **A checker process** (:class:`GrammarChecker`): a small child process (llguidance and the
   standard library; no torch) compiles the grammar on a thread of ``CHECK_STACK_BYTES`` and
   computes its first token mask, within ``CHECK_TIMEOUT_S``. If the child crashes or runs out of
   time, the grammar is refused (the child is started again for the next one); if the grammar is
   an error or matches no text at all, the child says so. The worker waits for the answer.
3. **The worker compiles it** on a thread with ``COMPILE_STACK_BYTES`` of stack, eight times the
   checker's: the same deterministic computation that fitted in the checker's stack fits here.

The checker's answers for grammars already seen are kept by the caller's cache of compiled
grammars (workers/engine/structured.py), so a popular grammar is checked once per worker.

The checker runs as ``python -m mqinfer.workers.engine.grammar_check``; it reads one JSON object per line
on stdin (first the tokenizer, then grammars) and answers one per line on stdout.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

# The checker's stack for compiling: what the worker's compile thread must be able to exceed.
CHECK_STACK_BYTES = 8 << 20
# The worker's own compile thread: a margin of eight over the checker's.
COMPILE_STACK_BYTES = 64 << 20
# How long the checker may take over one grammar (compiling and its first mask).
CHECK_TIMEOUT_S = 10.0
# How long the checker may take to start and build the tokenizer (a large vocabulary takes ~1 s).
START_TIMEOUT_S = 60.0

# Bounds on a grammar's source, counted before anything compiles it. A chain of 1,000 rules, the
# deepest shape, compiles in 2 MiB of stack; the checker has four times that.
MAX_RULES = 1000
MAX_NESTING = 64
MAX_ALTERNATIVES = 10_000
MAX_REGEX_GROUPS = 1000

_KIND_NAMES = {"json_schema": "the JSON schema", "regex": "the regex", "lark": "the Lark grammar",
               "gbnf": "the GBNF grammar"}

T = TypeVar("T")


def kind_name(kind: str) -> str:
    return _KIND_NAMES.get(kind, f"the {kind} grammar")


# -- bounds --------------------------------------------------------------------------------------
_GBNF_RULE = re.compile(r"::=")
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)


def _structure(source: str, regex: bool) -> tuple[int, int, int]:
    """(deepest nesting of ( [ {, alternatives '|', groups '(') of ``source``, skipping quoted
    strings and, in a regex, escapes and character classes."""
    depth = deepest = bars = groups = 0
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c == "\\":
            i += 2
            continue
        if not regex and c in "\"'":  # a grammar's string literal
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
            i = j + 1
            continue
        if not regex and c == "/" and i + 1 < n and source[i + 1] != "/":  # a Lark regex terminal
            j = i + 1
            while j < n and source[j] not in "/\n":
                j += 2 if source[j] == "\\" else 1
            i = j + 1
            continue
        if not regex and c == "#":  # a comment, to the end of the line
            j = source.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if regex and c == "[":  # a character class: its brackets and bars are characters
            j = i + 1
            if j < n and source[j] == "^":
                j += 1
            if j < n and source[j] == "]":
                j += 1
            level = 1
            while j < n and level:
                if source[j] == "\\":
                    j += 2
                    continue
                if source[j] == "[":
                    level += 1
                elif source[j] == "]":
                    level -= 1
                j += 1
            i = j
            continue
        if c in "([{" and not (regex and c == "{"):
            depth += 1
            deepest = max(deepest, depth)
            if c == "(":
                groups += 1
        elif c in ")]}" and not (regex and c == "}"):
            depth = max(0, depth - 1)
        elif c == "|":
            bars += 1
        i += 1
    return deepest, bars, groups


def check_bounds(kind: str, source: str) -> str | None:
    """Why ``source`` is over this module's bounds (a message naming the bound), or None.

    JSON schemas are not counted here: llguidance bounds their size and depth itself, and the
    checker process catches the rest."""
    if kind == "json_schema":
        return None
    what = kind_name(kind)
    if kind in ("gbnf", "lark"):
        rules = len((_GBNF_RULE if kind == "gbnf" else _LARK_RULE).findall(source))
        if rules > MAX_RULES:
            return f"response_format: {what} has {rules} rules, over the limit of {MAX_RULES}"
    deepest, bars, groups = _structure(source, regex=kind == "regex")
    if deepest > MAX_NESTING:
        return f"response_format: {what} nests {deepest} levels deep, over the limit of {MAX_NESTING}"
    if bars > MAX_ALTERNATIVES:
        return f"response_format: {what} has {bars} alternatives ('|'), over the limit of {MAX_ALTERNATIVES}"
    if kind == "regex" and groups > MAX_REGEX_GROUPS:
        return f"response_format: {what} has {groups} groups, over the limit of {MAX_REGEX_GROUPS}"
    return None


# -- what both processes share -------------------------------------------------------------------
class ByteTokens:
    """The byte tokenizer (workers/engine/tokenizer.py ``ByteTokenizer``) as llguidance reads a tokenizer:
    token i < 256 is the byte i; the rest are special tokens, never part of text."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, bos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode("utf-8"))


def llg_tokenizer(spec: dict) -> Any:
    """llguidance's tokenizer from plain data (:func:`mqinfer.workers.engine.structured.tokenizer_spec`):
    ``{"kind": "bytes", "vocab_size", "eos", "bos_token_id", "eos_token_id"}`` or
    ``{"kind": "hf", "json", "vocab_size", "eos"}``."""
    import llguidance as llg

    eos = spec["eos"] or None
    if spec["kind"] == "bytes":
        wrapper = llg.TokenizerWrapper(ByteTokens(spec["vocab_size"], spec["eos_token_id"], spec["bos_token_id"]))
        return llg.LLTokenizer(wrapper, n_vocab=spec["vocab_size"], eos_token=eos)
    return llg.LLTokenizer(spec["json"], n_vocab=spec["vocab_size"], eos_token=eos)


def compile_grammar(tokenizer: Any, kind: str, source: str, json_options: dict) -> Any:
    """llguidance's matcher for a grammar, in its initial state; ValueError with llguidance's
    message when it does not compile."""
    import llguidance as llg

    if kind == "json_schema":
        grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=json_options)
    else:
        grammar = llg.grammar_from(kind, source)
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(one_line(matcher.get_error()))
    return matcher


def first_mask_problem(matcher: Any) -> str | None:
    """Compute the first token mask of a copy of ``matcher`` (so that the parser limits that bite
    on a mask bite now, not after the first token) and say what is wrong: the grammar matches no
    text at all, or a limit was reached. None when the grammar can start."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        return describe_error(probe.get_error(), consumed=0)
    return None


def describe_error(message: str, consumed: int) -> str:
    """A matcher's error in a request's terms: ``NoExtensionBias`` means no token can extend the
    text (the constraint cannot be completed from here), the rest is llguidance's message."""
    if message.strip().startswith("NoExtensionBias"):
        if consumed == 0:
            return "the constraint matches no text at all (no output can satisfy it)"
        return f"after {consumed} output tokens the constraint allows no continuation: it cannot be completed"
    return one_line(message)


def one_line(message: str) -> str:
    """llguidance's messages can carry a multi-line excerpt of the grammar: keep the first line and
    the lines that say what the error is (``error: unclosed group``)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    details = [line for line in lines[1:] if line.lower().startswith("error")]
    first = lines[0].rstrip(":")
    return "; ".join([first, *details]) if details else first


def on_stack(executor: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
    return executor.submit(fn).result()


def stack_executor(stack_bytes: int, name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has ``stack_bytes`` of stack (the thread starts here,
    while the process-wide setting for new threads says so)."""
    with _STACK_LOCK:
        previous = threading.stack_size(stack_bytes)
        try:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
            executor.submit(lambda: None).result()
        finally:
            threading.stack_size(previous)
    return executor


_STACK_LOCK = threading.Lock()
# What the checker's reader returns when the answer did not come in time.
_TIMED_OUT = b"\0timed out"


# -- the worker's side ---------------------------------------------------------------------------
class GrammarChecker:
    """The checker child process, started on first use and again after a crash or a time-out.

    :meth:`check` returns None for a grammar the worker may compile, or the message of its error
    row. ``tokenizer`` is the plain data of :func:`llg_tokenizer`."""

    def __init__(self, tokenizer: dict, json_options: dict, *, timeout_s: float = CHECK_TIMEOUT_S,
                 stack_bytes: int = CHECK_STACK_BYTES) -> None:
        self._tokenizer = tokenizer
        self._json_options = json_options
        self.timeout_s = timeout_s
        self.stack_bytes = stack_bytes
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self.restarts = 0  # children ended by a crash or a time-out

    def check(self, kind: str, source: str) -> str | None:
        what = kind_name(kind)
        try:
            proc = self._started()
        except OSError as exc:
            return f"response_format: the grammar checker could not start: {exc}"
        try:
            proc.stdin.write(json.dumps({"kind": kind, "source": source}).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            self.restarts += 1
            return self._died(what)
        line = self._read_line(self.timeout_s)
        if line is None:
            self.restarts += 1
            return self._died(what)
        if line is _TIMED_OUT:
            self._stop()
            self.restarts += 1
            return f"response_format: {what} took longer than {self.timeout_s:g}s to compile; it is too complex"
        answer = json.loads(line)
        if answer.get("error"):
            return f"response_format: {what} {answer['error']}"
        return None

    def close(self) -> None:
        self._stop()

    def _started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        from mqinfer.procs import with_death_signal

        env = dict(os.environ, MQINFER_GRAMMAR_CHECK_STACK=str(self.stack_bytes))
        argv, preexec = with_death_signal([sys.executable, "-P", "-m", "mqinfer.workers.engine.grammar_check"],
                                          signal.SIGKILL)
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env, preexec_fn=preexec)
        self._buffer = b""
        hello = {"tokenizer": self._tokenizer, "json_options": self._json_options}
        self._proc.stdin.write(json.dumps(hello).encode() + b"\n")
        self._proc.stdin.flush()
        ready = self._read_line(START_TIMEOUT_S)
        if ready is None or ready is _TIMED_OUT or json.loads(ready).get("ready") is not True:
            self._stop()
            raise OSError("it exited or did not answer while building the tokenizer")
        return self._proc

    def _read_line(self, timeout_s: float) -> bytes | None:
        """The child's next answer line; None when its output ended (it died), ``_TIMED_OUT``
        when ``timeout_s`` passed first."""
        proc = self._proc
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return _TIMED_OUT
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return _TIMED_OUT
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _died(self, what: str) -> str:
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=START_TIMEOUT_S)  # a core dump may take a moment
            except subprocess.TimeoutExpired:
                pass
        self._stop()
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
        return (f"response_format: compiling {what} crashed the grammar checker ({how}); "
                "it is too deep or too large to compile safely")

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


# -- the checker's side --------------------------------------------------------------------------
def _serve(stdin, stdout) -> int:
    hello = json.loads(stdin.readline())
    tokenizer = llg_tokenizer(hello["tokenizer"])
    json_options = hello["json_options"]
    stack = int(os.environ.get("MQINFER_GRAMMAR_CHECK_STACK", CHECK_STACK_BYTES))
    executor = stack_executor(stack, "grammar-check")
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)

        def check() -> str | None:
            try:
                matcher = compile_grammar(tokenizer, request["kind"], request["source"], json_options)
            except ValueError as exc:
                return f"cannot be compiled: {one_line(str(exc))}"
            problem = first_mask_problem(matcher)
            return None if problem is None else f"cannot be used: {problem}"

        stdout.write(json.dumps({"error": on_stack(executor, check)}) + "\n")
        stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash here is expected: no core file
    return _serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
