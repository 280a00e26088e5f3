"""The simulator's HTTP protocol against a real uvicorn server, compared with recorded vLLM 0.32."""

import base64
import dataclasses
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.sim import SimConfig, create_sim_app
from mineru_gateway.vllm_contract import LOAD_PATH
from tests.support.servers import serve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
CONFIG = SimConfig(model_name="tiny", max_model_len=2048, kv_cache_tokens=65536, time_scale=0.01)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
def url() -> Iterator[str]:
    with serve(create_sim_app(CONFIG)) as base_url:
        yield base_url


@pytest.fixture
async def client(url: str) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=20.0) as http:
        yield http


def fixture_json(name: str) -> Any:
    return orjson.loads((FIXTURES / name).read_bytes())


def sse_payloads(text: str) -> list[Any]:
    """The JSON of each `data:` event; checks the stream ends with `[DONE]`."""
    events = [block for block in text.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    return [orjson.loads(event[len("data: ") :]) for event in events[:-1]]


def shape(value: Any) -> Any:
    """Keys all the way down; scalar values and types are ignored."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def chat_body(**fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hello there\nText Recognition:"}]
    return {"model": "tiny", "messages": messages, **fields}


def forced(tokens: int) -> dict[str, Any]:
    return {"vllm_xargs": {"sim_output_tokens": tokens}}


async def test_chat_stream_has_vllm_chunks(client: httpx.AsyncClient) -> None:
    body = chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True})
    response = await client.post(CHAT, json=body | forced(50))
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    ours = sse_payloads(response.text)
    theirs = sse_payloads((FIXTURES / "chat_stream.sse").read_text())
    assert len(ours) == len(theirs) == 8
    assert [shape(chunk) for chunk in ours] == [shape(chunk) for chunk in theirs]
    assert ours[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ours[-2]["choices"][0]["finish_reason"] == "length"
    assert ours[-1]["usage"]["completion_tokens"] == 6
    assert len({chunk["id"] for chunk in ours}) == 1
    assert ours[0]["id"].startswith("chatcmpl-")


async def test_chat_stream_without_usage_ends_with_the_finish_chunk(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(CHAT, json=chat_body(max_tokens=100, stream=True) | forced(3))
    chunks = sse_payloads(response.text)
    assert len(chunks) == 1 + 3
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in last and last["system_fingerprint"].startswith("vllm-")


async def test_chat_nonstream_has_the_vllm_body(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat_body(max_tokens=8) | forced(50))
    assert response.headers["content-type"] == "application/json"
    ours = response.json()
    assert shape(ours) == shape(fixture_json("chat_nonstream.json"))
    assert ours["choices"][0]["finish_reason"] == "length"
    usage = ours["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8


async def test_completions_stream_and_body_have_vllm_shapes(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4, "ignore_eos": True}
    streamed = await client.post(COMPLETIONS, json=body | {"stream": True})
    ours = sse_payloads(streamed.text)
    theirs = sse_payloads((FIXTURES / "completions_stream.sse").read_text())
    assert [shape(chunk) for chunk in ours] == [shape(chunk) for chunk in theirs]
    whole = (await client.post(COMPLETIONS, json=body)).json()
    assert shape(whole) == shape(fixture_json("completions_nonstream.json"))
    assert whole["choices"][0]["text"] == "".join(c["choices"][0]["text"] for c in ours)
    assert whole["id"].startswith("cmpl-")


async def test_completions_usage_chunk(client: httpx.AsyncClient) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True, "stream": True}
    response = await client.post(
        COMPLETIONS, json=body | {"stream_options": {"include_usage": True}}
    )
    chunks = sse_payloads(response.text)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["object"] == "text_completion"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}


@pytest.mark.parametrize(
    ("fields", "tokens", "reason"),
    [
        (forced(5) | {"max_tokens": 100}, 5, "stop"),
        (forced(5) | {"max_tokens": 5}, 5, "length"),
        (forced(500) | {"max_tokens": 20}, 20, "length"),
        (forced(5) | {"max_tokens": 100, "min_tokens": 30}, 30, "stop"),
        ({"max_tokens": 40, "ignore_eos": True}, 40, "length"),
        ({"max_completion_tokens": 7, "max_tokens": 900, "ignore_eos": True}, 7, "length"),
    ],
)
async def test_answer_length_and_finish_reason(
    client: httpx.AsyncClient, fields: dict[str, Any], tokens: int, reason: str
) -> None:
    streamed = await client.post(CHAT, json=chat_body(stream=True, **fields))
    chunks = sse_payloads(streamed.text)
    assert len(chunks) - 1 == tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == reason
    whole = (await client.post(CHAT, json=chat_body(**fields))).json()
    assert whole["usage"]["completion_tokens"] == tokens
    assert whole["choices"][0]["finish_reason"] == reason
    streamed_text = "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks)
    assert whole["choices"][0]["message"]["content"] == streamed_text


async def test_same_request_same_answer(client: httpx.AsyncClient) -> None:
    first = (await client.post(CHAT, json=chat_body())).json()
    again = (await client.post(CHAT, json=chat_body())).json()
    other = chat_body(messages=[{"role": "user", "content": "Other words\nText Recognition:"}])
    assert first["usage"] == again["usage"]
    assert first["choices"][0]["finish_reason"] == "stop"
    assert (await client.post(CHAT, json=other)).status_code == 200


def png_data_url(width: int, height: int) -> str:
    ihdr = struct.pack(">II5B", width, height, 8, 2, 0, 0, 0)
    image = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\0" * 4000
    return "data:image/png;base64," + base64.b64encode(image).decode()


async def test_a_mineru_layout_request(client: httpx.AsyncClient) -> None:
    """What mineru-vl-utils' http client sends (docs/mineru-client.md)."""
    user = [
        {"type": "image_url", "image_url": {"url": png_data_url(1036, 1036)}},
        {"type": "text", "text": "\nLayout Detection:"},
    ]
    body = {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": user},
        ],
        "temperature": 0.0,
        "top_p": 0.01,
        "top_k": 1,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "skip_special_tokens": False,
        "vllm_xargs": {"no_repeat_ngram_size": 100},
        "priority": 0,
    }
    response = await client.post(CHAT, json=body, headers={"Authorization": "Bearer x"})
    assert response.status_code == 200
    answer = response.json()
    assert 1371 < answer["usage"]["prompt_tokens"] < 1400
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["message"]["content"].startswith("<|box_start|>")
    assert answer["usage"]["completion_tokens"] >= 40


