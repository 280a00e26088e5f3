"""Request cost estimates: what routing weighs requests by."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest

from mineru_gateway.errors import InvalidRequest
from mineru_gateway.prompts import PromptEstimate, PromptKind, estimate_chat
from mineru_gateway.request import Request

pytestmark = pytest.mark.unit


def estimate(messages: list[object]) -> PromptEstimate:
    """A chat's estimate from its messages walked once, as admission does."""
    request = Request("chat", {"messages": messages})
    return estimate_chat(request.message_count, request.texts, request.image_urls)


def png_data_url(width: int, height: int, padding: int = 0) -> str:
    header = b"\x89PNG\r\n\x1a\n"
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    chunk = (
        struct.pack(">I", len(ihdr))
        + b"IHDR"
        + ihdr
        + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    )
    return "data:image/png;base64," + base64.b64encode(header + chunk + b"\0" * padding).decode()


def mineru_message(text: str, image: str | None = None) -> list[dict[str, object]]:
    content: list[dict[str, object]] = []
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image}})
    content.append({"type": "text", "text": text})
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": content},
    ]


def test_a_layout_page_costs_its_visual_tokens() -> None:
    page = estimate(mineru_message("\nLayout Detection:", png_data_url(1036, 1036)))
    assert page.kind is PromptKind.LAYOUT
    assert page.has_image
    assert 1369 <= page.tokens < 1369 + 40  # 37 x 37 patches of 28 px, plus text and template


def test_a_block_crop_costs_far_less_than_a_page() -> None:
    block = estimate(mineru_message("\nText Recognition:", png_data_url(600, 56)))
    page = estimate(mineru_message("\nLayout Detection:", png_data_url(1036, 1036)))
    assert block.kind is PromptKind.TEXT
    assert block.tokens * 10 < page.tokens


def test_an_image_without_a_readable_header_is_sized_by_its_bytes() -> None:
    small = "data:image/png;base64," + base64.b64encode(b"x" * 3000).decode()
    large = "data:image/png;base64," + base64.b64encode(b"x" * 300_000).decode()
    assert estimate(mineru_message("t", small)).tokens < estimate(mineru_message("t", large)).tokens


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": [1, {"type": "image_url"}, {"type": "text"}]}],
        [{"role": "user", "content": {"not": "a list"}}],
    ],
)
def test_malformed_content_is_estimated_without_failing(messages: list[object]) -> None:
    estimated = estimate(messages)
    assert estimated.tokens > 0
    assert not estimated.has_image


def test_one_walk_keeps_texts_in_order_and_every_media_part() -> None:
    image = {"type": "image_url", "image_url": {"url": png_data_url(56, 56)}}
    messages = [
        {"role": "system", "content": "Layout Detection:"},
        {"role": "user", "content": [image, "not a part", {"type": "text", "text": "second"}]},
        {"role": "user", "content": "Text Recognition:"},
    ]
    request = Request("chat", {"messages": messages})
    assert (request.message_count, request.part_count) == (3, 2)
    assert request.texts == ["Layout Detection:", "second", "Text Recognition:"]
    assert request.image_urls == [png_data_url(56, 56)]
    assert [(part.where, part.kind) for part in request.media] == [
        ("messages[1].content[0]", "image_url")
    ]
    # The last marker in the prompt's order wins: a string content after a list content.
    assert estimate(messages).kind is PromptKind.TEXT
    assert estimate(messages).has_image


@pytest.mark.parametrize(
    ("messages", "malformed"),
    [
        ([{"role": "user"}, "text", {"content": "x"}], 1),
        ([{"role": "user"}, {"content": "x"}, "text"], 1),
        ([{"role": "user"}, {"role": 2}], 1),
    ],
)
def test_the_walk_names_the_first_message_without_a_string_role(
    messages: list[object], malformed: int
) -> None:
    with pytest.raises(InvalidRequest) as info:
        Request("chat", {"messages": messages})
    assert info.value.param == f"messages.{malformed}"


def test_a_message_with_a_role_and_odd_content_is_the_workers_to_judge() -> None:
    request = Request("chat", {"messages": [{"role": "user"}, {"role": "a", "content": 3}]})
    assert (request.message_count, request.texts, request.part_count) == (2, [], 0)
