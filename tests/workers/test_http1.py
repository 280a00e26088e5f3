"""The relay's HTTP/1.1 client against real sockets: what reuses a connection and what drops it
(the worker must see a connection close to stop a generation), answers framed every way HTTP/1.1
allows, broken ones, deadlines, and chunked framing however its reads are cut."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from mineru_gateway.workers.http1 import (
    MAX_HEAD_BYTES,
    BadStatus,
    Disconnected,
    Http1Pool,
    Malformed,
)
from tests.support.raw_http import chunk, raw_server, read_request

pytestmark = pytest.mark.unit

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
STREAM = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@dataclass
class Seen:
    """What the worker saw: one entry per connection, the requests read on it, and whether the
    gateway closed it."""

    requests: list[list[bytes]] = field(default_factory=list)
    closed: list[asyncio.Event] = field(default_factory=list)
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # a request was read


Answerer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[None]]


@asynccontextmanager
async def worker(answer: Answerer) -> AsyncIterator[tuple[str, Seen]]:
    seen = Seen()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests: list[bytes] = []
        closed = asyncio.Event()
        seen.requests.append(requests)
        seen.closed.append(closed)
        try:
            while True:
                request = await read_request(reader)
                requests.append(request)
                seen.asked.set()
                await answer(reader, writer, request)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            closed.set()
            writer.close()

    async with raw_server(serve) as url:
        yield url, seen


def writes(*pieces: bytes) -> Answerer:
    async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        for piece in pieces:
            writer.write(piece)
            await writer.drain()

    return answer


@asynccontextmanager
async def pool(keepalive_s: float = 4.0) -> AsyncIterator[Http1Pool]:
    connections = Http1Pool(connect_timeout_s=2.0, keepalive_s=keepalive_s)
    try:
        yield connections
    finally:
        connections.close()


async def get(connections: Http1Pool, url: str, deadline_s: float = 2.0) -> bytes:
    answer = await connections.request("GET", url, {}, b"", deadline_s)
    try:
        return await answer.read()
    finally:
        answer.close()


async def closed_soon(event: asyncio.Event) -> bool:
    try:
        await asyncio.wait_for(event.wait(), 2.0)
    except TimeoutError:
        return False
    return True


# -- reuse ----------------------------------------------------------------------------------


async def test_answers_read_to_their_end_reuse_one_connection() -> None:
    async with worker(writes(OK)) as (url, seen), pool() as connections:
        for _ in range(5):
            assert await get(connections, url + "/health") == b"{}"
    assert [len(requests) for requests in seen.requests] == [5]


async def test_the_request_carries_its_line_host_length_headers_and_body() -> None:
    async with worker(writes(OK)) as (url, seen), pool() as connections:
        headers = {"Content-Type": "application/json", "X-Request-Id": "r-1"}
        answer = await connections.request(
            "POST", url + "/v1/chat/completions?x=1", headers, b"{}", 2
        )
        await answer.read()
    host = url.removeprefix("http://").encode()
    assert seen.requests[0][0] == (
        b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: " + host + b"\r\n"
        b"Content-Length: 2\r\nContent-Type: application/json\r\nX-Request-Id: r-1\r\n\r\n{}"
    )


async def test_a_body_already_in_is_whole_at_once_and_one_still_coming_is_not() -> None:
    rest = asyncio.Event()

    async def in_two_parts(
        _: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes
    ) -> None:
        writer.write(STREAM + chunk(b"a"))
        await rest.wait()
        writer.write(chunk(b"b") + b"0\r\n\r\n")

    async with worker(writes(OK)) as (url, _), pool() as connections:
        answer = await connections.request("GET", url + "/", {}, b"", 2)
        assert answer.whole() == b"{}"  # headers and body came in one read
    async with worker(in_two_parts) as (url, _), pool() as connections:
        answer = await connections.request("GET", url + "/", {}, b"", 2)
        assert answer.whole() is None  # not ended: the caller must wait with read()
        rest.set()
        assert await answer.read() == b"ab"


async def test_an_answer_closed_before_its_end_drops_its_connection() -> None:
    """How a worker learns that nobody waits for its generation any more."""
    stream = writes(STREAM, chunk(b"data: 0\n\n"))
    async with worker(stream) as (url, seen), pool() as connections:
        answer = await connections.request("POST", url + "/v1/completions", {}, b"{}", 2.0)
        assert await answer.read_some() == b"data: 0\n\n"
        answer.close()
        assert await closed_soon(seen.closed[0])
        assert connections.connections == 0


async def test_connection_close_and_http_1_0_answers_are_not_reused() -> None:
    close = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
    old = b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    for head in (close, old):
        async with worker(writes(head)) as (url, seen), pool() as connections:
            assert await get(connections, url) == b"{}"
            assert await get(connections, url) == b"{}"
        assert [len(requests) for requests in seen.requests] == [1, 1]


async def test_an_idle_connection_is_closed_after_the_keepalive() -> None:
    """Workers close idle keep-alive connections after 5 s (vLLM's uvicorn): the pool must not
    hand out one that the worker may be closing at that moment."""
    async with worker(writes(OK)) as (url, seen), pool(keepalive_s=0.2) as connections:
        await get(connections, url)
        assert await closed_soon(seen.closed[0])  # the sweep closed it, unasked
        await get(connections, url)
    assert [len(requests) for requests in seen.requests] == [1, 1]


async def test_an_answer_given_before_the_request_body_was_read_is_not_reused() -> None:
    """A worker that answers (say 413) without reading the body would take the rest of it for
    the next request."""

    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> None:
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")  # the head only, never the body
            await early(reader, writer, b"")
            while await reader.read(1 << 16):  # until the gateway drops the connection
                pass
        except ConnectionError:
            pass
        finally:
            writer.close()

    async with raw_server(serve, limit=1024) as url, pool() as connections:
        body = b"x" * (64 * 1024 * 1024)  # more than the socket buffers hold
        answer = await connections.request("POST", url + "/", {}, body, 5.0)
        assert answer.status == 413
        assert await answer.read() == b""
        assert connections.connections == 0


# -- framing and broken answers ------------------------------------------------------------------


async def test_a_body_that_runs_to_the_end_of_the_connection_is_read_whole() -> None:
    async def unframed(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of ")
        await writer.drain()
        writer.write(b"it")
        writer.close()

    async with worker(unframed) as (url, _), pool() as connections:
        answer = await connections.request("GET", url, {}, b"", 2.0)
        assert answer.content_type == "text/plain"
        assert await answer.read() == b"all of it"


async def test_a_chunked_body_arrives_as_its_chunks_and_ends_at_the_last() -> None:
    stream = writes(STREAM, chunk(b"data: 0\n\n"), chunk(b"data: 1\n\n"), b"0\r\n\r\n")
    async with worker(stream) as (url, seen), pool() as connections:
        answer = await connections.request("POST", url, {}, b"{}", 2.0)
        assert answer.content_type == "text/event-stream"
        assert await answer.read() == b"data: 0\n\ndata: 1\n\n"
        assert answer.ended
        assert await get(connections, url) == b"data: 0\n\ndata: 1\n\n"  # the same connection
    assert len(seen.requests) == 1


@pytest.mark.parametrize(
    "pieces",
    [
        (b"HTTP/1.1 abc\r\n\r\n",),
        (STREAM, chunk(b"data: 0\n\n"), b"zz\r\nnot a chunk\r\n"),
        (b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * 100_000 + b"\r\n\r\n",),
    ],
    ids=["bad status line", "bad chunk", "header too long"],
)
async def test_bytes_that_are_not_http_fail_the_answer_and_drop_the_connection(
    pieces: tuple[bytes, ...],
) -> None:
    async with worker(writes(*pieces)) as (url, seen), pool() as connections:
        with pytest.raises((Malformed, Disconnected)):
            answer = await connections.request("POST", url, {}, b"{}", 2.0)
            await answer.read()
        assert await closed_soon(seen.closed[0])


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"


@pytest.mark.parametrize(
    "pieces",
    [
        (CONTINUE, OK),
        (HINTS + OK,),
        (CONTINUE, HINTS, CONTINUE + HINTS, OK),
        (b"HTTP/1.1 102 Processing\r\nContent-Length: 9\r\n\r\n", OK),
    ],
    ids=["100 then the answer", "103 with the answer", "several", "102 with a length"],
)
async def test_interim_answers_are_skipped_for_the_final_one(pieces: tuple[bytes, ...]) -> None:
    """RFC 9110 15.2: any number of 1xx heads (which have no body, whatever they say) may come
    before the answer; the answer is the final one, and its connection is reused."""
    async with worker(writes(*pieces)) as (url, seen), pool() as connections:
        for _ in range(2):
            answer = await connections.request("POST", url, {}, b"{}", 2.0)
            assert (answer.status, answer.content_type) == (200, "application/json")
            assert await answer.read() == b"{}"
    assert [len(requests) for requests in seen.requests] == [2]


async def test_an_interim_answer_then_a_stream() -> None:
    stream = writes(HINTS, STREAM, chunk(b"data: 0\n\n"), b"0\r\n\r\n")
    async with worker(stream) as (url, _), pool() as connections:
        answer = await connections.request("POST", url, {}, b"{}", 2.0)
        assert answer.content_type == "text/event-stream"
        assert await answer.read() == b"data: 0\n\n"


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade", 101),
        (b"HTTP/1.1 101 Switching Protocols", 101),
        (b"HTTP/1.1 600 Beyond\r\nContent-Length: 2", 600),
        (b"HTTP/1.1 999 Beyond\r\nContent-Length: 2", 999),
        (b"HTTP/1.1 000 Nothing\r\nContent-Length: 2", 0),
    ],
    ids=["101 with upgrade", "101", "600", "999", "000"],
)
async def test_a_status_no_client_may_be_given_fails_the_answer(head: bytes, status: int) -> None:
    """A switch of protocols, or a status outside 200-599, is not an answer to relay; what the
    worker sends after it is not read, and the connection is dropped."""
    async with worker(writes(head + b"\r\n\r\n{}")) as (url, seen), pool() as connections:
        with pytest.raises(BadStatus) as info:
            await connections.request("POST", url, {}, b"{}", 2.0)
        assert info.value.status == status
        assert isinstance(info.value, Malformed)
        assert await closed_soon(seen.closed[0])
        assert connections.connections == 0


async def test_a_head_that_never_ends_is_cut_while_it_arrives() -> None:
    """One header value of tens of MiB without a line end: llhttp reports a header only at the
    end of its value, so the head is bounded by the bytes read while it is incomplete, and the
    connection dropped long before the worker has written it all."""
    value_bytes = 32 * 1024 * 1024
    written = 0

    async def endless(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        nonlocal written
        writer.write(b"HTTP/1.1 200 OK\r\nx-filler: ")
        piece = b"a" * 65536
        while written < value_bytes:
            writer.write(piece)
            await writer.drain()
            written += len(piece)

    async with worker(endless) as (url, seen), pool() as connections:
        with pytest.raises(Malformed, match=f"head longer than {MAX_HEAD_BYTES} bytes"):
            await connections.request("POST", url, {}, b"{}", 10.0)
        assert await closed_soon(seen.closed[0])
    assert written < value_bytes


async def test_bytes_after_an_answer_drop_its_connection() -> None:
    """A second answer to one request: whatever the next request on that connection read would
    not be its own."""
    extra = OK + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    async with worker(writes(extra)) as (url, seen), pool() as connections:
        assert await get(connections, url) == b"{}"
        assert await closed_soon(seen.closed[0])
        assert connections.connections == 0


async def test_a_connection_closed_mid_body_fails_the_read() -> None:
    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.write(STREAM + chunk(b"data: 0\n\n"))
        await writer.drain()
        writer.close()

    async with worker(cut) as (url, _), pool() as connections:
        answer = await connections.request("POST", url, {}, b"{}", 2.0)
        assert await answer.read_some() == b"data: 0\n\n"
        with pytest.raises(Disconnected, match="closed the connection"):
            await answer.read_some()


async def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    async with worker(writes(OK)) as (url, seen), pool() as connections:
        with pytest.raises(ValueError, match="line break"):
            await connections.request("POST", url, {"X-Request-Id": "a\r\nEvil: 1"}, b"{}", 2.0)
    assert seen.requests == []


# -- deadlines and cancellation ---------------------------------------------------------------


async def silent(reader: asyncio.StreamReader, _: asyncio.StreamWriter, __: bytes) -> None:
    await reader.read()  # until the gateway closes


async def test_headers_later_than_the_deadline_are_a_timeout_and_drop_the_connection() -> None:
    async with worker(silent) as (url, seen), pool() as connections:
        with pytest.raises(TimeoutError):
            await connections.request("POST", url, {}, b"{}", 0.2)
        assert await closed_soon(seen.closed[0])


async def test_a_caller_cancelled_while_waiting_for_headers_drops_the_connection() -> None:
    """A client that leaves while its request waits in the worker's queue: not a timeout."""
    async with worker(silent) as (url, seen), pool() as connections:
        waiting = asyncio.ensure_future(connections.request("POST", url, {}, b"{}", 5.0))
        await asyncio.wait_for(seen.asked.wait(), 2.0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await closed_soon(seen.closed[0])


# -- chunked framing ---------------------------------------------------------------------------


# Chunks a stream may bring after its first: plain framing, an upper-case size, a size line of
# more than 8 digits, an extension, then trailers.
EVENTS = [b"data: 1\n\n", b"data: 22\n\n", b"data: 333\n\n", b"data: 4444\n\n", b"data: 55\n\n"]
FRAMED = (
    chunk(EVENTS[0])
    + b"A\r\n" + EVENTS[1] + b"\r\n"
    + b"000000000b\r\n" + EVENTS[2] + b"\r\n"
    + b"c;name=value\r\n" + EVENTS[3] + b"\r\n"
    + chunk(EVENTS[4])
    + b"0\r\nx-trailer: yes\r\n\r\n"
)  # fmt: skip


async def test_a_stream_arrives_whole_however_its_reads_are_cut() -> None:
    """The same stream, its bytes after the first chunk cut at every place in turn and once at
    every byte: the reader gets every event once, in order, and every answer ends cleanly (all of
    them on one connection)."""
    plans = [[cut] for cut in range(len(FRAMED) + 1)] + [list(range(1, len(FRAMED)))]
    plan: list[int] = []
    gate = asyncio.Event()  # the first chunk is read

    async def cut(_: asyncio.StreamReader, writer: asyncio.StreamWriter, __: bytes) -> None:
        writer.write(STREAM + chunk(b"data: 0\n\n"))
        await writer.drain()
        await gate.wait()
        gate.clear()
        for start, stop in zip([0, *plan], [*plan, len(FRAMED)], strict=True):
            writer.write(FRAMED[start:stop])
            await writer.drain()
            await asyncio.sleep(0.001)

    async with worker(cut) as (url, seen), pool() as connections:
        for cuts in plans:
            plan[:] = cuts
            answer = await connections.request("POST", url, {}, b"{}", 2.0)
            assert await answer.read_some() == b"data: 0\n\n"
            gate.set()
            got = await asyncio.wait_for(answer.read(), 5.0)
            assert got == b"".join(EVENTS), cuts
    assert [len(requests) for requests in seen.requests] == [len(plans)]


async def test_the_parsed_url_cache_grows_with_the_workers_and_drops_only_its_oldest() -> None:
    """The table holds a few URLs per worker whatever the fleet's size; past that (more paths
    per worker than expected) the oldest parsed URL goes, counted, not all of them."""
    async with pool() as connections:
        connections.MIN_KEYS, connections.KEYS_PER_SLOT = 4, 2
        fleet = [f"http://127.0.0.1:{port}/{path}" for port in range(1000, 1600) for path in "ab"]
        keys = [connections._key(url) for url in fleet]
        assert all(connections._key(url) is key for url, key in zip(fleet, keys, strict=True))
        assert connections.evicted == 0  # 1,200 URLs of 600 workers: all kept
        paths = [f"http://127.0.0.1:2000/{n}" for n in range(50)]
        for url in paths:
            connections._key(url)
        assert connections.evicted == 50 - 2  # one worker's two were room enough
        assert connections._key(fleet[-1]) is keys[-1]  # the newest stay parsed
