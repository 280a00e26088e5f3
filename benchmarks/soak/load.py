"""The soak's traffic: closed-loop clients sending MinerU's mix, and what each request got.

Every request ends as one kind (`kinds`): `ok`; an explicit error, `error:<status>:<code>`
(OpenAI-shaped JSON) or `stream_error:<code>` (an SSE error event just before `data: [DONE]`);
or `lost:<what>` (no answer, a cut stream, an error body in no known shape). Nothing may be lost.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson
from benchmarks.flow.client import non_streaming
from benchmarks.routing import fleet
from benchmarks.routing.loadgen import CHAT
from benchmarks.routing.workload import Mix, Request, StreamBuilder

JSON_HEADERS = {"Content-Type": "application/json"}
# MinerU's answers at a quarter of their length: short requests keep the two cores' load on the
# gateway's handling of requests and faults, not on long generations. The model is named, so
# that the slow readers' firehose (a model of its own) gets none of this traffic.
MIX = Mix(length_scale=0.25, layout_png_bytes=16 * 1024, model=fleet.MODEL)


def requests(pages: int, seed: int) -> list[Request]:
    """MinerU's mix for `pages` pages, every other request sent whole (as MinerU does)."""
    builder = StreamBuilder(MIX, seed)
    drawn = [request for _ in range(pages) for request in builder.page()]
    return [non_streaming(r) if i % 2 else r for i, r in enumerate(drawn)]


def error_kind(status: int, data: bytes) -> str:
    code = _error_code(data)
    return f"lost:{status} in no OpenAI shape" if code is None else f"error:{status}:{code}"


def _error_code(data: bytes) -> str | None:
    try:
        error = orjson.loads(data).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(error, dict) or not {"message", "type", "code"} <= set(error):
        return None
    return str(error["code"])


def stream_kind(data: bytes) -> str:
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "lost:stream without [DONE]"
    codes = [(index, _error_code(event)) for index, event in enumerate(events[:-1])]
    errors = [(index, code) for index, code in codes if code is not None]
    if not errors:
        return "ok"
    if len(errors) == 1 and errors[0][0] == len(events) - 2:
        return f"stream_error:{errors[0][1]}"
    return "lost:error event mid-stream"


async def send(session: aiohttp.ClientSession, url: str, request: Request) -> str:
    """One request through the gateway; its kind."""
    try:
        async with session.post(url + CHAT, data=request.body, headers=JSON_HEADERS) as response:
            data = await response.read()
            streamed = response.content_type == "text/event-stream"
    except (aiohttp.ClientError, TimeoutError) as error:
        return f"lost:{type(error).__name__}"
    if response.status != 200:
        return error_kind(response.status, data)
    if streamed:
        return stream_kind(data)
    return "ok" if b'"choices"' in data else "lost:200 without choices"


@dataclass
class Tally:
    """Kinds of every request, in all and by the fault that was on when it was sent."""

    kinds: Counter[str] = field(default_factory=Counter)
    by_fault: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, fault: str, kind: str) -> None:
        self.kinds[kind] += 1
        self.by_fault.setdefault(fault, Counter())[kind] += 1


async def closed_loop(
    url: str,
    bodies: Sequence[Request],
    clients: int,
    until: Callable[[], bool],
    fault: Callable[[], str],
    tally: Tally,
) -> None:
    """`clients` slots, each sending its next request when the last one ended, until `until()`
    is true; `fault()` names the fault on at each send."""
    turn = itertools.count()
    timeout = aiohttp.ClientTimeout(total=180, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0)

    async def slot(session: aiohttp.ClientSession) -> None:
        while not until():
            label = fault()
            tally.add(label, await send(session, url, bodies[next(turn) % len(bodies)]))

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(slot(session) for _ in range(clients)))


def deadline(seconds: float) -> Callable[[], bool]:
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end
