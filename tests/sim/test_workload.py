import base64
import struct

import pytest

from mineru_gateway import prompts
from mineru_gateway.prompts import PromptKind
from mineru_gateway.sim import workload

pytestmark = pytest.mark.unit


def png(width: int, height: int, payload: int = 0) -> bytes:
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + b"\0\0\0\0"
    return b"\x89PNG\r\n\x1a\n" + chunk + b"\0" * payload


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\1\1\0\0\1\0\1\0\0"
    fill = b"\xff"  # a fill byte before the next marker is legal
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\1\x11\0"
    return b"\xff\xd8" + app0 + fill + sof0 + b"\xff\xd9"


def data_url(image: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(image).decode()


@pytest.mark.parametrize(
    ("prompt", "kind"),
    [
        ("\nLayout Detection:", PromptKind.LAYOUT),
        ("\nText Recognition:", PromptKind.TEXT),
        ("\nTable Recognition:", PromptKind.TABLE),
        ("\nFormula Recognition:", PromptKind.FORMULA),
        ("hello", PromptKind.OTHER),
        ("Text Recognition: then\nTable Recognition:", PromptKind.TABLE),
    ],
)
def test_prompt_kind(prompt: str, kind: PromptKind) -> None:
    assert prompts.prompt_kind(prompt) is kind


def test_layout_page_is_1369_visual_tokens_plus_markers() -> None:
    assert prompts.image_tokens(data_url(png(1036, 1036))) == 1369 + 2


def test_broken_base64_is_sized_from_its_length() -> None:
    assert prompts.image_size("data:image/png;base64,A===") == prompts.size_from_bytes(3)


def test_jpeg_data_url_uses_its_header() -> None:
    tokens = prompts.image_tokens(data_url(jpeg(560, 280), "image/jpeg"))
    assert tokens == 20 * 10 + 2


def test_unknown_format_is_sized_from_its_bytes() -> None:
    small = prompts.image_tokens(data_url(b"GIF89a" + b"\0" * 1000, "image/gif"))
    large = prompts.image_tokens(data_url(b"GIF89a" + b"\0" * 200_000, "image/gif"))
    assert 4 <= small < large


def test_remote_url_counts_as_a_layout_page() -> None:
    assert prompts.image_tokens("https://example.invalid/page.png") == 1369 + 2


def test_smart_resize_keeps_within_bounds() -> None:
    assert prompts.smart_resize(1036, 1036) == (1036, 1036)
    width, height = prompts.smart_resize(10000, 10000)
    assert width * height <= prompts.IMAGE_MAX_PIXELS
    assert width % 28 == 0 and height % 28 == 0
    width, height = prompts.smart_resize(10, 10)
    assert width * height >= prompts.IMAGE_MIN_PIXELS


def test_lengths_are_deterministic_and_depend_on_content() -> None:
    first = workload.content_seed(["user", "\nText Recognition:", "data:..."], seed=0)
    again = workload.content_seed(["user", "\nText Recognition:", "data:..."], seed=0)
    other = workload.content_seed(["user", "\nText Recognition:", "data:!!!"], seed=0)
    assert first == again != other
    assert workload.draw_length(PromptKind.TEXT, first) == workload.draw_length(
        PromptKind.TEXT, again
    )


def test_long_parts_are_sampled_for_the_seed() -> None:
    image = "A" * 100_000
    assert workload.content_seed([image], 0) != workload.content_seed([image + "B"], 0)


def test_layout_answers_are_longer_than_block_answers() -> None:
    def median(kind: PromptKind) -> int:
        lengths = sorted(workload.draw_length(kind, seed) for seed in range(401))
        return lengths[200]

    layout = median(PromptKind.LAYOUT)
    assert 300 <= layout <= 1000
    assert median(PromptKind.TEXT) < 100
    assert median(PromptKind.FORMULA) < 100
    assert median(PromptKind.TEXT) < median(PromptKind.TABLE) < layout
    assert max(workload.draw_length(PromptKind.LAYOUT, seed) for seed in range(2000)) <= 2500


@pytest.mark.parametrize(
    ("drawn", "max_tokens", "min_tokens", "ignore_eos", "expected"),
    [
        (10, 100, 0, False, workload.Answer(10, "stop")),
        (100, 100, 0, False, workload.Answer(100, "length")),
        (500, 100, 0, False, workload.Answer(100, "length")),
        (10, 100, 50, False, workload.Answer(50, "stop")),
        (10, 100, 100, False, workload.Answer(100, "length")),
        (10, 100, 0, True, workload.Answer(100, "length")),
    ],
)
def test_plan_answer(
    drawn: int, max_tokens: int, min_tokens: int, ignore_eos: bool, expected: workload.Answer
) -> None:
    assert workload.plan_answer(drawn, max_tokens, min_tokens, ignore_eos) == expected


def test_answer_text_cycles_the_vocabulary() -> None:
    vocabulary = workload.VOCABULARY[PromptKind.TEXT]
    text = workload.answer_text(PromptKind.TEXT, len(vocabulary) + 2)
    assert text == "".join(vocabulary) + vocabulary[0] + vocabulary[1]