@pytest.mark.parametrize(
    ("body", "fixture"),
    [
        ({"model": "nope", "messages": []}, "error_404_unknown_model.json"),
        ({"model": "tiny", "messages": "x"}, "error_400_validation.json"),
        (chat_body(max_tokens=5000), "error_400_too_long.json"),
    ],
)
async def test_errors_match_vllm_exactly(
    client: httpx.AsyncClient, body: dict[str, Any], fixture: str
) -> None:
    response = await client.post(CHAT, json=body)
    expected = fixture_json(fixture)
    assert response.status_code == expected["error"]["code"]
    assert response.json() == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "body.messages"),
        (chat_body(max_tokens="many"), "body.max_tokens"),
        (chat_body(stream="yes"), "body.stream"),
        (chat_body(messages=[{"content": "no role"}]), "body.messages.0.role"),
        (chat_body(messages=[{"role": "user", "content": 5}]), "body.messages.0.content"),
        (chat_body(messages=["hi"]), "body.messages.0"),
        (chat_body(messages=[{"role": "user", "content": [5]}]), "body.messages.0.content.0"),
        (
            chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "body.messages.0.content.0.image_url.url",
        ),
        (
            chat_body(stream=True, stream_options={"include_usage": 1}),
            "body.stream_options.include_usage",
        ),
        (chat_body(stream_options={"include_usage": True}), "body"),
        (chat_body(min_tokens=-1), None),
        (chat_body(max_tokens=2040), "max_tokens"),
        (chat_body(max_tokens=0), "max_tokens"),
        (chat_body(max_tokens=5, min_tokens=9), None),
        (chat_body(n=2), "n"),
        (chat_body(messages=[{"role": "user", "content": "x" * 9000}]), "prompt"),
    ],
)
async def test_bad_requests_get_400(
    client: httpx.AsyncClient, body: dict[str, Any], param: str | None
) -> None:
    response = await client.post(CHAT, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (400, param)
    assert error["type"] in ("BadRequestError", "Bad Request")


async def test_lenient_where_vllm_is(client: httpx.AsyncClient) -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    messages = [{"role": "user", "content": [audio, {"type": "text", "text": "hi"}]}]
    body = {"messages": messages, "max_tokens": 3.0, "ignore_eos": True}
    answer = (await client.post(CHAT, json=body)).json()
    assert answer["usage"]["completion_tokens"] == 3
    batch_of_one = {"prompt": ["hello"], "max_tokens": 2, "ignore_eos": True}
    answer = (await client.post(COMPLETIONS, json=batch_of_one)).json()
    assert answer["usage"] == answer["usage"] | {"prompt_tokens": 2, "completion_tokens": 2}


async def test_invalid_json_and_bad_prompts(client: httpx.AsyncClient) -> None:
    assert (await client.post(CHAT, content=b"{nope")).status_code == 400
    assert (await client.post(CHAT, json=[1, 2])).status_code == 400
    assert (await client.post(COMPLETIONS, json={"model": "tiny"})).status_code == 400
    assert (await client.post(COMPLETIONS, json={"prompt": ["a", "b"]})).status_code == 400


async def test_request_id_header_is_honoured_and_echoed(client: httpx.AsyncClient) -> None:
    headers = {"X-Request-Id": "trace-42"}
    response = await client.post(CHAT, json=chat_body(), headers=headers)
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "chatcmpl-trace-42"
    streamed = await client.post(
        COMPLETIONS, json={"prompt": "hi", "stream": True}, headers=headers
    )
    assert streamed.headers["x-request-id"] == "trace-42"
    assert all(chunk["id"] == "cmpl-trace-42" for chunk in sse_payloads(streamed.text))
    from_body = await client.post(CHAT, json=chat_body(request_id="body-id"))
    assert from_body.json()["id"] == "chatcmpl-body-id"
    assert "x-request-id" not in from_body.headers


async def test_models_health_and_version(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert shape(models) == shape(fixture_json("models.json"))
    assert [model["id"] for model in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 2048
    health = await client.get("/health")
    assert (health.status_code, health.content) == (200, b"")
    assert (await client.get("/version")).json() == fixture_json("version.json")
    assert (await client.get("/load")).status_code == 404


def metric_families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample_name: str, **labels: str) -> float:
    for family in families.values():
        for sample in family.samples:
            if sample.name == sample_name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise KeyError(sample_name)


def sample_names(text: str) -> set[str]:
    return {sample.name for family in metric_families(text).values() for sample in family.samples}


async def test_a_read_filtered_by_name_answers_the_series_vllm_answers(
    client: httpx.AsyncClient,
) -> None:
    """vLLM applies `name[]` on `/metrics/` (prometheus_client's ASGI app) and ignores it on
    `/metrics` (prometheus-fastapi-instrumentator's route): fixtures/vllm/metrics_filtered.txt
    is the gateway's own load read of a real vLLM."""
    await client.post(CHAT, json=chat_body(max_tokens=5, ignore_eos=True))
    filtered = await client.get(LOAD_PATH)
    assert filtered.headers["content-type"].startswith("text/plain")
    recorded = (FIXTURES / "metrics_filtered.txt").read_text()
    assert sample_names(filtered.text) == sample_names(recorded)
    assert value(metric_families(filtered.text), "vllm:inter_token_latency_seconds_count") == 4
    ignored = await client.get("/metrics", params={"name[]": "vllm:num_requests_waiting"})
    assert sample_names(ignored.text) > sample_names(filtered.text)
    unfiltered = await client.get("/metrics/")
    assert sample_names(unfiltered.text) == sample_names(ignored.text)


async def test_with_several_api_servers_a_filtered_read_is_empty() -> None:
    """vLLM's multiprocess registry (`--api-server-count` above 1) registers no names, so
    prometheus_client's filter finds none of them; the whole page is still there."""
    config = dataclasses.replace(CONFIG, api_server_count=2)
    with serve(create_sim_app(config)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20.0) as http:
            filtered = await http.get(LOAD_PATH)
            assert filtered.status_code == 200 and filtered.content == b""
            assert "vllm:num_requests_waiting" in (await http.get("/metrics")).text


REQUIRED_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
}


async def test_metrics_use_vllm_names_labels_and_buckets(client: httpx.AsyncClient) -> None:
    answer = (await client.post(CHAT, json=chat_body(max_tokens=9, ignore_eos=True))).json()
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    ours = metric_families(response.text)
    theirs = metric_families((FIXTURES / "metrics.txt").read_text())
    vllm_names = {name for name in ours if name.startswith("vllm:")}
    assert vllm_names >= REQUIRED_FAMILIES
    assert vllm_names <= set(theirs)
    for name in vllm_names:
        assert ours[name].type == theirs[name].type, name
    labels = {"engine": "0", "model_name": "tiny"}
    assert value(ours, "vllm:generation_tokens_total", **labels) == 9
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert value(ours, "vllm:prompt_tokens_total", **labels) == prompt_tokens
    assert value(ours, "vllm:request_success_total", finished_reason="length") == 1
    assert value(ours, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(ours, "vllm:inter_token_latency_seconds_count") == 8
    assert value(ours, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(ours, "vllm:num_requests_running", **labels) == 0

    def bounds(families: dict[str, Any], name: str) -> list[str]:
        return [s.labels["le"] for s in families[name].samples if s.name.endswith("_bucket")]

    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert bounds(ours, name) == bounds(theirs, name)


async def test_sim_state_and_control(url: str, client: httpx.AsyncClient) -> None:
    state = (await client.get("/sim/state")).json()
    assert (state["running"], state["waiting"], state["aborted"]) == (0, 0, 0)
    changed = await client.post("/sim/control", json={"speed": 0.5, "healthy": False})
    assert changed.json()["speed"] == 0.5
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/sim/control", json={"speed": -1})).status_code == 400
    assert (await client.post("/sim/control", json={"healthy": "no"})).status_code == 400
    assert (await client.post("/sim/control", content=b"[")).status_code == 400
    assert (await client.post("/sim/control", json=[1])).status_code == 400


async def test_load_endpoint_with_server_load_tracking() -> None:
    config = SimConfig(model_name="tiny", time_scale=0.01, enable_server_load_tracking=True)
    with serve(create_sim_app(config)) as base_url:
        async with httpx.AsyncClient(base_url=base_url) as http:
            assert (await http.get("/load")).json() == {"server_load": 0}
