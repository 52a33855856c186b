"""Prefix-tree order for a whole job's requests: requests that share a prompt prefix become
neighbours, so a worker meets them while the prefix's KV blocks are still cached.

The order is the depth-first order of the tree of prompts, which is their lexicographic order,
on the most precise prefix the producer can see without the model's tokenizer:
- ``prompt_token_ids``: the token ids themselves;
- a text ``prompt``: its UTF-8 bytes (a shared byte prefix is a shared token prefix up to the
  last token or two);
- ``messages``: each message's role and content in turn, with separators no text contains, so
  two chats that share their system prompt and first turns sort together.

Token-id requests come first, then text and chats (their bytes compare among themselves). The
sort is stable: requests with the same prompt keep their input order. Nothing else about a
request changes; the results are identified by id, so their order in the output does not depend
on the order the requests ran in.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

from mqinfer.schemas.request import Request

T = TypeVar("T", bound=Request)

# Between a message's role and content, and between messages: bytes valid UTF-8 never holds.
_ROLE_END, _MESSAGE_END = b"\xfe", b"\xff"


def prefix_key(request: Request) -> tuple[int, tuple[int, ...] | bytes]:
    """The request's place in prefix-tree order (see the module docstring)."""
    if request.prompt_token_ids is not None:
        return (0, tuple(request.prompt_token_ids))
    if request.messages is not None:
        return (1, b"".join(m.role.encode() + _ROLE_END + m.content.encode() + _MESSAGE_END
                            for m in request.messages))
    return (1, (request.prompt or "").encode())


def prefix_order(requests: Iterable[T]) -> list[T]:
    """``requests`` in prefix-tree order (stable)."""
    return sorted(requests, key=prefix_key)


__all__ = ["prefix_key", "prefix_order"]
