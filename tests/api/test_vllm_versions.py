"""The gateway against each supported vLLM version's dialect (the simulator speaking it), and a
worker whose own queue is full (vLLM's queue-full 503): busy, never failed."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from mineru_gateway.vllm_contract import IMAGE_VERSION, NEWEST_VERSION, SUPPORTED_VERSIONS
from tests.conftest import StartGateway, StartSim
from tests.support.servers import wait_until

CHAT = "/v1/chat/completions"


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "\nText Recognition:"}], **fields}


def workers(gateway: str) -> dict[str, dict[str, Any]]:
    listing = httpx.get(gateway + "/v1/workers").json()["workers"]
    return {worker["url"]: worker for worker in listing}


def metric(gateway: str, name: str, worker: str) -> float:
    text = httpx.get(gateway + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_image_and_the_newest_version_are_supported() -> None:
    assert IMAGE_VERSION in SUPPORTED_VERSIONS
    assert NEWEST_VERSION == "0.32.0"


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_the_gateway_reads_each_versions_load(
    version: str, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(vllm_version=version, time_scale=1.0, max_num_seqs=2)
    gateway = start_gateway([worker], load_interval_s=0.05, batch_limit=64)

    async def load_it() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            sent = [client.post(gateway + CHAT, json=chat(max_tokens=60)) for _ in range(6)]
            tasks = [asyncio.ensure_future(request) for request in sent]
            # 2 running, 4 waiting in the worker's own queue: /v1/workers shows its reading.
            await asyncio.to_thread(
                wait_until,
                lambda: (workers(gateway)[worker]["reported"] or {}).get("waiting", 0) >= 1,
                10.0,
            )
            reported = workers(gateway)[worker]["reported"]
            assert reported["running"] == 2
            return [(await task).status_code for task in tasks]

    assert asyncio.run(load_it()) == [200] * 6
    assert workers(gateway)[worker]["state"] == "healthy"


def test_clients_reusing_an_id_both_get_answers_from_vllm_0_11(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    """vLLM 0.11 refuses an X-Request-Id already in flight; the gateway sends each attempt its
    own id, and answers the client with the client's."""
    worker = start_sim(vllm_version="0.11.0", time_scale=1.0)
    gateway = start_gateway([worker])

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            headers = {"X-Request-Id": "page-7"}
            sent = [
                client.post(gateway + CHAT, json=chat(max_tokens=40 + i), headers=headers)
                for i in range(2)
            ]
            return await asyncio.gather(*sent)

    answers = asyncio.run(twice())
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-request-id"] for a in answers] == ["page-7", "page-7"]
    # vLLM names its answer after the id it was sent: the client's, made unique.
    ids = [a.json()["id"] for a in answers]
    assert all(i.startswith("chatcmpl-page-7-") for i in ids) and ids[0] != ids[1]


async def _concurrently(url: str, count: int, **fields: Any) -> list[int]:
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        sent = [client.post(url + CHAT, json=chat(**fields)) for _ in range(count)]
        return [response.status_code for response in await asyncio.gather(*sent)]


def test_a_full_worker_queue_sends_requests_elsewhere_and_is_never_ejected(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    """60 requests over two workers, one of which refuses every request with vLLM's queue-full
    503: every request is answered, and the full worker stays in routing."""
    full = start_sim(vllm_version="0.32.0", max_num_queued_reqs=0)
    roomy = start_sim(vllm_version="0.32.0")
    gateway = start_gateway(
        [full, roomy], routing_policy="round_robin", eject_after=1, busy_hold_s=0.2
    )
    statuses = asyncio.run(_concurrently(gateway, 60, max_tokens=8))
    assert statuses == [200] * 60
    listed = workers(gateway)
    assert listed[full]["state"] == "healthy"
    refused = metric(gateway, "mineru_gateway_worker_queue_full_total", full)
    assert refused >= 1
    # Each refusal went to the other worker, not back to the client or to a retry's budget.
    assert metric(gateway, "mineru_gateway_worker_ejections_total", full) == 0
    assert httpx.get(full + "/metrics").text.count("max_num_queued_reqs") >= 1
    # The hold ends: the full worker is offered requests again later, and refuses them again.
    assert httpx.post(gateway + CHAT, json=chat(max_tokens=4)).status_code == 200


def test_when_every_worker_is_full_requests_wait_in_the_gateways_queue(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    """Each worker takes 2 requests; the gateway believes it may send 64: the rest are refused,
    wait in the gateway's queue, and are served as room appears."""
    urls = [start_sim(max_num_queued_reqs=2, time_scale=0.2) for _ in range(2)]
    gateway = start_gateway(urls, batch_limit=64, busy_hold_s=0.05)
    statuses = asyncio.run(_concurrently(gateway, 12, max_tokens=12))
    assert statuses == [200] * 12
    refused = sum(metric(gateway, "mineru_gateway_worker_queue_full_total", u) for u in urls)
    assert refused >= 1
    assert all(worker["state"] == "healthy" for worker in workers(gateway).values())


def test_without_flow_control_a_fleet_of_full_workers_answers_503_with_retry_after(
    start_sim: StartSim, start_gateway: StartGateway
) -> None:
    worker = start_sim(max_num_queued_reqs=0)
    gateway = start_gateway([worker], flow_control=False)
    response = httpx.post(gateway + CHAT, json=chat(max_tokens=4))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "workers_busy"
    assert float(response.headers["retry-after"]) >= 1
    assert workers(gateway)[worker]["state"] == "healthy"
