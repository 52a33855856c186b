"""Prefix-tree order for a whole job's requests: requests that share a prompt prefix become
neighbours, so a worker meets them while the prefix's KV blocks are still cached.

The order is the depth-first order of the tree of prompts, which is their lexicographic order,
on the most precise prefix the producer can see without the model's tokenizer:
- ``prompt_token_ids``: the token ids themselves;
- a text ``prompt``: its UTF-8 bytes (a shared byte prefix is a shared token prefix up to the
  last token or two);
- ``messages``: each message's role and content in turn, with separators no text contains, so
  two chats that share their system prompt and first turns sort together.

Requests share cached KV only within their cache partition (schemas/cache_scope.py: the tenant
and ``cache_salt`` under the workers' default scope ``tenant``, the salt alone under ``global``), so
the order is first by partition: a prefix group never spans two partitions, and under ``global``
requests without a salt keep the order they had before scopes existed. Within a partition,
token-id requests come first, then text and chats (their bytes compare among themselves). The
sort is stable: requests with the same prompt keep their input order. Nothing else about a
request changes; the results are identified by id, so their order in the output does not depend
on the order the requests ran in.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

from mqinfer.schemas.cache_scope import DEFAULT_PREFIX_CACHE_SCOPE, cache_partition
from mqinfer.schemas.request import Request

T = TypeVar("T", bound=Request)

# Between a message's role and content, and between messages: bytes valid UTF-8 never holds.
_ROLE_END, _MESSAGE_END = b"\xfe", b"\xff"


def prompt_key(request: Request) -> tuple[int, tuple[int, ...] | bytes]:
    """The request's prompt as prefix-tree order compares it: (0, token ids) or (1, bytes)."""
    if request.prompt_token_ids is not None:
        return (0, tuple(request.prompt_token_ids))
    if request.messages is not None:
        return (1, b"".join(m.role.encode() + _ROLE_END + m.content.encode() + _MESSAGE_END
                            for m in request.messages))
    return (1, (request.prompt or "").encode())


def prefix_key(request: Request, scope: str = DEFAULT_PREFIX_CACHE_SCOPE
               ) -> tuple[bytes, int, tuple[int, ...] | bytes]:
    """The request's place in prefix-tree order under the prefix cache ``scope`` (see the module
    docstring): its cache partition, then its prompt."""
    return (cache_partition(scope, request.tenant, request.cache_salt), *prompt_key(request))


def prefix_order(requests: Iterable[T], scope: str = DEFAULT_PREFIX_CACHE_SCOPE) -> list[T]:
    """``requests`` in prefix-tree order under the prefix cache ``scope`` (stable)."""
    return sorted(requests, key=lambda r: prefix_key(r, scope))


__all__ = ["prefix_key", "prefix_order", "prompt_key"]
