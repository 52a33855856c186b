"""The hostile-input corpus: stream entries a careless or malicious producer could send.

Each case is the raw field map of one stream entry and what must become of it:

- ``row``: the request id is known, so the entry ends as an error row with ``code`` (or, with
  ``code`` None, as an ordinary row: the input is odd but valid);
- ``dead``: no usable id, so the entry goes to the dead-letter stream with ``code`` and a reason.

``decode`` is what :func:`mqinfer.schemas.stream.decode_entry` alone says (``None`` when it
accepts the entry and the engine decides later, e.g. an out-of-vocabulary token id).
Ids are unique per case, so a test can map every row back to its case.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import msgspec

pack = msgspec.msgpack.encode

# A valid request to mutate; the tiny model's vocabulary is 264 tokens (256 bytes + specials).
BASE = {"prompt_token_ids": [256, 72, 105], "max_tokens": 3, "temperature": 0.0}


def _j(obj) -> dict[str, bytes]:
    return {"json": json.dumps(obj).encode(), "v": b"1"}


def _p(obj) -> dict[str, bytes]:
    return {"r": pack(obj), "v": b"1"}


def _req(rid: str, **changes) -> dict:
    return {"id": rid, **BASE, **changes}


@dataclass(frozen=True)
class Case:
    name: str
    fields: dict[str, bytes]
    outcome: str  # "row" | "dead"
    code: str | None  # the row's error_code (None: an ordinary row) or the dead letter's
    decode: str | None  # decode_entry's RequestError code, None when it accepts the entry
    rid: str | None = None  # the id the row carries (dead letters have none)


def _row(name: str, fields: dict, code: str | None, rid: str, decode: str | None = "same") -> Case:
    return Case(name, fields, "row", code, code if decode == "same" else decode, rid)


def _dead(name: str, fields: dict, code: str) -> Case:
    return Case(name, fields, "dead", code, code)


_valid = pack(_req("trunc-mp"))
_huge_prompt = "A" * (1 << 20)
# A chain of alternatives 5,000 rules deep (about 110 KB, under the size limit): compiling it
# recursed past the native stack and crashed the worker.
_chain = "\n".join(["root ::= r0", *(f'r{k} ::= "t{k}" | r{k + 1}' for k in range(5000)), 'r5000 ::= "end"'])


def _grammar(text: str, syntax: str = "gbnf") -> dict:
    return {"type": "grammar", "grammar": text, "syntax": syntax}

CASES: list[Case] = [
    # -- broken encodings: no id can be read ---------------------------------------------------
    _dead("truncated msgpack", {"r": _valid[: len(_valid) // 2], "v": b"1"}, "invalid_json"),
    _dead("random bytes as msgpack", {"r": bytes(range(7, 250, 3)), "v": b"1"}, "invalid_json"),
    _dead("truncated json", {"json": b'{"id": "trunc-json", "prompt": "x", "max_tok', "v": b"1"}, "invalid_json"),
    _dead("json with a NaN literal", {"json": b'{"id": "nan-lit", "prompt": "x", "temperature": NaN}', "v": b"1"},
          "invalid_json"),
    _dead("invalid utf-8 in json", {"json": b'{"id": "bad-utf8", "prompt": "\xff\xfe"}', "v": b"1"}, "invalid_json"),
    _dead("json array", _j([1, 2, 3]), "invalid_request"),
    _dead("json string", _j("just text"), "invalid_request"),
    _dead("json null", {"json": b"null", "v": b"1"}, "invalid_request"),
    _dead("msgpack integer", {"r": pack(42), "v": b"1"}, "invalid_request"),
    _dead("deeply nested json", {"json": b'{"id": ' + b"[" * 5000 + b"]" * 5000 + b"}", "v": b"1"},
          "invalid_json"),
    _dead("no payload field", {"x": b"1", "v": b"1"}, "invalid_request"),
    # -- ids that cannot identify a request ---------------------------------------------------------
    _dead("no id", _j({**BASE}), "invalid_request"),
    _dead("numeric id", _j({"id": 12345, **BASE}), "invalid_request"),
    _dead("list id", _p({"id": ["a"], **BASE}), "invalid_request"),
    _dead("binary id", _p({"id": b"bin-id", **BASE}), "invalid_request"),
    _dead("empty id", _j({"id": "", **BASE}), "invalid_request"),
    _dead("id with a newline", _j({"id": "evil\nid", **BASE}), "invalid_request"),
    _dead("id with NUL", _p({"id": "nul\x00id", **BASE}), "invalid_request"),
    _dead("id with an escape sequence", _j({"id": "\x1b[31mred", **BASE}), "invalid_request"),
    _dead("id of 129 characters", _j({"id": "x" * 129, **BASE}), "invalid_request"),
    # -- known id, invalid request: an error row naming the field -----------------------------------
    _row("max_tokens as a string", _j(_req("wt-max", max_tokens="16")), "invalid_request", "wt-max"),
    _row("prompt as a number", _p({"id": "wt-prompt", "prompt": 7}), "invalid_request", "wt-prompt"),
    _row("metadata with a number", _j(_req("wt-meta", metadata={"k": 1})), "invalid_request", "wt-meta"),
    _row("unknown field", _j(_req("unknown-field", colour="blue")), "invalid_request", "unknown-field"),
    _row("negative token id", _j({"id": "neg-token", "prompt_token_ids": [256, -1]}), "invalid_request",
         "neg-token"),
    _row("token id over int32", _p({"id": "big-token", "prompt_token_ids": [256, 2**40]}), "invalid_request",
         "big-token"),
    _row("infinite temperature", {"json": b'{"id": "inf-temp", "prompt": "x", "temperature": 1e999}', "v": b"1"},
         "invalid_request", "inf-temp"),
    _row("NaN temperature (msgpack)", _p(_req("nan-temp", temperature=float("nan"))), "invalid_request",
         "nan-temp"),
    _row("NaN top_p", _p(_req("nan-top-p", top_p=float("nan"))), "invalid_request", "nan-top-p"),
    _row("top_p 0", _j(_req("zero-top-p", top_p=0.0)), "invalid_request", "zero-top-p"),
    _row("infinite deadline", _p(_req("inf-deadline", deadline=float("inf"))), "invalid_request",
         "inf-deadline"),
    _row("max_tokens over int32", _p(_req("huge-max", max_tokens=2**31)), "invalid_request", "huge-max"),
    _row("TTFT target 0", _j(_req("zero-ttft", slo_ttft_ms=0)), "invalid_request", "zero-ttft"),
    _row("negative TPOT target", _p(_req("neg-tpot", slo_tpot_ms=-50)), "invalid_request", "neg-tpot"),
    _row("TTFT target over a day", _j(_req("long-ttft", slo_ttft_ms=86_400_001)), "invalid_request", "long-ttft"),
    _row("TPOT target over int64", _j(_req("huge-tpot", slo_tpot_ms=2**70)), "invalid_request", "huge-tpot"),
    _row("fractional TPOT target", _j(_req("frac-tpot", slo_tpot_ms=12.5)), "invalid_request", "frac-tpot"),
    _row("NaN TTFT target (msgpack)", _p(_req("nan-ttft", slo_ttft_ms=float("nan"))), "invalid_request",
         "nan-ttft"),
    _row("TTFT target as a string", _j(_req("str-ttft", slo_ttft_ms="500")), "invalid_request", "str-ttft"),
    _row("TPOT target true", _j(_req("bool-tpot", slo_tpot_ms=True)), "invalid_request", "bool-tpot"),
    _row("openai line with a TPOT target of 0", _j({"custom_id": "oa-tpot", "method": "POST", "url": "/v1/completions",
                                                    "body": {"prompt": "x", "max_tokens": 2, "slo_tpot_ms": 0}}),
         "invalid_request", "oa-tpot"),
    _row("seed over int64", _p(_req("huge-seed", seed=2**64 - 1)), "invalid_request", "huge-seed"),
    _row("logprobs 1000", _j(_req("many-logprobs", logprobs=1000)), "invalid_request", "many-logprobs"),
    _row("a thousand stop strings", _j(_req("many-stops", stop=["x"] * 1000)), "invalid_request", "many-stops"),
    _row("reply_to outside mqinfer:reply:", _j(_req("reply-outside", reply_to="mqinfer:{requests}")),
         "invalid_request", "reply-outside"),
    _row("reply_to another app's key", _j(_req("reply-other", reply_to="session:admin")), "invalid_request",
         "reply-other"),
    _row("job_id with a control character", _j(_req("bad-job", job_id="job\x07")), "invalid_request", "bad-job"),
    _row("both prompt forms", _j(_req("both-prompts", prompt="x")), "invalid_request", "both-prompts"),
    _row("schema version 2", {"json": json.dumps(_req("v2")).encode(), "v": b"2"}, "unsupported_version", "v2"),
    _row("both payload fields", {"json": json.dumps(_req("two-payloads")).encode(), "r": pack(_req("two-payloads")),
                                 "v": b"1"}, "invalid_request", "two-payloads"),
    _row("entry over 1 MiB", _j({"id": "huge-prompt", "prompt": _huge_prompt}), "invalid_request", "huge-prompt"),
    _row("openai line with a bad body", _j({"custom_id": "oa-bad", "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": "x", "best_of": 5}}), "unsupported_parameter", "oa-bad"),
    # -- valid for the schema, refused by the engine -------------------------------------------------
    _row("out-of-vocabulary token id", _j({"id": "oov-token", "prompt_token_ids": [256, 100_000]}),
         "invalid_token_id", "oov-token", decode=None),
    _row("prompt longer than the context", _p({"id": "long-prompt", "prompt_token_ids": [65] * 600}),
         "prompt_too_long", "long-prompt", decode=None),
    _row("another model", _j(_req("other-model", model="llama-70b")), "model_mismatch", "other-model",
         decode=None),
    _row("stop token outside the vocabulary", _j(_req("oov-stop", stop_token_ids=[72, 100_000])),
         "invalid_token_id", "oov-stop", decode=None),
    _row("huge repetition penalty", _j(_req("huge-rep", repetition_penalty=1e308)), "invalid_request", "huge-rep"),
    _row("tiny repetition penalty", _j(_req("tiny-rep", repetition_penalty=1e-308)), "invalid_request", "tiny-rep"),
    # -- constraints that crash a compiler or can never be met ---------------------------------------
    _row("grammar bomb: 5,000 chained rules", _j(_req("gbnf-chain", response_format=_grammar(_chain))),
         "invalid_response_format", "gbnf-chain", decode=None),
    _row("grammar nested 200 deep", _j(_req("lark-deep", response_format=_grammar(
        "start: " + "(" * 200 + '"a"' + ")" * 200, "lark"))), "invalid_response_format", "lark-deep", decode=None),
    _row("regex that matches nothing", _j(_req("regex-never", response_format={"type": "regex", "regex": "[a&&b]"})),
         "invalid_response_format", "regex-never", decode=None),
    _row("grammar rule x ::= x", _j(_req("gbnf-loop", response_format=_grammar("root ::= x\nx ::= x"))),
         "invalid_response_format", "gbnf-loop", decode=None),
    _row("schema whose refs form a cycle", _j(_req("schema-cycle", response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                                         "$ref": "#/$defs/a"}}})),
         "invalid_response_format", "schema-cycle", decode=None),
    _row("regex with an unclosed group", _j(_req("regex-open", response_format={"type": "regex", "regex": "(ab"})),
         "invalid_response_format", "regex-open", decode=None),
    # -- odd but valid: an ordinary row, the id kept as data and never used as a path ---------------
    _row("id with path separators", _j(_req("../../etc/passwd")), None, "../../etc/passwd", decode=None),
    _row("id with a backslash and dots", _p(_req("..\\..\\win.ini")), None, "..\\..\\win.ini", decode=None),
    _row("unicode id", _j(_req("идентификатор-🙂")), None, "идентификатор-🙂", decode=None),
    _row("extra tracing field", {**_j(_req("traced")), "traceparent": b"00-abc-def-01"}, None, "traced",
         decode=None),
]
