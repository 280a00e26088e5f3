"""The relay against a scriptable worker: pass-through, limits, errors, timeouts, cancellation."""

from __future__ import annotations

import base64
import hashlib
import os
import threading

import httpx
import orjson
import pytest

from tests.conftest import StartGateway
from tests.support.servers import ServerThread, free_port, wait_until
from tests.support.workers import DroppingWorker, Script, scripted_worker

CHAT = "/v1/chat/completions"


def chat_body(**extra: object) -> dict[str, object]:
    return {"model": "echo-model", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_body_reaches_worker_byte_for_byte_with_unknown_fields(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _script, worker = scripted
    gateway = start_gateway([worker])
    body = orjson.dumps(
        chat_body(
            vllm_xargs={"no_repeat_ngram_size": 100},
            skip_special_tokens=False,
            top_k=1,
            repetition_penalty=1.05,
            priority=0,
            temperature=0.0,
        )
    )
    response = httpx.post(
        gateway + CHAT, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200
    assert response.json()["sha256"] == hashlib.sha256(body).hexdigest()
    assert response.json()["received"]["vllm_xargs"] == {"no_repeat_ngram_size": 100}


@pytest.mark.parametrize(
    ("pass_priority", "sent", "forwarded"), [(False, 3, None), (True, 3, 3), (True, None, None)]
)
def test_priority_reaches_workers_only_when_they_schedule_by_it(
    scripted: tuple[Script, str],
    start_gateway: StartGateway,
    pass_priority: bool,
    sent: int | None,
    forwarded: int | None,
) -> None:
    """vLLM orders by `priority` only under `--scheduling-policy priority` (its default fcfs
    ignores the field): the gateway honours it itself and removes it, unless told the workers
    schedule by it."""
    _script, worker = scripted
    gateway = start_gateway([worker], pass_priority=pass_priority)
    extra = {} if sent is None else {"priority": sent}
    response = httpx.post(gateway + CHAT, json=chat_body(top_k=1, **extra))
    assert response.status_code == 200
    received = response.json()["received"]
    assert received.get("priority") == forwarded
    assert received["top_k"] == 1


def test_ten_megabyte_image_body_passes(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    image = base64.b64encode(os.urandom(7_600_000)).decode()  # ~10 MB once base64-encoded
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": "\nLayout Detection:"},
    ]
    body = orjson.dumps({"model": "echo-model", "messages": [{"role": "user", "content": content}]})
    assert len(body) > 10_000_000
    response = httpx.post(gateway + CHAT, content=body, timeout=30)
    assert response.status_code == 200
    assert script.seen[-1]["size"] == len(body)
    assert script.seen[-1]["sha256"] == hashlib.sha256(body).hexdigest()


def test_body_over_the_limit_is_413(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], max_body_bytes=1000)
    response = httpx.post(gateway + CHAT, json=chat_body(pad="x" * 2000))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert script.seen == []


def test_request_id_is_kept_or_made_and_forwarded(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    given = httpx.post(gateway + CHAT, json=chat_body(), headers={"x-request-id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    # The worker gets the client's id made unique per attempt (vLLM 0.11 refuses a duplicate).
    first = script.seen[-1]["headers"]["x-request-id"]
    assert first.startswith("abc-123-")
    again = httpx.post(gateway + CHAT, json=chat_body(), headers={"x-request-id": "abc-123"})
    assert again.headers["x-request-id"] == "abc-123"
    second = script.seen[-1]["headers"]["x-request-id"]
    assert second.startswith("abc-123-") and second != first
    made = httpx.post(gateway + CHAT, json=chat_body())
    assert len(made.headers["x-request-id"]) == 32
    assert script.seen[-1]["headers"]["x-request-id"].startswith(made.headers["x-request-id"])


def test_authorization_is_forwarded(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    httpx.post(gateway + CHAT, json=chat_body(), headers={"authorization": "Bearer k"})
    assert script.seen[-1]["headers"]["authorization"] == "Bearer k"


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"model": "echo-model"}', 400, "messages"),
        (b'{"model": "echo-model", "messages": []}', 400, "messages"),
        (b'{"model": "echo-model", "messages": "x"}', 400, "messages"),
        (b'{"model": "echo-model", "messages": [1]}', 400, "messages.0"),
        (b'{"model": 7, "messages": [{"role": "user"}]}', 400, "model"),
        (b'{"messages": [{"role": "user"}], "stream": "yes"}', 400, "stream"),
        (b'{"model": "nope", "messages": [{"role": "user"}]}', 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(
    scripted: tuple[Script, str],
    start_gateway: StartGateway,
    content: bytes,
    status: int,
    param: str | None,
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    response = httpx.post(gateway + CHAT, content=content)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert script.seen == []


def test_completions_requires_a_prompt(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _script, worker = scripted
    gateway = start_gateway([worker])
    assert httpx.post(gateway + "/v1/completions", json={"model": "echo-model"}).status_code == 400
    ok = httpx.post(gateway + "/v1/completions", json={"model": "echo-model", "prompt": "x"})
    assert ok.status_code == 200


def test_worker_error_status_and_body_pass_through(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    script.mode, script.status = "status", 422
    response = httpx.post(gateway + CHAT, json=chat_body())
    assert response.status_code == 422
    assert response.json()["error"]["message"] == "scripted"
    # A whole answer is sized, not chunked; the gateway's own errors too.
    assert response.headers["content-length"] == str(len(response.content))
    assert "transfer-encoding" not in response.headers
    refused = httpx.post(gateway + CHAT, content=b"not json")
    assert refused.status_code == 400
    assert refused.headers["content-length"] == str(len(refused.content))


def test_no_healthy_worker_is_503(start_gateway: StartGateway) -> None:
    gateway = start_gateway([f"http://127.0.0.1:{free_port()}"])
    response = httpx.post(gateway + CHAT, json=chat_body())
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_healthy_worker"
    assert httpx.get(gateway + "/ready").status_code == 503
    assert httpx.get(gateway + "/health").status_code == 200
    assert httpx.get(gateway + "/v1/models").status_code == 503


def test_worker_that_dies_is_skipped_without_losing_requests(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    doomed = ServerThread(scripted_worker(Script()))
    doomed_url = doomed.start()
    # A long health interval: only the relay's own connect failure can find out it is gone;
    # round robin, so that requests one at a time go to both workers (`queue` keeps an idle
    # fleet's requests on the worker it holds a connection to).
    gateway = start_gateway(
        [worker, doomed_url], health_interval_s=60, routing_policy="round_robin"
    )
    doomed.stop()
    for _ in range(20):
        assert httpx.post(gateway + CHAT, json=chat_body()).status_code == 200
    assert len(script.seen) == 20
    states = {w["url"]: w["state"] for w in httpx.get(gateway + "/v1/workers").json()["workers"]}
    assert states == {worker: "healthy", doomed_url: "unhealthy"}


def test_first_byte_timeout_is_504_and_worker_request_is_cancelled(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], first_byte_timeout_s=0.3)
    script.mode = "hang"
    response = httpx.post(gateway + CHAT, json=chat_body())
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout"
    wait_until(lambda: script.cancelled == 1)


def test_silent_stream_ends_with_an_sse_error_event(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker], idle_stream_timeout_s=0.3)
    script.mode = "stream_then_hang"
    with httpx.stream("POST", gateway + CHAT, json=chat_body(stream=True)) as response:
        events = [line for line in response.iter_lines() if line]
    assert response.status_code == 200
    assert events[0].startswith('data: {"choices"')
    assert orjson.loads(events[1].removeprefix("data: "))["error"]["code"] == "upstream_timeout"
    assert events[-1] == "data: [DONE]"
    wait_until(lambda: script.cancelled == 1)


def test_worker_dying_mid_stream_ends_with_an_sse_error_event(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    script.mode = "stream_then_die"
    with httpx.stream("POST", gateway + CHAT, json=chat_body(stream=True)) as response:
        events = [line for line in response.iter_lines() if line]
    assert orjson.loads(events[1].removeprefix("data: "))["error"]["type"] == "upstream_error"
    assert events[-1] == "data: [DONE]"


def test_client_leaving_a_non_streaming_request_cancels_the_worker_request(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    script, worker = scripted
    gateway = start_gateway([worker])
    script.mode = "hang"

    def leave_early() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway + CHAT, json=chat_body(), timeout=httpx.Timeout(5, read=0.3))

    thread = threading.Thread(target=leave_early)
    thread.start()
    thread.join()
    wait_until(lambda: script.cancelled == 1)
    workers = httpx.get(gateway + "/v1/workers").json()["workers"]
    wait_until(lambda: httpx.get(gateway + "/v1/workers").json()["workers"][0]["in_flight"] == 0)
    assert workers[0]["url"] == worker


def test_unknown_route_is_an_openai_404(
    scripted: tuple[Script, str], start_gateway: StartGateway
) -> None:
    _, worker = scripted
    gateway = start_gateway([worker])
    response = httpx.get(gateway + "/v1/nope")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert httpx.get(gateway + CHAT).status_code == 405


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_dropped_before_any_answer_is_retried_on_another_worker(
    scripted: tuple[Script, str], start_gateway: StartGateway, stream: bool
) -> None:
    script, worker = scripted
    dropping = DroppingWorker()
    try:
        gateway = start_gateway([dropping.start(), worker], routing_policy="round_robin")
        for _ in range(6):
            response = httpx.post(gateway + CHAT, json=chat_body(stream=stream))
            assert response.status_code == 200
        assert len(script.seen) == 6
        assert dropping.dropped >= 1
        metrics = httpx.get(gateway + "/metrics").text
        assert 'mineru_gateway_retries_total{reason="upstream_disconnect"}' in metrics
    finally:
        dropping.stop()


def test_retries_are_bounded(start_gateway: StartGateway) -> None:
    workers = [DroppingWorker() for _ in range(3)]
    try:
        gateway = start_gateway([w.start() for w in workers], max_retries=1, eject_after=100)
        response = httpx.post(gateway + CHAT, json=chat_body())
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_error"
        assert sum(w.dropped for w in workers) == 2
    finally:
        for worker in workers:
            worker.stop()


def test_an_exchange_records_each_field_under_its_own_name() -> None:
    """`Exchange.record` builds the record positionally (for speed): every field must land
    where its name says, with values that tell each field from the others."""
    from mineru_gateway.api.relay import Exchange
    from mineru_gateway.api.requests import parse_request

    async def send(message: object) -> None:
        raise AssertionError("nothing is sent")

    exchange = Exchange(send, "rid", "chat")
    clock, answer = exchange.clock, exchange.answer
    clock.received, clock.first_chunk, clock.finished = 1.0, 2.0, 3.0
    exchange.worker, exchange.attempts, answer.status = "http://w:1", 2, 201
    answer.streaming, clock.tokens, exchange.tenant = True, 7, "team"
    exchange.priority, exchange.queued_s = 4, 0.5
    clock.usage = {"prompt_tokens": 11}  # no completion count: the stream's is taken
    request = parse_request("chat", orjson.dumps(chat_body(stream=True)))
    record = exchange.record(request, "ok")
    assert (record.request_id, record.endpoint, record.outcome) == ("rid", "chat", "ok")
    assert (record.received, record.first_chunk, record.finished) == (1.0, 2.0, 3.0)
    assert record.ended > 3.0  # now (perf_counter), not one of the exchange's times
    assert (record.model, record.stream, record.cost) == ("echo-model", True, request.cost)
    assert (record.worker, record.attempts, record.status) == ("http://w:1", 2, 201)
    assert (record.streaming, record.completion_tokens, record.prompt_tokens) == (True, 7, 11)
    assert (record.tenant, record.priority, record.queued_s) == ("team", 4, 0.5)
    none = Exchange(send, "r2", "completions").record(None, "invalid_request")
    assert (none.model, none.stream, none.cost, none.prompt_tokens) == (None, None, None, None)


def test_a_streams_usage_is_read_from_its_last_chunks_and_tokens_from_every_chunk() -> None:
    """The usage of a stream comes from its last usage event (vLLM's, before [DONE]), whether
    each event came as a chunk of its own or several were joined into one; the stream's own
    count stands when no usage came."""
    from mineru_gateway.api.relay import Exchange
    from mineru_gateway.api.requests import parse_request

    async def send(message: object) -> None:
        raise AssertionError("nothing is sent")

    def event(payload: dict[str, object]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def token(text: str, usage: dict[str, int] | None = None) -> bytes:
        delta = {"choices": [{"index": 0, "delta": {"content": text}}]}
        return event(delta | ({"usage": usage} if usage else {}))

    done = b"data: [DONE]\n\n"
    final = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    request = parse_request("chat", orjson.dumps(chat_body(stream=True)))

    def record(*chunks: bytes) -> tuple[int, int | None]:
        exchange = Exchange(send, "rid", "chat")
        exchange.answer.streaming = True
        for chunk in chunks:
            exchange.clock.note(chunk)
        kept = exchange.record(request, "ok")
        return kept.completion_tokens, kept.prompt_tokens

    assert record(token("a"), token("b"), token("c"), final, done) == (3, 5)
    assert record(token("a") + token("b") + token("c") + final + done) == (3, 5)
    assert record(token("a"), token("b"), final + done) == (3, 5)
    # Usage with every chunk (vLLM's continuous_usage_stats): the last one is the answer's.
    running = [token(t, {"prompt_tokens": 5, "completion_tokens": n}) for n, t in enumerate("ab")]
    assert record(*running, final, done) == (3, 5)
    assert record(*running) == (1, 5)  # cut short: what the last event said
    # No usage asked for: the tokens counted in the stream.
    assert record(token("a"), token("b"), done) == (2, None)
