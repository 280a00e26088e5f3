"""The relay's hook: answer a cacheable request from the cache, from an identical request's
generation in flight, or from a new generation that later ones may share (docs/cache.md).

Order: join a generation in flight (nothing to look up); else look the answer up; else start a
generation. Joining and hits come before the dispatcher's `acquire`, so they take no queue slot
and no room on a worker. Streamed requests are served from the cache (the answer replayed as
SSE events) but neither lead nor join a generation: their events go to their one client as the
worker writes them (docs/cache.md, "Streams").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mineru_gateway.cache.answers import Answer, complete, replay_stream, usage_of
from mineru_gateway.cache.flights import Flight, Flights
from mineru_gateway.cache.metrics import CacheCollector, CacheMetrics
from mineru_gateway.cache.stores import MemoryStore, RedisStore, Store
from mineru_gateway.config import GatewaySettings
from mineru_gateway.errors import UpstreamError
from mineru_gateway.request import ParsedRequest

Headers = list[tuple[bytes, bytes]]
SSE_TYPE = "text/event-stream"
HIT = [(b"x-cache", b"hit")]
MISS = [(b"x-cache", b"miss")]
COALESCED = [(b"x-cache", b"coalesced")]


class Sink(Protocol):
    """Where the relay writes a worker's answer: a head then chunks, or a whole answer.
    `status` stays None until something is written (until then, another worker may be tried).
    The client's writer is one (api/answer.py); the cache puts its own in its place."""

    @property
    def status(self) -> int | None: ...

    async def start(self, status: int, content_type: str, extra: Headers | None = None) -> None: ...

    async def chunk(self, data: bytes) -> None: ...

    async def finish(self, data: bytes = b"") -> None: ...

    async def respond(
        self, status: int, content_type: str, body: bytes, extra: Headers | None = None
    ) -> None: ...


class Tally(Protocol):
    """What the cache reads and leaves on the exchange's clock (api/answer.py): when the
    request went to a worker, and the answer's usage, which accounting reads."""

    upstream_sent: float | None
    usage: dict[str, Any] | None


Run = Callable[[Sink], Awaitable[None]]


class Held:
    """A sink that keeps a whole answer instead of sending it: a generation others share is
    given to each of them, its leader too, once it is whole."""

    __slots__ = ("answer", "status", "streamed")

    def __init__(self) -> None:
        self.status: int | None = None
        self.answer: tuple[int, str, bytes] | None = None
        self.streamed = False

    async def start(self, status: int, content_type: str, extra: Headers | None = None) -> None:
        self.status, self.streamed = status, True  # kept by nobody: `_generate` refuses it

    async def chunk(self, data: bytes) -> None:
        pass

    async def finish(self, data: bytes = b"") -> None:
        pass

    async def respond(
        self, status: int, content_type: str, body: bytes, extra: Headers | None = None
    ) -> None:
        self.status = status
        self.answer = (status, content_type, body)


class Labelled:
    """The client's sink with the answer's `X-Cache` header added to its head."""

    __slots__ = ("_label", "_sink")

    def __init__(self, sink: Sink, label: Headers) -> None:
        self._sink = sink
        self._label = label

    @property
    def status(self) -> int | None:
        return self._sink.status

    async def start(self, status: int, content_type: str, extra: Headers | None = None) -> None:
        await self._sink.start(status, content_type, [*(extra or ()), *self._label])

    async def chunk(self, data: bytes) -> None:
        await self._sink.chunk(data)

    async def finish(self, data: bytes = b"") -> None:
        await self._sink.finish(data)

    async def respond(
        self, status: int, content_type: str, body: bytes, extra: Headers | None = None
    ) -> None:
        await self._sink.respond(status, content_type, body, [*(extra or ()), *self._label])


class Generation:
    """What a shared generation left: the answer, and its usage as the relay read it."""

    __slots__ = ("answer", "usage")

    def __init__(self, answer: Answer, usage: dict[str, Any] | None) -> None:
        self.answer = answer
        self.usage = usage


