"""The upstream seam against real sockets: the stream watchdog's timing and the one mapping of
transport failures to gateway errors.

Each worker here is a raw asyncio server on 127.0.0.1 that plays a script of chunks, pauses and
abrupt closes, so a test can put a silence or a dropped connection exactly where it wants one.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from mineru_gateway.errors import (
    UpstreamBadStatus,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTimeout,
)
from mineru_gateway.testing import free_port
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient, UpstreamResponse
from tests.support.raw_http import chunk, raw_server, read_request

pytestmark = pytest.mark.unit

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
# Loose upper bounds: a limit must fire after its time and soon after it, on a busy machine too.
SLACK_S = 0.5


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Raw:
    data: bytes


class Drop:
    """Close the connection where it stands (no terminating chunk)."""


Step = Pause | Raw | Drop | bytes  # bytes: one chunk of a chunked body


def sse(count: int, gap_s: float) -> list[Step]:
    """`count` events `gap_s` apart, then the end of the body."""
    steps: list[Step] = []
    for index in range(count):
        steps += [Pause(gap_s), f"data: {index}\n\n".encode()]
    return [*steps, Raw(b"0\r\n\r\n")]


@asynccontextmanager
async def worker(script: Sequence[Step]) -> AsyncIterator[str]:
    """A server that reads one request per connection and answers with `script`."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            for step in script:
                if isinstance(step, Drop):
                    return
                if isinstance(step, Pause):
                    await asyncio.sleep(step.seconds)
                    continue
                writer.write(step.data if isinstance(step, Raw) else chunk(step))
                await writer.drain()
            await reader.read()  # until the client closes
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async with raw_server(answer) as url:
        yield url


@asynccontextmanager
async def upstream(
    first_byte_s: float = 5.0, idle_s: float = 5.0, connect_s: float = 5.0
) -> AsyncIterator[UpstreamClient]:
    client = UpstreamClient(Timeouts(connect_s, first_byte_s, idle_s))
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def post(client: UpstreamClient, url: str) -> UpstreamResponse:
    return await client.post(url + "/v1/chat/completions", b"{}", {})


async def collect(response: UpstreamResponse) -> list[bytes]:
    try:
        return [piece async for piece in response.iter_chunks()]
    finally:
        response.close()


async def failure_of(response: UpstreamResponse) -> tuple[BaseException, float]:
    """The error that ends the stream, and how long after the start it came."""
    started = time.monotonic()
    with pytest.raises(UpstreamError) as info:
        await collect(response)
    return info.value, time.monotonic() - started


# -- the watchdog's timing ---------------------------------------------------------------------


async def test_the_first_chunk_has_the_first_byte_limit() -> None:
    async with worker([Raw(STREAM_HEAD), Pause(5.0), b"late"]) as url, upstream(0.3) as client:
        error, after = await failure_of(await post(client, url))
    assert type(error) is UpstreamTimeout
    assert error.message == "worker stream went silent"
    assert 0.3 <= after < 0.3 + SLACK_S


async def test_a_first_chunk_slower_than_the_idle_limit_is_waited_for() -> None:
    script = [Raw(STREAM_HEAD), *sse(3, gap_s=0.4)]  # the first chunk after 0.4 s
    async with worker(script) as url, upstream(first_byte_s=2.0, idle_s=0.6) as client:
        chunks = await collect(await post(client, url))
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_after_the_first_chunk_a_silence_longer_than_the_idle_limit_ends_the_stream() -> None:
    script = [Raw(STREAM_HEAD), b"data: 0\n\n", Pause(5.0), b"data: 1\n\n"]
    async with worker(script) as url, upstream(first_byte_s=5.0, idle_s=0.3) as client:
        response = await post(client, url)
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"data: 0\n\n"
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout, match="went silent"):
            await anext(chunks)
        after = time.monotonic() - started
        response.close()
    assert 0.3 - 0.05 <= after < 0.3 + SLACK_S


async def test_every_chunk_moves_the_idle_deadline() -> None:
    script = [Raw(STREAM_HEAD), *sse(12, gap_s=0.1)]  # 1.2 s in all, never 0.4 s silent
    async with worker(script) as url, upstream(first_byte_s=1.0, idle_s=0.4) as client:
        chunks = await collect(await post(client, url))
    assert b"".join(chunks).count(b"data: ") == 12


async def test_a_cancellation_from_outside_is_not_taken_for_a_timeout() -> None:
    async with worker([Raw(STREAM_HEAD), Pause(5.0)]) as url, upstream(5.0, 5.0) as client:
        reading = asyncio.create_task(collect(await post(client, url)))
        await asyncio.sleep(0.1)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading


async def test_response_headers_have_the_first_byte_limit() -> None:
    async with worker([Pause(5.0), Raw(STREAM_HEAD)]) as url, upstream(0.3) as client:
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout, match=r"no response from worker within 0\.3 s"):
            await post(client, url)
    assert 0.3 <= time.monotonic() - started < 0.3 + SLACK_S


async def test_a_whole_answer_must_arrive_within_the_first_byte_limit() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n"
    async with worker([Raw(head), Raw(b"{"), Pause(5.0)]) as url, upstream(0.3) as client:
        response = await post(client, url)
        with pytest.raises(UpstreamTimeout, match="did not finish its answer in time"):
            await response.read()
        response.close()


# -- transport errors to gateway errors -------------------------------------------------------


async def test_a_refused_connection_is_a_connect_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with upstream() as client:
        with pytest.raises(UpstreamConnectError, match="cannot reach worker"):
            await post(client, url)
        with pytest.raises(UpstreamConnectError, match="cannot reach"):
            await client.get_ok(url + "/health", timeout_s=1.0)


