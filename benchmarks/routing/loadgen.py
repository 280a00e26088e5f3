"""An open-loop load generator: Poisson arrivals, streaming requests, vLLM bench's definitions.

Each request is sent at its scheduled time whatever happened to earlier ones (open loop: a slow
router gets the same arrivals as a fast one). Measured as `vllm bench serve` does (docs/vllm.md):
TTFT from just before the request is sent to the first streamed chunk carrying content,
E2E from the same start to the last byte. The generator's own lag, the time between a request's
scheduled and actual send, is recorded, so a run where the generator fell behind is visible.

A run has three phases: warm-up (requests sent, not measured: the running batches fill), the
measured window (requests *scheduled* in it are measured), then a tail where arrivals go on at the
same rate, so measured requests finish under the same load, until waiting longer cannot change
the measured p99 (of TTFT, or of E2E where E2E is measured; see `_Settler`) or a cap is reached.
Then every request still open is cancelled: the routers and workers abort it (their disconnect
handling), and the workers go idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from .workload import Arrival

CHAT = "/v1/chat/completions"
_CONTENT = re.compile(rb'"(?:content|text)":"(?!")')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')


@dataclass(slots=True)
class Record:
    kind: str
    scheduled: float  # seconds after the run's start
    measured: bool
    planned_tokens: int
    sent: float = 0.0  # perf_counter
    first_token: float | None = None
    done: float | None = None
    output_tokens: int | None = None
    error: str | None = None
    cancelled: bool = False


@dataclass(slots=True)
class Phases:
    warmup_s: float
    window_s: float
    tail_cap_s: float
    wait_for: str = "first_token"  # or "done": E2E needs every measured request to finish

    @property
    def window_end(self) -> float:
        return self.warmup_s + self.window_s

    @property
    def total(self) -> float:
        return self.window_end + self.tail_cap_s


@dataclass(slots=True)
class RunOutcome:
    records: list[Record]
    start: float  # perf_counter at offset 0
    window_tokens: int  # streamed events received inside the measured window (all requests)
    window_done: int  # requests (measured or not) that completed inside the window
    lags: list[float] = field(default_factory=list)
    tail_s: float = 0.0
    capped: bool = False


class _Window:
    __slots__ = ("done", "start", "stop", "tokens")

    def __init__(self, start: float, stop: float) -> None:
        self.start, self.stop = start, stop
        self.tokens = 0
        self.done = 0


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, record: Record, window: _Window
) -> None:
    headers = {"Content-Type": "application/json"}
    record.sent = time.perf_counter()
    tail = b""
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                record.error = f"status {response.status}"
                await response.read()
                return
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                joined = tail + chunk
                if record.first_token is None and _CONTENT.search(joined):
                    record.first_token = now
                if window.start <= now <= window.stop:
                    window.tokens += chunk.count(b"data: ")
                tail = joined[-4096:]
        record.done = time.perf_counter()
        if window.start <= record.done <= window.stop:
            window.done += 1
        found = _COMPLETION_TOKENS.findall(tail)
        record.output_tokens = int(found[-1]) if found else None
    except asyncio.CancelledError:
        record.cancelled = True
        raise
    except (aiohttp.ClientError, TimeoutError) as error:
        record.error = type(error).__name__


async def run_open_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    arrivals: Sequence[Arrival],
    phases: Phases,
    measure: bool = True,
) -> RunOutcome:
    """Sends `arrivals` (sorted by time) to `base_url`; see the module docstring for phases."""
    url = base_url + CHAT
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    window = _Window(start + phases.warmup_s, start + phases.window_end)
    records: list[Record] = []
    tasks: set[asyncio.Task[None]] = set()
    settler = _Settler(phases.wait_for)
    lags: list[float] = []
    capped = True
    for arrival in arrivals:
        if arrival.at >= phases.total:
            break
        if arrival.at >= phases.window_end and settler.settled():
            capped = False
            break
        delay = start + arrival.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        measured = measure and phases.warmup_s <= arrival.at < phases.window_end
        record = Record(arrival.request.kind, arrival.at, measured, arrival.request.output_tokens)
        records.append(record)
        if measured:
            settler.add(record)
        task = loop.create_task(_one(session, url, arrival.request.body, record, window))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        lags.append(time.perf_counter() - (start + arrival.at))
    else:
        # The schedule ran out first: wait for measured requests up to the cap.
        deadline = start + phases.total
        while True:
            if settler.settled() or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.05)
        capped = not settler.settled()
    tail_s = time.perf_counter() - window.stop
    for task in list(tasks):
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    return RunOutcome(records, start, window.tokens, window.done, lags, max(0.0, tail_s), capped)


class _Settler:
    """Decides when the tail may end: once waiting longer cannot change the measured requests'
    p99 (nor any lower percentile) of what the run waits for (first token, or end).

    Requests still open when the tail ends are cancelled and count as infinitely slow; that is
    exact for the percentiles reported when at most 1% are open and each has already been open
    longer than the p99 of the settled ones: whatever they would have taken, they rank above it.
    """

    def __init__(self, wait_for: str) -> None:
        self.wait_for = wait_for
        self.count = 0
        self.known: list[float] = []
        self.open: list[Record] = []

    def add(self, record: Record) -> None:
        self.count += 1
        self.open.append(record)

    def settled(self) -> bool:
        still = []
        for record in self.open:
            value = _value(record, self.wait_for)
            if value is None:
                still.append(record)
            else:
                self.known.append(value)
        self.open = still
        if not still:
            return True
        rank = math.ceil(0.99 * self.count)
        if len(still) > self.count - rank:
            return False
        p99 = sorted(self.known)[rank - 1]
        now = time.perf_counter()
        return all(r.sent > 0 and now - r.sent >= p99 for r in still)


def _value(record: Record, wait_for: str) -> float | None:
    """Seconds to the first token or the end; inf for a failure; None while unknown."""
    if record.error is not None:
        return math.inf
    if wait_for == "first_token" and record.first_token is not None:
        return record.first_token - record.sent
    if record.done is not None:
        return record.done - record.sent
    return None


async def background_load(
    session: aiohttp.ClientSession, base_url: str, arrivals: Sequence[Arrival], stop: asyncio.Event
) -> list[Record]:
    """Open-loop traffic that bypasses the router (another gateway, clients calling a worker
    directly): sent until `stop` is set, then cancelled; not measured."""
    url = base_url + CHAT
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    window = _Window(0.0, 0.0)
    tasks: set[asyncio.Task[None]] = set()
    records: list[Record] = []
    for arrival in arrivals:
        delay = start + arrival.at - time.perf_counter()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)
        if stop.is_set():
            break
        record = Record(arrival.request.kind, arrival.at, False, arrival.request.output_tokens)
        records.append(record)
        task = loop.create_task(_one(session, url, arrival.request.body, record, window))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    for task in list(tasks):
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def new_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)
