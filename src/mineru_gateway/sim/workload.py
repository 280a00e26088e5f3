"""What a MinerU request costs and answers: prompt tokens, answer length, answer text. Pure.

Prompt tokens follow Qwen2-VL, MinerU2.5's architecture: text at ~4 characters a token plus the chat
template's markers, and each image resized to multiples of 28 pixels (14-pixel patches merged 2x2)
giving one visual token per 28x28 cell, so MinerU's 1036x1036 layout page is 37x37 = 1369 tokens.
Image sizes are read from the PNG or JPEG header inside the data URL; other images are sized from
their byte count.

Answer lengths are drawn from a log-normal per MinerU prompt kind, seeded by the request's content,
so the same request always gets the same answer. Layout answers list every block of the page at ~23
tokens a block (hundreds to ~2000 tokens); block recognitions are shorter (text and formulas tens of
tokens, tables hundreds). Together they give ~1100 output tokens per page as in the MinerU2.5 paper.
"""

from __future__ import annotations

import binascii
import enum
import math
import random
import struct
import zlib
from dataclasses import dataclass

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
HEADER_BASE64_CHARS = 64 * 1024  # enough to reach a JPEG's SOF marker after EXIF and tables
SEED_SAMPLE_CHARS = 4096


class PromptKind(enum.Enum):
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


@dataclass(frozen=True, slots=True)
class LengthModel:
    median: float
    sigma: float
    low: int
    high: int


LENGTH_MODELS = {
    PromptKind.LAYOUT: LengthModel(median=500, sigma=0.5, low=40, high=2500),
    PromptKind.TEXT: LengthModel(median=30, sigma=0.9, low=1, high=2000),
    PromptKind.TABLE: LengthModel(median=400, sigma=0.7, low=20, high=4000),
    PromptKind.FORMULA: LengthModel(median=40, sigma=0.7, low=3, high=1000),
    PromptKind.OTHER: LengthModel(median=100, sigma=0.8, low=1, high=2000),
}

# Answer text, one string per token, cycled; shaped like MinerU2.5's outputs.
VOCABULARY = {
    PromptKind.LAYOUT: (
        "<|box_start|>",
        "1",
        "2",
        "3",
        " ",
        "4",
        "5",
        "6",
        " ",
        "7",
        "8",
        "9",
        " ",
        "9",
        "0",
        "0",
        "<|box_end|>",
        "<|ref_start|>",
        "text",
        "<|ref_end|>",
        "\n",
    ),
    PromptKind.TEXT: (
        " The",
        " quick",
        " brown",
        " fox",
        " jumps",
        " over",
        " the",
        " lazy",
        " dog.",
    ),
    PromptKind.TABLE: ("<table>", "<tr>", "<td>", "cell", "</td>", "<td>", "42", "</td>", "</tr>"),
    PromptKind.FORMULA: ("\\frac", "{", "a", "}", "{", "b", "}", " +", " c"),
    PromptKind.OTHER: (" lorem", " ipsum", " dolor", " sit", " amet", ","),
}


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
    comma = url.find(",")
    if not url.startswith("data:") or comma < 0 or ";base64" not in url[:comma]:
        return DEFAULT_IMAGE_SIDE, DEFAULT_IMAGE_SIDE
    payload_chars = len(url) - comma - 1
    head_chars = min(payload_chars, HEADER_BASE64_CHARS) // 4 * 4
    try:
        head = binascii.a2b_base64(url[comma + 1 : comma + 1 + head_chars])
    except binascii.Error:
        head = b""
    size = png_size(head) or jpeg_size(head)
    return size if size is not None else size_from_bytes(payload_chars * 3 // 4)


def png_size(data: bytes) -> tuple[int, int] | None:
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return _positive(width, height)


_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xDA)) | {0x01}


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    if data[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 9 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
        elif marker in _JPEG_SOF:
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return _positive(width, height)
        elif marker in _JPEG_STANDALONE:
            at += 2
        else:
            at += 2 + struct.unpack(">H", data[at + 2 : at + 4])[0]
    return None


def _positive(width: int, height: int) -> tuple[int, int] | None:
    return (width, height) if width > 0 and height > 0 else None


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


def content_seed(parts: list[str], seed: int) -> int:
    """A seed that depends only on the prompt's content (not on `stream` or ids)."""
    digest = seed & 0xFFFFFFFF
    for part in parts:
        digest = zlib.crc32(_sample(part).encode("utf-8", "surrogatepass"), digest)
    return digest


def _sample(part: str) -> str:
    # Images are megabytes of base64: their ends and length identify them well enough.
    if len(part) <= 2 * SEED_SAMPLE_CHARS:
        return part
    return f"{part[:SEED_SAMPLE_CHARS]}{len(part)}{part[-SEED_SAMPLE_CHARS:]}"


def draw_length(kind: PromptKind, seed: int) -> int:
    model = LENGTH_MODELS[kind]
    value = random.Random(seed).lognormvariate(math.log(model.median), model.sigma)
    return min(model.high, max(model.low, round(value)))


@dataclass(frozen=True, slots=True)
class Answer:
    """How many tokens a request generates, and why it stops."""

    tokens: int
    finish_reason: str


def plan_answer(drawn: int, max_tokens: int, min_tokens: int, ignore_eos: bool) -> Answer:
    """vLLM's rules: EOS is not honoured before `min_tokens` nor with `ignore_eos`; `max_tokens`
    always stops the answer, with finish reason `length`."""
    wanted = max_tokens if ignore_eos else max(drawn, min_tokens)
    if wanted < max_tokens:
        return Answer(wanted, "stop")
    return Answer(max_tokens, "length")


def answer_text(kind: PromptKind, tokens: int) -> str:
    vocabulary = VOCABULARY[kind]
    cycles, rest = divmod(tokens, len(vocabulary))
    return "".join(vocabulary) * cycles + "".join(vocabulary[:rest])
