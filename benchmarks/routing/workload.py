"""A MinerU-like request stream: pages of one layout request and many block requests, seeded.

Per page (docs/mineru-client.md): one layout request on the page image resized to 1036x1036 (1369
visual tokens, long output), then `blocks_per_page` block requests on small crops (Text, Formula
or Table Recognition, short outputs), and now and then a text-only request. Output lengths are
drawn here, from the simulator's own per-kind length models, and forced with
`vllm_xargs: {"sim_output_tokens": N}`, so every router sees exactly the same requests: the stream
depends only on the seed, the rate and the duration.

Images are valid PNGs of the intended size (the simulator reads width and height from the header)
padded with a private ancillary chunk to a realistic but moderate byte size, so bodies cost the
load generator and the routers something without making the load generator the bottleneck.
"""

from __future__ import annotations

import base64
import math
import random
import struct
import zlib
from dataclasses import dataclass
from functools import cache

import orjson

from mineru_gateway.sim.workload import LENGTH_MODELS, PromptKind

SYSTEM_PROMPT = "You are a helpful assistant."
PROMPTS = {
    PromptKind.LAYOUT: "\nLayout Detection:",
    PromptKind.TEXT: "\nText Recognition:",
    PromptKind.FORMULA: "\nFormula Recognition:",
    PromptKind.TABLE: "\nTable Recognition:",
}
LAYOUT_SIDE = 1036  # MinerU resizes every page to this before layout detection


@dataclass(frozen=True, slots=True)
class Mix:
    """Shape of the stream. Defaults give ~14 requests and ~1300 output tokens per page, close to
    the simulator's calibration (MinerU2.5 paper: ~1100 output tokens a page)."""

    blocks_per_page: tuple[int, int] = (6, 18)  # uniform, inclusive: 12 on average
    text_share: float = 0.80  # of blocks; the rest split below
    formula_share: float = 0.15
    text_only_per_page: float = 0.5  # expected text-only requests per page (no image)
    layout_png_bytes: int = 48 * 1024
    block_png_bytes_per_kpixel: float = 40.0  # crops: ~40 bytes per 1000 pixels, PNG-like
    images: bool = True  # False: every request text-only (real vLLM on CPU serves no images)
    model: str | None = None
    max_tokens: int | None = None  # None: as MinerU, leave max_tokens to the server
    force_lengths: str = "sim"  # "sim": vllm_xargs.sim_output_tokens; "vllm": min/max_tokens
    length_scale: float = 1.0  # multiplies every drawn output length (1.0 = MinerU's)


@dataclass(frozen=True, slots=True)
class Request:
    kind: str
    body: bytes
    output_tokens: int
    image_tokens: int


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float  # seconds after the start of the run
    request: Request


def png(width: int, height: int, size: int, salt: int = 0) -> bytes:
    """A valid white grayscale PNG of `width` x `height`, padded to about `size` bytes."""
    return _png_core(width, height) + _pad_chunk(size, salt) + _chunk(b"IEND", b"")


@cache
def _png_core(width: int, height: int) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit gray, no interlace
    rows = (b"\x00" + b"\xff" * width) * height
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows, 9))


def _pad_chunk(size: int, salt: int) -> bytes:
    # `paDd`: ancillary, private, safe to copy; decoders skip it. Pseudo-random so it does not
    # compress away anywhere on the path.
    length = max(0, size - 128)
    data = random.Random(salt).randbytes(length)
    return _chunk(b"paDd", data)


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


@cache
def data_url(width: int, height: int, size: int, salt: int = 0) -> str:
    encoded = base64.b64encode(png(width, height, size, salt)).decode("ascii")
    return "data:image/png;base64," + encoded


def visual_tokens(width: int, height: int) -> int:
    """Qwen2-VL visual tokens of an image (the simulator's rule: 28-pixel cells, plus 2 markers);
    used only to describe the mix, the simulator computes its own."""
    cells = max(1, round(width / 28)) * max(1, round(height / 28))
    return cells + 2


