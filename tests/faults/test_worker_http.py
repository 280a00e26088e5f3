"""Workers that answer with broken HTTP, against the gateway's relay: interim answers, statuses
no client may be given, streams cut inside an event, and the retry rule (relay.py's docstring):
another worker is tried only while nothing of the answer has reached the client.

Each worker here is a `RawWorker` writing raw bytes on 127.0.0.1, beside a good one when the
test is about retries; the gateway runs in this process (`gateway_thread`).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.api.relay import MAX_HELD_EVENT
from tests.faults.conftest import StartGatewayThread, StartRawWorker
from tests.faults.harness import (
    CHAT,
    CHAT_ANSWER,
    OK,
    SSE_ANSWER,
    STREAM_HEAD,
    Handler,
    Probe,
    RawRequest,
    Writer,
    answer,
    chat,
    chunk,
    outcome,
    send_and_close,
    serve_ok,
)

pytestmark = pytest.mark.unit

EVENT = b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
# The head of a chunk that would carry a whole event, and only the first part of that event.
CUT_EVENT = b"%x\r\n" % len(EVENT) + EVENT[:25]
CUT_SECOND = send_and_close(STREAM_HEAD + chunk(EVENT), CUT_EVENT)  # one event, then half one
HINTS = b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


async def metric_total(probe: Probe, name: str, **labels: str) -> float:
    """The sum of the gateway's `name` samples that have `labels`."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(probe.url + "/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def retries(probe: Probe, reason: str | None) -> float:
    if reason is None:
        return 0.0
    return await metric_total(probe, "mineru_gateway_retries_total", reason=reason)


async def outcomes(probe: Probe, stream: bool, count: int) -> list[str]:
    """What `count` chat requests in turn got."""
    async with httpx.AsyncClient(timeout=30) as client:
        return [await outcome(client, probe.url, chat(stream=stream)) for _ in range(count)]


def sse_data(body: bytes) -> list[str]:
    """The data of each event of an SSE body, by the rules of the SSE standard (a blank line
    ends an event; its `data:` lines are joined)."""
    events, data = [], []
    for line in body.decode().splitlines():
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))
    return events


# -- interim answers and statuses no client may be given --------------------------------------


async def interim_then_ok(
    request: RawRequest, reader: asyncio.StreamReader, writer: Writer
) -> bool:
    """Interim answers (each a moment apart), then a good answer."""
    for interim in (CONTINUE, HINTS, CONTINUE + HINTS):
        writer.write(interim)
        await writer.drain()
        await asyncio.sleep(0.02)
    return await serve_ok(request, reader, writer)


