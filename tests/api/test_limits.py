"""Request limits (issue 14): what a request may carry is checked before any worker sees it, and
every refusal is an OpenAI-shaped 4xx naming the limit."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import orjson
import pytest
from PIL import Image

from mineru_gateway.api.limits import COUNT_BRACKETS_UP_TO, RequestLimits
from mineru_gateway.errors import GatewayError, HeadersTooLarge, InvalidRequest
from mineru_gateway.request import Request
from tests.conftest import StartGateway
from tests.support.workers import Script
from tests.test_images import png_header

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def check(limits: RequestLimits, payload: dict[str, Any], text: bytes | None = None) -> None:
    """What admission checks of a parsed body: its depth, then the request read from it."""
    limits.check_depth(payload, text)
    if "messages" in payload:
        limits.check(Request("chat", payload))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def page(width: int = 1240, height: int = 1754) -> str:
    buffer = io.BytesIO()
    Image.new("L", (width, height), 255).save(buffer, format="PNG")
    return data_url(buffer.getvalue())


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "\nText Recognition:"}]
    return {"model": "echo-model", "messages": [{"role": "user", "content": content}]} | fields


def nested(depth: int) -> dict[str, Any]:
    value: Any = "leaf"
    for _ in range(depth - 1):
        value = [value]
    return chat(extra=value)


def refusal(limits: RequestLimits, payload: dict[str, Any]) -> GatewayError:
    with pytest.raises(GatewayError) as refused:
        check(limits, payload)
    return refused.value


def test_a_mineru_page_request_is_far_inside_every_default() -> None:
    check(RequestLimits(), chat(image(page())))


@pytest.mark.parametrize(
    ("payload", "code", "param"),
    [
        (nested(70), "json_too_deep", None),
        ({"messages": [{"role": "user", "content": "x"}] * 1025}, "too_many_messages", "messages"),
        (chat(*[{"type": "text", "text": "x"}] * 1024), "too_many_content_parts", "messages"),
        (chat(*[image(page(28, 28))] * 33), "too_many_images", "messages"),
        (chat(image(data_url(png_header(50_000, 50_000)))), "image_too_large", None),
        (chat(image(page(1, 100_000))), "image_too_large", None),
        (chat(image(data_url(png_header(40_000, 1000)))), "image_too_large", None),
        (chat(image(data_url(png_header(0, 10)))), "image_too_large", None),
        (chat(image("data:image/png,rawbytes")), "image_unreadable", None),
    ],
)
def test_what_is_refused_by_default(payload: dict[str, Any], code: str, param: str | None) -> None:
    error = refusal(RequestLimits(), payload)
    assert isinstance(error, InvalidRequest)
    assert error.body()["error"]["code"] == code
    if param is not None:
        assert error.param == param
    if code.startswith("image"):
        assert error.param == "messages.0.content.0"
        assert error.message.startswith("messages[0].content[0]")


def test_deep_json_at_the_limit_passes() -> None:
    check(RequestLimits(max_json_depth=8), nested(8))
    assert refusal(RequestLimits(max_json_depth=8), nested(9)).reason == "json_too_deep"


@pytest.mark.parametrize("depth", [8, 9])
def test_depth_is_judged_the_same_with_the_text_it_was_parsed_from(depth: int) -> None:
    """With its JSON text, the walk is skipped only where the brackets cannot reach the limit;
    brackets inside strings make it walk, and never refuse a shallow request."""
    limits = RequestLimits(max_json_depth=8)
    deep = orjson.dumps(nested(depth))
    if depth == 8:
        check(limits, orjson.loads(deep), deep)
    else:
        with pytest.raises(InvalidRequest, match="deeper than 8"):
            check(limits, orjson.loads(deep), deep)
    shallow = orjson.dumps(chat(extra="[[[[{{{{[[[[{{{{"))
    check(limits, orjson.loads(shallow), shallow)


@pytest.mark.parametrize("depth", [8, 9])
def test_a_large_body_is_walked_for_its_depth_whatever_its_brackets(depth: int) -> None:
    """Past `COUNT_BRACKETS_UP_TO` bytes (a page image) the depth is walked, not counted: the
    same verdicts, brackets in strings or not."""
    limits = RequestLimits(max_json_depth=8)
    padding = "A" * COUNT_BRACKETS_UP_TO + "[[[[{{{{[[[[{{{{"
    body = nested(depth)
    body["padding"] = padding
    text = orjson.dumps(body)
    assert len(text) > COUNT_BRACKETS_UP_TO
    if depth == 8:
        check(limits, orjson.loads(text), text)
    else:
        with pytest.raises(InvalidRequest, match="deeper than 8"):
            check(limits, orjson.loads(text), text)


def test_the_image_message_says_what_is_wrong() -> None:
    error = refusal(RequestLimits(), chat(image(page(1, 10_000))))
    assert "1x10000" in error.message and "10000 to 1" in error.message


def test_an_image_format_it_cannot_measure_is_left_to_the_worker() -> None:
    tiff = data_url(b"II*\0" + b"\0" * 64, "image/tiff")
    check(RequestLimits(), chat(image(tiff)))


def test_a_fetched_url_is_not_measured_here() -> None:
    check(RequestLimits(), chat(image("https://example.com/a.png")))


def test_the_max_tokens_ceiling_is_optional() -> None:
    check(RequestLimits(), chat(max_tokens=1_000_000))
    limits = RequestLimits(max_tokens=4096)
    check(limits, chat(max_tokens=4096))
    error = refusal(limits, chat(max_completion_tokens=4097))
    assert (error.reason, error.param) == ("max_tokens_too_large", "max_completion_tokens")


@pytest.mark.parametrize(
    "headers",
    [
        [(b"x-h%d" % i, b"v") for i in range(101)],
        [(b"cookie", b"c" * 33_000)],
    ],
)
def test_headers_past_their_limits_are_431(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(HeadersTooLarge) as refused:
        RequestLimits().check_headers(headers)
    assert refused.value.status == 431


# -- through a running gateway: refused before any worker sees the request -------------------


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (nested(70), 400, "json_too_deep"),
        (chat(image(data_url(png_header(50_000, 50_000)))), 400, "image_too_large"),
        # past api/payload.py's ELIDE_FROM: parsed without the URL, which is put back
        (chat(image(data_url(png_header(50_000, 50_000) + bytes(40_000)))), 400, "image_too_large"),
        (chat(*[image(page(28, 28))] * 33), 400, "too_many_images"),
        (chat(max_tokens=100_000), 400, "max_tokens_too_large"),
    ],
)
def test_the_gateway_refuses_before_any_worker_sees_it(
    scripted: tuple[Script, str],
    start_gateway: StartGateway,
    payload: dict[str, Any],
    status: int,
    code: str,
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], max_tokens_limit=8192)
    response = httpx.post(gateway + CHAT, content=orjson.dumps(payload))
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    assert script.seen == []
    assert httpx.post(gateway + CHAT, json=chat(image(page(200, 300)))).status_code == 200
    assert len(script.seen) == 1


@pytest.mark.parametrize("path", [CHAT, "/v1/models", "/health"])
def test_oversized_headers_get_431_on_every_path(
    scripted: tuple[Script, str], start_gateway: StartGateway, path: str
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], max_headers=20)
    headers = {f"x-extra-{i}": "1" for i in range(25)}
    response = httpx.request(
        "POST" if path == CHAT else "GET", gateway + path, headers=headers, json=chat()
    )
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    assert script.seen == []
