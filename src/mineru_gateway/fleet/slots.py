"""Tenants' in-flight slots in Redis, shared by every replica and process of the gateway.

A tenant's `max_in_flight` holds per process without this (flow.py); with N replicas a tenant
would get N times its limit. Here each request of a tenant with a limit takes a slot before it
may go to a worker, and gives it back when it ends (docs/operate/fleet-state.md):

- A tenant's slots are a sorted set, `mineru-gateway:fleet:in-flight:<hash of the name>`: one
  member per request holding a slot, scored by when its lease runs out (Redis's own clock, so
  replicas' clocks need not agree). Taking is one script, run atomically: drop expired members,
  count, add as many as the limit leaves room for. One round trip per admitted request.
- Leases: each replica re-asserts the slots it holds every `lease_s / 3` (one pipelined round
  trip for all of them); a crashed replica's slots expire after `lease_s`.
- Giving back is off the request's path: slots ended are removed in one pipelined round trip
  soon after, batched.
- Redis down or slow (`timeout_s`): the replica counts alone (its own limit per replica, as
  without fleet state), sets `mineru_gateway_fleet_state_fallback` and logs it; no client sees
  an error. It tries Redis again every `probe_s`; when Redis answers, the slots it holds are
  asserted there again (a restarted Redis forgets them) and shared counting resumes.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from mineru_gateway.flow import TenantPolicy
from mineru_gateway.metrics import Counter

log = structlog.get_logger("mineru_gateway.fleet")

KEY_PREFIX = "mineru-gateway:fleet:in-flight:"
MAX_PENDING_RELEASES = 65536  # kept while Redis is away; past it the leases expire on their own

# Redis's clock in milliseconds; effects replication where a Redis older than 7 needs it asked.
_NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# KEYS[1] the tenant's set; ARGV: limit, lease ms, then the ids asking. Returns how many of
# them (the first ones) now hold a slot.
_TAKE = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lease = tonumber(ARGV[2])
local free = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local granted = 0
for i = 3, #ARGV do
  if granted >= free then break end
  redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
  granted = granted + 1
end
redis.call('PEXPIRE', KEYS[1], lease)
return granted
"""
)
# KEYS[1] the tenant's set; ARGV: lease ms, then the ids this replica holds: their leases
# renewed, or added again after Redis lost them.
_RENEW = (
    _NOW
    + """
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], now + lease, ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], lease)
return #ARGV - 1
"""
)


def tenant_key(name: str) -> str:
    """The tenant's Redis key: a hash of its name, never the name (nor a key) in clear."""
    digest = hashlib.sha256(b"mineru-gateway fleet in-flight\0" + name.encode()).hexdigest()
    return KEY_PREFIX + digest[:32]


@dataclass(eq=False, slots=True)
class Permit:
    """One request's slot: its tenant's key and its own id."""

    key: str
    id: str


@dataclass
class FleetMetrics:
    fallbacks: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_fleet_state_fallbacks",
            "Times this process lost Redis and counted tenants' requests alone.",
            (),
        )
    )