@pytest.mark.parametrize("stream", [False, True])
async def test_interim_answers_are_skipped_for_the_final_one(
    stream: bool, raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    worker, url = await raw_worker(interim_then_ok)
    probe = await gateway_thread([url])
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(probe.url + CHAT, json=chat(stream=stream))
    assert response.status_code == 200
    assert response.content == (SSE_ANSWER if stream else CHAT_ANSWER)
    assert worker.completions == 1


def odd_status(status: int) -> Handler:
    return send_and_close(b"HTTP/1.1 %03d Odd\r\ncontent-length: 2\r\n\r\n{}" % status)


async def test_a_status_no_client_may_be_given_is_a_502_and_a_failure_of_the_worker(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    """A 101 would hand the client's connection to nobody, a 600 has no status line: each is
    the gateway's own 502 in OpenAI's shape, and counts against the worker's health (with one
    worker, there is no other to try)."""
    worker, url = await raw_worker(serve_ok)
    statuses = [101, 600, 999, 0]
    probe = await gateway_thread([url], eject_after=2 * len(statuses), health_interval_s=60)
    got = []
    for status in statuses:
        worker.on_completion = odd_status(status)
        got += await outcomes(probe, stream=False, count=1)
        got += await outcomes(probe, stream=True, count=1)
    assert got == ["error:502:bad_upstream_status"] * 2 * len(statuses)
    assert worker.completions == 2 * len(statuses)
    ejections = "mineru_gateway_worker_ejections_total"
    assert await metric_total(probe, ejections, worker=url, reason="bad_upstream_status") == 1


# -- a stream cut inside an event -------------------------------------------------------------


async def test_a_stream_cut_inside_an_event_ends_on_an_event_boundary(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    """The half-written event never reaches the client: every event it gets is JSON or
    [DONE], the error event last before [DONE]; the OpenAI SDK raises the gateway's error."""
    worker, url = await raw_worker(CUT_SECOND)
    probe = await gateway_thread([url])
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(probe.url + CHAT, json=chat(stream=True))
    events = sse_data(response.content)
    assert events[-1] == "[DONE]"
    payloads = [orjson.loads(event) for event in events[:-1]]  # each one JSON
    assert payloads[0]["id"] == "chatcmpl-1"
    assert [payload.get("error", {}).get("code") for payload in payloads] == [
        None,
        "upstream_error",
    ]
    sdk = openai.AsyncOpenAI(base_url=probe.url + "/v1", api_key="unused", max_retries=0)
    async with sdk:
        stream = await sdk.chat.completions.create(
            model="raw-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        deltas = []
        with pytest.raises(openai.APIError) as info:
            async for part in stream:
                deltas.append(part.choices[0].delta.content)
    assert deltas == ["a"]
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "upstream_error"
    assert worker.completions == 2


async def test_an_event_that_never_ends_is_not_held_for_ever(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    """Past MAX_HELD_EVENT the start of an event goes out as it is (and the relay holds no
    more of it than that); if the worker then fails, the error event still comes after a blank
    line, as an event of its own."""
    start = b"data: " + b"x" * (MAX_HELD_EVENT + 512 * 1024)
    _, url = await raw_worker(send_and_close(STREAM_HEAD + chunk(start), b""))
    probe = await gateway_thread([url])
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(probe.url + CHAT, json=chat(stream=True))
    events = sse_data(response.content)
    assert len(events[0]) > MAX_HELD_EVENT - len("data: ") and events[0].strip("x") == ""
    assert orjson.loads(events[1])["error"]["code"] == "upstream_error"
    assert events[2:] == ["[DONE]"]


async def events_cut_everywhere(
    request: RawRequest, reader: asyncio.StreamReader, writer: Writer
) -> bool:
    """A stream whose events (LF and CRLF lines) come cut at every place in turn, a moment
    apart: each cut after the first byte of an event, inside it, and inside its blank line."""
    writer.write(STREAM_HEAD)
    for index, whole in enumerate(CUT_STREAM):
        cut = 1 + index % (len(whole) - 1)
        for piece in (whole[:cut], whole[cut:]):
            writer.write(chunk(piece))
            await writer.drain()
            await asyncio.sleep(0.005)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


CUT_STREAM = [
    *(b'data: {"n":%d}\n\n' % n for n in range(12)),
    *(b'data: {"n":%d}\r\n\r\n' % n for n in range(12, 26)),
    b"data: [DONE]\n\n",
]


async def test_events_cut_across_chunks_reach_the_client_whole_and_in_order(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    _, url = await raw_worker(events_cut_everywhere)
    probe = await gateway_thread([url])
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(probe.url + CHAT, json=chat(stream=True))
    assert response.content == b"".join(CUT_STREAM)


# -- the retry rule ----------------------------------------------------------------------------

JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
DROPPED = send_and_close(JSON_HEAD + b"content-length: 99\r\n\r\n")
BAD_BODY = send_and_close(JSON_HEAD + b"transfer-encoding: chunked\r\n\r\n", b"zz\r\nno\r\n")
CUT_FIRST = send_and_close(STREAM_HEAD, CUT_EVENT)  # the head, then half an event
VLLM_400 = orjson.dumps(
    {"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}}
)

# What the worker does, whether the request streams, the retry reason it should be counted
# under (None: not retried), and what each client may get.
DISCONNECT = "upstream_disconnect"
RULE: dict[str, tuple[Handler, bool, str | None, set[str]]] = {
    "dropped after its head (whole)": (DROPPED, False, DISCONNECT, {OK}),
    "dropped after its head (stream)": (send_and_close(STREAM_HEAD), True, DISCONNECT, {OK}),
    "malformed after its head (whole)": (BAD_BODY, False, DISCONNECT, {OK}),
    "cut in its first event (stream)": (CUT_FIRST, True, DISCONNECT, {OK}),
    "bad status": (odd_status(600), False, "bad_upstream_status", {OK}),
    "broken after its first event": (CUT_SECOND, True, None, {OK, "stream_error:upstream_error"}),
    "a 4xx (whole)": (answer(400, VLLM_400), False, None, {OK, "error:400:400"}),
    "a 4xx (stream)": (answer(400, VLLM_400), True, None, {OK, "error:400:400"}),
}


async def test_another_worker_is_tried_only_while_nothing_reached_the_client(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    """Each case of RULE in turn, from one worker beside a good one. Retried: every client gets
    its answer, each request the bad worker broke went on to the good one. Not retried: the
    client gets what the worker did (an error event after the stream's start, a worker's 4xx as
    it came), and no request reached both workers."""
    bad, bad_url = await raw_worker(serve_ok)
    good, good_url = await raw_worker(serve_ok)
    probe = await gateway_thread(
        [bad_url, good_url], routing_policy="round_robin", eject_after=10**6, max_retries=1
    )
    wrong = {}
    for case, (handler, stream, reason, allowed) in RULE.items():
        bad.on_completion = handler
        before = (bad.completions, good.completions)
        counted = await retries(probe, reason)
        got = await outcomes(probe, stream, count=6)
        broken, served = bad.completions - before[0], good.completions - before[1]
        retried = await retries(probe, reason) - counted
        # Retried: each request the bad worker broke went on to the good one. Not retried:
        # each request reached one worker only.
        expected = (len(got), broken) if reason else (len(got) - broken, 0)
        if set(got) - allowed or broken < 1 or (served, retried) != expected:
            wrong[case] = (got, broken, served, retried)
        if not reason and len(set(got)) < 2:
            wrong[case] = ("the bad worker's answer never reached a client", got)
    assert not wrong, wrong


async def test_a_refused_connection_is_retried(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    """Nothing was sent: another worker takes the request, and the refusing one leaves routing
    at once (no probe finds out first: they are a minute apart)."""
    gone, gone_url = await raw_worker(serve_ok)
    good, good_url = await raw_worker(serve_ok)
    probe = await gateway_thread(
        [gone_url, good_url], routing_policy="round_robin", health_interval_s=60
    )
    await gone.stop()
    assert await outcomes(probe, stream=False, count=2) == [OK, OK]
    assert await outcomes(probe, stream=True, count=2) == [OK, OK]
    assert good.completions == 4
    assert await retries(probe, "connect_error") == 1
