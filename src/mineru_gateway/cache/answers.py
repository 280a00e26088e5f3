"""A finished generation as the cache keeps it, its stored form, and its replay as a stream.

Only complete, correct answers are kept: status 200 and every choice's `finish_reason` `stop`
(an answer cut by `max_tokens` or an error is not what the next client should get). The stored
form carries a checksum: a truncated or corrupt entry is a miss, never an answer. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import orjson

from mineru_gateway.values import value

MAGIC = b"MGC1"
_LENGTH = struct.Struct(">I")
_DIGEST = 32
_HEAD = len(MAGIC) + _DIGEST + _LENGTH.size
# What an entry costs in memory beyond its body's bytes: the body's object header, its key, its
# answer and the memory store's records of it (tests/cache/test_memory_store.py measures it).
OVERHEAD_BYTES = 512


@value
class Answer:
    """A worker's answer to a non-streamed request, and the worker time it took (from sending
    the request to its last byte), which a later identical request saves."""

    status: int
    content_type: str
    body: bytes
    worker_s: float = 0.0

    @property
    def size(self) -> int:
        return len(self.body) + len(self.content_type) + OVERHEAD_BYTES


def complete(answer: Answer) -> bool:
    """Status 200 and every choice finished by `stop`: an answer worth giving again."""
    if answer.status != 200:
        return False
    try:
        choices = orjson.loads(answer.body).get("choices")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    if not isinstance(choices, list) or not choices:
        return False
    return all(isinstance(c, dict) and c.get("finish_reason") == "stop" for c in choices)


def encode(answer: Answer) -> bytes:
    """The stored form: magic, sha256 of the rest, the header's length, header, body."""
    header = orjson.dumps({"s": answer.status, "t": answer.content_type, "w": answer.worker_s})
    rest = _LENGTH.pack(len(header)) + header + answer.body
    return MAGIC + hashlib.sha256(rest).digest() + rest


def decode(blob: bytes) -> Answer | None:
    """The answer `encode` stored, or None for anything else (truncated, corrupt, foreign)."""
    if len(blob) < _HEAD or not blob.startswith(MAGIC):
        return None
    rest = memoryview(blob)[len(MAGIC) + _DIGEST :]
    if hashlib.sha256(rest).digest() != blob[len(MAGIC) : len(MAGIC) + _DIGEST]:
        return None
    (length,) = _LENGTH.unpack_from(rest)
    try:
        header = orjson.loads(rest[_LENGTH.size : _LENGTH.size + length])
        status, content_type, worker_s = header["s"], header["t"], float(header["w"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    if not isinstance(status, int) or not isinstance(content_type, str):
        return None
    return Answer(status, content_type, bytes(rest[_LENGTH.size + length :]), worker_s)


def usage_of(answer: Answer) -> dict[str, Any] | None:
    try:
        usage = orjson.loads(answer.body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def replay_stream(endpoint: str, answer: Answer, include_usage: bool) -> bytes:
    """The answer as the SSE events vLLM would have streamed, in one piece: one chunk with the
    whole content and its finish_reason per choice, the usage event when asked, [DONE]."""
    whole = orjson.loads(answer.body)
    chat = endpoint == "chat"
    head = {
        "id": whole.get("id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": whole.get("created", 0),
        "model": whole.get("model", ""),
    }
    choices = []
    for number, choice in enumerate(whole.get("choices", [])):
        item: dict[str, Any] = {"index": choice.get("index", number)}
        if chat:
            message = choice.get("message") or {}
            item["delta"] = {"role": "assistant", "content": message.get("content") or ""}
        else:
            item["text"] = choice.get("text", "")
        item |= {"logprobs": None, "finish_reason": choice.get("finish_reason")}
        choices.append(item)
    events = [b"data: " + orjson.dumps(head | {"choices": choices}) + b"\n\n"]
    if include_usage and whole.get("usage") is not None:
        usage = head | {"choices": [], "usage": whole["usage"]}
        events.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)
