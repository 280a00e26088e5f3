"""Admission of an OpenAI request: read the body within its limit, check its shape, keep its bytes.

The gateway validates only what it needs to route and to refuse obvious garbage with a clear 400.
The body is forwarded byte for byte: fields it does not know (`vllm_xargs`, `top_k`,
`skip_special_tokens`, `priority`, ...) reach the worker unchanged, and vLLM validates the rest.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import replace
from typing import Any

import orjson

from mineru_gateway.api.limits import RequestLimits
from mineru_gateway.api.media import MediaPolicy
from mineru_gateway.api.payload import loads
from mineru_gateway.cache.keys import cache_tag
from mineru_gateway.cost import CostInputs
from mineru_gateway.errors import InvalidRequest, RequestTooLarge
from mineru_gateway.prompts import estimate_chat, estimate_completion
from mineru_gateway.request import Endpoint, ParsedRequest, Request

DATA_ONLY = MediaPolicy()
DEFAULT_LIMITS = RequestLimits()
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class ClientDisconnected(Exception):
    """The client went away before its request body arrived."""


async def read_body(receive: Receive, content_length: int | None, limit: int) -> bytes:
    if content_length is not None and content_length > limit:
        raise _too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"request body exceeds the gateway's limit of {limit} bytes (MINERU_GATEWAY_MAX_BODY_BYTES)"
    )


def parse_request(
    endpoint: Endpoint,
    body: bytes,
    media: MediaPolicy = DATA_ONLY,
    limits: RequestLimits = DEFAULT_LIMITS,
    key_scope: str | None = None,
) -> ParsedRequest:
    """The body parsed (api/payload.py) and read into one typed value (request.py), which the
    limits, the media policy, the prompt estimate and, with a `key_scope`, the cache key (a
    greedy request's within that scope, for coalescing and the cache: cache/keys.py) then
    read."""
    try:
        payload = loads(body)  # orjson's result, page images kept out of the parse
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidRequest("request body must be a JSON object")
    limits.check_depth(payload, body)
    request = Request(endpoint, payload)
    limits.check(request)
    if request.urls:  # none: nothing for the media policy
        media.check(request)
    if endpoint == "chat":
        prompt = estimate_chat(request.message_count, request.texts, request.image_urls)
    else:
        prompt = estimate_completion(request.prompt)
    cost = CostInputs(request.model or "", prompt, request.max_tokens, request.ignore_eos)
    tag = None if key_scope is None else cache_tag(request, key_scope)
    return ParsedRequest(endpoint, body, request.model, request.stream, cost, request.priority, tag)


def header_priority(value: bytes | None) -> int | None:
    """A priority from a header (lower first); None when the header is absent."""
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        raise InvalidRequest(
            f"the priority header must be an integer, not {value[:32]!r}", param="priority"
        ) from None


MAX_DOCUMENT_ID = 256  # bytes of a document id (docs/flow-control.md, "Documents")


def header_document(value: bytes | None) -> str | None:
    """A document id from its header; None when absent or empty."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_DOCUMENT_ID:
        raise InvalidRequest(
            f"the document id header is longer than {MAX_DOCUMENT_ID} bytes",
            param="document_id",
        )
    return value.decode("latin-1")


def forward_priority(request: ParsedRequest, priority: int, pass_priority: bool) -> ParsedRequest:
    """The request as workers get it: with the effective `priority` when they schedule by it
    (`pass_priority`), else without a non-zero one, so that only the gateway's order reaches a
    worker that schedules by priority (vLLM's default fcfs ignores the field: docs/vllm.md).
    The body is rewritten only when it must change (page images make bodies megabytes)."""
    wanted = priority if pass_priority and priority != 0 else None
    current = request.priority if request.priority != 0 else None
    if wanted == current:
        return request
    payload = loads(request.body)
    if wanted is None:
        payload.pop("priority", None)
    else:
        payload["priority"] = wanted
    return replace(request, body=orjson.dumps(payload), priority=wanted)
