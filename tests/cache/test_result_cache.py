"""The result cache end to end: a real gateway over the simulator, in memory and in a real Redis."""

from __future__ import annotations

import asyncio
import base64

import httpx
import orjson
import pytest
from redis import Redis

from mineru_gateway.cache.stores import REDIS_PREFIX
from mineru_gateway.testing import wait_until
from tests.cache.conftest import RedisServer
from tests.cache.test_coalescing import CHAT, counter, page, state
from tests.conftest import StartGateway, StartSim


def image_page(seed: int) -> dict[str, object]:
    """A greedy request with a page image (a data: URL of about 100 KB)."""
    image = base64.b64encode(seed.to_bytes(4, "big") * 25_000).decode()
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}},
        {"type": "text", "text": "Layout Detection:"},
    ]
    request = page(20)
    request["messages"] = [{"role": "user", "content": content}]
    return request


async def test_a_second_pass_is_answered_from_memory_without_a_worker_request(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim()
    gateway = start_gateway([worker], cache="memory")
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        first = [await client.post(CHAT, json=page(10 + n)) for n in range(5)]
        second = [await client.post(CHAT, json=page(10 + n)) for n in range(5)]
        assert [a.headers["x-cache"] for a in first] == ["miss"] * 5
        assert [a.headers["x-cache"] for a in second] == ["hit"] * 5
        assert [a.content for a in first] == [a.content for a in second]
        assert (await state(client, worker))["arrived"] == 5
        metrics = (await client.get("/metrics")).text
    assert counter(metrics, "mineru_gateway_cache_hits") == 5
    assert 'mineru_gateway_cache_bytes{tenant="default"}' in metrics


async def test_incomplete_answers_and_sampled_requests_are_not_cached(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim()
    gateway = start_gateway([worker], cache="memory")
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        cut = page(50, max_tokens=10)  # finish_reason "length"
        sampled = page(temperature=1.0)
        for request in (cut, cut, sampled, sampled):
            answer = await client.post(CHAT, json=request)
            assert answer.status_code == 200 and answer.headers.get("x-cache") != "hit"
        assert (await state(client, worker))["arrived"] == 4


async def test_a_stream_is_answered_from_the_cache_as_valid_sse(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim()
    gateway = start_gateway([worker], cache="memory")
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        whole = (await client.post(CHAT, json=page(30))).json()
        streamed = page(30, stream=True, stream_options={"include_usage": True})
        answer = await client.post(CHAT, json=streamed)
        assert answer.headers["x-cache"] == "hit"
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert (await state(client, worker))["arrived"] == 1
    events = answer.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [orjson.loads(event.removeprefix("data: ")) for event in events[:-2]]
    content = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert content == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == whole["usage"]


async def test_tenants_do_not_share_cached_answers_unless_the_scope_is_shared(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim()
    own = start_gateway([worker], cache="memory", api_keys=["ka", "kb"])
    shared = start_gateway([worker], cache="memory", api_keys=["ka", "kb"], cache_scope="shared")
    async with httpx.AsyncClient(timeout=60) as client:
        for gateway, wanted in ((own, "miss"), (shared, "hit")):
            first = await client.post(gateway + CHAT, json=page(), headers=_key("ka"))
            other = await client.post(gateway + CHAT, json=page(), headers=_key("kb"))
            assert (first.headers["x-cache"], other.headers["x-cache"]) == ("miss", wanted)


def _key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_two_gateways_on_one_redis_share_answers_with_nothing_in_clear(
    start_sim: StartSim, start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    worker = start_sim()
    one = start_gateway([worker], cache=redis_server.url, api_keys=["secret-key"])
    two = start_gateway([worker], cache=redis_server.url, api_keys=["secret-key"])
    request = image_page(1)
    async with httpx.AsyncClient(timeout=60, headers=_key("secret-key")) as client:
        computed = await client.post(one + CHAT, json=request)
        assert computed.headers["x-cache"] == "miss"
        redis = Redis.from_url(redis_server.url)
        await asyncio.to_thread(_wait_for_keys, redis, 1)
        served = await client.post(two + CHAT, json=request)
        assert served.headers["x-cache"] == "hit" and served.content == computed.content
        assert (await state(client, worker))["arrived"] == 1
    keys = redis.keys(b"*")
    assert len(keys) == 1 and keys[0].startswith(REDIS_PREFIX)
    assert b"secret" not in keys[0] and b"default" not in keys[0]
    assert redis.pttl(keys[0]) > 0
    redis.close()


def _wait_for_keys(redis: Redis, count: int) -> None:
    wait_until(lambda: len(redis.keys(b"*")) >= count, 10.0, "the answer in Redis")


@pytest.mark.parametrize("damage", ["truncated", "altered", "foreign"])
async def test_a_corrupt_redis_entry_is_a_miss(
    start_sim: StartSim, start_gateway: StartGateway, redis_server: RedisServer, damage: str
) -> None:
    worker = start_sim()
    gateway = start_gateway([worker], cache=redis_server.url)
    redis = Redis.from_url(redis_server.url)
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        first = await client.post(CHAT, json=page())
        await asyncio.to_thread(_wait_for_keys, redis, 1)
        (key,) = redis.keys(b"*")
        blob = redis.get(key)
        assert isinstance(blob, bytes)
        broken = {
            "truncated": blob[: len(blob) // 2],
            "altered": blob[:-5] + b"XXXXX",
            "foreign": b"something else",
        }[damage]
        redis.set(key, broken)
        again = await client.post(CHAT, json=page())
        assert again.status_code == 200 and again.headers["x-cache"] == "miss"
        assert again.json()["choices"] == first.json()["choices"]
        assert (await state(client, worker))["arrived"] == 2
        metrics = (await client.get("/metrics")).text
    assert 'mineru_gateway_cache_errors_total{reason="corrupt"} 1.0' in metrics
    redis.close()


async def test_redis_killed_mid_test_means_misses_never_a_client_error(
    start_sim: StartSim, start_gateway: StartGateway, redis_server: RedisServer
) -> None:
    worker = start_sim()
    gateway = start_gateway([worker], cache=redis_server.url)
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        await client.post(CHAT, json=page())
        redis = Redis.from_url(redis_server.url)
        await asyncio.to_thread(_wait_for_keys, redis, 1)
        redis.close()
        assert (await client.post(CHAT, json=page())).headers["x-cache"] == "hit"
        redis_server.stop()
        answers = [await client.post(CHAT, json=page(5 + n % 3)) for n in range(6)]
        assert {a.status_code for a in answers} == {200}
        assert {a.headers["x-cache"] for a in answers} == {"miss"}
        assert (await state(client, worker))["arrived"] == 7
        metrics = (await client.get("/metrics")).text
    assert 'mineru_gateway_cache_errors_total{reason="unavailable"}' in metrics
