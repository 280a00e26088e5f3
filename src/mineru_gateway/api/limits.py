"""Limits on what one request may carry, checked before anything reaches a worker.

A hostile or broken client must not make a worker (or the gateway) spend memory or time it was
not meant to: thousands of headers, JSON nested a thousand deep, ten thousand messages, or a page
image whose pixels are far more than its bytes suggest (a 1x100000 strip, a 50000x50000 PNG of a
few kilobytes: a decompression bomb). Images are measured from their header only: a few bytes of
the base64 payload are decoded, never the pixels. Pure: no I/O.

    headers              431  too many, or too many bytes in all
    JSON depth           400  json_too_deep
    messages, parts      400  too_many_messages, too_many_content_parts
    images per request   400  too_many_images
    image pixels, shape  400  image_too_large (pixels, a side, or an aspect ratio past the
                              200:1 Qwen2-VL's processor accepts), image_unreadable
    max_tokens ceiling   400  max_tokens_too_large (optional)

The defaults leave every real MinerU request (one page image of a few megapixels, one or two
messages) far inside them; docs/request-limits.md says where each number comes from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from mineru_gateway.errors import HeadersTooLarge, InvalidRequest
from mineru_gateway.images import data_url_start, image_size
from mineru_gateway.request import IMAGE_PARTS, Request, param_of

PIL_MAX_IMAGE_PIXELS = 89_478_485  # PIL's own decompression-bomb warning threshold
QWEN2_VL_MAX_ASPECT = 200.0  # Qwen2-VL's smart_resize refuses a longer-to-shorter ratio past it


# Bodies up to this many bytes count their brackets instead of walking the parsed payload for its
# depth (`RequestLimits.check_depth`): an order of magnitude cheaper for MinerU's text prompts.
COUNT_BRACKETS_UP_TO = 4096


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    max_json_depth: int = 64
    max_messages: int = 1024
    max_content_parts: int = 1024
    max_images: int = 32
    max_image_pixels: int = PIL_MAX_IMAGE_PIXELS
    max_image_side: int = 32768
    max_image_aspect: float = QWEN2_VL_MAX_ASPECT
    max_tokens: int | None = None

    def check_headers(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        if len(headers) > self.max_headers:
            raise HeadersTooLarge(
                f"the request has {len(headers)} headers; this gateway accepts at most "
                f"{self.max_headers} (MINERU_GATEWAY_MAX_HEADERS)"
            )
        size = sum(map(len, chain.from_iterable(headers)))  # no Python call per header
        if size > self.max_header_bytes:
            raise HeadersTooLarge(
                f"the request's headers hold {size} bytes; this gateway accepts at most "
                f"{self.max_header_bytes} (MINERU_GATEWAY_MAX_HEADER_BYTES)"
            )

    def check_depth(self, payload: Any, text: bytes | None = None) -> None:
        """The parsed body's nesting, before anything walks it.

        `text`, the JSON the payload was parsed from, spares a small body the depth walk when
        it holds no more brackets than the depth limit: each level of nesting needs one
        (brackets inside strings only add to the count). Counting is a pass over the body per
        bracket, though, dearer than walking the few containers of a page-image request
        (docs/proxy-costs.md). So larger bodies are walked.
        """
        if (
            text is None
            or len(text) > COUNT_BRACKETS_UP_TO
            or text.count(b"[") + text.count(b"{") > self.max_json_depth
        ):
            _check_depth(payload, self.max_json_depth)

    def check(self, request: Request) -> None:
        """The request's counts, images and max tokens, as `Request` read them."""
        if request.message_count > self.max_messages:
            raise InvalidRequest(
                f"the request has {request.message_count} messages; this gateway accepts at "
                f"most {self.max_messages}",
                param="messages",
                code="too_many_messages",
            )
        if request.part_count:
            self._check_parts(request)
        if self.max_tokens is not None:
            self._check_max_tokens(request.token_fields, self.max_tokens)

    def _check_parts(self, request: Request) -> None:
        if request.part_count > self.max_content_parts:
            raise InvalidRequest(
                f"the request has {request.part_count} content parts; this gateway accepts at "
                f"most {self.max_content_parts}",
                param="messages",
                code="too_many_content_parts",
            )
        media = request.media
        if len(media) > self.max_images:
            raise InvalidRequest(
                f"the request carries {len(media)} images or other media; this gateway accepts "
                f"at most {self.max_images}",
                param="messages",
                code="too_many_images",
            )
        for part in media:
            if part.kind in IMAGE_PARTS:
                self._check_image(part.where, part.payload)

    @staticmethod
    def _check_max_tokens(fields: tuple[tuple[str, int], ...], ceiling: int) -> None:
        for name, tokens in fields:
            if tokens > ceiling:
                raise InvalidRequest(
                    f"`{name}` is {tokens}; this gateway allows at most {ceiling} "
                    "(MINERU_GATEWAY_MAX_TOKENS_LIMIT)",
                    param=name,
                    code="max_tokens_too_large",
                )

    def _check_image(self, where: str, image: Any) -> None:
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            return
        if not url.startswith("data:"):
            return  # a fetched URL is the media policy's business (api/media.py)
        start = data_url_start(url)
        if start is None:
            raise InvalidRequest(
                f"{where}: a data: URL image must be base64 (data:image/png;base64,...)",
                param=param_of(where),
                code="image_unreadable",
            )
        size = image_size(url, start)
        if size is not None:  # other formats: the worker's image library judges them
            self._check_dimensions(where, *size)

    def _check_dimensions(self, where: str, width: int, height: int) -> None:
        longer, shorter = max(width, height), min(width, height)
        problem = None
        if shorter < 1:
            problem = "has no pixels"
        elif width * height > self.max_image_pixels:
            problem = f"has {width * height} pixels (at most {self.max_image_pixels})"
        elif longer > self.max_image_side:
            problem = f"has a side of {longer} pixels (at most {self.max_image_side})"
        elif longer / shorter > self.max_image_aspect:
            ratio = longer / shorter
            problem = f"has sides {ratio:.0f} to 1 (at most {self.max_image_aspect:g} to 1)"
        if problem is not None:
            raise InvalidRequest(
                f"{where}: the image ({width}x{height}) {problem}",
                param=param_of(where),
                code="image_too_large",
            )


def _check_depth(payload: Any, limit: int) -> None:
    """Iterative (a recursive walk is what a deep document would overflow)."""
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise InvalidRequest(
                f"the request body nests deeper than {limit} levels",
                code="json_too_deep",
            )
        children: Iterable[Any]
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
