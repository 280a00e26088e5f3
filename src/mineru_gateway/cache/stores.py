"""Where answers are kept: in this process (an LRU bounded in bytes), or in Redis, shared by
every process and replica of the gateway (docs/cache.md).

A store never fails a request: Redis down, slow or holding a corrupt entry is a miss, counted in
`mineru_gateway_cache_errors_total`. Every Redis call is bounded by a short timeout, and after a
failure Redis is left alone for a moment rather than tried again by every request.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from mineru_gateway.cache.answers import Answer, decode, encode
from mineru_gateway.cache.metrics import CacheMetrics
from mineru_gateway.redis_link import RedisLink, RedisReplyError

REDIS_PREFIX = b"mineru-gateway:cache:"


class Store(Protocol):
    async def get(self, key: bytes) -> Answer | None: ...

    async def put(self, key: bytes, tenant: str, answer: Answer) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    """An in-process LRU bounded in bytes, with each tenant's share bounded too.

    The rule (docs/cache.md): a tenant holds at most `tenant_max_bytes`; past it, its own least
    recently used answers go. When the whole cache is full, the least recently used answer of
    the tenant holding the most bytes goes. So one tenant filling the cache evicts its own
    answers, never everything the others hold.
    """

    def __init__(
        self,
        max_bytes: int,
        tenant_max_bytes: int,
        ttl_s: float,
        metrics: CacheMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.tenant_max_bytes = min(tenant_max_bytes, max_bytes)
        self._ttl_s = ttl_s
        self._metrics = metrics
        self._clock = clock
        self._entries: dict[bytes, tuple[str, Answer, float]] = {}  # -> tenant, answer, expiry
        self._lru: dict[str, OrderedDict[bytes, int]] = {}  # tenant -> key -> size, oldest first
        self._held: dict[str, int] = {}
        self.total = 0

    async def get(self, key: bytes) -> Answer | None:
        return self.lookup(key)

    def lookup(self, key: bytes) -> Answer | None:
        found = self._entries.get(key)
        if found is None:
            return None
        tenant, answer, expires = found
        if self._clock() >= expires:
            self._remove(key)
            return None
        self._lru[tenant].move_to_end(key)
        return answer

    async def put(self, key: bytes, tenant: str, answer: Answer) -> None:
        self.keep(key, tenant, answer)

    def keep(self, key: bytes, tenant: str, answer: Answer) -> None:
        size = answer.size
        if size > self.tenant_max_bytes:
            return
        if key in self._entries:
            self._remove(key)
        while self._held.get(tenant, 0) + size > self.tenant_max_bytes:
            self._evict(tenant)
        while self.total + size > self.max_bytes:
            self._evict(max(self._held, key=self._held.__getitem__))
        self._entries[key] = (tenant, answer, self._clock() + self._ttl_s)
        self._lru.setdefault(tenant, OrderedDict())[key] = size
        self._held[tenant] = self._held.get(tenant, 0) + size
        self.total += size

    def held(self) -> dict[str, int]:
        """Bytes held by each tenant."""
        return dict(self._held)

    async def close(self) -> None:
        self._entries.clear()

    def _evict(self, tenant: str) -> None:
        oldest = next(iter(self._lru[tenant]))
        self._remove(oldest)
        self._metrics.evictions.inc(tenant)

    def _remove(self, key: bytes) -> None:
        tenant, _, _ = self._entries.pop(key)
        size = self._lru[tenant].pop(key)
        self.total -= size
        self._held[tenant] -= size
        if not self._lru[tenant]:
            del self._lru[tenant], self._held[tenant]


class RedisStore:
    """Answers in Redis under `mineru-gateway:cache:<hex of the scoped key>`, with a TTL."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        timeout_s: float,
        metrics: CacheMetrics,
        pause_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # One bounded try, then a miss (module docstring): the link never retries.
        self._redis = RedisLink(url, connect_timeout_s=timeout_s)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._pause_s = pause_s
        self._clock = clock
        self._resume_at = 0.0

    async def get(self, key: bytes) -> Answer | None:
        if self._paused():
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                blob = await self._redis.get(REDIS_PREFIX + key.hex().encode())
        except (TimeoutError, RedisReplyError, OSError) as error:
            self._failed(error)
            return None
        if blob is None:
            return None
        answer = decode(blob)
        if answer is None:
            self._metrics.errors.inc("corrupt")
        return answer

    async def put(self, key: bytes, tenant: str, answer: Answer) -> None:
        if self._paused():
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.set(
                    REDIS_PREFIX + key.hex().encode(), encode(answer), px=self._ttl_ms
                )
        except (TimeoutError, RedisReplyError, OSError) as error:
            self._failed(error)

    async def close(self) -> None:
        await self._redis.close()

    def _paused(self) -> bool:
        return self._clock() < self._resume_at

    def _failed(self, error: BaseException) -> None:
        self._metrics.errors.inc("timeout" if isinstance(error, TimeoutError) else "unavailable")
        self._resume_at = self._clock() + self._pause_s
