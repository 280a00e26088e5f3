"""Fuzzing the gateway's HTTP surface with hypothesis: bodies, headers and paths (issue 14).

Each drawn request goes, on a connection of its own and byte for byte as drawn, to a real gateway
on uvicorn. Its answer must come within `HANG_S` (no hang), must not be a 5xx (the worker behind
the gateway answers every completion with the same small 200, so a 5xx is the gateway's own),
and when it is an error, it must have OpenAI's shape. The requests are valid HTTP/1.1 (tokens for
header names, visible characters and obs-text in values, RFC 3986 characters in the target,
framing by Content-Length): what breaks the HTTP grammar is uvicorn's to answer, not the app's.

Derandomized, with no example database: every run, and CI, tries the same 2,000 cases.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import socket
import string
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mineru_gateway.testing import free_port, wait_http_ok
from tests.faults.harness import address, openai_error
from tests.support.servers import CliProcess, serve
from tests.support.workers import Script, scripted_worker

HANG_S = 15.0
KEY, ADMIN_KEY = "sk-fuzz", "sk-fuzz-admin"
MAX_BODY = 256 * 1024
RELAYED = ("/v1/chat/completions", "/v1/completions")


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """`mineru-gateway serve` with client and admin keys (so that authentication is fuzzed
    too) in front of a worker whose every completion is the same 200. In a process of its own:
    drawing the cases takes most of a core, and the gateway gets the other."""
    with serve(scripted_worker(Script(mode="status", status=200))) as worker:
        port = free_port()
        cli = CliProcess.mineru_gateway(
            *("serve", "--port", str(port), "--workers", worker, "--log-level", "warning"),
            *("--api-keys", KEY, "--admin-keys", ADMIN_KEY, "--max-body-bytes", str(MAX_BODY)),
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(url + "/ready", 30, cli.start())
            yield url
        finally:
            cli.stop()


# -- requests on the wire ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    method: str
    target: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def wire(self) -> bytes:
        lines = [b"%s %s HTTP/1.1" % (self.method.encode(), self.target), b"host: 127.0.0.1"]
        lines += [name + b": " + value for name, value in self.headers]
        lines += [b"content-length: %d" % len(self.body), b"connection: close"]
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body

    def __repr__(self) -> str:  # what a failure report shows: the request, cut to a readable size
        wire = self.wire()
        return f"Case({wire[:2000]!r}{' ...' if len(wire) > 2000 else ''}, {len(wire)} bytes)"


def exchange(url: str, case: Case) -> tuple[int, bytes]:
    """The status and body of the gateway's answer to `case`; a hang raises TimeoutError.

    The request is written from a thread while the answer is read: the gateway may answer (a
    413) before it has read a body, as any server may."""
    with socket.create_connection(address(url), timeout=HANG_S) as sock:
        writer = threading.Thread(target=_send, args=(sock, case.wire()), daemon=True)
        writer.start()
        response = http.client.HTTPResponse(sock, method=case.method)
        response.begin()
        answer = response.status, response.read()
        writer.join(HANG_S)
        return answer


def _send(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the gateway answered and closed before the end
        sock.sendall(data)


def check(url: str, case: Case) -> None:
    shown = case.wire()[:800]
    try:
        status, body = exchange(url, case)
    except TimeoutError:
        raise AssertionError(f"no answer within {HANG_S} s to {shown!r}") from None
    assert status < 500, f"{status} {body[:300]!r} for {shown!r}"
    if status >= 400 and case.method != "HEAD":
        assert openai_error(body) is not None, f"{status} {body[:300]!r} for {shown!r}"


def fuzz(url: str, cases: st.SearchStrategy[Case], examples: int) -> int:
    """Runs `examples` cases drawn from `cases` against the gateway; returns how many ran."""
    ran = 0

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases)
    def one(case: Case) -> None:
        nonlocal ran
        ran += 1
        check(url, case)

    one()
    return ran


# -- strategies: pieces ------------------------------------------------------------------------

TOKEN = st.text(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~", min_size=1, max_size=24)
# Visible ASCII and obs-text (RFC 9110 field-vchar), inner spaces and tabs: every byte but
# the other controls and DEL.
NOT_IN_VALUES = bytes([*range(0, 9), *range(10, 32), 127])
FIELD_VALUE = st.binary(max_size=300).map(lambda raw: raw.translate(None, NOT_IN_VALUES).strip())
GOOD_AUTH = (b"authorization", b"Bearer " + KEY.encode())
JSON_SCALARS = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from([2**63, -(2**63) - 1, 10**40, "", "\x00", "\ud7ff\ue000"])
)  # fmt: skip
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=6,
)
ROLES = st.sampled_from(["user", "system", "assistant", "tool", "developer", ""]) | st.text(
    max_size=8
)


def png(width: int, height: int) -> bytes:
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + crc


def jpeg(width: int, height: int) -> bytes:
    frame = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x22\x00" * 3
    return b"\xff\xd8\xff\xc0" + struct.pack(">H", len(frame) + 2) + frame + b"\xff\xd9"


SIDES = st.integers(0, 2**32 - 1) | st.integers(0, 70_000) | st.sampled_from([1, 100_000, 2**16])
IMAGE_BYTES = st.one_of(
    st.builds(png, SIDES, SIDES),
    st.builds(jpeg, SIDES.map(lambda s: s % 2**16), SIDES.map(lambda s: s % 2**16)),
    st.binary(max_size=64),
)
DATA_URL = st.one_of(
    st.builds(lambda data: "data:image/png;base64," + base64.b64encode(data).decode(), IMAGE_BYTES),
    st.builds(lambda text: "data:image/png;base64," + text, st.text(max_size=40)),
    st.sampled_from(
        ["data:,", "data:image/png;base64", "http://169.254.169.254/latest", "file:///etc/passwd"]
    ),
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40) | JSON}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": DATA_URL}) | JSON}
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_image", "video_url", "x"])}, optional={"image_url": JSON}
    ),
    JSON,
)


def repeated(element: st.SearchStrategy[Any], most: int) -> st.SearchStrategy[list[Any]]:
    """A short list, or one element many times over (limits on counts without drawing each)."""
    many = st.tuples(element, st.integers(0, most)).map(lambda pair: [pair[0]] * pair[1])
    return st.lists(element, max_size=4) | many


TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)})
IMAGE_PART = st.builds(lambda url: {"type": "image_url", "image_url": {"url": url}}, DATA_URL)
CONTENT = st.one_of(
    st.text(max_size=60),
    st.lists(PART, max_size=4),
    repeated(TEXT_PART, 1200),
    repeated(IMAGE_PART, 40),
    JSON,
)
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": CONTENT})
SHORT_MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=8)})
MESSAGES = st.lists(MESSAGE | JSON, max_size=4) | repeated(SHORT_MESSAGE, 1200) | JSON
NUMBER = (
    st.integers()
    | st.floats(allow_nan=False)
    | st.sampled_from([0, -1, 2**31, 10**30, "16", True, None])
)
OPTIONAL = {
    "model": st.text(max_size=20) | JSON,
    "stream": st.booleans() | JSON,
    "max_tokens": NUMBER,
    "max_completion_tokens": NUMBER,
    "priority": NUMBER,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | JSON,
    "temperature": NUMBER,
    "ignore_eos": JSON,
    "n": NUMBER,
}
CHAT = st.fixed_dictionaries({"messages": MESSAGES}, optional=OPTIONAL)
PROMPT = (
    st.text(max_size=60)
    | st.lists(st.integers(), max_size=20)
    | st.lists(st.text(max_size=8), max_size=5)
    | JSON
)
COMPLETION = st.fixed_dictionaries({"prompt": PROMPT}, optional=OPTIONAL)


def nested(depth: int, inner: str) -> str:
    """`inner` at the bottom of `depth` alternating arrays and objects."""
    return (
        "".join('{"a":[' if i % 2 else "[" for i in range(depth))
        + inner
        + "".join("]}" if i % 2 else "]" for i in reversed(range(depth)))
    )


DEEP_CHAT = st.builds(
    lambda depth: '{"messages":[{"role":"user","content":' + nested(depth, '"x"') + "}]}",
    st.integers(1, 5000),
)
RAW_BODIES = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda depth: nested(depth, "1"), st.integers(1, 20_000)).map(str.encode),
    DEEP_CHAT.map(str.encode),
    st.sampled_from(
        ["NaN", "[1e999]", '{"messages": [{"role": "user"}], "messages": 1}', "\ufeff{}"]
    ).map(str.encode),
    st.integers(0, 2 * MAX_BODY).map(
        lambda size: b'{"messages":[{"role":"user","content":"' + b"x" * size + b'"}]}'
    ),
)


def dumps(value: Any) -> bytes:
    """JSON as a client library might write it: NaN and Infinity literals, raw UTF-8."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


