"""Tenants' queue counts and shares across replicas: each process's counts in Redis.

A tenant's `max_queued`, `max_queued_bytes` and its fair share count its requests in this
replica's queue (flow.py); here the other replicas' are added (docs/operate/fleet-state.md), as a
`flow.TenantsElsewhere`:

- Every `share_s` each replica sends one pipelined round trip: its own (in flight, queued,
  queued bytes) per tenant, when they changed or every `KEEPALIVE_PERIODS` periods, written to
  a hash of its own with a TTL (a crashed replica's counts vanish with it); and the other
  replicas' totals per tenant, read back in the same script. `others()` reads those totals
  without I/O, so they are up to one period old: a queue limit can be passed by what other
  replicas queued within one period. `max_in_flight` stays exact (fleet/slots.py).
- A replica's hash is named by its random id; the script leaves its own out of the totals.
- Tenants' names are never in Redis: a hash of each names its field (as slots.py's keys).
- Redis down or slow (`timeout_s`): the replica counts itself alone, sets
  `mineru_gateway_fleet_state_fallback` and logs it; it tries Redis again every `probe_s`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import secrets
from collections.abc import Callable

import structlog

from mineru_gateway.fleet.slots import FleetMetrics
from mineru_gateway.redis_link import Argument, RedisLink, RedisReplyError

log = structlog.get_logger("mineru_gateway.fleet")

KEY_PREFIX = "mineru-gateway:fleet:tenants:"
INDEX_KEY = KEY_PREFIX + "index"  # every replica's hash, scored by when it expires
KEEPALIVE_PERIODS = 4  # unchanged counts are written again every so many periods
TTL_PERIODS = 12  # a replica's counts outlive three missed keep-alives, no more

Counts = tuple[int, int, int]  # in flight, queued, queued bytes

# Redis's clock in milliseconds (as fleet/slots.py's scripts).
# KEYS[1] the index, KEYS[2] this replica's hash. ARGV: TTL ms, this replica's member, the
# hashes' key prefix, "1" to write its counts (then field, "in-flight queued bytes" pairs).
# Returns how many other replicas there are, then their totals, flat: field, in flight, queued,
# queued bytes, ...
_SHARE = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
if ARGV[4] == '1' then
  redis.call('DEL', KEYS[2])
  for i = 5, #ARGV, 2 do
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
  redis.call('PEXPIRE', KEYS[2], ttl)
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ttl)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local own = ARGV[2]
local totals, order, others = {}, {}, 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if member ~= own then
    others = others + 1
    local found = redis.call('HGETALL', ARGV[3] .. member)
    for i = 1, #found, 2 do
      local f, q, b = string.match(found[i + 1], '^(%d+) (%d+) (%d+)$')
      if f then
        local sum = totals[found[i]]
        if not sum then
          sum = {0, 0, 0}
          totals[found[i]] = sum
          order[#order + 1] = found[i]
        end
        sum[1] = sum[1] + tonumber(f)
        sum[2] = sum[2] + tonumber(q)
        sum[3] = sum[3] + tonumber(b)
      end
    end
  end
end
local reply = {others}
for _, field in ipairs(order) do
  local sum = totals[field]
  reply[#reply + 1] = field
  reply[#reply + 1] = sum[1]
  reply[#reply + 1] = sum[2]
  reply[#reply + 1] = sum[3]
end
return reply
"""


@functools.lru_cache(maxsize=65536)
def tenant_field(name: str) -> bytes:
    """A tenant's field in a replica's hash: a hash of its name, never the name."""
    digest = hashlib.sha256(b"mineru-gateway fleet tenants\0" + name.encode()).hexdigest()
    return digest[:32].encode()


def replica_id() -> str:
    """A new replica's id: 16 random hex digits."""
    return secrets.token_hex(8)


