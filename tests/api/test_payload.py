"""Page images kept out of the JSON parse (api/payload.py): the result is orjson's for every
document, valid or not, but for the one documented difference."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest
from benchmarks.small_requests import chat_body

from mineru_gateway.api import payload
from mineru_gateway.api.payload import ELIDE_FROM, loads

pytestmark = pytest.mark.unit

LONG = "data:image/png;base64," + "iVBORw0KGgo" * (ELIDE_FROM // 8)
SHORT = "data:image/png;base64,iVBORw0KGgo="


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def same_as_orjson(body: bytes) -> Any:
    """`loads(body)`, asserted equal to orjson's result or error."""
    try:
        expected = orjson.loads(body)
    except orjson.JSONDecodeError as error:
        with pytest.raises(orjson.JSONDecodeError) as raised:
            loads(body)
        assert str(raised.value) == str(error)
        return None
    assert loads(body) == expected
    return expected


def test_a_mineru_page_request_parses_as_orjson_parses_it() -> None:
    body = chat_body("m", image_kb=300)
    parsed = same_as_orjson(body)
    url = parsed["messages"][0]["content"][0]["image_url"]["url"]
    assert type(url) is str and url.startswith("data:image/png;base64,") and len(url) > 300_000


def test_a_page_requests_image_never_reaches_the_json_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[int] = []
    parse = orjson.loads

    def counted(data: bytes) -> Any:
        parsed.append(len(data))
        return parse(data)

    monkeypatch.setattr(payload.orjson, "loads", counted)
    body = chat_body("m", image_kb=300)
    assert len(loads(body)["messages"][0]["content"][0]["image_url"]["url"]) > 300_000
    assert len(parsed) == 1 and parsed[0] < 1000  # the JSON around the image, once


@pytest.mark.parametrize(
    "document",
    [
        # several images, in several messages, and one short enough to be parsed in place
        {"messages": [{"role": "user", "content": [image(LONG), image(SHORT), image(LONG)]}]},
        {"messages": [{"role": "user", "content": [image(LONG)]}, {"content": [image(LONG)]}]},
        # a long data: URL as a key, as a bare value, as a top-level string, in a list
        {LONG: 1, "x": LONG},
        [LONG, [LONG, {"k": [LONG]}]],
        LONG,
        # data: text inside other strings: after an escaped quote, quoted, with escapes
        {"text": 'say "' + LONG + '" twice', "url": LONG},
        {"text": "\\" + LONG, "url": LONG},
        {"text": '\\"' + LONG, "url": LONG},
        # the URL itself with an escape (JSON may escape "/"), or not ASCII: parsed in place
        {"url": LONG + "\n"},
        {"url": LONG + "é"},
        # the same URL twice under one key: the last wins, as in orjson
        {"url": "a", "url2": LONG},
    ],
)
def test_documents_with_long_data_urls_parse_as_orjson_parses_them(document: Any) -> None:
    assert same_as_orjson(orjson.dumps(document)) == document
    assert same_as_orjson(json.dumps(document, ensure_ascii=True).encode()) == document
    escaped_slashes = json.dumps(document).replace("/", "\\/").encode()
    assert same_as_orjson(escaped_slashes) == document


def test_a_repeated_key_keeps_the_last_value_as_orjson_does() -> None:
    body = b'{"u": "' + LONG.encode() + b'", "u": "' + LONG.encode() + b'x"}'
    assert same_as_orjson(body) == {"u": LONG + "x"}


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": "x"' + LONG.encode() + b'"}',  # data: right after a closing quote
        b'{"a": "' + LONG.encode(),  # no closing quote
        b'{"a": "' + LONG.encode() + b'"',  # no closing brace
        b'{"a": "' + LONG.encode() + b'" "b"}',  # no colon
        b'["\\\\"' + LONG.encode() + b'"]',  # an escaped backslash, then the quote closes
        b'{"a": "' + LONG.encode() + b'"}}',  # one brace too many
    ],
)
def test_invalid_documents_fail_with_orjsons_error(body: bytes) -> None:
    assert same_as_orjson(body) is None


CLIENTS = payload._PLACEHOLDER + "0"  # the first URL's placeholder, as a client's own text


@pytest.mark.parametrize(
    "document",
    [
        {"a": CLIENTS, "b": LONG},
        {"b": LONG, "a": CLIENTS},
        {CLIENTS: LONG},
        {"b": LONG, CLIENTS: 1},
        {LONG: 1, "a": CLIENTS},  # the URL's placeholder is a key, the client's text a value
    ],
)
def test_text_of_the_clients_that_looks_like_a_placeholder_stays_its_own(document: Any) -> None:
    assert same_as_orjson(orjson.dumps(document)) == document


def test_a_placeholder_spelt_with_an_escape_stays_the_clients_own_text() -> None:
    escaped = b'{"a": "\\u006d' + CLIENTS[1:].encode() + b'", "b": "' + LONG.encode() + b'"}'
    assert same_as_orjson(escaped) == {"a": CLIENTS, "b": LONG}


@pytest.mark.parametrize(
    ("body", "spans"),
    [
        (b'["' + LONG.encode() + b'"]', [(1, 2 + len(LONG))]),
        (b'["\\\\"' + LONG.encode() + b'"]', [(4, 5 + len(LONG))]),  # an even run: a quote
        (b'["x \\"' + LONG.encode() + b'"]', []),  # an escaped quote inside a string
        (b'["' + LONG.encode() + b'\\n"]', []),  # an escape inside: parsed in place
        (b'["' + SHORT.encode() + b'"]', []),  # short: parsed in place
        (
            b'["' + LONG.encode() + b'", "' + LONG.encode() + b'"]',
            [(1, 2 + len(LONG)), (5 + len(LONG), 6 + 2 * len(LONG))],
        ),
    ],
)
def test_which_strings_are_taken_out(body: bytes, spans: list[tuple[int, int]]) -> None:
    assert payload._long_data_urls(body) == spans


def test_a_control_character_inside_a_long_data_url_is_left_to_the_worker() -> None:
    """The documented difference: orjson refuses it, `loads` passes it on (vLLM answers 400)."""
    body = b'{"url": "' + LONG.encode() + b'\x01"}'
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(body)
    assert loads(body) == {"url": LONG + "\x01"}


def test_random_documents_and_their_mutations_parse_as_orjson_parses_them() -> None:
    rng = random.Random(20261204)
    pieces = ['"', "\\", "data:", "{", "}", "[", "]", ",", ":", " ", "x", LONG, "é"]

    def value(depth: int) -> Any:
        kind = rng.randrange(7 if depth < 4 else 4)
        if kind == 0:
            return rng.choice([LONG, SHORT, "data:", 'q"' + LONG, "\\" + LONG])
        if kind == 1:
            return "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))
        if kind == 2:
            return rng.randrange(-5, 5)
        if kind == 3:
            return rng.choice([None, True, 1.5])
        if kind in (4, 5):
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(["a", "b", LONG, "data:x"]): value(depth + 1) for _ in range(3)}

    for _ in range(300):
        document = value(0)
        body = orjson.dumps(document)
        assert same_as_orjson(body) == document
        # Cut or spliced anywhere: valid or not, the same result or the same error.
        at = rng.randrange(len(body) + 1)
        for mutated in (
            body[:at],
            body[:at] + rng.choice(pieces).encode() + body[at:],
            body[:at] + b'"' + LONG.encode() + b'"' + body[at:],
        ):
            if b"\x00" not in mutated:
                same_as_orjson(mutated)
