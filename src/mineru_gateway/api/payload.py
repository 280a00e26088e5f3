"""A request body's JSON, parsed without running its page images through the JSON parser.

MinerU sends every page as a base64 PNG inside the body: hundreds of kilobytes of JSON, nearly
all of it one `data:` URL. orjson spends most of its parse validating and copying that one
string, of which the gateway reads only the first bytes (the image's header) and the length
(docs/proxy-costs.md, "Page-image requests"). So `loads` takes each long `data:` URL out of the
text, parses what is left (a few hundred bytes), and puts the URLs back as strings made straight
from the body's bytes (an ASCII decode, far cheaper). Pure: no I/O.

Why the result is orjson's for every valid document. A span is taken only from a `"` that no odd
run of backslashes precedes and that `data:` follows, to the next `"`, with no backslash in
between. In valid JSON such a quote cannot close a string (a closing quote is followed by `,`,
`:`, `}`, `]` or white space, never `d`), so it opens one, and with no backslash inside, the next
quote closes it: the span is exactly one string token, whose value is its bytes. Swapping string
tokens for other string tokens (the placeholders) keeps the document's structure, and the
placeholders are swapped back. A placeholder met anywhere but once as a value (a key, say), text
of the client's that starts like one, a URL that is not ASCII, or any parse error sends the
whole body to orjson instead, so errors are orjson's own, at their own positions.

The one difference: raw control characters inside such a URL make the document invalid JSON,
which orjson refuses and `loads` does not look for (that is a pass over the whole URL, as dear
as the parse saved). The body goes to the worker as it came, and vLLM refuses it with a 400.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

import orjson

ELIDE_FROM = 16 * 1024  # shorter `data:` URLs are parsed with the rest: orjson is fast enough
_START = b'"data:'
_BACKSLASH = 0x5C
# Placeholders: a string no client can guess, numbered per URL.
_PLACEHOLDER = "mineru-gateway-elided-" + secrets.token_hex(16) + "-"


def loads(body: bytes) -> Any:
    """`orjson.loads(body)`, with the same result and errors (module docstring)."""
    spans = _long_data_urls(body) if len(body) > ELIDE_FROM else None
    if not spans:
        return orjson.loads(body)
    urls: dict[str, tuple[int, int]] = {}
    parts: list[bytes] = []
    last = 0
    for number, (start, end) in enumerate(spans):
        name = f"{_PLACEHOLDER}{number}"
        urls[name] = (start + 1, end)
        parts += (body[last:start], b'"', name.encode(), b'"')
        last = end + 1
    parts.append(body[last:])
    try:
        payload = orjson.loads(b"".join(parts))
        if _restore(payload, urls, memoryview(body)):
            return payload
    except (orjson.JSONDecodeError, UnicodeDecodeError):
        pass
    return orjson.loads(body)  # its result, or its error at its own position


def _long_data_urls(body: bytes) -> list[tuple[int, int]]:
    """(opening quote, closing quote) of each long `data:` URL string with no escapes."""
    spans: list[tuple[int, int]] = []
    at = body.find(_START)
    while at != -1:
        end = body.find(b'"', at + 1)
        if end == -1:
            break
        if end - at > ELIDE_FROM and _unescaped(body, at) and body.find(b"\\", at, end) == -1:
            spans.append((at, end))
            at = body.find(_START, end + 1)
        else:
            at = body.find(_START, at + 1)
    return spans


def _unescaped(body: bytes, at: int) -> bool:
    """No odd run of backslashes before `at`."""
    run = 0
    while at - run > 0 and body[at - run - 1] == _BACKSLASH:
        run += 1
    return run % 2 == 0


def _restore(payload: Any, urls: dict[str, tuple[int, int]], body: memoryview) -> bool:
    """Puts each URL back where its placeholder is, as a value. False when the client's own text
    looks like a placeholder, as a key or a value (it cannot guess one, but the result must not
    depend on that), or when a placeholder is not met once as a value."""
    stack = [payload]
    while stack:
        container = stack.pop()
        if isinstance(container, dict):
            if any(key.startswith(_PLACEHOLDER) for key in container):
                return False
            items: Iterable[tuple[Any, Any]] = container.items()
        else:
            items = enumerate(container)
        for key, item in items:
            if isinstance(item, str):
                if item.startswith(_PLACEHOLDER):
                    span = urls.pop(item, None)
                    if span is None:
                        return False
                    container[key] = str(body[span[0] : span[1]], "ascii")
            elif isinstance(item, dict | list):
                stack.append(item)
    return not urls
