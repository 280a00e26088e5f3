"""Admission of a request: the body read within its limit, and the shape checks of parse_request.

`read_body` is fed ASGI messages as a server would send them; the relay tests cover the same
limits over real connections.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from typing import Any

import orjson
import pytest
from benchmarks.small_requests import chat_body

from mineru_gateway.api.requests import ClientDisconnected, parse_request, read_body
from mineru_gateway.errors import InvalidRequest, RequestTooLarge
from mineru_gateway.prompts import PromptKind
from tests.test_cost import estimate

pytestmark = pytest.mark.unit

Message = MutableMapping[str, Any]


class Receiver:
    """An ASGI `receive` that hands out `messages` in order and counts what it handed out."""

    def __init__(self, *messages: Message) -> None:
        self.messages = list(messages)
        self.handed_out = 0

    async def __call__(self) -> Message:
        message = self.messages[self.handed_out]
        self.handed_out += 1
        return message


def part(body: bytes, more: bool = True) -> Message:
    return {"type": "http.request", "body": body, "more_body": more}


# -- read_body ---------------------------------------------------------------------------------


async def test_the_body_is_joined_from_its_parts() -> None:
    receive = Receiver(part(b'{"a":'), part(b""), part(b" 1}", more=False))
    assert await read_body(receive, content_length=None, limit=100) == b'{"a": 1}'


async def test_a_message_without_body_or_more_body_is_an_empty_body() -> None:
    assert await read_body(Receiver({"type": "http.request"}), None, limit=10) == b""


async def test_a_body_of_exactly_the_limit_is_accepted() -> None:
    receive = Receiver(part(b"x" * 6), part(b"y" * 4, more=False))
    assert await read_body(receive, content_length=10, limit=10) == b"x" * 6 + b"y" * 4


async def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    receive = Receiver(part(b"x", more=False))
    with pytest.raises(RequestTooLarge, match="limit of 10 bytes") as info:
        await read_body(receive, content_length=11, limit=10)
    assert receive.handed_out == 0
    assert info.value.status == 413
    assert "MINERU_GATEWAY_MAX_BODY_BYTES" in info.value.message


async def test_a_body_that_grows_past_the_limit_is_refused_as_soon_as_it_does() -> None:
    receive = Receiver(part(b"x" * 6), part(b"x" * 5), part(b"never read", more=False))
    with pytest.raises(RequestTooLarge):
        await read_body(receive, content_length=None, limit=10)  # chunked: no length given
    assert receive.handed_out == 2


async def test_a_client_that_leaves_mid_body_is_a_disconnect() -> None:
    receive = Receiver(part(b"x" * 6), {"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        await read_body(receive, content_length=20, limit=100)


# -- parse_request -----------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "\nText Recognition:"}]


def body(**fields: Any) -> bytes:
    return orjson.dumps(fields)


def test_a_chat_request_keeps_its_bytes_and_yields_what_routing_needs() -> None:
    raw = body(model="m", messages=MESSAGES, stream=True, max_tokens=40, ignore_eos=True, top_k=1)
    parsed = parse_request("chat", raw)
    assert (parsed.endpoint, parsed.body, parsed.model, parsed.stream) == ("chat", raw, "m", True)
    assert parsed.cost.model == "m"
    assert parsed.cost.prompt == estimate(MESSAGES)
    assert parsed.cost.prompt.kind is PromptKind.TEXT
    assert (parsed.cost.max_tokens, parsed.cost.ignore_eos) == (40, True)


def test_a_page_image_request_costs_what_its_parsed_messages_cost() -> None:
    raw = chat_body("m", image_kb=300)  # MinerU's page request: its URL is parsed apart
    parsed = parse_request("chat", raw)
    assert parsed.body is raw
    assert parsed.cost.prompt == estimate(orjson.loads(raw)["messages"])
    assert parsed.cost.prompt.has_image and parsed.cost.prompt.tokens > 100  # the image read


def test_a_completion_request_without_model_or_stream_has_their_defaults() -> None:
    parsed = parse_request("completions", body(prompt="hello world", stream=None))
    assert (parsed.model, parsed.stream, parsed.cost.model) == (None, False, "")
    assert parsed.cost.prompt.tokens == 3
    assert (parsed.cost.max_tokens, parsed.cost.ignore_eos) == (None, False)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_completion_tokens": 10, "max_tokens": 99}, 10),
        ({"max_completion_tokens": 0, "max_tokens": 99}, 99),
        ({"max_tokens": True}, None),
        ({"max_tokens": -3}, None),
        ({"max_tokens": "12"}, None),
    ],
)
def test_max_tokens_counts_only_when_it_is_a_positive_integer(
    fields: dict[str, Any], expected: int | None
) -> None:
    assert parse_request("chat", body(messages=MESSAGES, **fields)).cost.max_tokens == expected


@pytest.mark.parametrize(
    ("endpoint", "raw", "param", "message"),
    [
        ("chat", b"{not json", None, "not valid JSON"),
        ("chat", b"[1, 2]", None, "must be a JSON object"),
        ("chat", body(), "messages", "`messages` must be a non-empty array"),
        ("chat", body(messages=[]), "messages", "`messages` must be a non-empty array"),
        ("chat", body(messages="hi"), "messages", "`messages` must be a non-empty array"),
        ("chat", body(messages=[*MESSAGES, "hi"]), "messages.1", "`messages[1]` must be an"),
        ("chat", body(messages=[{"role": 1}]), "messages.0", "with a string `role`"),
        ("completions", body(), "prompt", "`prompt` must be a non-empty string or array"),
        ("completions", body(prompt=""), "prompt", "non-empty string or array"),
        ("completions", body(prompt=[]), "prompt", "non-empty string or array"),
        ("completions", body(prompt=7), "prompt", "non-empty string or array"),
        ("chat", body(messages=MESSAGES, model=3), "model", "`model` must be a string"),
        ("chat", body(messages=MESSAGES, stream="yes"), "stream", "`stream` must be a boolean"),
    ],
)
def test_malformed_requests_get_a_400_that_names_the_field(
    endpoint: Any, raw: bytes, param: str | None, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)) as info:
        parse_request(endpoint, raw)
    assert (info.value.status, info.value.param) == (400, param)


def test_prompts_of_token_ids_and_of_several_strings_are_accepted() -> None:
    assert parse_request("completions", body(prompt=[1, 2, 3])).cost.prompt.tokens == 3
    assert parse_request("completions", body(prompt=["abcd", "efgh"])).cost.prompt.tokens == 2
