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
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mineru_gateway.flow import TenantPolicy
from mineru_gateway.metrics import Counter
from mineru_gateway.redis_link import Argument, RedisLink, RedisReplyError

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
            "Times this process lost Redis and counted tenants' requests alone, by what it "
            "shares there: in-flight slots, or queue counts.",
            ("part",),
        )
    )

    def fell_back(self, part: str, error: BaseException, meaning: str) -> None:
        """A part of fleet state lost Redis: counted, and said once in the log."""
        self.fallbacks.inc(part)
        log.warning(
            "fleet_state_fallback",
            part=part,
            error=type(error).__name__,
            detail=str(error)[:200],
            meaning=meaning,
        )


@dataclass(eq=False, slots=True)
class _Ask:
    """A `take` waiting for the next exchange with Redis: how many of `ids` got a slot."""

    key: str
    limit: int
    ids: list[str]
    answer: asyncio.Future[int]

    def give(self, granted: int) -> None:
        if not self.answer.done():  # done: its caller left, and gave all of `ids` back
            self.answer.set_result(granted)


def _by_tenant(asks: list[_Ask]) -> dict[tuple[str, int], list[_Ask]]:
    """One take per tenant (and limit) for all its asks of an exchange."""
    groups: dict[tuple[str, int], list[_Ask]] = {}
    for ask in asks:
        groups.setdefault((ask.key, ask.limit), []).append(ask)
    return groups


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
    ) -> None:
        # The link never retries: one bounded try, then this replica counts alone.
        self._redis = RedisLink(url, connect_timeout_s=timeout_s)
        self._take_sha = self._redis.script(_TAKE)
        self._renew_sha = self._redis.script(_RENEW)
        self.lease_s = lease_s
        self._lease_ms = max(1, int(lease_s * 1000))
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self.poll_s = poll_s  # how often requests waiting for a slot ask again
        self.replica = secrets.token_hex(8)
        self._ids = itertools.count()
        self._held: dict[str, set[str]] = {}  # key -> ids of the slots this replica holds
        self._asks: list[_Ask] = []
        self._ended: dict[str, list[str]] = {}  # key -> ids to remove from Redis
        self._ended_count = 0
        self._sender: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self.fallback = False
        self._closed = False
        self.metrics = FleetMetrics()

    # -- the dispatcher's side --------------------------------------------------------------
    async def take(self, tenant: TenantPolicy, wanted: int) -> list[Permit]:
        """Up to `wanted` slots of `tenant` (whose `max_in_flight` is set): as many as its
        limit leaves, fleet-wide; all of them while Redis is away (the queue's own count per
        replica then limits the tenant). The takes of one loop iteration share a round trip."""
        limit = tenant.max_in_flight
        assert limit is not None
        key = tenant_key(tenant.name)
        ids = [f"{self.replica}:{next(self._ids)}" for _ in range(wanted)]
        granted = len(ids)
        if not self.fallback:
            ask = _Ask(key, limit, ids, asyncio.get_running_loop().create_future())
            self._asks.append(ask)
            self._wake()
            try:
                granted = await ask.answer
            except asyncio.CancelledError:
                self._end(key, ids)  # taken or not: removing them is harmless
                raise
        if granted:
            self._held.setdefault(key, set()).update(ids[:granted])
        return [Permit(key, id_) for id_ in ids[:granted]]

    def release(self, permit: Permit) -> None:
        """The slot's request ended: its slot goes back soon after, off the request's path."""
        held = self._held.get(permit.key)
        if held is None or permit.id not in held:
            return
        held.discard(permit.id)
        if not held:
            del self._held[permit.key]
        self._end(permit.key, [permit.id])

    def held(self) -> int:
        return sum(map(len, self._held.values()))

    # -- Redis ------------------------------------------------------------------------------
    def _end(self, key: str, ids: list[str]) -> None:
        """Removals to send with the next exchange (bounded: past the bound, while Redis is
        away, the slots' leases end them)."""
        if self._ended_count + len(ids) <= MAX_PENDING_RELEASES:
            self._ended.setdefault(key, []).extend(ids)
            self._ended_count += len(ids)
        self._wake()

    def _wake(self) -> None:
        if self._sender is None and not self.fallback and not self._closed:
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        """Exchanges with Redis while takes or removals wait; those of one loop iteration go
        in one pipelined round trip."""
        try:
            await asyncio.sleep(0)
            while (self._asks or self._ended) and not self.fallback:
                await self._exchange()
        finally:
            self._sender = None
            if self.fallback:
                self._answer_alone()

    def _answer_alone(self) -> None:
        asks, self._asks = self._asks, []
        for ask in asks:
            ask.give(len(ask.ids))

    async def _exchange(self, *, renew: bool = False) -> None:
        """One pipelined round trip: removals, takes, and (`renew`) the held slots' leases.
        Falls back on failure; a renewal that succeeds resumes shared counting."""
        # An ask whose caller has left takes nothing: its ids are among the removals.
        asks, self._asks = [ask for ask in self._asks if not ask.answer.done()], []
        tenants = _by_tenant(asks)
        ended, self._ended, self._ended_count = self._ended, {}, 0
        commands: list[tuple[Argument, ...]] = [(b"ZREM", key, *ids) for key, ids in ended.items()]
        for (key, limit), group in tenants.items():
            ids = [id_ for ask in group for id_ in ask.ids]
            commands.append((b"EVALSHA", self._take_sha, 1, key, limit, self._lease_ms, *ids))
        if renew:
            for key, held in self._held.items():
                commands.append((b"EVALSHA", self._renew_sha, 1, key, self._lease_ms, *held))
        try:
            async with asyncio.timeout(self.timeout_s):
                results = await self._redis.pipeline(commands)
        except (TimeoutError, RedisReplyError, OSError) as error:
            for key, ids in ended.items():
                self._end(key, ids)
            self._fall_back(error)
            self._asks[:0] = asks
            self._answer_alone()
            return
        for group, granted in zip(tenants.values(), results[len(ended) :], strict=False):
            left = granted if isinstance(granted, int) else 0
            for ask in group:  # first come, first served
                ask.give(min(left, len(ask.ids)))
                left -= min(left, len(ask.ids))
        if self.fallback and renew:
            self.fallback = False
            log.info("fleet_state_shared", held=self.held())
            self._wake()

    def _fall_back(self, error: BaseException) -> None:
        if self.fallback:
            return
        self.fallback = True
        meaning = "tenants' in-flight limits hold per replica until Redis answers again"
        self.metrics.fell_back("slots", error, meaning)

    async def _keep(self) -> None:
        """Renews the held slots' leases every lease_s / 3; while Redis is away, tries it
        every probe_s."""
        while True:
            await asyncio.sleep(self.probe_s if self.fallback else self.lease_s / 3)
            await self._exchange(renew=True)

    async def start(self) -> None:
        self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def close(self) -> None:
        """Stops renewing; gives back every slot still held (when Redis answers)."""
        self._closed = True
        for task in (self._keeper, self._sender):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._keeper = self._sender = None
        for ask in self._asks:
            ask.give(0)  # the gateway is stopping: no slot for what still asks
        self._asks = []
        for key, held in self._held.items():
            self._end(key, list(held))
        self._held.clear()
        if self._ended and not self.fallback:
            await self._exchange()
        await self._redis.close()

    def collector(self, tenants: Sharing | None = None) -> Collector:
        """Fleet state's metrics; `tenants`' fallback (fleet/tenants.py) shows in the gauge."""
        return FleetCollector(self, tenants)


class Sharing(Protocol):
    fallback: bool


class FleetCollector(Collector):
    def __init__(self, slots: FleetSlots, tenants: Sharing | None = None) -> None:
        self._slots = slots
        self._tenants = tenants

    def collect(self) -> Iterator[Metric]:
        fallback = GaugeMetricFamily(
            "mineru_gateway_fleet_state_fallback",
            "1 while Redis is away and this process limits tenants' requests alone.",
        )
        alone = self._slots.fallback or (self._tenants is not None and self._tenants.fallback)
        fallback.add_metric([], float(alone))
        yield fallback
        held = GaugeMetricFamily(
            "mineru_gateway_fleet_state_slots",
            "Tenants' in-flight slots this process holds (requests queued or on workers).",
        )
        held.add_metric([], self._slots.held())
        yield held
        yield self._slots.metrics.fallbacks.collect()
