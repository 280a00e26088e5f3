"""Identical greedy requests in flight share one generation: a real gateway over the simulator."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

from mineru_gateway.testing import wait_until_async
from tests.conftest import StartGateway, StartSim

CHAT = "/v1/chat/completions"


def page(tokens: int = 200, **extra: object) -> dict[str, object]:
    """A MinerU-style greedy request whose answer has `tokens` tokens and ends in `stop`."""
    return {
        "model": "opendatalab/MinerU2.5-2509-1.2B",
        "messages": [{"role": "user", "content": "Layout Detection:"}],
        "temperature": 0.0,
        "top_p": 0.01,
        "max_tokens": 4096,
        "vllm_xargs": {"sim_output_tokens": tokens, "no_repeat_ngram_size": 100},
        **extra,
    }


async def state(client: httpx.AsyncClient, worker: str) -> dict[str, Any]:
    answer: dict[str, Any] = (await client.get(worker + "/sim/state")).json()
    return answer


def counter(text: str, name: str, tenant: str = "default") -> float:
    found = re.search(rf'^{name}_total{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_identical_concurrent_requests_make_one_worker_request_and_all_get_the_answer(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(time_scale=0.2)
    gateway = start_gateway([worker])
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        answers = await asyncio.gather(*(client.post(CHAT, json=page()) for _ in range(8)))
        assert {a.status_code for a in answers} == {200}
        assert len({a.content for a in answers}) == 1
        labels = sorted(a.headers["x-cache"] for a in answers)
        assert labels == ["coalesced"] * 7 + ["miss"]
        assert (await state(client, worker))["arrived"] == 1
        metrics = (await client.get("/metrics")).text
    assert counter(metrics, "mineru_gateway_cache_coalesced") == 7
    assert counter(metrics, "mineru_gateway_cache_misses") == 1
    assert counter(metrics, "mineru_gateway_cache_npu_seconds_saved") > 0


async def test_a_joined_request_takes_no_room_on_a_full_worker(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(time_scale=0.2)
    # One request fits on the worker: a second distinct one queues, identical ones join.
    gateway = start_gateway([worker], batch_limit=1, batch_headroom_min=0)
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        first = asyncio.ensure_future(client.post(CHAT, json=page()))
        await wait_until_async(
            lambda: _arrived(client, worker, 1), 10.0, "the first request on the worker"
        )
        joined = await asyncio.gather(*(client.post(CHAT, json=page()) for _ in range(3)))
        assert [a.headers["x-cache"] for a in joined] == ["coalesced"] * 3
        assert (await first).status_code == 200
        assert (await state(client, worker))["arrived"] == 1


async def _arrived(client: httpx.AsyncClient, worker: str, count: int) -> bool:
    return (await state(client, worker))["arrived"] >= count


async def test_the_first_client_leaving_does_not_cancel_the_others_the_last_does(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(time_scale=1.0)  # 200 tokens: about two seconds
    gateway = start_gateway([worker])
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        first = asyncio.ensure_future(client.post(CHAT, json=page()))
        await wait_until_async(lambda: _arrived(client, worker, 1), 10.0, "first on the worker")
        second = asyncio.ensure_future(client.post(CHAT, json=page()))
        await asyncio.sleep(0.2)
        first.cancel()  # the leader's client goes away
        answer = await second
        assert answer.status_code == 200 and answer.headers["x-cache"] == "coalesced"
        assert answer.json()["choices"][0]["finish_reason"] == "stop"
        done = await state(client, worker)
        assert (done["arrived"], done["completed"], done["aborted"]) == (1, 1, 0)

        leavers = [asyncio.ensure_future(client.post(CHAT, json=page(201))) for _ in range(3)]
        await wait_until_async(lambda: _arrived(client, worker, 2), 10.0, "second on the worker")
        for leaver in leavers:
            leaver.cancel()
        await wait_until_async(
            lambda: _aborted(client, worker), 10.0, "the worker's request aborted"
        )


async def test_the_leader_leaving_first_then_the_last_waiter_cancels_the_generation(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    """The leader's client goes first: its generation goes on for the one waiting; when that
    one goes too, the worker's request is aborted (nobody is left to read it)."""
    worker = start_sim(time_scale=1.0)
    gateway = start_gateway([worker])
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        leader = asyncio.ensure_future(client.post(CHAT, json=page(202)))
        await wait_until_async(lambda: _arrived(client, worker, 1), 10.0, "leader on the worker")
        waiter = asyncio.ensure_future(client.post(CHAT, json=page(202)))
        await asyncio.sleep(0.2)
        leader.cancel()
        await asyncio.sleep(0.2)
        assert (await state(client, worker))["aborted"] == 0  # kept for the waiter
        waiter.cancel()
        await wait_until_async(
            lambda: _aborted(client, worker), 10.0, "the worker's request aborted"
        )


async def _aborted(client: httpx.AsyncClient, worker: str) -> bool:
    current = await state(client, worker)
    return bool(current["aborted"] == 1 and current["in_flight"] == 0)


async def test_sampled_and_streamed_requests_are_not_coalesced(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(time_scale=0.2)
    gateway = start_gateway([worker])
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        sampled = page(temperature=0.7)
        answers = await asyncio.gather(*(client.post(CHAT, json=sampled) for _ in range(3)))
        assert all(a.status_code == 200 and "x-cache" not in a.headers for a in answers)
        assert (await state(client, worker))["arrived"] == 3
        streamed = page(stream=True)
        answers = await asyncio.gather(*(client.post(CHAT, json=streamed) for _ in range(3)))
        assert [a.headers["x-cache"] for a in answers] == ["miss"] * 3
        assert all(a.text.endswith("data: [DONE]\n\n") for a in answers)
        assert (await state(client, worker))["arrived"] == 6


async def test_coalescing_off_sends_every_request(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(time_scale=0.2)
    gateway = start_gateway([worker], coalesce=False)
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        answers = await asyncio.gather(*(client.post(CHAT, json=page()) for _ in range(3)))
        assert all(a.status_code == 200 and "x-cache" not in a.headers for a in answers)
        assert (await state(client, worker))["arrived"] == 3


async def test_tenants_do_not_share_a_generation_by_default(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(time_scale=0.2)
    gateway = start_gateway([worker], api_keys=["ka", "kb"])
    async with httpx.AsyncClient(base_url=gateway, timeout=60) as client:
        answers = await asyncio.gather(
            *(
                client.post(CHAT, json=page(), headers={"Authorization": f"Bearer {key}"})
                for key in ("ka", "kb", "ka", "kb")
            )
        )
        assert sorted(a.headers["x-cache"] for a in answers) == ["coalesced"] * 2 + ["miss"] * 2
        assert (await state(client, worker))["arrived"] == 2