async def test_a_connection_that_is_never_made_is_a_connect_timeout_not_a_504() -> None:
    """A listener whose accept queue is full drops new handshakes: the connect limit fires.
    Nothing was sent, so it is a (retryable) connect error, not the first-byte timeout that
    aiohttp's TimeoutError subclass was taken for (30 of 200 requests got 504 at once, 7.7 s
    in, when a loaded machine delayed their connections to a busy real vLLM)."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        waiting = [socket.socket() for _ in range(4)]
        for queued in waiting:
            queued.setblocking(False)
            queued.connect_ex(full.getsockname())
        host, port = full.getsockname()
        url = f"http://{host}:{port}"
        try:
            async with upstream(connect_s=0.3) as client:
                started = time.monotonic()
                expected = r"no connection to .* within 0\.3 s"
                with pytest.raises(UpstreamConnectTimeout, match=expected):
                    await post(client, url)
                assert time.monotonic() - started < 0.3 + SLACK_S
        finally:
            for queued in waiting:
                queued.close()


async def test_a_connection_closed_before_any_answer_is_an_upstream_error() -> None:
    async with worker([Drop()]) as url, upstream() as client:
        with pytest.raises(UpstreamError, match="worker request failed") as info:
            await post(client, url)
    assert type(info.value) is UpstreamError  # something was sent: not a connect error


async def test_a_stream_dropped_midway_is_an_upstream_error() -> None:
    script = [Raw(STREAM_HEAD), b"data: 0\n\n", Pause(0.05), Drop()]
    async with worker(script) as url, upstream(1.0, 1.0) as client:
        error, after = await failure_of(await post(client, url))
    assert type(error) is UpstreamError
    assert error.message.startswith("worker connection failed mid-stream")
    assert after < 1.0  # the drop, not the idle limit


async def test_a_body_dropped_midway_is_an_upstream_error() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n"
    async with worker([Raw(head), Raw(b"{"), Drop()]) as url, upstream() as client:
        response = await post(client, url)
        with pytest.raises(UpstreamError, match="failed while reading") as info:
            await response.read()
        response.close()
    assert type(info.value) is UpstreamError


def answer(status: int, body: bytes, content_type: bytes = b"application/json") -> list[Step]:
    reason = b"OK" if status == 200 else b"Error"
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
        status,
        reason,
        content_type,
        len(body),
    )
    return [Raw(head + body)]


async def test_get_json_reads_a_document_and_maps_what_is_not_one() -> None:
    async with upstream() as client:
        async with worker(answer(200, b'{"data": []}')) as url:
            assert await client.get_json(url + "/v1/models", 1.0) == {"data": []}
        async with worker(answer(200, b"<html>")) as url:
            with pytest.raises(UpstreamError, match="did not answer JSON"):
                await client.get_json(url + "/v1/models", 1.0)
        async with worker(answer(503, b"busy")) as url:
            with pytest.raises(UpstreamError, match="answered 503"):
                await client.get_ok(url + "/health", 1.0)
        async with worker([Pause(5.0)]) as url:
            with pytest.raises(UpstreamTimeout, match=r"took longer than 0\.2 s"):
                await client.get_ok(url + "/health", 0.2)


async def test_a_get_has_one_deadline_for_its_headers_and_its_body() -> None:
    """A body that does not come with the headers is waited for with what is left of the
    GET's time, not a time of its own."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n"
    async with upstream() as client:
        async with worker([Raw(head + b"ok"), Pause(0.05), Raw(b"ok")]) as url:
            assert await client.get_ok(url + "/health", 1.0) == b"okok"
        async with worker([Raw(head + b"ok"), Pause(5.0)]) as url:
            started = time.monotonic()
            with pytest.raises(UpstreamTimeout, match=r"took longer than 0\.3 s"):
                await client.get_ok(url + "/health", 0.3)
            assert time.monotonic() - started < 2.0
        # headers late, body later: each within 0.3 s, together not
        async with worker([Pause(0.2), Raw(head), Pause(0.2), Raw(b"okok")]) as url:
            with pytest.raises(UpstreamTimeout, match=r"took longer than 0\.3 s"):
                await client.get_ok(url + "/health", 0.3)


async def test_an_answer_keeps_its_status_and_content_type() -> None:
    async with worker(answer(400, b'{"error": {}}')) as url, upstream() as client:
        response = await post(client, url)
        assert (response.status, response.content_type) == (400, "application/json")
        assert not response.is_event_stream
        assert await response.read() == b'{"error": {}}'
        response.close()


async def test_an_interim_answer_is_skipped_and_the_final_one_kept() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    script = [Raw(interim), Pause(0.05), *answer(200, b'{"ok": 1}')]
    async with worker(script) as url, upstream() as client:
        response = await post(client, url)
        assert (response.status, await response.read()) == (200, b'{"ok": 1}')
        response.close()


@pytest.mark.parametrize("status", [101, 600, 999, 0])
async def test_a_status_no_client_may_be_given_is_a_bad_upstream_status(status: int) -> None:
    """Not the worker's own answer to pass back: a 502 of the gateway's, in OpenAI's shape."""
    head = b"HTTP/1.1 %03d Odd\r\nContent-Length: 2\r\n\r\n{}" % status
    async with worker([Raw(head)]) as url, upstream() as client:
        with pytest.raises(UpstreamBadStatus, match=f"answered status {status}$") as info:
            await post(client, url)
    assert (info.value.status, info.value.reason) == (502, "bad_upstream_status")
