"""A vLLM worker reduced to its fastest possible answers: a raw asyncio protocol (uvloop,
httptools) that answers every `POST /v1/chat/completions` at once with the same small
chat.completion, and `GET /health`, `/v1/models` and `/metrics` from the recorded vLLM fixtures,
so that a proxy's health checks and load scrapes pass. Keep-alive, no logging, no JSON parsing:
whatever CPU a benchmark sees on the proxy is the proxy's own.

With `--events N` every chat completion is streamed instead, as vLLM streams one: a chunked SSE
answer of N token events (the recorded vLLM stream's), then its usage event and `[DONE]`. With
`--gap-ms G` the token events of every open stream are written together every G ms, as vLLM's
engine emits one token for each request of its batch per step; with 0, the whole answer at once.

    python -m benchmarks.small_requests.upstream --port 32001 --model tiny [--events 16 --gap-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import httptools
import uvloop
from benchmarks.routing.fleet import READY_TIMEOUT_S, Processes

from mineru_gateway.testing import free_port, wait_http_ok

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm"
FIXTURE_MODEL = "tiny"


def response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    head = b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (status, content_type, len(body)) + body


def answers(model: str) -> dict[tuple[bytes, bytes], bytes]:
    """Complete responses by (method, path), the fixtures' model renamed to `model`."""
    json_type, text_type = b"application/json", b"text/plain; version=0.0.4; charset=utf-8"
    quoted = f'"{model}"'.encode()

    def fixture(name: str) -> bytes:
        return (FIXTURES / name).read_bytes().strip().replace(b'"tiny"', quoted)

    return {
        (b"POST", b"/v1/chat/completions"): response(
            b"200 OK", json_type, fixture("chat_nonstream.json")
        ),
        (b"GET", b"/health"): response(b"200 OK", text_type, b""),
        (b"GET", b"/v1/models"): response(b"200 OK", json_type, fixture("models.json")),
        (b"GET", b"/metrics"): response(b"200 OK", text_type, fixture("metrics.txt") + b"\n"),
    }


NOT_FOUND = response(b"404 Not Found", b"application/json", b'{"detail":"Not Found"}')
CHAT_KEY = (b"POST", b"/v1/chat/completions")


def chunk(data: bytes) -> bytes:
    """`data` in HTTP/1.1 chunked framing."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def stream_parts(model: str) -> tuple[bytes, bytes, bytes]:
    """A streamed chat answer in three parts, from the recorded vLLM stream: its head (chunked
    SSE), one token event as a chunk, and its tail (the usage event, `[DONE]`, the last chunk)."""
    text = (FIXTURES / "chat_stream.sse").read_bytes().replace(b'"tiny"', f'"{model}"'.encode())
    events = [event + b"\n\n" for event in text.strip().split(b"\n\n")]
    token = next(event for event in events if b'"content":"\\n"' in event)
    usage, done = events[-2], events[-1]
    if b'"usage":' not in usage or done != b"data: [DONE]\n\n":
        raise ValueError("the recorded stream does not end with its usage event and [DONE]")
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    return head, chunk(token), chunk(usage) + chunk(done) + b"0\r\n\r\n"


class HttpProtocol(asyncio.Protocol):
    """A connection parsed by httptools; subclasses answer in `on_message_complete`."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.WriteTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCP transport is not an asyncio.Transport subclass; it does write().
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


async def serve_forever(
    factory: Callable[[], asyncio.Protocol], port: int, backlog: int = 4096
) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(factory, "127.0.0.1", port, backlog=backlog)
    async with server:
        await server.serve_forever()


class Upstream(HttpProtocol):
    """One keep-alive connection: each complete request gets its canned answer."""

    def __init__(self, table: dict[tuple[bytes, bytes], bytes]) -> None:
        super().__init__()
        self.table = table
        self.path = b""

    def on_url(self, url: bytes) -> None:
        self.path += url

    def on_message_complete(self) -> None:
        key = (self.parser.get_method(), self.path.split(b"?", 1)[0])
        self.path = b""
        self.answer(key)

    def answer(self, key: tuple[bytes, bytes]) -> None:
        """Answers the request `key` (method, path) names."""
        self.write(self.table.get(key, NOT_FOUND))


class Streams:
    """The open streamed answers of one upstream, all written by one timer: each `gap_s`, the
    next token event of every stream (so what the upstream spends per event is a write)."""

    def __init__(self, model: str, events: int, gap_s: float) -> None:
        self.head, self.token, self.tail = stream_parts(model)
        self.events = events
        self.gap_s = gap_s
        self.open: dict[HttpProtocol, int] = {}  # stream -> token events still to write
        self._ticking = False

    def start(self, stream: HttpProtocol) -> None:
        if self.gap_s <= 0:
            stream.write(self.head + self.token * self.events + self.tail)
            return
        stream.write(self.head)
        self.open[stream] = self.events
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_later(self.gap_s, self.tick)

    def tick(self) -> None:
        for stream, left in list(self.open.items()):
            if stream.transport is None or left <= 1:
                del self.open[stream]
                stream.write(self.token + self.tail)
            else:
                self.open[stream] = left - 1
                stream.write(self.token)
        if self.open:
            asyncio.get_running_loop().call_later(self.gap_s, self.tick)
        else:
            self._ticking = False


class StreamingUpstream(Upstream):
    """An upstream whose chat completions are streamed (`Streams`)."""

    def __init__(self, table: dict[tuple[bytes, bytes], bytes], streams: Streams) -> None:
        super().__init__(table)
        self.streams = streams

    def answer(self, key: tuple[bytes, bytes]) -> None:
        if key == CHAT_KEY:
            self.streams.start(self)
        else:
            super().answer(key)


async def serve(port: int, model: str, events: int = 0, gap_s: float = 0.0) -> None:
    table = answers(model)
    if events > 0:
        streams = Streams(model, events, gap_s)
        await serve_forever(lambda: StreamingUpstream(table, streams), port, backlog=1024)
    else:
        await serve_forever(lambda: Upstream(table), port, backlog=1024)


def streaming(events: int, gap_ms: float) -> list[str]:
    """The arguments that make `start`'s upstreams stream `events` token events `gap_ms`
    apart; none for `events` 0 (answers at once)."""
    return ["--events", str(events), "--gap-ms", f"{gap_ms:g}"] if events else []


def start(
    procs: Processes, model: str, count: int = 2, extra: Sequence[str] = ()
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """`count` upstreams started as children of `procs`, each answering: base URLs, processes.
    `extra`: more arguments for each (`streaming(events, gap_ms)`)."""
    started = []
    for index in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "benchmarks.small_requests.upstream", "--port", str(port)]
        handle = procs.spawn(f"upstream-{index}", [*argv, "--model", model, *extra])
        started.append((f"http://127.0.0.1:{port}", handle))
    for url, _ in started:
        wait_http_ok(url + "/health", READY_TIMEOUT_S)
    return started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=FIXTURE_MODEL)
    parser.add_argument("--events", type=int, default=0, help="stream this many token events")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="between two token events")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.model, args.events, args.gap_ms / 1000))


if __name__ == "__main__":
    main()
