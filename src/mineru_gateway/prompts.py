"""How many tokens a MinerU prompt costs, and which MinerU task it asks for. Pure.

Shared by the gateway (to estimate a request's cost for routing) and the simulator (to charge
prefill time). Prompt tokens follow Qwen2-VL, MinerU2.5's architecture: text at ~4 characters a
token plus the chat template's markers, and each image resized to multiples of 28 pixels (14-pixel
patches merged 2x2) giving one visual token per 28x28 cell, so MinerU's 1036x1036 layout page is
37x37 = 1369 tokens. Image sizes are read from the header inside the data URL (images.py); other
images are sized from their byte count.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

from mineru_gateway import images
from mineru_gateway.images import data_url_start
from mineru_gateway.values import value

PATCH_PIXELS = 28  # Qwen2-VL: 14-pixel patches, merged 2x2 into one token
IMAGE_MIN_PIXELS = 4 * PATCH_PIXELS * PATCH_PIXELS
# Assumed: large enough for MinerU's 1036x1036 layout page to keep its size (1369 tokens).
IMAGE_MAX_PIXELS = 2048 * PATCH_PIXELS * PATCH_PIXELS
IMAGE_MARKER_TOKENS = 2  # <|vision_start|> and <|vision_end|>
DEFAULT_IMAGE_SIDE = 1036  # a remote image URL is not fetched: assume a layout page
PIXELS_PER_BYTE = 4.0  # rough PNG/JPEG compression of scanned document pages
CHARS_PER_TOKEN = 4
MESSAGE_TOKENS = 5  # <|im_start|>, role, newline, <|im_end|>, newline
GENERATION_PROMPT_TOKENS = 3  # <|im_start|>assistant newline


class PromptKind(enum.StrEnum):
    """A StrEnum for its hash, str's: a plain Enum member's is `Enum.__hash__`, a Python call,
    and the cost model hashes a class key holding one about six times per request."""

    LAYOUT = "layout"
    TEXT = "text"
    TABLE = "table"
    FORMULA = "formula"
    OTHER = "other"


_KIND_MARKERS = (
    ("Layout Detection", PromptKind.LAYOUT),
    ("Text Recognition", PromptKind.TEXT),
    ("Table Recognition", PromptKind.TABLE),
    ("Formula Recognition", PromptKind.FORMULA),
)


def prompt_kind(text: str) -> PromptKind:
    """The MinerU task a prompt asks for; the last marker wins."""
    found, at = PromptKind.OTHER, -1
    for marker, kind in _KIND_MARKERS:
        position = text.rfind(marker)
        if position > at:
            found, at = kind, position
    return found


def text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def chat_overhead_tokens(num_messages: int) -> int:
    return num_messages * MESSAGE_TOKENS + GENERATION_PROMPT_TOKENS


def image_tokens(url: str) -> int:
    """Visual tokens of one image part, markers included."""
    width, height = image_size(url)
    resized_w, resized_h = smart_resize(width, height)
    return (resized_w // PATCH_PIXELS) * (resized_h // PATCH_PIXELS) + IMAGE_MARKER_TOKENS


def image_size(url: str) -> tuple[int, int]:
    """Width and height from a base64 data URL's header, else estimated from its size."""
    start = data_url_start(url)
    if start is None:
        return DEFAULT_IMAGE_SIDE, DEFAULT_IMAGE_SIDE
    size = images.image_size(url, start)
    if size is not None and size[0] > 0 and size[1] > 0:
        return size
    return size_from_bytes((len(url) - start) * 3 // 4)


def size_from_bytes(num_bytes: int) -> tuple[int, int]:
    side = max(PATCH_PIXELS, round(math.sqrt(num_bytes * PIXELS_PER_BYTE)))
    return side, side


def smart_resize(width: int, height: int) -> tuple[int, int]:
    """Qwen2-VL's resize: multiples of 28 pixels, total pixels kept within the min/max bounds."""
    w = max(PATCH_PIXELS, round(width / PATCH_PIXELS) * PATCH_PIXELS)
    h = max(PATCH_PIXELS, round(height / PATCH_PIXELS) * PATCH_PIXELS)
    if w * h > IMAGE_MAX_PIXELS:
        beta = math.sqrt(width * height / IMAGE_MAX_PIXELS)
        w = max(PATCH_PIXELS, math.floor(width / beta / PATCH_PIXELS) * PATCH_PIXELS)
        h = max(PATCH_PIXELS, math.floor(height / beta / PATCH_PIXELS) * PATCH_PIXELS)
    elif w * h < IMAGE_MIN_PIXELS:
        beta = math.sqrt(IMAGE_MIN_PIXELS / (width * height))
        w = math.ceil(width * beta / PATCH_PIXELS) * PATCH_PIXELS
        h = math.ceil(height * beta / PATCH_PIXELS) * PATCH_PIXELS
    return w, h


@value
class PromptEstimate:
    """A prompt as far as cost goes: its tokens, its MinerU task, whether it has images."""

    tokens: int
    kind: PromptKind
    has_image: bool
    images: int = 0  # image parts (usage counts them: docs/usage.md)


def estimate_chat(
    message_count: int, texts: Sequence[str], image_urls: Sequence[str]
) -> PromptEstimate:
    """Lenient estimate of a chat prompt from its messages walked once (request.py's
    `Request`): their count, their texts in order and their image parts' URLs."""
    tokens = message_count * MESSAGE_TOKENS + GENERATION_PROMPT_TOKENS  # chat_overhead_tokens
    for url in image_urls:
        tokens += image_tokens(url)
    for text in texts:
        tokens -= -len(text) // CHARS_PER_TOKEN  # text_tokens, inline: per request
    prompt = texts[0] if len(texts) == 1 else "\n".join(texts)
    return PromptEstimate(tokens, prompt_kind(prompt), bool(image_urls), len(image_urls))


def estimate_completion(prompt: Any) -> PromptEstimate:
    if isinstance(prompt, str):
        return PromptEstimate(text_tokens(prompt), prompt_kind(prompt), False)
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return PromptEstimate(len(prompt), PromptKind.OTHER, False)
    texts = [item for item in prompt if isinstance(item, str)] if isinstance(prompt, list) else []
    return PromptEstimate(sum(map(text_tokens, texts)), PromptKind.OTHER, False)
