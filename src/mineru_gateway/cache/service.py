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
from typing import Any

from mineru_gateway.api.relay import Exchange
from mineru_gateway.cache.answers import Answer, complete, replay_stream, usage_of
from mineru_gateway.cache.flights import Flight, Flights
from mineru_gateway.cache.keys import scoped_key
from mineru_gateway.cache.metrics import CacheCollector, CacheMetrics
from mineru_gateway.cache.stores import MemoryStore, RedisStore, Store
from mineru_gateway.config import GatewaySettings
from mineru_gateway.errors import UpstreamError
from mineru_gateway.request import ParsedRequest

Run = Callable[[Exchange], Awaitable[None]]
SSE_TYPE = "text/event-stream"
HIT = [(b"x-cache", b"hit")]
MISS = [(b"x-cache", b"miss")]
COALESCED = [(b"x-cache", b"coalesced")]


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
        self._memory = store if isinstance(store, MemoryStore) else None

    def collector(self) -> CacheCollector:
        held = self.store.held if isinstance(self.store, MemoryStore) else None
        return CacheCollector(self.metrics, held)

    async def serve(self, request: ParsedRequest, exchange: Exchange, run: Run) -> None:
        """Answers `request` on `exchange`; `run(exchange)` is the relay's way to a worker."""
        tag = request.cache_tag
        assert tag is not None
        tenant = exchange.tenant
        key = scoped_key(tag, "" if self._shared else tenant)
        flight = self.flights.find(key) if not request.stream else None
        if flight is None and self.store is not None:
            if self._memory is not None:
                answer = self._memory.lookup(key)
            else:
                answer = await self.store.get(key)
            if answer is not None:
                self.metrics.hits.inc(tenant)
                self.metrics.npu_seconds_saved.inc(tenant, amount=answer.worker_s)
                usage = usage_of(answer) if answer.status == 200 else None
                await _give(exchange, request, answer, usage, HIT, tag.include_usage)
                return
            if not request.stream:
                flight = self.flights.find(key)  # one may have started while we looked
        if request.stream:
            self.metrics.misses.inc(tenant)
            exchange.extra_headers = MISS
            await run(exchange)
            return
        if flight is not None:
            self.metrics.coalesced.inc(tenant)
            generation = await flight.wait()
            answer = generation.answer
            self.metrics.npu_seconds_saved.inc(tenant, amount=answer.worker_s)
            await _give(exchange, request, answer, generation.usage, COALESCED, False)
            return
        self.metrics.misses.inc(tenant)
        generation = await self._lead(key, tenant, exchange, run)
        await _give(exchange, request, generation.answer, generation.usage, MISS, False)

    async def _lead(self, key: bytes, tenant: str, leader: Exchange, run: Run) -> Generation:
        """The generation, in the leader's own task, shared with whoever joins meanwhile; the
        leader's client leaving while others wait does not stop it (flights.py)."""
        flight: Flight[Generation] = self.flights.lead(key)
        leader.stays = flight.leader_left
        try:
            generation = await self._generate(key, tenant, leader, run)
        except BaseException as error:
            flight.failed(error)
            raise
        else:
            flight.landed(generation)
        finally:
            leader.stays = None
            self.flights.done(key, flight)
        return generation

    async def _generate(self, key: bytes, tenant: str, leader: Exchange, run: Run) -> Generation:
        """Runs the generation on the leader's own exchange, its answer held for everyone
        (`Exchange.holding`): the leader's record names the worker and queueing it took."""
        leader.holding = True
        try:
            await run(leader)
        finally:
            leader.holding = False
        held, leader.held = leader.held, None
        if held is None:  # a worker that streamed an answer nobody asked to stream
            raise UpstreamError("the worker streamed its answer to a request not for a stream")
        sent = leader.upstream_sent
        worker_s = time.perf_counter() - sent if sent is not None else 0.0
        answer = Answer(*held, worker_s)
        if self.store is not None and answer.size <= self._max_entry_bytes and complete(answer):
            self._write(key, tenant, answer)
        return Generation(answer, leader.usage)

    def _write(self, key: bytes, tenant: str, answer: Answer) -> None:
        """Stores the answer without its clients waiting for the store: in place in memory, in
        a task of its own for Redis."""
        assert self.store is not None
        self.metrics.stored_bytes.inc(tenant, amount=len(answer.body))
        if self._memory is not None:
            self._memory.keep(key, tenant, answer)
            return
        task = asyncio.ensure_future(self.store.put(key, tenant, answer))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        if self.store is not None:
            await self.store.close()


async def _give(
    exchange: Exchange,
    request: ParsedRequest,
    answer: Answer,
    usage: dict[str, Any] | None,
    label: list[tuple[bytes, bytes]],
    include_usage: bool,
) -> None:
    """`usage`: the answer's, already read (by the relay for a generation, once for a hit)."""
    exchange.usage = usage
    if request.stream:
        body = replay_stream(request.endpoint, answer, include_usage)
        await exchange.respond(200, SSE_TYPE, body, label)
        return
    await exchange.respond(answer.status, answer.content_type, answer.body, label)


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
