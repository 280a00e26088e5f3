"""The clients of the flow benchmark: tenants that authenticate with an API key.

- `Interactive`: open-loop Poisson streams (a user waiting on each answer), TTFT measured as
  `loadgen.py` does (from just before the request is sent to the first chunk carrying content).
  No retries: a 429 is an error to this user.
- `MineruBatch`: MinerU's client doing a batch (docs/mineru-client.md): non-streaming requests,
  `concurrency` of them at once (a closed loop: each slot sends its next request when the last
  one ended). On 429, 502, 503 and 504 it waits `Retry-After` (capped at 120 s; 0.5 s when the
  answer names none) with jitter and sends again. Unlike MinerU (3 retries) it retries until it
  succeeds, so nothing is lost, up to a deadline after which a request counts as `lost`. Any
  other failure is an error and is not retried (MinerU does not retry a 500 either).

All times are `time.perf_counter()` wall seconds; scenarios convert to engine time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson
from benchmarks.routing.loadgen import CHAT
from benchmarks.routing.workload import Request

_CONTENT = re.compile(rb'"(?:content|text)":"(?!")')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
RETRY_STATUSES = frozenset({429, 502, 503, 504})
RETRY_AFTER_CAP_S = 120.0


@dataclass(slots=True)
class Call:
    """One logical request, all its attempts included."""

    tenant: str
    kind: str
    due: float  # when it was meant to be sent (open loop) or its slot became free
    sent: float = 0.0  # first attempt
    first_token: float | None = None
    done: float | None = None  # success only
    output_tokens: int = 0
    error: str | None = None
    attempts: int = 0
    rejected: int = 0  # 429 answers
    unavailable: int = 0  # 502/503/504 answers
    codes: dict[str, int] = field(default_factory=dict)  # error codes of the 429/503 answers
    lost: bool = False  # gave up retrying at the deadline
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.done is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.error else self.first_token - self.sent

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent


def auth(key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def non_streaming(request: Request) -> Request:
    """The same request as MinerU's client sends it: not streamed."""
    body = orjson.loads(request.body)
    body["stream"] = False
    body.pop("stream_options", None)
    return Request(request.kind, orjson.dumps(body), request.output_tokens, request.image_tokens)


def _error_code(data: bytes) -> str:
    try:
        error = orjson.loads(data).get("error", {})
        return str(error.get("code") or error.get("type") or "?")
    except (orjson.JSONDecodeError, AttributeError):
        return "?"


async def stream_once(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], call: Call
) -> None:
    """One streamed attempt: TTFT, end, output tokens (from the final usage chunk)."""
    call.sent = time.perf_counter()
    call.attempts += 1
    tail = b""
    try:
        async with session.post(url + CHAT, data=body, headers=headers) as response:
            if response.status != 200:
                data = await response.read()
                call.error = f"status {response.status}"
                code = _error_code(data)
                call.codes[code] = call.codes.get(code, 0) + 1
                call.rejected += response.status == 429
                return
            async for chunk in response.content.iter_any():
                joined = tail + chunk
                if call.first_token is None and _CONTENT.search(joined):
                    call.first_token = time.perf_counter()
                tail = joined[-4096:]
        call.done = time.perf_counter()
        found = _COMPLETION_TOKENS.findall(tail)
        call.output_tokens = int(found[-1]) if found else 0
    except asyncio.CancelledError:
        call.cancelled = True
        raise
    except (aiohttp.ClientError, TimeoutError) as error:
        call.error = type(error).__name__


@dataclass(eq=False)
class _TenantClient:
    """What both clients share: one tenant's key, requests, seeded randomness and calls."""

    session: aiohttp.ClientSession
    url: str
    key: str | None
    tenant: str
    requests: Sequence[Request]
    seed: int
    calls: list[Call] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.headers = auth(self.key)
        self.rng = random.Random(self.seed)