class FleetTenants:
    """`flow.TenantsElsewhere` over every replica (module docstring); `replica`: this one's id
    (`replica_id`)."""

    def __init__(
        self,
        url: str,
        *,
        replica: str,
        share_s: float = 0.25,
        timeout_s: float = 0.05,
        probe_s: float = 1.0,
        metrics: FleetMetrics | None = None,
    ) -> None:
        self._redis = RedisLink(url, connect_timeout_s=timeout_s)
        self._member = replica
        self._ttl_ms = max(1, int(share_s * TTL_PERIODS * 1000))
        self.share_s = share_s
        self.timeout_s = timeout_s
        self.probe_s = probe_s
        self._mine: dict[str, Counts] = {}  # this replica's counts, tenants with any
        self._remote: dict[bytes, Counts] = {}  # other replicas' totals, by tenant field
        self._other_replicas = 0  # replicas, other than this one, sharing
        self._dirty = True
        self._unwritten = 0  # periods since this replica's counts were last written
        self._share = self._redis.script(_SHARE)
        self._task: asyncio.Task[None] | None = None
        self.fallback = False
        self.metrics = metrics or FleetMetrics()  # fleet/slots.py's, when both run
        # Called when the others' totals changed: a queue waits on events, and a tenant's
        # order or limits may have moved with no event of this replica's.
        self.on_change: Callable[[], None] | None = None

    # -- flow.TenantsElsewhere ----------------------------------------------------------------
    def others(self, tenant: str) -> Counts:
        if not self._remote:
            return (0, 0, 0)
        return self._remote.get(tenant_field(tenant), (0, 0, 0))

    def publish(self, tenant: str, in_flight: int, queued: int, queued_bytes: int) -> None:
        if in_flight or queued or queued_bytes:
            self._mine[tenant] = (in_flight, queued, queued_bytes)
        elif self._mine.pop(tenant, None) is None:
            return
        self._dirty = True

    def replicas(self) -> int:
        """The gateway's replicas that share counts here, this one included (1 while Redis is
        away): what a budget set for the whole deployment is divided by
        (docs/operate/fleet-scale.md)."""
        return 1 + self._other_replicas

    # -- Redis ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s if self.fallback else self.share_s)
            await self.exchange()

    async def exchange(self) -> None:
        """One round trip: this replica's counts (when changed, or due for a keep-alive, or
        Redis is back) and the other replicas' totals."""
        write = self._dirty or self.fallback or self._unwritten + 1 >= KEEPALIVE_PERIODS
        self._dirty = False  # a publish during the round trip marks it again
        command: list[Argument] = [b"EVALSHA", self._share, 2, INDEX_KEY, KEY_PREFIX + self._member]
        command += [self._ttl_ms, self._member, KEY_PREFIX, b"1" if write else b"0"]
        if write:
            for tenant, (in_flight, queued, size) in self._mine.items():
                command += [tenant_field(tenant), b"%d %d %d" % (in_flight, queued, size)]
        try:
            async with asyncio.timeout(self.timeout_s):
                others, remote = _totals(await self._redis.call(*command))
        except (TimeoutError, RedisReplyError, OSError) as error:
            self._dirty = self._dirty or write
            self._fall_back(error)
            return
        changed, self._remote = remote != self._remote, remote
        self._other_replicas = others
        if changed and self.on_change is not None:
            self.on_change()
        self._unwritten = 0 if write else self._unwritten + 1
        if self.fallback:
            self.fallback = False
            log.info("fleet_state_shared", part="tenants' queue counts")

    def _fall_back(self, error: BaseException) -> None:
        self._other_replicas = 0
        if self._remote:
            self._remote = {}  # counts this replica alone
            if self.on_change is not None:
                self.on_change()
        if self.fallback:
            return
        self.fallback = True
        meaning = "tenants' queue limits and shares count this replica alone until Redis answers"
        self.metrics.fell_back("counts", error, meaning)

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stops sharing; this replica's counts are taken out of Redis (when it answers)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if not self.fallback:
            self._mine.clear()
            self._dirty = True
            await self.exchange()
        await self._redis.close()


def _totals(reply: object) -> tuple[int, dict[bytes, Counts]]:
    """The script's reply: how many other replicas, and {field: (in flight, queued, queued
    bytes)}."""
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], int):
        raise RedisReplyError(f"the tenants' script answered {reply!r}")
    totals: dict[bytes, Counts] = {}
    for at in range(1, len(reply) - 3, 4):
        field, in_flight, queued, size = reply[at : at + 4]
        if isinstance(field, bytes):
            totals[field] = (int(in_flight), int(queued), int(size))
    return reply[0], totals