class ResultCache:
    """Coalescing and the result cache of one gateway process."""

    def __init__(
        self,
        store: Store | None,
        metrics: CacheMetrics,
        *,
        coalesce: bool = True,
        shared: bool = False,
        max_entry_bytes: int = 1 << 20,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.coalesce = coalesce
        self._shared = shared
        self._max_entry_bytes = max_entry_bytes
        self.flights: Flights[Generation] = Flights(register=coalesce)
        self._writes: set[asyncio.Task[None]] = set()
        # The in-process store is read and written in place: no coroutine, no task per answer.
        self.memory = store if isinstance(store, MemoryStore) else None

    def collector(self) -> CacheCollector:
        held = self.store.held if isinstance(self.store, MemoryStore) else None
        return CacheCollector(self.metrics, held)

    def visit(self, request: ParsedRequest, tenant: str) -> Visit:
        """One cacheable request's way through the cache (`Visit.serve`)."""
        return Visit(self, request, tenant)

    def scope(self, tenant: str) -> str:
        """The scope a tenant's requests are keyed in (`parse_request`'s `key_scope`)."""
        return "" if self._shared else tenant

    async def generate(self, key: bytes, tenant: str, tally: Tally, run: Run) -> Generation:
        """Runs the generation into a held sink, for everyone: the leader's exchange still
        records the worker and queueing it took."""
        held = Held()
        await run(held)
        if held.answer is None:  # a worker that streamed an answer nobody asked to stream
            raise UpstreamError("the worker streamed its answer to a request not for a stream")
        sent = tally.upstream_sent
        worker_s = time.perf_counter() - sent if sent is not None else 0.0
        answer = Answer(*held.answer, worker_s)
        if self.store is not None and answer.size <= self._max_entry_bytes and complete(answer):
            self._write(key, tenant, answer)
        return Generation(answer, tally.usage)

    def _write(self, key: bytes, tenant: str, answer: Answer) -> None:
        """Stores the answer without its clients waiting for the store: in place in memory, in
        a task of its own for Redis."""
        assert self.store is not None
        self.metrics.stored_bytes.inc(tenant, amount=len(answer.body))
        if self.memory is not None:
            self.memory.keep(key, tenant, answer)
            return
        task = asyncio.ensure_future(self.store.put(key, tenant, answer))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        if self.store is not None:
            await self.store.close()


class Visit:
    """One cacheable request: answered from the cache, from an identical request's generation
    in flight, or from a generation it leads (the module docstring has the order)."""

    __slots__ = ("_cache", "_flight", "_request", "_tenant")

    def __init__(self, cache: ResultCache, request: ParsedRequest, tenant: str) -> None:
        self._cache = cache
        self._request = request
        self._tenant = tenant
        self._flight: Flight[Generation] | None = None  # while it leads a generation

    def stays(self) -> bool:
        """Asked when the client leaves: True keeps the work going (it leads a generation
        others wait for, flights.py); False cancels it."""
        flight = self._flight
        return flight is not None and flight.leader_left()

    async def serve(self, client: Sink, tally: Tally, run: Run) -> None:
        """Answers on `client`; `run(sink)` is the relay's way to a worker, written to `sink`."""
        cache, request, tenant = self._cache, self._request, self._tenant
        metrics = cache.metrics
        tag = request.cache_tag
        assert tag is not None
        key = tag.digest  # scoped to the tenant, or shared (`ResultCache.scope`)
        flight = cache.flights.find(key) if not request.stream else None
        if flight is None and cache.store is not None:
            memory = cache.memory  # read in place: no coroutine
            answer = memory.lookup(key) if memory is not None else await cache.store.get(key)
            if answer is not None:
                metrics.hits.inc(tenant)
                metrics.npu_seconds_saved.inc(tenant, amount=answer.worker_s)
                usage = usage_of(answer) if answer.status == 200 else None
                await _give(client, tally, request, answer, usage, HIT, tag.include_usage)
                return
            if not request.stream:
                flight = cache.flights.find(key)  # one may have started while we looked
        if request.stream:
            metrics.misses.inc(tenant)
            await run(Labelled(client, MISS))
            return
        if flight is not None:
            metrics.coalesced.inc(tenant)
            generation = await flight.wait()
            answer = generation.answer
            metrics.npu_seconds_saved.inc(tenant, amount=answer.worker_s)
            await _give(client, tally, request, answer, generation.usage, COALESCED, False)
            return
        metrics.misses.inc(tenant)
        # It leads the generation, in its own task, shared with whoever joins meanwhile; its
        # client leaving while others wait does not stop it (`stays`).
        flights = cache.flights
        leading: Flight[Generation] = flights.lead(key)
        self._flight = leading
        try:
            generation = await cache.generate(key, tenant, tally, run)
        except BaseException as error:
            leading.failed(error)
            raise
        else:
            leading.landed(generation)
        finally:
            self._flight = None
            flights.done(key, leading)
        await _give(client, tally, request, generation.answer, generation.usage, MISS, False)


async def _give(
    client: Sink,
    tally: Tally,
    request: ParsedRequest,
    answer: Answer,
    usage: dict[str, Any] | None,
    label: Headers,
    include_usage: bool,
) -> None:
    """`usage`: the answer's, already read (by the relay for a generation, once for a hit)."""
    tally.usage = usage
    if request.stream:
        body = replay_stream(request.endpoint, answer, include_usage)
        await client.respond(200, SSE_TYPE, body, label)
        return
    await client.respond(answer.status, answer.content_type, answer.body, label)


def build_result_cache(settings: GatewaySettings) -> ResultCache | None:
    """The settings' cache and coalescing; None when both are off."""
    if settings.cache == "off" and not settings.coalesce:
        return None
    metrics = CacheMetrics()
    store: Store | None = None
    if settings.cache == "memory":
        tenant_max = int(settings.cache_max_bytes * settings.cache_tenant_share)
        store = MemoryStore(settings.cache_max_bytes, tenant_max, settings.cache_ttl_s, metrics)
    elif settings.cache != "off":
        store = RedisStore(
            settings.cache, settings.cache_ttl_s, settings.cache_redis_timeout_s, metrics
        )
    return ResultCache(
        store,
        metrics,
        coalesce=settings.coalesce,
        shared=settings.cache_scope == "shared",
        max_entry_bytes=settings.cache_max_entry_bytes,
    )