@dataclass(eq=False)
class Interactive(_TenantClient):
    """Open-loop streamed requests of one tenant at a Poisson `rate` (wall requests/s)."""

    rate: float = field(kw_only=True)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False)

    async def run(self, until: float, settle_s: float) -> list[Call]:
        """Sends until `until` (perf_counter), then waits up to `settle_s` for open requests
        and cancels the rest."""
        loop = asyncio.get_running_loop()
        index = 0
        due = time.perf_counter() + self.rng.expovariate(self.rate)
        while due < until:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request = self.requests[index % len(self.requests)]
            index += 1
            call = Call(self.tenant, request.kind, due)
            self.calls.append(call)
            task = loop.create_task(
                stream_once(self.session, self.url, request.body, self.headers, call)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            due += self.rng.expovariate(self.rate)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=settle_s)
        await cancel_all(self._tasks)
        return self.calls


@dataclass(eq=False)
class MineruBatch(_TenantClient):
    """A closed loop of `concurrency` MinerU client slots for one tenant (see module doc)."""

    concurrency: int = field(kw_only=True)
    retry_afters: list[float] = field(default_factory=list, init=False)  # every one answered, s
    _next: Iterator[int] = field(default_factory=itertools.count, init=False)
    started: float = field(default=0.0, init=False)
    stopped_sending: float = field(default=0.0, init=False)

    async def run(self, stop_sending: float, give_up: float, drain: bool = True) -> list[Call]:
        """Slots start requests until `stop_sending` (perf_counter). With `drain`, requests under
        way then finish (retrying as needed) until `give_up`, when the rest count as lost;
        without, they are cancelled at `stop_sending` (a capacity measurement)."""
        self.started = time.perf_counter()
        slots = [
            asyncio.create_task(self._slot(stop_sending, give_up)) for _ in range(self.concurrency)
        ]
        pending = set(slots)
        try:
            if not drain:
                await asyncio.sleep(max(0.0, stop_sending - time.perf_counter()))
            else:
                _, pending = await asyncio.wait(
                    slots, timeout=max(0.0, give_up - time.perf_counter()) + 5
                )
        finally:
            self.stopped_sending = stop_sending
            await cancel_all(pending)
        return self.calls

    async def _slot(self, stop_sending: float, give_up: float) -> None:
        while (now := time.perf_counter()) < stop_sending:
            request = self.requests[next(self._next) % len(self.requests)]
            call = Call(self.tenant, request.kind, now)
            self.calls.append(call)
            await self.until_success(request.body, call, give_up)

    async def until_success(self, body: bytes, call: Call, give_up: float) -> None:
        call.sent = time.perf_counter()
        try:
            while True:
                call.attempts += 1
                try:
                    async with self.session.post(
                        self.url + CHAT, data=body, headers=self.headers
                    ) as response:
                        data = await response.read()
                        status = response.status
                        retry_after = response.headers.get("Retry-After")
                except (aiohttp.ClientError, TimeoutError) as error:
                    call.error = type(error).__name__
                    return
                if status == 200:
                    call.done = time.perf_counter()
                    found = _COMPLETION_TOKENS.findall(data[-512:])
                    call.output_tokens = int(found[-1]) if found else 0
                    return
                if status not in RETRY_STATUSES:
                    call.error = f"status {status}"
                    return
                code = _error_code(data)
                call.codes[code] = call.codes.get(code, 0) + 1
                if status == 429:
                    call.rejected += 1
                else:
                    call.unavailable += 1
                wait = self._backoff(retry_after)
                if time.perf_counter() + wait > give_up:
                    call.lost = True
                    call.error = "gave up"
                    return
                await asyncio.sleep(wait)
        except asyncio.CancelledError:
            call.cancelled = True
            raise

    def _backoff(self, retry_after: str | None) -> float:
        """MinerU's client: `Retry-After` capped at 120 s, else 0.5 s; plus jitter."""
        base = 0.5
        if retry_after is not None:
            with contextlib.suppress(ValueError):
                given = float(retry_after)
                self.retry_afters.append(given)
                base = min(RETRY_AFTER_CAP_S, max(0.0, given))
        return base * self.rng.uniform(1.0, 1.1) + self.rng.uniform(0.0, 0.5)


async def cancel_all(tasks: set[asyncio.Task[None]] | list[asyncio.Task[None]]) -> None:
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


def new_session() -> aiohttp.ClientSession:
    """No connection limit (a closed loop of 1,500 needs 1,500 connections), no total timeout."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)
