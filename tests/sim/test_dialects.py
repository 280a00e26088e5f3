"""The simulator speaks each supported vLLM version's dialect, as recorded from that version's
source (tests/fixtures/vllm/dialects/): metric names, duplicate request ids, queue limits."""

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from mineru_gateway.sim import SimConfig, create_sim_app
from mineru_gateway.sim.config import add_sim_arguments, sim_config_from_args
from mineru_gateway.vllm_contract import (
    DIALECTS,
    LOAD_SERIES,
    SUPPORTED_VERSIONS,
    is_queue_full,
    parse_vllm_load,
)
from tests.support.servers import serve

DIALECT_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "dialects"
BASE = SimConfig(model_name="tiny", max_model_len=2048, kv_cache_tokens=65536, time_scale=0.01)
CHAT = "/v1/chat/completions"


def recorded(version: str) -> dict[str, Any]:
    return orjson.loads((DIALECT_FIXTURES / f"{version}.json").read_bytes())


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "\nText Recognition:"}], **fields}


@pytest.fixture
def sim_url(request: pytest.FixtureRequest) -> Iterator[str]:
    config = dataclasses.replace(BASE, **request.param)
    with serve(create_sim_app(config)) as url:
        yield url


def families(text: str) -> set[str]:
    """The vllm: metric families on a page, by the names their loggers register."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE vllm:"):
            _, _, name, kind = line.split(" ")
            if name.endswith("_created"):
                continue  # a counter's or histogram's creation time
            names.add(name.removesuffix("_total") if kind == "counter" else name)
    return names


def test_every_supported_version_has_a_recorded_dialect() -> None:
    assert set(SUPPORTED_VERSIONS) == {path.stem for path in DIALECT_FIXTURES.glob("*.json")}


@pytest.mark.parametrize(
    "sim_url", [{"vllm_version": v} for v in SUPPORTED_VERSIONS], indirect=True
)
async def test_metric_names_are_the_versions_own(sim_url: str) -> None:
    async with httpx.AsyncClient(base_url=sim_url) as client:
        version = (await client.get("/version")).json()["version"]
        text = (await client.get("/metrics")).text
    names = recorded(version)["metric_families"]["names"]
    exposed = families(text)
    # Every vllm: family the simulator shows is one that version registers...
    assert exposed <= set(names), exposed - set(names)
    # ...and the gateway finds its load in it.
    load = parse_vllm_load(text.encode())
    assert load is not None
    present = {name.decode() for name in LOAD_SERIES if name.decode() in text}
    dialect = DIALECTS[version]
    if "vllm:time_per_output_token_seconds" in dialect.extra_metrics:
        assert "vllm:time_per_output_token_seconds_sum" in present
    else:
        assert "vllm:time_per_output_token_seconds_sum" not in present
    assert ("vllm:admission_rejections" in exposed) == dialect.admission_metric


@pytest.mark.parametrize(
    "sim_url", [{"vllm_version": v} for v in SUPPORTED_VERSIONS], indirect=True
)
async def test_fcfs_ignores_a_non_zero_priority(sim_url: str) -> None:
    async with httpx.AsyncClient(base_url=sim_url) as client:
        version = (await client.get("/version")).json()["version"]
        response = await client.post(CHAT, json=chat(priority=5, max_tokens=4))
    assert recorded(version)["priority_under_fcfs"]["rejected"] is False
    assert response.status_code == 200, response.text


async def _twice(url: str, stream: bool) -> list[httpx.Response]:
    """Two requests with one X-Request-Id, the second sent while the first is running."""
    headers = {"X-Request-Id": "same-id"}
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:
        first = asyncio.create_task(
            client.post(CHAT, json=chat(max_tokens=200, stream=stream), headers=headers)
        )
        await asyncio.sleep(0.2)
        second = await client.post(CHAT, json=chat(max_tokens=4, stream=stream), headers=headers)
        return [await first, second]


@pytest.mark.parametrize("sim_url", [{"vllm_version": "0.11.0", "time_scale": 1.0}], indirect=True)
async def test_vllm_0_11_refuses_an_id_already_in_flight(sim_url: str) -> None:
    first, second = await _twice(sim_url, stream=False)
    assert first.status_code == 200
    expected = recorded("0.11.0")["duplicate_request_id"]
    assert second.status_code == expected["status"]
    body = orjson.dumps(expected["body"]).decode().replace("{id}", "same-id")
    assert second.json() == orjson.loads(body)


@pytest.mark.parametrize("sim_url", [{"vllm_version": "0.11.0", "time_scale": 1.0}], indirect=True)
async def test_vllm_0_11_refuses_a_streamed_duplicate_in_its_stream(sim_url: str) -> None:
    _, second = await _twice(sim_url, stream=True)
    assert second.status_code == 200
    events = [e for e in second.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert orjson.loads(events[0].removeprefix("data: "))["error"]["code"] == 400


@pytest.mark.parametrize(
    "sim_url",
    [{"vllm_version": v, "time_scale": 1.0} for v in ("0.23.0", "0.32.0")],
    indirect=True,
)
async def test_later_versions_serve_a_duplicate_id(sim_url: str) -> None:
    assert [r.status_code for r in await _twice(sim_url, stream=False)] == [200, 200]


@pytest.mark.parametrize(
    "sim_url", [{"vllm_version": "0.32.0", "max_num_queued_reqs": 0}], indirect=True
)
async def test_a_full_queue_answers_vllms_503(sim_url: str) -> None:
    async with httpx.AsyncClient(base_url=sim_url) as client:
        whole = await client.post(CHAT, json=chat(max_tokens=4))
        streamed = await client.post(CHAT, json=chat(max_tokens=4, stream=True))
        text = (await client.get("/metrics")).text
    expected = recorded("0.32.0")["queue_full"]
    for response in (whole, streamed):  # refused before a stream starts, as vLLM's preflight
        assert response.status_code == expected["status"]
        assert response.json() == expected["bodies"][0]
        assert is_queue_full(response.status_code, response.content)
    assert (
        'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 2.0'
        in (text)
    )


@pytest.mark.parametrize(
    "sim_url",
    [{"vllm_version": "0.32.0", "max_num_queued_reqs": 1, "time_scale": 1.0}],
    indirect=True,
)
async def test_the_queue_limit_counts_waiting_and_running(sim_url: str) -> None:
    async with httpx.AsyncClient(base_url=sim_url, timeout=20) as client:
        first = asyncio.create_task(client.post(CHAT, json=chat(max_tokens=200)))
        await asyncio.sleep(0.2)
        refused = await client.post(CHAT, json=chat(max_tokens=4))
        assert (await first).status_code == 200
        after = await client.post(CHAT, json=chat(max_tokens=4))
    assert refused.status_code == 503
    assert after.status_code == 200


def test_the_token_backlog_body_is_recorded_queue_full() -> None:
    body = orjson.dumps(recorded("0.32.0")["queue_full"]["bodies"][1])
    assert is_queue_full(503, body)
    assert not is_queue_full(500, body)
    assert not is_queue_full(503, b'{"error": {"message": "engine dead", "type": "x"}}')


@pytest.mark.parametrize(
    ("version", "field", "value"),
    [
        ("0.23.0", "max_num_queued_reqs", 4),
        ("0.11.0", "max_num_queued_tokens", 4),
        ("0.11.0", "shutdown_timeout", 5.0),
    ],
)
def test_flags_a_version_lacks_are_refused(version: str, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"vLLM {version} has no"):
        SimConfig(vllm_version=version, **{field: value})  # type: ignore[arg-type]


def test_unknown_versions_are_refused() -> None:
    with pytest.raises(ValueError, match="vllm_version must be one of"):
        SimConfig(vllm_version="0.9.0")


def test_the_cli_takes_a_version_and_queue_limits() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    ns = parser.parse_args(["--vllm-version", "0.11.0"])
    assert sim_config_from_args(ns).dialect.refuses_duplicate_id
    ns = parser.parse_args(["--max-num-queued-reqs", "0"])
    assert sim_config_from_args(ns).max_num_queued_reqs == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--vllm-version", "0.10.0"])