class StreamBuilder:
    """Draws pages and turns them into request bodies."""

    def __init__(self, mix: Mix, seed: int) -> None:
        self.mix = mix
        self.rng = random.Random(seed)

    def page(self) -> list[Request]:
        mix, rng = self.mix, self.rng
        requests = [self._layout()]
        low, high = mix.blocks_per_page
        for _ in range(rng.randint(low, high)):
            requests.append(self._block())
        whole, fraction = divmod(mix.text_only_per_page, 1.0)
        for _ in range(int(whole) + (rng.random() < fraction)):
            requests.append(self._text_only())
        return requests

    def _length(self, kind: PromptKind) -> int:
        model = LENGTH_MODELS[kind]
        value = self.rng.lognormvariate(math.log(model.median), model.sigma)
        drawn = min(model.high, max(model.low, round(value)))
        return max(1, round(drawn * self.mix.length_scale))

    def _layout(self) -> Request:
        salt = self.rng.randrange(8)  # a few distinct pages, so bodies are not all identical
        url = data_url(LAYOUT_SIDE, LAYOUT_SIDE, self.mix.layout_png_bytes, salt)
        tokens = visual_tokens(LAYOUT_SIDE, LAYOUT_SIDE)
        return self._request(PromptKind.LAYOUT, url, tokens)

    def _block(self) -> Request:
        rng, mix = self.rng, self.mix
        roll = rng.random()
        if roll < mix.text_share:
            kind = PromptKind.TEXT
            width, height = rng.choice((896, 784, 672, 448)), rng.choice((56, 84, 112, 168))
        elif roll < mix.text_share + mix.formula_share:
            kind = PromptKind.FORMULA
            width, height = rng.choice((336, 448, 560)), rng.choice((56, 84, 112))
        else:
            kind = PromptKind.TABLE
            width, height = rng.choice((896, 784)), rng.choice((280, 420, 560))
        size = int(width * height / 1000 * mix.block_png_bytes_per_kpixel) + 256
        url = data_url(width, height, size, rng.randrange(4))
        return self._request(kind, url, visual_tokens(width, height))

    def _text_only(self) -> Request:
        words = " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randint(20, 120)))
        return self._request(PromptKind.OTHER, None, 0, text=f"Summarise: {words}")

    def _request(
        self, kind: PromptKind, url: str | None, image_tokens: int, text: str | None = None
    ) -> Request:
        mix = self.mix
        output = self._length(kind)
        prompt = text if text is not None else PROMPTS[kind]
        if url is not None and mix.images:
            content: object = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": prompt},
            ]
        else:
            content, image_tokens = prompt, 0
        body: dict[str, object] = {
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": content},
            ],
            "temperature": 0.0,
            "top_p": 0.01,
            "top_k": 1,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "skip_special_tokens": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if mix.model is not None:
            body["model"] = mix.model
        if mix.force_lengths == "sim":
            body["vllm_xargs"] = {"no_repeat_ngram_size": 100, "sim_output_tokens": output}
            if mix.max_tokens is not None:
                body["max_tokens"] = mix.max_tokens
        else:  # real vLLM: a random-weight model stops anywhere, so pin the length
            body["max_tokens"] = output
            body["min_tokens"] = output
            body["ignore_eos"] = True
        return Request(kind.value, orjson.dumps(body), output, image_tokens)


_WORDS = (
    *("document", "page", "table", "figure", "formula", "caption", "header", "footer"),
    *("paragraph", "column", "reference", "section", "equation", "result", "method"),
    *("layout", "reading", "order", "block", "text", "title", "list", "index", "note"),
)


def arrivals(mix: Mix, seed: int, rate: float, duration: float) -> list[Arrival]:
    """Poisson arrivals at `rate` requests/s for `duration` s; requests come page by page."""
    timing = random.Random(seed * 7919 + 1)
    builder = StreamBuilder(mix, seed)
    pending: list[Request] = []
    out: list[Arrival] = []
    at = timing.expovariate(rate)
    while at < duration:
        if not pending:
            pending = builder.page()[::-1]
        out.append(Arrival(at, pending.pop()))
        at += timing.expovariate(rate)
    return out


def describe(mix: Mix, seed: int = 1, pages: int = 2000) -> dict[str, float]:
    """Average requests, output tokens and visual tokens per page of `mix` (for reports)."""
    builder = StreamBuilder(mix, seed)
    requests = [request for _ in range(pages) for request in builder.page()]
    by_kind: dict[str, int] = {}
    for request in requests:
        by_kind[request.kind] = by_kind.get(request.kind, 0) + 1
    summary = {
        "requests_per_page": len(requests) / pages,
        "output_tokens_per_page": sum(r.output_tokens for r in requests) / pages,
        "visual_tokens_per_page": sum(r.image_tokens for r in requests) / pages,
        "mean_body_bytes": sum(len(r.body) for r in requests) / len(requests),
    }
    summary |= {f"share_{kind}": count / len(requests) for kind, count in sorted(by_kind.items())}
    return summary
