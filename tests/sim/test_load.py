"""Queueing and client disconnects against a real uvicorn server."""

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.sim import SimConfig, create_sim_app
from mineru_gateway.testing import wait_until_async
from tests.support.servers import serve

CHAT = "/v1/chat/completions"
# Slow enough that a 2000-token answer lasts seconds, so requests stay in flight while observed.
CONFIG = SimConfig(model_name="tiny", max_num_seqs=2, time_scale=0.1, kv_cache_tokens=65536)


def endless(stream: bool = True) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Tell me everything"}]
    return {"messages": messages, "max_tokens": 2000, "ignore_eos": True, "stream": stream}


@pytest.fixture
def url() -> Iterator[str]:
    with serve(create_sim_app(CONFIG)) as base_url:
        yield base_url


async def wait_for_state(
    client: httpx.AsyncClient, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Polls /sim/state until `check` holds."""

    async def state_that_holds() -> dict[str, Any] | None:
        state: dict[str, Any] = (await client.get("/sim/state")).json()
        return state if check(state) else None

    return await wait_until_async(state_that_holds, 10.0, "sim state", poll=0.02)


async def read_first_event(client: httpx.AsyncClient, opened: asyncio.Event) -> None:
    async with client.stream("POST", CHAT, json=endless()) as response:
        async for _ in response.aiter_lines():
            opened.set()
            await asyncio.sleep(3600)  # hold the stream open until cancelled


def gauge(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return float(family.samples[0].value)
    raise KeyError(name)


async def test_requests_beyond_the_batch_queue_and_abort_when_their_clients_go(
    url: str,
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as control:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as load:
            tasks = [asyncio.ensure_future(load.post(CHAT, json=endless())) for _ in range(6)]
            state = await wait_for_state(control, lambda s: s["arrived"] == 6)
            assert (state["running"], state["waiting"]) == (2, 4)
            metrics = (await control.get("/metrics")).text
            assert gauge(metrics, "vllm:num_requests_waiting") == 4
            assert gauge(metrics, "vllm:num_requests_running") == 2
            assert 0 < gauge(metrics, "vllm:kv_cache_usage_perc") < 1
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # in_flight drops when each handler has returned, a moment after its abort
        state = await wait_for_state(control, lambda s: s["aborted"] == 6 and s["in_flight"] == 0)
        assert (state["running"], state["waiting"], state["completed"]) == (0, 0, 0)
        assert state["kv_cache_usage"] == 0.0
        assert state["in_flight"] == 0


async def test_a_closed_stream_is_aborted_at_once(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as control:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as streamer:
            opened = asyncio.Event()
            task = asyncio.ensure_future(read_first_event(streamer, opened))
            await asyncio.wait_for(opened.wait(), 10.0)
            assert (await control.get("/sim/state")).json()["running"] == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        state = await wait_for_state(control, lambda s: s["aborted"] == 1)
        assert (state["running"], state["completed"]) == (0, 0)
        assert 0 < state["generation_tokens"] < 2000
        metrics = (await control.get("/metrics")).text
        successes = [
            sample.value
            for family in text_string_to_metric_families(metrics)
            if family.name == "vllm:request_success"
            for sample in family.samples
            if sample.name.endswith("_total")
        ]
        assert sum(successes) == 0


async def test_a_waiting_request_whose_client_leaves_is_dropped_from_the_queue(
    url: str,
) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as control:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as load:
            running = [asyncio.ensure_future(load.post(CHAT, json=endless())) for _ in range(2)]
            await wait_for_state(control, lambda s: s["running"] == 2)
            queued = asyncio.ensure_future(load.post(CHAT, json=endless(stream=False)))
            await wait_for_state(control, lambda s: s["waiting"] == 1)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            state = await wait_for_state(control, lambda s: s["aborted"] == 1)
            assert (state["running"], state["waiting"]) == (2, 0)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        await wait_for_state(control, lambda s: s["aborted"] == 3 and s["running"] == 0)


async def test_an_app_serves_again_after_a_shutdown() -> None:
    app = create_sim_app(CONFIG)
    for _ in range(2):
        with serve(app) as base_url:
            async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
                body = {"prompt": "hi", "max_tokens": 3, "ignore_eos": True}
                answer = (await client.post("/v1/completions", json=body)).json()
                assert answer["usage"]["completion_tokens"] == 3
