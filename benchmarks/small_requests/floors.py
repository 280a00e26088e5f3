"""Two relays with nothing but relaying, to measure what a Python proxy costs per small request
before any of the gateway's own work (routing, flow control, limits, accounting, metrics):

- `raw`: an asyncio protocol over httptools answers each POST by relaying it through the
  gateway's own HTTP/1.1 client (`workers/http1.py`) to the upstreams in turn, head and body in
  one write; GET answers 200 at once (the benchmark's readiness check).
- `asgi`: the same relay as a raw ASGI app on uvicorn (uvloop, httptools), answering through
  ASGI's `send`.
- `link`: the same app on the gateway's own server protocol (`api/connection.py`), answering
  through its client link in one write, as the gateway's relay does: the server stack the
  gateway pays for, less its own work.

Benchmark use only: no errors handled beyond dropping the connection.

    python -m benchmarks.small_requests.floors --mode raw --port 8600 --upstreams U1,U2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn
import uvloop

from mineru_gateway.api.connection import ClientLink
from mineru_gateway.entry import server
from mineru_gateway.workers.http1 import Http1Pool

from . import CHAT
from .upstream import HttpProtocol, serve_forever

HEADERS = {"Content-Type": "application/json"}
DEADLINE_S = 30.0


class Relay:
    """The upstreams in turn, over one pool of keep-alive connections."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        self._urls: Iterator[str] = itertools.cycle([url + CHAT for url in upstreams])
        self._pool: Http1Pool | None = None

    async def relay(self, body: bytes) -> tuple[int, bytes]:
        if self._pool is None:
            self._pool = Http1Pool(connect_timeout_s=5.0, keepalive_s=4.0)
        answer = await self._pool.request("POST", next(self._urls), HEADERS, body, DEADLINE_S)
        return answer.status, await answer.read()


def head(status: int, length: int) -> bytes:
    return b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
        status,
        length,
    )


class RawProtocol(HttpProtocol):
    def __init__(self, relay: Relay) -> None:
        super().__init__()
        self._relay = relay
        self._body: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body, self._body = b"".join(self._body), []
        if self.parser.get_method() != b"POST":
            self.write(head(200, 2) + b"{}")
            return
        asyncio.get_running_loop().create_task(self._answer(body))

    async def _answer(self, body: bytes) -> None:
        status, data = await self._relay.relay(body)
        self.write(head(status, len(data)) + data)


def asgi_app(relay: Relay) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope["method"] == "POST":
            status, data = await relay.relay(b"".join(parts))
        else:
            status, data = 200, b"{}"
        link = ClientLink.of(scope)
        if link is not None:
            await link.respond(status, [(b"content-type", b"application/json")], data)
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("raw", "asgi", "link"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstreams", required=True, help="comma-separated base URLs")
    args = parser.parse_args(argv)
    relay = Relay(args.upstreams.split(","))
    if args.mode == "raw":
        uvloop.run(serve_forever(lambda: RawProtocol(relay), args.port))
    elif args.mode == "link":
        server.run(asgi_app(relay), "127.0.0.1", args.port)  # the gateway's own server
    else:
        uvicorn.run(
            asgi_app(relay),
            host="127.0.0.1",
            port=args.port,
            loop="uvloop",
            http="httptools",
            lifespan="off",
            log_level="warning",
            access_log=False,
            backlog=4096,
        )


if __name__ == "__main__":
    main()
