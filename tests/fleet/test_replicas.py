"""Two gateway replicas sharing Redis (fleet/slots.py) in front of one counting worker: a
tenant's `max_in_flight` holds across both, counted at the worker; without Redis each replica
holds it alone, and no client sees an error; with Redis back the limit is shared again."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from mineru_gateway.testing import CountingWorker
from tests.conftest import StartGateway
from tests.fleet.conftest import CountingWorkers
from tests.support.redis_server import RedisServer
from tests.support.servers import wait_until

CHAT = "/v1/chat/completions"
LIMIT = 3
PER_REPLICA = 4 * LIMIT
KEY = {"Authorization": "Bearer fleet-key"}
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def worker(counting_worker: CountingWorkers) -> tuple[CountingWorker, str]:
    return counting_worker(0.15)


def replicas(
    start_gateway: StartGateway, worker: str, redis: RedisServer, **extra: object
) -> list[str]:
    settings = {
        "api_keys": "fleet-key",
        "tenant_max_in_flight": LIMIT,
        "max_queue_wait_s": 60,
        "fleet_state": redis.url,
        "fleet_state_timeout_s": 0.2,
        "fleet_state_lease_s": 3.0,
    } | extra
    return [start_gateway([worker], **settings) for _ in range(2)]


async def burst(gateways: list[str], per_replica: int = PER_REPLICA) -> list[int]:
    """`per_replica` concurrent requests of the one tenant to each replica; their statuses."""
    async with httpx.AsyncClient(timeout=60) as client:
        sends = [
            client.post(gateway + CHAT, json=BODY, headers=KEY)
            for gateway in gateways
            for _ in range(per_replica)
        ]
        return [response.status_code for response in await asyncio.gather(*sends)]


def fallback(gateway: str) -> float:
    text = httpx.get(gateway + "/metrics").text
    found = re.search(r"^mineru_gateway_fleet_state_fallback (\S+)$", text, re.M)
    assert found is not None, "no fallback gauge"
    return float(found.group(1))


async def test_a_tenants_limit_holds_exactly_across_two_replicas(
    worker: tuple[CountingWorker, str], start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    counts, url = worker
    gateways = replicas(start_gateway, url, redis_server)
    statuses = await burst(gateways)
    assert statuses == [200] * 2 * PER_REPLICA
    assert counts.served == 2 * PER_REPLICA
    assert counts.peak == LIMIT  # never more at the worker, and the limit is used
    assert [fallback(gateway) for gateway in gateways] == [0.0, 0.0]


async def test_redis_away_each_replica_holds_the_limit_then_shares_it_again(
    worker: tuple[CountingWorker, str], start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    counts, url = worker
    gateways = replicas(start_gateway, url, redis_server)
    redis_server.stop()
    statuses = await burst(gateways)
    assert statuses == [200] * 2 * PER_REPLICA  # no client sees Redis go
    assert LIMIT < counts.peak <= 2 * LIMIT  # each replica alone, still within its limit
    assert [fallback(gateway) for gateway in gateways] == [1.0, 1.0]

    redis_server.start()
    await asyncio.to_thread(
        wait_until,
        lambda: all(fallback(gateway) == 0.0 for gateway in gateways) or None,
        15.0,
        "both replicas sharing again",
    )
    counts.reset_peak()
    statuses = await burst(gateways)
    assert statuses == [200] * 2 * PER_REPLICA
    assert counts.peak == LIMIT


async def test_under_sustained_load_every_request_is_served_within_the_limit(
    worker: tuple[CountingWorker, str], start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    """Clients sending back to back: requests arrive while others of the tenant queue, some
    when a slot is free. Each is served in its turn (none waits out `max_queue_wait_s`)."""
    counts, url = worker
    counts.hold_s = 0.05
    gateways = replicas(start_gateway, url, redis_server, max_queue_wait_s=10)
    deadline = asyncio.get_running_loop().time() + 3.0
    statuses: list[int] = []

    async def client_loop(client: httpx.AsyncClient, gateway: str) -> None:
        while asyncio.get_running_loop().time() < deadline:
            response = await client.post(gateway + CHAT, json=BODY, headers=KEY)
            statuses.append(response.status_code)

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(
            *(client_loop(client, g) for g in gateways for _ in range(PER_REPLICA))
        )
    assert set(statuses) == {200}
    assert counts.served == len(statuses)
    assert counts.peak == LIMIT
