"""An image's width and height from the first bytes of its base64 text. Pure.

Used where the gateway must know an image's size without decoding it: request limits (a
decompression bomb is refused from its header, api/limits.py) and prompt cost (Qwen2-VL's visual
tokens follow the pixel count, prompts.py). Only the bytes that hold the header are decoded: a
few dozen for PNG, GIF, BMP and WebP, one small read per segment for JPEG (whose frame header
follows EXIF, ICC profiles and thumbnails).
"""

from __future__ import annotations

import binascii
import struct


def data_url_start(url: str) -> int | None:
    """Where the base64 text of a `data:...;base64,` URL begins, else None.

    An offset, not a copy: a page image's text is hundreds of kilobytes, and slicing it out
    would cost more than reading its header (docs/proxy-costs.md, "Page-image requests").
    """
    comma = url.find(",")
    if not url.startswith("data:") or comma < 0 or ";base64" not in url[:comma]:
        return None
    return comma + 1


class Base64Prefix:
    """Random access into base64 text, from `start` in `text`, without decoding or copying all
    of it: bytes [i, i+n) come from the 4-character groups that hold them.

    Whitespace (some encoders wrap lines) shifts those groups. Only the characters up to the
    last one read are searched for it (whitespace further on moves nothing before it), so a
    header costs a header's worth of searching however large the image; where there is any,
    the text is taken without its whitespace once.
    """

    def __init__(self, text: str, start: int = 0) -> None:
        self._text = text
        self._start = start
        self._clean = start  # text[start:_clean] holds no whitespace

    def read(self, start: int, length: int) -> bytes:
        first = start // 3 * 4
        last = -(-(start + length) // 3) * 4
        chunk = self._chars(first, last)
        try:
            data = binascii.a2b_base64(chunk + "=" * (-len(chunk) % 4), strict_mode=False)
        except (binascii.Error, ValueError):
            return b""
        skip = start - first // 4 * 3
        return data[skip : skip + length]

    def _chars(self, first: int, last: int) -> str:
        """Characters [first, last) of the base64 text without whitespace."""
        end = self._start + last
        if end > self._clean:
            text, scan_to = self._text, min(end, len(self._text))
            if any(text.find(space, self._clean, scan_to) >= 0 for space in _WHITESPACE):
                self._text = "".join(text[self._start :].split())
                self._start, self._clean = 0, len(self._text)  # all of it clean now
            else:
                self._clean = scan_to
        return self._text[self._start + first : self._start + last]


_WHITESPACE = ("\n", "\r", " ")


def image_size(base64_text: str, start: int = 0) -> tuple[int, int] | None:
    """(width, height) from the header of the base64 image from `start` in `base64_text`, or None
    when the format is not one of PNG, JPEG, WebP, GIF or BMP, or its header is cut short."""
    data = Base64Prefix(base64_text, start)
    head = data.read(0, 32)
    try:
        if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
            return _unpack(">II", head, 16)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            return _unpack("<HH", head, 6)
        if head.startswith(b"BM"):
            return _bmp_size(head)
        if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
            return _webp_size(head)
        if head.startswith(b"\xff\xd8"):
            return _jpeg_size(data)
    except (struct.error, IndexError):  # a header cut short
        return None
    return None


def _unpack(layout: str, data: bytes, offset: int) -> tuple[int, int]:
    width, height = struct.unpack_from(layout, data, offset)
    return int(width), int(height)


def _bmp_size(head: bytes) -> tuple[int, int]:
    (header_size,) = struct.unpack_from("<I", head, 14)
    if header_size == 12:  # BITMAPCOREHEADER
        return _unpack("<HH", head, 18)
    width, height = struct.unpack_from("<ii", head, 18)
    return abs(width), abs(height)  # a negative height is a top-down bitmap


def _webp_size(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", head, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        (bits,) = struct.unpack_from("<I", head, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        width = int.from_bytes(head[24:27], "little") + 1
        height = int.from_bytes(head[27:30], "little") + 1
        return width, height
    return None


# Start-of-frame markers (baseline, progressive, lossless, arithmetic); not DHT (C4), JPG (C8)
# or DAC (CC), which share the range.
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM, RSTn
_JPEG_END = frozenset({0xD8, 0xD9, 0xDA})  # SOI, EOI, SOS: no frame header before them
_JPEG_MAX_SEGMENTS = 256  # EXIF, ICC and thumbnails come first; a real header has a few dozen


def _jpeg_size(data: Base64Prefix) -> tuple[int, int] | None:
    offset = 2
    for _ in range(_JPEG_MAX_SEGMENTS):
        marker = data.read(offset, 9)
        if len(marker) < 4 or marker[0] != 0xFF:
            return None
        kind = marker[1]
        if kind == 0xFF:  # fill byte
            offset += 1
            continue
        if kind in _JPEG_STANDALONE:
            offset += 2
            continue
        if kind in _JPEG_END:
            return None
        if kind in _JPEG_FRAMES:
            if len(marker) < 9:
                return None
            height, width = struct.unpack_from(">HH", marker, 5)
            return width, height
        (length,) = struct.unpack_from(">H", marker, 2)
        if length < 2:
            return None
        offset += 2 + length
    return None
