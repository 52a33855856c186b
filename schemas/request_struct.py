"""The request wire type itself: the msgspec struct every producer sends and every worker decodes,
its field constraints (as ``Annotated`` aliases, so that msgspec checks them while decoding and
names the path of a bad value, e.g. ``$.max_tokens``) and its cross-field rules.

:mod:`mqinfer.schemas.request` (which re-exports every name here) decodes and encodes it, and
:mod:`mqinfer.schemas.openai_batch` maps OpenAI Batch lines onto it; both import it from here.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

import msgspec

from mqinfer.schemas.cache_scope import MAX_CACHE_SALT_LENGTH
from mqinfer.schemas.response_format import ResponseFormat

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_ID_LENGTH = 128
MAX_STOP_STRINGS = 16
# OpenAI's limits: at most 128 choices per request, 300 logit_bias entries of -100..100 each.
MAX_CHOICES = 128
MAX_LOGIT_BIAS = 300
REPLY_PREFIX = "mqinfer:reply:"

# C0, DEL and C1 controls: they break log lines, file names and terminal output.
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH)]
Label = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
# Token ids are stored as int32 in the results dataset; no vocabulary comes near that bound.
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
PositiveTokenCount = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
# Any signed 64-bit value (torch.Generator.manual_seed takes these; msgpack carries them).
Seed = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]
StopStrings = Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP_STRINGS)]
Logprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
Priority = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
ReplyTo = Annotated[str, msgspec.Meta(pattern=f"^{REPLY_PREFIX}.", max_length=512)]
Role = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
NumChoices = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)]
# OpenAI's presence and frequency penalties.
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# vLLM's and Hugging Face's repetition penalty: 1 is off, above 1 discourages repeats. It divides
# (or multiplies) a seen token's logit, so it is bounded to keep logits finite and meaningful.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
RepetitionPenalty = Annotated[float, msgspec.Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
Bias = Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]
# A latency target in milliseconds: at least 1, at most a day (a longer one is a mistake, not a target).
MAX_SLO_MS = 86_400_000
SloMs = Annotated[int, msgspec.Meta(ge=1, le=MAX_SLO_MS)]
# Token id -> bias. JSON object keys are text: "50256" decodes as the token id 50256.
LogitBias = Annotated[dict[TokenId, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CACHE_SALT_LENGTH)]
# A request's labels travel into its result row and every cost row it causes, and reports group
# by them: OpenAI's limits on such labels (16 pairs, keys of 64 characters, values of 512) keep
# the rows small and the groups meaningful.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_LENGTH = 64
MAX_METADATA_VALUE_LENGTH = 512
MetadataKey = Annotated[str, msgspec.Meta(max_length=MAX_METADATA_KEY_LENGTH)]
MetadataValue = Annotated[str, msgspec.Meta(max_length=MAX_METADATA_VALUE_LENGTH)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], msgspec.Meta(max_length=MAX_METADATA_KEYS)]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One turn of a chat prompt; the worker renders a list of them with the model's template."""

    role: Role
    content: str


class Request(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One generation request, exactly as it travels (JSONL line, Parquet row, stream entry).

    Exactly one of ``prompt`` (text), ``prompt_token_ids`` or ``messages`` (a chat, rendered by
    the worker with the model's chat template) is given. ``api`` is set only by the OpenAI Batch
    mapping: ``"completions"`` or ``"chat"`` (which endpoint the line named), so that the output
    side can answer in the OpenAI format; it is None for native requests. Decoding a ``stop``
    given as a single string normalises it to a one-element list.

    ``n`` asks for that many choices of the same prompt (one result row each, told apart by
    their ``index``); the penalties and ``logit_bias`` change the logits before sampling, with
    OpenAI's meaning (``presence_penalty`` and ``frequency_penalty`` count the output so far,
    ``repetition_penalty`` the prompt and the output, as in vLLM and Hugging Face).
    """

    id: RequestId
    prompt: str | None = None
    prompt_token_ids: TokenIds | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    max_tokens: PositiveTokenCount = 16
    min_tokens: TokenCount = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TokenCount = 0
    seed: Seed | None = None
    stop: StopStrings | StopString = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    logprobs: Logprobs | None = None
    n: NumChoices = 1
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    logit_bias: LogitBias = {}
    # Constrains the output to JSON, a JSON Schema, a regex or a grammar (schemas/response_format.py).
    response_format: ResponseFormat | None = None
    # False keeps the request out of speculative decoding (the worker's --speculative).
    speculative: bool = True
    tenant: Label = "default"
    # Requests share cached prompt KV only with requests of the same salt (and, under the worker's
    # default --prefix-cache-scope tenant, of the same tenant): schemas/cache_scope.py.
    cache_salt: CacheSalt | None = None
    model: str | None = None
    request_type: Label = "default"
    priority: Priority = 0
    deadline: float | None = None
    # Latency targets: time to first token (from enqueue) and time per output token after it, in
    # milliseconds. A request with either is interactive: while such requests run, the worker sizes
    # its steps to meet them (scheduler/slo.py), and its result row says whether they were met
    # (``slo_met``). Without them the worker's --tenant-slos default for the tenant applies, if any.
    slo_ttft_ms: SloMs | None = None
    slo_tpot_ms: SloMs | None = None
    reply_to: ReplyTo | None = None
    job_id: RequestId | None = None
    metadata: Metadata = {}
    api: Literal["completions", "chat"] | None = None

    def __post_init__(self) -> None:
        # msgspec reports a ValueError raised here as a ValidationError with this message.
        if _CONTROL_CHARS.search(self.id):
            raise ValueError("id must not contain control characters - at `$.id`")
        if self.job_id is not None and _CONTROL_CHARS.search(self.job_id):
            raise ValueError("job_id must not contain control characters - at `$.job_id`")
        if any(_CONTROL_CHARS.search(key) for key in self.metadata):
            raise ValueError("metadata keys must not contain control characters - at `$.metadata`")
        given = [
            name
            for name, value in (
                ("prompt", self.prompt),
                ("prompt_token_ids", self.prompt_token_ids),
                ("messages", self.messages),
            )
            if value is not None
        ]
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise ValueError(
                f"exactly one of `prompt`, `prompt_token_ids` or `messages` is required, got {got} - at `$`"
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
                " - at `$.min_tokens`"
            )
        if not math.isfinite(self.temperature):
            raise ValueError("temperature must be a finite number - at `$.temperature`")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number from {MIN_REPETITION_PENALTY} to "
                             f"{MAX_REPETITION_PENALTY} - at `$.repetition_penalty`")
        if self.deadline is not None and not math.isfinite(self.deadline):
            raise ValueError("deadline must be a finite number of unix seconds - at `$.deadline`")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


def usable_id(value: object) -> str | None:
    """``value`` if it can identify a request (a str of 1..128 chars, no control chars), else None."""
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH and not _CONTROL_CHARS.search(value):
        return value
    return None
