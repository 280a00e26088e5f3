"""Real vLLM (CPU build) with its own queue limit: its queue-full 503 is the one the contract
and the simulator know, and the gateway sends such requests elsewhere without ejecting it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from mineru_gateway.testing import start_vllm_server, vllm_paths_from_env
from mineru_gateway.vllm_contract import is_queue_full
from tests.conftest import StartGateway, StartSim

pytestmark = pytest.mark.vllm

CHAT = "/v1/chat/completions"
RECORDED = Path(__file__).resolve().parent / "fixtures" / "vllm" / "dialects" / "0.32.0.json"


@pytest.fixture(scope="module")
def full_vllm() -> Iterator[str]:
    """A vLLM that takes no request: `--max-num-queued-reqs 0`."""
    python, model_dir = vllm_paths_from_env()
    server = start_vllm_server(
        python, model_dir, served_name="tiny", extra_args=["--max-num-queued-reqs", "0"]
    )
    try:
        server.wait_ready(timeout=300)
        yield server.url
    finally:
        server.stop()


def chat(**fields: object) -> dict[str, object]:
    messages = [{"role": "user", "content": "Say something about documents."}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, **fields}


def test_real_vllms_queue_full_answer_is_the_recorded_one(full_vllm: str) -> None:
    expected = orjson.loads(RECORDED.read_bytes())["queue_full"]
    for stream in (False, True):
        response = httpx.post(full_vllm + CHAT, json=chat(stream=stream), timeout=60)
        assert response.status_code == expected["status"]
        assert response.json() == expected["bodies"][0]
        assert is_queue_full(response.status_code, response.content)
    metrics = httpx.get(full_vllm + "/metrics", timeout=30).text
    assert 'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"}' in (
        metrics
    )


def test_the_gateway_sends_a_full_real_vllms_requests_elsewhere(
    full_vllm: str, start_sim: StartSim, start_gateway: StartGateway
) -> None:
    roomy = start_sim(model_name="tiny")
    gateway = start_gateway(
        [full_vllm, roomy], routing_policy="round_robin", eject_after=1, busy_hold_s=0.2
    )

    async def send(count: int) -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            sent = [client.post(gateway + CHAT, json=chat()) for _ in range(count)]
            return [response.status_code for response in await asyncio.gather(*sent)]

    assert asyncio.run(send(20)) == [200] * 20
    listed = {w["url"]: w for w in httpx.get(gateway + "/v1/workers").json()["workers"]}
    assert listed[full_vllm]["state"] == "healthy"
    text = httpx.get(gateway + "/metrics").text
    refused = [
        line
        for line in text.splitlines()
        if line.startswith("mineru_gateway_worker_queue_full_total{") and full_vllm in line
    ]
    assert refused and float(refused[0].rsplit(" ", 1)[1]) >= 1
