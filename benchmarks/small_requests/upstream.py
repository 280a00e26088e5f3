"""A vLLM worker reduced to its fastest possible answers: a raw asyncio protocol (uvloop,
httptools) that answers every `POST /v1/chat/completions` at once with the same small
chat.completion, and `GET /health`, `/v1/models` and `/metrics` from the recorded vLLM fixtures,
so that a proxy's health checks and load scrapes pass. Keep-alive, no logging, no JSON parsing:
whatever CPU a benchmark sees on the proxy is the proxy's own.

    python -m benchmarks.small_requests.upstream --port 32001 --model tiny
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
        method, path = self.parser.get_method(), self.path.split(b"?", 1)[0]
        self.path = b""
        self.write(self.table.get((method, path), NOT_FOUND))


async def serve(port: int, model: str) -> None:
    table = answers(model)
    await serve_forever(lambda: Upstream(table), port, backlog=1024)


def start(
    procs: Processes, model: str, count: int = 2
) -> list[tuple[str, subprocess.Popen[bytes]]]:
    """`count` upstreams started as children of `procs`, each answering: base URLs, processes."""
    started = []
    for index in range(count):
        port = free_port()
        argv = [sys.executable, "-m", "benchmarks.small_requests.upstream", "--port", str(port)]
        handle = procs.spawn(f"upstream-{index}", [*argv, "--model", model])
        started.append((f"http://127.0.0.1:{port}", handle))
    for url, _ in started:
        wait_http_ok(url + "/health", READY_TIMEOUT_S)
    return started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default=FIXTURE_MODEL)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.model))


if __name__ == "__main__":
    main()