# -- strategies: whole requests -----------------------------------------------------------------


def posts(bodies: st.SearchStrategy[bytes]) -> st.SearchStrategy[Case]:
    """Authorized POSTs of `bodies` to one of the relayed endpoints."""
    targets = st.sampled_from(RELAYED).map(str.encode)
    return st.builds(lambda target, body: Case("POST", target, (GOOD_AUTH,), body), targets, bodies)


BAD_AUTH = (
    st.sampled_from([b"", b"Bearer", b"Bearer " + ADMIN_KEY.encode(), b"Basic eDp5"]) | FIELD_VALUE
)
SPECIAL_HEADERS = st.one_of(
    st.tuples(
        st.just(b"x-priority"),
        st.integers().map(lambda n: str(n).encode())
        | st.sampled_from([b"", b"1e9", b" 7 ", b"9" * 400])
        | FIELD_VALUE,
    ),
    st.tuples(st.just(b"x-request-id"), FIELD_VALUE),
    st.tuples(
        st.sampled_from(
            [
                b"content-type",
                b"accept",
                b"accept-encoding",
                b"content-encoding",
                b"expect",
                b"cookie",
                b"user-agent",
                b"x-forwarded-for",
            ]
        ),
        FIELD_VALUE,
    ),
    st.tuples(st.just(b"expect"), st.just(b"100-continue")),
    st.tuples(TOKEN.map(str.encode), FIELD_VALUE),
)
HEADER_LISTS = st.one_of(
    st.lists(SPECIAL_HEADERS, max_size=12),
    repeated(SPECIAL_HEADERS, 160),
    st.tuples(TOKEN.map(str.encode), st.integers(1000, 48_000)).map(
        lambda p: [(p[0], b"v" * p[1])]
    ),
)
WITH_HEADERS = st.builds(
    lambda target, auth, headers, body: Case("POST", target, (*auth, *headers), body),
    st.sampled_from(RELAYED).map(str.encode),
    st.one_of(
        *[st.just((GOOD_AUTH,))] * 3, st.just(()), BAD_AUTH.map(lambda v: ((b"authorization", v),))
    ),
    HEADER_LISTS,
    st.sampled_from(
        [b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}', b'{"prompt":"hi"}']
    ),
)

