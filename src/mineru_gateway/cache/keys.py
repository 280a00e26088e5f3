"""Which requests may share an answer, and the key they share it under (docs/cache.md).

MinerU's client samples greedily (`temperature` 0, `top_k` 1), so one page image and prompt give
one valid answer: such a request may be answered by another's generation. Sampled requests, more
than one choice and log-probabilities are never shared. The key hashes a canonical form of what
determines the answer: the endpoint and every body field but those that only shape delivery or
scheduling. Pure: no I/O.

The canonical form is orjson's dump of the parsed body with its keys sorted, so the same request
gives the same key whatever the order or spacing of its JSON. Dumping costs little next to
hashing: a page request is megabytes of base64 image, and the hash reads every byte of it on
every request, hit or miss. So the hash is BLAKE3, a cryptographic hash faster than sha256 on
the same core (docs/cache.md, "Keys"); it stays cryptographic because with
`cache_scope=shared` one tenant's request must not be able to collide with another's.
"""

from __future__ import annotations

from typing import Any

import orjson
from blake3 import blake3

from mineru_gateway.request import CacheTag, Request

# Fields that do not change the answer: scheduling, attribution and delivery.
NOT_IN_KEY = frozenset({"priority", "user", "stream", "stream_options", "request_id"})


def cache_tag(request: Request, scope: str) -> CacheTag | None:
    """The request's tag when its answer is the same every time it is asked, else None. Its
    digest is the key its answer is stored and coalesced under within `scope` (a tenant's name,
    or "" when tenants share answers), hashed with it so that neither appears in clear."""
    payload = request.payload
    if not _greedy(payload) or not _single_plain_choice(payload):
        return None
    canonical = orjson.dumps(
        {name: item for name, item in payload.items() if name not in NOT_IN_KEY},
        option=orjson.OPT_SORT_KEYS,
    )
    scoped = scope.encode()
    # Length-prefixed: no scope and endpoint can read as another pair.
    hasher = blake3(b"%d:%b\0%b\0" % (len(scoped), scoped, request.endpoint.encode()))
    hasher.update(canonical)
    digest = hasher.digest()
    options = payload.get("stream_options")
    usage = isinstance(options, dict) and options.get("include_usage") is True
    return CacheTag(digest, usage)


def _greedy(payload: dict[str, Any]) -> bool:
    return _number_is(payload.get("temperature"), 0) or _number_is(payload.get("top_k"), 1)


def _single_plain_choice(payload: dict[str, Any]) -> bool:
    n = payload.get("n")
    if n is not None and not _number_is(n, 1):
        return False
    logprobs = payload.get("logprobs")
    if logprobs is not None and logprobs is not False:
        return False
    return payload.get("top_logprobs") is None and payload.get("prompt_logprobs") is None


def _number_is(item: Any, wanted: int) -> bool:
    return isinstance(item, int | float) and not isinstance(item, bool) and item == wanted
