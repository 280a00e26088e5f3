"""Tenants' queue limits and fair shares across two gateway replicas sharing Redis
(fleet/tenants.py), in front of one counting worker that each replica fills to its own batch
limit: the replicas' queues hold the load, and what each queues counts in the other's limits and
order. Redis killed mid-run: requests keep being served."""

from __future__ import annotations

import asyncio
import re
import statistics
from collections import Counter

import httpx
import pytest

from mineru_gateway.testing import CountingWorker
from tests.conftest import StartGateway
from tests.fleet.conftest import CountingWorkers
from tests.support.redis_server import RedisServer

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TENANTS = '{"a": {"keys": ["key-a"]}, "b": {"keys": ["key-b"]}}'
A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}
SHARE_S = 0.1

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def worker(counting_worker: CountingWorkers) -> tuple[CountingWorker, str]:
    return counting_worker(0.1)


def replicas(
    start_gateway: StartGateway, worker: str, fleet_state: str, **extra: object
) -> list[str]:
    """Two gateways, each sending the worker at most `batch_limit` requests at once."""
    settings = {
        "tenants": TENANTS,
        "batch_limit": 2,
        "batch_headroom_min": 0,
        "max_queue_wait_s": 60,
        "fleet_state": fleet_state,
        "fleet_state_timeout_s": 0.2,
        "fleet_state_share_s": SHARE_S,
    } | extra
    return [start_gateway([worker], **settings) for _ in range(2)]


async def flood(
    client: httpx.AsyncClient,
    url: str,
    key: dict[str, str],
    until: float,
    outcomes: Counter[str],
) -> None:
    """One client sending the tenant's requests back to back until `until` (loop time); each
    outcome counted: `200`, or the 429's error code (retried after a short pause)."""
    loop = asyncio.get_running_loop()
    while loop.time() < until:
        response = await client.post(url + CHAT, json=BODY, headers=key)
        if response.status_code == 200:
            outcomes["200"] += 1
            continue
        assert response.status_code == 429, response.text
        outcomes[response.json()["error"]["code"]] += 1
        await asyncio.sleep(0.02)


def queued(text: str) -> int:
    found = re.findall(r"^mineru_gateway_queue_requests\{[^}]*\} (\S+)$", text, re.M)
    return int(sum(float(value) for value in found))


def fallback(text: str) -> float:
    found = re.search(r"^mineru_gateway_fleet_state_fallback (\S+)$", text, re.M)
    assert found is not None, "no fallback gauge"
    return float(found.group(1))


async def test_a_tenants_queue_limit_holds_across_replicas(
    worker: tuple[CountingWorker, str], start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    """Both replicas flooded by one tenant with `max_queued` 4: together they queue about 4
    (each alone would queue 4), the rest is refused with `tenant_queue_full`. Each dequeue is
    refilled at once by a waiting client; what the replicas refill within the counts'
    staleness (about two share periods) passes the limit, so dequeues are kept slower than
    that."""
    counts, url = worker
    counts.hold_s = 0.6
    gateways = replicas(
        start_gateway, url, redis_server.url, tenant_max_queued=4, fleet_state_share_s=0.05
    )
    outcomes: Counter[str] = Counter()
    totals: list[int] = []
    async with httpx.AsyncClient(timeout=60) as client:
        until = asyncio.get_running_loop().time() + 4.0

        async def sample() -> None:
            await asyncio.sleep(1.0)  # past the first burst, which no replica has yet shared
            while asyncio.get_running_loop().time() < until - 0.5:
                texts = [(await client.get(g + "/metrics")).text for g in gateways]
                totals.append(sum(queued(text) for text in texts))
                await asyncio.sleep(0.05)

        await asyncio.gather(
            sample(), *(flood(client, g, A, until, outcomes) for g in gateways for _ in range(8))
        )
    assert outcomes["200"] > 0 and outcomes["tenant_queue_full"] > 0
    assert set(outcomes) == {"200", "tenant_queue_full"}
    # Over 4 by what one replica refilled while the other's counts were stale: here a batch's
    # dequeues (2). Never over each replica's own queue limit; alone, each would hold 4 (8).
    assert max(totals) <= 8
    assert statistics.median(totals) <= 6, totals


async def share_of_b(gateways: list[str], seconds: float = 3.0) -> tuple[float, Counter[str]]:
    """A floods both replicas, B only the second; B's share of the answers."""
    a_done: Counter[str] = Counter()
    b_done: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=60) as client:
        until = asyncio.get_running_loop().time() + seconds
        await asyncio.gather(
            *(flood(client, g, A, until, a_done) for g in gateways for _ in range(6)),
            *(flood(client, gateways[1], B, until, b_done) for _ in range(6)),
        )
    return b_done["200"] / (a_done["200"] + b_done["200"]), a_done + b_done


async def test_fair_shares_count_every_replicas_requests(
    worker: tuple[CountingWorker, str], start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    """Each replica fills half the worker. Counting alone, the second replica splits its half
    between A and B (B gets about a quarter); with the counts shared it sees A holding the
    first replica's half too and serves B first: B gets about half."""
    _, url = worker
    alone, _ = await share_of_b(replicas(start_gateway, url, "off"))
    shared, outcomes = await share_of_b(replicas(start_gateway, url, redis_server.url))
    assert set(outcomes) == {"200"}
    assert alone < 0.37, alone
    assert shared > 0.40, shared
    assert shared > alone + 0.08


async def test_redis_killed_mid_run_requests_keep_being_served(
    worker: tuple[CountingWorker, str], start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    _, url = worker
    gateways = replicas(start_gateway, url, redis_server.url, tenant_max_queued=50)

    async def kill_soon() -> None:
        await asyncio.sleep(1.0)
        redis_server.stop()

    (_, outcomes), _ = await asyncio.gather(share_of_b(gateways, seconds=3.0), kill_soon())
    assert set(outcomes) == {"200"} and outcomes["200"] > 0
    async with httpx.AsyncClient(timeout=10) as client:
        texts = [(await client.get(g + "/metrics")).text for g in gateways]
    assert [fallback(text) for text in texts] == [1.0, 1.0]