class FleetSlots:
    """Tenants' in-flight slots in the Redis at `url` (module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        lease_s: float = 30.0,
        timeout_s: float = 0.05,
        probe_s: float = 1.0,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # No retries inside the client: one bounded try, then this replica counts alone.
        self._redis = Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._take = self._redis.register_script(_TAKE)
        self._renew = self._redis.register_script(_RENEW)
        self.lease_s = lease_s
        self._lease_ms = max(1, int(lease_s * 1000))
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self.poll_s = poll_s  # how often requests waiting for a slot ask again
        self._clock = clock
        self.replica = secrets.token_hex(8)
        self._ids = itertools.count()
        self._held: dict[str, set[str]] = {}  # key -> ids of the slots this replica holds
        self._ended: dict[str, list[str]] = {}  # key -> ids to remove from Redis
        self._ended_count = 0
        self._releasing: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self.fallback = False
        self.metrics = FleetMetrics()

    # -- the dispatcher's side --------------------------------------------------------------
    async def take(self, tenant: TenantPolicy, wanted: int) -> list[Permit]:
        """Up to `wanted` slots of `tenant` (whose `max_in_flight` is set): as many as its
        limit leaves, fleet-wide; all of them while Redis is away (the queue's own count per
        replica then limits the tenant)."""
        limit = tenant.max_in_flight
        assert limit is not None
        key = tenant_key(tenant.name)
        ids = [f"{self.replica}:{next(self._ids)}" for _ in range(wanted)]
        if not self.fallback:
            try:
                async with asyncio.timeout(self.timeout_s):
                    granted = await self._take(keys=[key], args=[limit, self._lease_ms, *ids])
                ids = ids[: int(granted)]
            except (TimeoutError, RedisError, OSError) as error:
                self._fall_back(error)
        if ids:
            self._held.setdefault(key, set()).update(ids)
        return [Permit(key, id_) for id_ in ids]

    def release(self, permit: Permit) -> None:
        """The slot's request ended: its slot goes back soon after, off the request's path."""
        held = self._held.get(permit.key)
        if held is None or permit.id not in held:
            return
        held.discard(permit.id)
        if not held:
            del self._held[permit.key]
        self._keep_ended({permit.key: [permit.id]})
        if not self.fallback and self._releasing is None:
            self._releasing = asyncio.get_running_loop().create_task(self._send_releases())

    def held(self) -> int:
        return sum(map(len, self._held.values()))

    # -- Redis ------------------------------------------------------------------------------
    async def _send_releases(self) -> None:
        try:
            await asyncio.sleep(0)  # the releases of this loop iteration go together
            await self._sync(renew=False)
        finally:
            self._releasing = None

    async def _sync(self, *, renew: bool) -> None:
        """Sends the ended slots' removals (and, with `renew`, the held slots' leases) in one
        pipelined round trip; falls back on failure, resumes shared counting on success."""
        ended, self._ended, self._ended_count = self._ended, {}, 0
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                self._redis.pipeline(transaction=False) as pipe,
            ):
                for key, ids in ended.items():
                    pipe.zrem(key, *ids)
                if renew:
                    for key, held in self._held.items():
                        await self._renew(keys=[key], args=[self._lease_ms, *held], client=pipe)
                await pipe.execute()
        except (TimeoutError, RedisError, OSError) as error:
            self._keep_ended(ended)
            self._fall_back(error)
            return
        if self.fallback and renew:
            self.fallback = False
            log.info("fleet_state_shared", held=self.held())

    def _keep_ended(self, ended: dict[str, list[str]]) -> None:
        """Removals to send with the next sync (bounded: past the bound, while Redis is away,
        the slots' leases end them)."""
        for key, ids in ended.items():
            if self._ended_count + len(ids) > MAX_PENDING_RELEASES:
                return
            self._ended.setdefault(key, []).extend(ids)
            self._ended_count += len(ids)

    def _fall_back(self, error: BaseException) -> None:
        if self.fallback:
            return
        self.fallback = True
        self.metrics.fallbacks.inc()
        log.warning(
            "fleet_state_fallback",
            error=type(error).__name__,
            detail=str(error)[:200],
            meaning="tenants' in-flight limits hold per replica until Redis answers again",
        )

    async def _keep(self) -> None:
        """Renews the held slots' leases every lease_s / 3; while Redis is away, tries it
        every probe_s."""
        while True:
            await asyncio.sleep(self.probe_s if self.fallback else self.lease_s / 3)
            await self._sync(renew=True)

    async def start(self) -> None:
        self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def close(self) -> None:
        for task in (self._keeper, self._releasing):
            if task is not None:
                task.cancel()
        for task in (self._keeper, self._releasing):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        self._keeper = self._releasing = None
        if not self.fallback and (self._held or self._ended):
            self._keep_ended({key: list(held) for key, held in self._held.items()})
            self._held.clear()
            await self._sync(renew=False)
        await self._redis.aclose()

    def collector(self) -> Collector:
        return FleetCollector(self)


class FleetCollector(Collector):
    def __init__(self, slots: FleetSlots) -> None:
        self._slots = slots

    def collect(self) -> Iterator[Metric]:
        fallback = GaugeMetricFamily(
            "mineru_gateway_fleet_state_fallback",
            "1 while Redis is away and this process limits tenants' requests alone.",
        )
        fallback.add_metric([], float(self._slots.fallback))
        yield fallback
        held = GaugeMetricFamily(
            "mineru_gateway_fleet_state_slots",
            "Tenants' in-flight slots this process holds (requests queued or on workers).",
        )
        held.add_metric([], self._slots.held())
        yield held
        yield self._slots.metrics.fallbacks.collect()
