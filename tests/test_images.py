"""An image's size from its header: every format MinerU or an OpenAI client sends, as Pillow
writes it, and the hostile shapes (cut short, wrapped, bombs) the request limits rely on."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from mineru_gateway.images import Base64Prefix, data_url_start, image_size

pytestmark = pytest.mark.unit


def encoded(image: Image.Image, format: str, **options: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    return base64.b64encode(buffer.getvalue()).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG of any declared size, a few dozen bytes long: what a decompression bomb looks like
    before its pixels are inflated."""
    ihdr = struct.pack(">II5B", width, height, 8, 0, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr
    chunk += struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk + b"\0\0\0\0IDAT"


def jpeg(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + b"\1\1\0\0\1\0\1\0\0"
    fill = b"\xff"  # a fill byte before the next marker is legal
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\1\x11\0"
    return b"\xff\xd8" + app0 + fill + sof0 + b"\xff\xd9"


PAGE = Image.new("RGB", (1240, 1754), "white")
SMALL = Image.new("RGBA", (300, 200), (10, 20, 30, 128))


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (encoded(PAGE, "PNG"), (1240, 1754)),
        (encoded(PAGE, "JPEG", quality=80), (1240, 1754)),
        (encoded(PAGE, "JPEG", progressive=True), (1240, 1754)),
        # EXIF and an ICC profile put kilobytes between the JPEG's start and its frame header.
        (
            encoded(PAGE, "JPEG", exif=b"Exif\0\0" + b"\0" * 20_000, icc_profile=b"\0" * 9000),
            (1240, 1754),
        ),
        (encoded(SMALL.convert("RGB"), "GIF"), (300, 200)),
        (encoded(SMALL.convert("RGB"), "BMP"), (300, 200)),
        (encoded(SMALL.convert("RGB"), "WEBP", quality=50), (300, 200)),  # VP8
        (encoded(SMALL, "WEBP", lossless=True), (300, 200)),  # VP8L
        (encoded(SMALL, "WEBP", quality=50), (300, 200)),  # VP8X (alpha)
        (encoded(Image.new("L", (1, 100_000)), "PNG"), (1, 100_000)),
        (base64.b64encode(png_header(50_000, 50_000)).decode(), (50_000, 50_000)),
        (base64.b64encode(jpeg(640, 480)).decode(), (640, 480)),
    ],
)
def test_the_size_is_read_from_the_header(text: str, size: tuple[int, int]) -> None:
    assert image_size(text) == size


def wrap(text: str, width: int = 76, newline: str = "\n") -> str:
    return newline.join(text[i : i + width] for i in range(0, len(text), width))


def test_wrapped_base64_is_read_as_well() -> None:
    assert image_size(wrap(encoded(PAGE, "PNG"))) == (1240, 1754)
    # A JPEG's frame header kilobytes in, past many line ends (and CRLF ones).
    exif = encoded(PAGE, "JPEG", exif=b"Exif\0\0" + b"\0" * 20_000)
    assert image_size(wrap(exif, newline="\r\n")) == (1240, 1754)
    assert image_size(wrap(exif, width=7, newline=" ")) == (1240, 1754)


def test_the_size_is_read_where_the_base64_starts_in_a_longer_text() -> None:
    url = "data:image/png;base64," + encoded(PAGE, "PNG")
    start = data_url_start(url)
    assert start == len("data:image/png;base64,")
    assert image_size(url, start) == (1240, 1754)
    wrapped = "data:image/jpeg;base64," + wrap(encoded(PAGE, "JPEG", icc_profile=b"\0" * 9000))
    assert image_size(wrapped, data_url_start(wrapped)) == (1240, 1754)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x89PNG\r\n\x1a\n",  # the signature alone
        b"\xff\xd8" + b"\xff\xd0" * 8 + b"\xff\xd9",  # no frame header before the end
        b"\xff\xd8" + b"\x00" * 16,
        b"\xff\xd8\xff\xe0\x00\x00",  # a segment whose length is impossible
        b"RIFF\0\0\0\0WEBPVP8L\0\0",  # cut short
        b"GIF8",
        b"II*\0" + b"\0" * 40,  # TIFF: not measured, left to the worker
        b"not an image at all, just text",
    ],
)
def test_what_cannot_be_measured_is_none(data: bytes) -> None:
    assert image_size(base64.b64encode(data).decode()) is None


def test_a_jpeg_of_endless_segments_is_given_up_on() -> None:
    segment = b"\xff\xe1" + struct.pack(">H", 4) + b"\0\0"
    assert image_size(base64.b64encode(b"\xff\xd8" + segment * 1000).decode()) is None


def test_broken_base64_is_none_not_an_error() -> None:
    assert image_size("!!!!****") is None
    assert image_size("A===") is None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.binary(max_size=200),
    st.lists(st.tuples(st.integers(0, 220), st.integers(0, 40)), min_size=1, max_size=4),
    st.text(alphabet="ab", max_size=5),
    st.integers(1, 80),
)
def test_any_slice_reads_as_the_decoded_bytes(
    data: bytes, reads: list[tuple[int, int]], prefix: str, width: int
) -> None:
    """Reads in any order, from base64 after any prefix, wrapped at any width or not."""
    text = base64.b64encode(data).decode()
    for body in (text, wrap(text, width), wrap(text, width, "\r\n")):
        source = Base64Prefix(prefix + body, len(prefix))
        for start, length in reads:
            assert source.read(start, length) == data[start : start + length]


@pytest.mark.parametrize(
    ("url", "payload"),
    [
        ("data:image/png;base64,AAAA", "AAAA"),
        ("data:image/png,AAAA", None),  # not base64
        ("https://example.com/a.png", None),
        ("data:image/png;base64", None),
    ],
)
def test_the_payload_of_a_data_url(url: str, payload: str | None) -> None:
    start = data_url_start(url)
    assert (None if start is None else url[start:]) == payload