PCHAR = string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@%"
SEGMENT = st.sampled_from(
    ["v1", "chat", "completions", "models", "workers", "health", "ready", "metrics", "docs",
     "openapi.json", "..", ".", "", "%2e%2e", "%2F", "%00", "%ff", "%", "CHAT", "v2"]
) | st.text(PCHAR, max_size=12)  # fmt: skip
PATH = st.lists(SEGMENT, max_size=6).map(lambda segments: "/" + "/".join(segments))
TARGET = st.one_of(
    st.tuples(PATH, st.none() | st.text(PCHAR + "/?", max_size=40)).map(
        lambda p: p[0] + ("" if p[1] is None else "?" + p[1])
    ),
    st.sampled_from(["*", "http://127.0.0.1/v1/models", "/" + "a" * 8000, "//v1/models"]),
).map(str.encode)
METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
ANYWHERE = st.builds(
    lambda method, target, auth, body: Case(method, target, auth, body),
    METHODS,
    TARGET,
    st.sampled_from([(GOOD_AUTH,), ((b"authorization", b"Bearer " + ADMIN_KEY.encode()),), ()]),
    st.sampled_from(
        [b"", b'{"url": "http://127.0.0.1:1"}', b'{"messages":[{"role":"user"}]}', b"x"]
    ),
)

# The cases, and how many of each: 2,000 in all.
SUITES: dict[str, tuple[Callable[[], st.SearchStrategy[Case]], int]] = {
    "chat bodies": (lambda: posts(CHAT.map(dumps)), 600),
    "completion bodies": (lambda: posts(COMPLETION.map(dumps)), 250),
    "raw and deep bodies": (lambda: posts(RAW_BODIES), 350),
    "headers": (lambda: WITH_HEADERS, 400),
    "paths and methods": (lambda: ANYWHERE, 400),
}


@pytest.mark.parametrize("suite", list(SUITES))
def test_no_5xx_no_hang_and_every_error_in_openais_shape(gateway: str, suite: str) -> None:
    cases, examples = SUITES[suite]
    assert fuzz(gateway, cases(), examples) >= examples
