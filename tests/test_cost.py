"""Request cost estimates: what routing weighs requests by (issue 3)."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest

from mineru_gateway.cost import Cost, CostInputs, CostModel
from mineru_gateway.prompts import (
    Chat,
    PromptEstimate,
    PromptKind,
    estimate_chat,
    estimate_completion,
)

pytestmark = pytest.mark.unit


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
    page = estimate_chat(mineru_message("\nLayout Detection:", png_data_url(1036, 1036)))
    assert page.kind is PromptKind.LAYOUT
    assert page.has_image
    assert 1369 <= page.tokens < 1369 + 40  # 37 x 37 patches of 28 px, plus text and template


def test_a_block_crop_costs_far_less_than_a_page() -> None:
    block = estimate_chat(mineru_message("\nText Recognition:", png_data_url(600, 56)))
    page = estimate_chat(mineru_message("\nLayout Detection:", png_data_url(1036, 1036)))
    assert block.kind is PromptKind.TEXT
    assert block.tokens * 10 < page.tokens


def test_an_image_without_a_readable_header_is_sized_by_its_bytes() -> None:
    small = "data:image/png;base64," + base64.b64encode(b"x" * 3000).decode()
    large = "data:image/png;base64," + base64.b64encode(b"x" * 300_000).decode()
    assert (
        estimate_chat(mineru_message("t", small)).tokens
        < estimate_chat(mineru_message("t", large)).tokens
    )


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": [1, {"type": "image_url"}, {"type": "text"}]}],
        [{"role": "user", "content": {"not": "a list"}}],
    ],
)
def test_malformed_content_is_estimated_without_failing(messages: list[object]) -> None:
    estimate = estimate_chat(messages)
    assert estimate.tokens > 0
    assert not estimate.has_image


def test_one_walk_keeps_texts_in_order_and_names_every_part() -> None:
    image = {"type": "image_url", "image_url": {"url": png_data_url(56, 56)}}
    messages = [
        {"role": "system", "content": "Layout Detection:"},
        {"role": "user", "content": [image, "not a part", {"type": "text", "text": "second"}]},
        {"role": "user", "content": "Text Recognition:"},
    ]
    chat = Chat(messages)
    assert chat.message_count == 3
    assert chat.texts == ["Layout Detection:", "second", "Text Recognition:"]
    assert chat.parts == [(1, 0, image), (1, 2, {"type": "text", "text": "second"})]
    assert chat.malformed is None
    # The last marker in the prompt's order wins: a string content after a list content.
    assert estimate_chat(chat) == estimate_chat(messages)
    assert estimate_chat(chat).kind is PromptKind.TEXT
    assert estimate_chat(chat).has_image


@pytest.mark.parametrize(
    ("messages", "malformed"),
    [
        ([{"role": "user"}, "text", {"content": "x"}], 1),
        ([{"role": "user"}, {"content": "x"}, "text"], 1),
        ([{"role": "user"}, {"role": 2}], 1),
        ([{"role": "user"}, {"role": "assistant", "content": 3}], None),
    ],
)
def test_the_walk_finds_the_first_message_without_a_string_role(
    messages: list[object], malformed: int | None
) -> None:
    assert Chat(messages).malformed == malformed


def test_completion_prompts() -> None:
    assert estimate_completion("abcdefgh").tokens == 2
    assert estimate_completion([1, 2, 3]).tokens == 3
    assert estimate_completion(["abcd", "efgh"]).tokens == 2


def inputs(
    kind: PromptKind = PromptKind.TEXT,
    tokens: int = 100,
    max_tokens: int | None = None,
    ignore_eos: bool = False,
    image: bool = True,
) -> CostInputs:
    return CostInputs("m", PromptEstimate(tokens, kind, image), max_tokens, ignore_eos)


def test_cost_is_prefill_plus_a_batch_slot_and_expected_decode() -> None:
    model = CostModel(prefill_weight=0.001, decode_weight=0.002, default_decode_tokens=200)
    assert model.estimate(inputs(tokens=1000)) == Cost(prefill=1.0, hold=pytest.approx(1.4))
    assert model.estimate(inputs(tokens=1000, max_tokens=50)).hold == pytest.approx(1.1)
    assert model.estimate(inputs(tokens=0, max_tokens=700, ignore_eos=True)).total == (
        pytest.approx(2.4)
    )


def test_a_layout_page_weighs_more_than_a_block_only_until_its_prefill_is_done() -> None:
    model = CostModel()
    model.learn(inputs(PromptKind.LAYOUT, tokens=1400), 1000)
    model.learn(inputs(PromptKind.TEXT, tokens=60), 30)
    layout = model.estimate(inputs(PromptKind.LAYOUT, tokens=1400))
    block = model.estimate(inputs(PromptKind.TEXT, tokens=60))
    assert 2 < layout.total / block.total < 3
    assert layout.hold == block.hold == 1.0  # by default a long answer is not extra work


def test_expected_decode_is_learnt_per_request_class() -> None:
    model = CostModel(default_decode_tokens=200, smoothing=0.5)
    layout, text = inputs(PromptKind.LAYOUT), inputs(PromptKind.TEXT)
    model.learn(layout, 1000)
    model.learn(text, 20)
    model.learn(text, 40)
    assert model.expected_decode(layout) == 1000
    assert model.expected_decode(text) == 30
    assert model.expected_decode(inputs(PromptKind.TABLE)) == 200  # not learnt yet


def test_learnt_classes_are_bounded() -> None:
    model = CostModel(max_classes=3)
    for index in range(10):
        model.learn(
            CostInputs(f"m{index}", PromptEstimate(1, PromptKind.OTHER, False), None, False), 5
        )
    assert model.classes() == 3
