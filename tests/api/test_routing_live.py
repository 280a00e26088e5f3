"""Routing on real simulated workers: load the gateway can and cannot see (issue 3)."""

from __future__ import annotations

import asyncio
import time
from functools import partial

import httpx

from mineru_gateway.testing import wait_until_async
from tests.conftest import StartGateway, StartSim
from tests.support.workers import Script

CHAT = "/v1/chat/completions"


def body(tokens: int, stream: bool = True) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": "\nText Recognition:"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def stream_once(client: httpx.AsyncClient, url: str, tokens: int) -> None:
    async with client.stream("POST", url + CHAT, json=body(tokens)) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass


async def closed_loop(url: str, streams: int, tokens: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds

    async def loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await stream_once(client, url, tokens)

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(loop(client) for _ in range(streams)))


async def sees_direct_load(client: httpx.AsyncClient, gateway: str, worker: str) -> bool:
    """True once the gateway's last scrape of `worker` shows the 12 direct streams."""
    listing = (await client.get(gateway + "/v1/workers")).json()
    [reported] = [w["reported"] for w in listing["workers"] if w["url"] == worker]
    return reported is not None and reported["running"] + reported["waiting"] >= 12


def completed(worker: str) -> int:
    state = httpx.get(worker + "/sim/state").json()
    return int(state["completed"])


async def test_a_slower_worker_gets_less_work(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    fast = start_sim(model_name="m", time_scale=1.0)
    # A quarter of the pace: with half of it, a loaded test machine (which slows both
    # simulators alike) left too little difference to tell from noise.
    slow = start_sim(model_name="m", time_scale=1.0, speed=0.25)
    gateway = start_gateway([fast, slow], routing_policy="queue", load_interval_s=0.1)
    await closed_loop(gateway, streams=16, tokens=20, seconds=4.0)
    on_fast, on_slow = completed(fast), completed(slow)
    assert on_fast + on_slow > 40
    assert on_slow < 0.75 * on_fast, (on_fast, on_slow)


async def test_load_sent_straight_to_a_worker_pushes_gateway_traffic_elsewhere(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    busy = start_sim(model_name="m", time_scale=1.0)
    idle = start_sim(model_name="m", time_scale=1.0)
    gateway = start_gateway([busy, idle], routing_policy="queue", load_interval_s=0.1)
    async with httpx.AsyncClient(timeout=60) as client:
        # Long generations sent directly to one worker, bypassing the gateway.
        direct = [asyncio.create_task(stream_once(client, busy, 400)) for _ in range(12)]
        seen = partial(sees_direct_load, client, gateway, busy)
        await wait_until_async(seen, 10, "the gateway seeing the direct load", poll=0.02)
        for _ in range(20):
            await stream_once(client, gateway, 5)
        for task in direct:
            task.cancel()
        await asyncio.gather(*direct, return_exceptions=True)
    to_idle = completed(idle)
    assert to_idle >= 17, f"only {to_idle} of 20 gateway requests avoided the busy worker"


async def test_a_request_weighs_its_prompt_only_until_the_first_byte_of_its_answer(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    long_prompt = {
        "model": "echo-model",
        "messages": [{"role": "user", "content": "x" * 4000}],  # ~1000 tokens: ~1 slot
    }

    async def cost_on_worker(client: httpx.AsyncClient) -> tuple[int, float]:
        listing = (await client.get(gateway + "/v1/workers")).json()
        return listing["workers"][0]["in_flight"], listing["workers"][0]["estimated_cost"]

    async with httpx.AsyncClient(timeout=30) as client:
        script.mode = "stream_then_hang"  # first chunk at once, then nothing
        async with client.stream(
            "POST", gateway + CHAT, json=long_prompt | {"stream": True}
        ) as streaming:
            lines = streaming.aiter_lines()  # kept: a collected iterator closes the stream
            await anext(lines)
            assert await cost_on_worker(client) == (1, 1.0)  # prefilled: one batch slot
            script.mode = "hang"  # a non-streaming answer: its first byte is the whole answer
            waiting = asyncio.create_task(client.post(gateway + CHAT, json=long_prompt))

            async def both_on_worker() -> tuple[int, float] | None:
                state = await cost_on_worker(client)
                return state if state[0] == 2 else None

            state = await wait_until_async(both_on_worker, 5, "the second request sent", poll=0.02)
            assert 2.8 <= state[1] <= 3.2  # 1 + (1 slot + ~1 of queued prefill)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
