"""Tenants' fleet-wide slots (fleet/slots.py) against a real `redis-server`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from mineru_gateway.fleet.slots import KEY_PREFIX, FleetSlots, tenant_key
from mineru_gateway.flow import TenantPolicy
from tests.support.redis_server import RedisServer

TENANT = TenantPolicy("acme-corp", max_in_flight=3)


async def members(url: str, tenant: str = TENANT.name) -> int:
    redis = Redis.from_url(url)
    try:
        return int(await redis.zcard(tenant_key(tenant)))
    finally:
        await redis.aclose()


async def eventually(condition: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_tenants_limit_holds_across_replicas(redis_server: RedisServer) -> None:
    one, two = FleetSlots(redis_server.url), FleetSlots(redis_server.url)
    try:
        first = await one.take(TENANT, 2)
        assert len(first) == 2
        assert len(await two.take(TENANT, 5)) == 1  # the limit leaves one
        assert await two.take(TENANT, 1) == []
        one.release(first[0])
        await eventually(lambda: members_are(redis_server.url, 2))
        assert len(await two.take(TENANT, 1)) == 1
        assert await members(redis_server.url) == 3
        assert not one.fallback and not two.fallback
    finally:
        await one.close()
        await two.close()


async def members_are(url: str, wanted: int) -> bool:
    return await members(url) == wanted


async def test_takes_at_once_share_one_round_trip_first_come_first_served(
    redis_server: RedisServer,
) -> None:
    slots = FleetSlots(redis_server.url)
    try:
        taken = await asyncio.gather(*(slots.take(TENANT, 1) for _ in range(5)))
        assert [len(permits) for permits in taken] == [1, 1, 1, 0, 0]
        assert await members(redis_server.url) == 3
    finally:
        await slots.close()


async def test_a_take_its_caller_leaves_gives_its_slots_back(redis_server: RedisServer) -> None:
    slots = FleetSlots(redis_server.url)
    try:
        for iterations in range(8):  # left before its round trip, during it, after it
            task = asyncio.create_task(slots.take(TENANT, 2))
            for _ in range(iterations):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if task.cancelled():
                await eventually(lambda: members_are(redis_server.url, 0))
            else:  # it had its answer: its caller holds the slots
                for permit in task.result():
                    slots.release(permit)
                await eventually(lambda: members_are(redis_server.url, 0))
        assert slots.held() == 0
    finally:
        await slots.close()


async def test_no_tenant_name_in_redis_keys(redis_server: RedisServer) -> None:
    slots = FleetSlots(redis_server.url)
    redis = Redis.from_url(redis_server.url)
    try:
        await slots.take(TENANT, 1)
        keys = [key.decode() for key in await redis.keys("*")]
        assert keys == [tenant_key(TENANT.name)]
        assert keys[0].startswith(KEY_PREFIX) and "acme" not in keys[0]
    finally:
        await redis.aclose()
        await slots.close()


async def test_a_crashed_replicas_slots_expire_with_their_lease(redis_server: RedisServer) -> None:
    # `crashed` never starts its lease keeper and never gives its slots back: a dead process.
    crashed = FleetSlots(redis_server.url, lease_s=0.5)
    alive = FleetSlots(redis_server.url, lease_s=0.5)
    try:
        assert len(await crashed.take(TENANT, 3)) == 3
        assert await alive.take(TENANT, 1) == []
        await asyncio.sleep(0.7)
        assert len(await alive.take(TENANT, 3)) == 3
    finally:
        await alive.close()
        await crashed.close()  # its connection only: its slots are gone by now


async def test_a_live_replica_keeps_its_leases(redis_server: RedisServer) -> None:
    holder = FleetSlots(redis_server.url, lease_s=0.4)
    other = FleetSlots(redis_server.url, lease_s=0.4)
    await holder.start()
    try:
        assert len(await holder.take(TENANT, 3)) == 3
        await asyncio.sleep(1.0)  # past two leases: renewed every lease / 3
        assert await other.take(TENANT, 1) == []
    finally:
        await holder.close()
        await other.close()


async def test_redis_away_falls_back_then_shares_again(redis_server: RedisServer) -> None:
    slots = FleetSlots(redis_server.url, lease_s=3.0, timeout_s=0.2, probe_s=0.1)
    await slots.start()
    try:
        redis_server.stop()
        started = time.monotonic()
        taken = await slots.take(TENANT, 5)  # alone: the queue's own count limits the tenant
        assert time.monotonic() - started < 2.0
        assert len(taken) == 5 and slots.fallback
        assert slots.metrics.fallbacks.cell("slots")[0] == 1
        assert len(await slots.take(TENANT, 1)) == 1  # no second wait for Redis
        slots.release(taken[0])
        redis_server.start()  # an empty Redis: it lost the slots
        await eventually(lambda: sharing(slots))
        # The slots still held were asserted again: the limit counts them.
        assert await members(redis_server.url) == 5
        assert await slots.take(TENANT, 1) == []
    finally:
        await slots.close()


async def sharing(slots: FleetSlots) -> bool:
    return not slots.fallback
