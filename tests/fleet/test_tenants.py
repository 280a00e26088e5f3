"""Tenants' counts shared between replicas (fleet/tenants.py) against a real `redis-server`."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from mineru_gateway.fleet.tenants import INDEX_KEY, KEY_PREFIX, FleetTenants, replica_id
from tests.support.redis_server import RedisServer


def replica(url: str, **options: object) -> FleetTenants:
    return FleetTenants(url, replica=replica_id(), **options)  # type: ignore[arg-type]


async def test_each_replica_sees_the_others_counts_not_its_own(redis_server: RedisServer) -> None:
    one, two, three = (replica(redis_server.url) for _ in range(3))
    try:
        one.publish("acme", 2, 5, 500)
        two.publish("acme", 1, 3, 300)
        two.publish("globex", 0, 1, 10)
        for shares in (one, two, three):
            await shares.exchange()
        await one.exchange()  # after the others wrote
        assert one.others("acme") == (1, 3, 300)
        assert one.others("globex") == (0, 1, 10)
        assert three.others("acme") == (3, 8, 800)
        assert three.others("initech") == (0, 0, 0)
        two.publish("acme", 0, 0, 0)  # all its acme requests ended
        await two.exchange()
        await three.exchange()
        assert three.others("acme") == (2, 5, 500)
        assert not any(shares.fallback for shares in (one, two, three))
    finally:
        for shares in (one, two, three):
            await shares.close()


async def test_the_replicas_sharing_are_counted(redis_server: RedisServer) -> None:
    """What each replica's share of a worker's GET budget is worked out from
    (workers/registry.py): the replicas sharing, and 1 while Redis is away."""
    first, second, third = (replica(redis_server.url) for _ in range(3))
    try:
        assert first.replicas() == 1  # nothing heard yet
        for shares in (first, second, third, first, second, third):
            await shares.exchange()
        assert (first.replicas(), second.replicas(), third.replicas()) == (3, 3, 3)
        redis_server.stop()
        await first.exchange()
        assert first.fallback and first.replicas() == 1
    finally:
        for shares in (first, second, third):
            await shares.close()


async def test_no_tenant_name_in_redis_and_closing_takes_the_counts_out(
    redis_server: RedisServer,
) -> None:
    shares, reader = replica(redis_server.url), replica(redis_server.url)
    redis = Redis.from_url(redis_server.url)
    try:
        shares.publish("acme-corp", 1, 1, 1)
        await shares.exchange()
        keys = [key.decode() for key in await redis.keys("*")]
        own = KEY_PREFIX + shares._member
        assert sorted(keys) == sorted([INDEX_KEY, own])
        fields = await redis.hgetall(own)
        assert list(fields.values()) == [b"1 1 1"]
        assert not any(b"acme" in name for name in [*fields, *map(str.encode, keys)])
        assert 0 < await redis.pttl(own) <= 3000  # 12 periods of 0.25 s
        await shares.close()
        await reader.exchange()
        assert reader.others("acme-corp") == (0, 0, 0)
    finally:
        await redis.aclose()
        await reader.close()


async def test_a_crashed_replicas_counts_vanish_with_their_ttl(redis_server: RedisServer) -> None:
    # `crashed` exchanges once and never again, nor closes: a dead process.
    crashed = replica(redis_server.url, share_s=0.05)
    alive = replica(redis_server.url, share_s=0.05)
    try:
        crashed.publish("acme", 3, 3, 3)
        await crashed.exchange()
        await alive.exchange()
        assert alive.others("acme") == (3, 3, 3)
        await asyncio.sleep(0.8)  # past 12 periods
        await alive.exchange()
        assert alive.others("acme") == (0, 0, 0)
        assert alive._remote == {}  # bounded: only tenants reported within the TTL
    finally:
        await alive.close()
        await crashed.close()  # its connection only: its counts are gone by now


async def test_a_live_replica_keeps_its_counts_alive_unchanged(redis_server: RedisServer) -> None:
    holder = replica(redis_server.url, share_s=0.05)
    reader = replica(redis_server.url, share_s=0.05)
    await holder.start()
    try:
        holder.publish("acme", 2, 0, 0)
        await asyncio.sleep(1.0)  # past the TTL: keep-alives, with nothing changed
        await reader.exchange()
        assert reader.others("acme") == (2, 0, 0)
    finally:
        await holder.close()
        await reader.close()


async def test_a_flushed_script_is_loaded_again_without_falling_back(
    redis_server: RedisServer,
) -> None:
    shares = replica(redis_server.url)
    redis = Redis.from_url(redis_server.url)
    try:
        await shares.exchange()
        await redis.script_flush()
        shares.publish("acme", 1, 0, 0)
        await shares.exchange()
        assert not shares.fallback
        assert len(await redis.hgetall(KEY_PREFIX + shares._member)) == 1
    finally:
        await redis.aclose()
        await shares.close()


async def test_redis_away_counts_alone_then_shares_again(redis_server: RedisServer) -> None:
    shares = replica(redis_server.url, timeout_s=0.2, share_s=0.05, probe_s=0.1)
    other = replica(redis_server.url)
    try:
        other.publish("acme", 5, 5, 5)
        await other.exchange()
        await shares.start()
        await asyncio.sleep(0.2)
        assert shares.others("acme") == (5, 5, 5)
        redis_server.stop()
        await asyncio.sleep(0.3)
        assert shares.fallback and shares.metrics.fallbacks.cell("counts")[0] == 1
        assert shares.others("acme") == (0, 0, 0)  # this replica alone
        redis_server.start()  # an empty Redis: the other replica writes again
        other.publish("acme", 2, 2, 2)
        await other.exchange()
        for _ in range(100):
            if not shares.fallback and shares.others("acme") == (2, 2, 2):
                break
            await asyncio.sleep(0.05)
        assert not shares.fallback and shares.others("acme") == (2, 2, 2)
        assert shares.metrics.fallbacks.cell("counts")[0] == 1
    finally:
        await shares.close()
        await other.close()
