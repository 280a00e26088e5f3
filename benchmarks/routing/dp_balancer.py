"""vLLM's own data-parallel load balancer, emulated as a small proxy in front of N workers.

What is emulated (vLLM V1 `DPLBAsyncMPClient.get_core_engine_for_request` and the DP coordinator,
as in v0.10.x-0.11, the releases behind the seed's vllm-ascend images; docs/vllm.md):
- A coordinator publishes every engine's `[waiting, running]` counts every
  `stats_update_interval_ms` = 100 ms while they change. Here a poller reads each worker's
  `vllm:num_requests_waiting` and `vllm:num_requests_running` from `/metrics` every `--interval`
  seconds and the new snapshot *replaces* the local counts wholesale, as the client's
  `self.lb_engines = counts` does.
- Each request goes to the engine with the lowest `score = 4 * waiting + running`, scanning from
  `eng_start_index` (0 for a single API server) and keeping the first strict minimum, so ties go
  to the lowest index.
- After each choice the chosen engine's local waiting count grows by `client_count` (1 here), so
  decisions between two snapshots see each other until the next snapshot overwrites them.
Not emulated: newer releases' in-flight floor and KV-usage term, rotation of the scan start, more
than one API server, and the coordinator's 5 s republish of unchanged counts (under load the counts
always change). vLLM does this in-process over ZMQ; here it costs one HTTP hop, like any external
router, and the relay is a raw ASGI app with an aiohttp client (the cheapest Python relay measured
in docs/proxy-costs.md).

    python -m benchmarks.routing.dp_balancer --port 31000 --workers http://a:1,http://b:2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import aiohttp
import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

WAITING_WEIGHT = 4
RELAYED_PATHS = ("/v1/chat/completions", "/v1/completions")
_HOP_HEADERS = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding"})


class DpLoadBalancer:
    """The selection rule and its state; pure, so it can be checked by hand."""

    def __init__(self, engines: int, client_count: int = 1, client_index: int = 0) -> None:
        self.counts: list[list[int]] = [[0, 0] for _ in range(engines)]  # [waiting, running]
        self.client_count = client_count
        self.start_index = engines * client_index // client_count
        self.chosen = [0] * engines
        self.snapshots = 0

    def choose(self) -> int:
        engines = len(self.counts)
        best, best_score = 0, sys.maxsize
        for offset in range(engines):
            index = (self.start_index + offset) % engines
            waiting, running = self.counts[index]
            score = waiting * WAITING_WEIGHT + running
            if score < best_score:
                best, best_score = index, score
        self.counts[best][0] += self.client_count
        self.chosen[best] += 1
        return best

    def publish(self, counts: Sequence[tuple[int, int] | None]) -> None:
        """A new snapshot; an engine whose scrape failed keeps its last counts."""
        self.counts = [
            [new[0], new[1]] if new is not None else old
            for new, old in zip(counts, self.counts, strict=True)
        ]
        self.snapshots += 1


def parse_counts(text: str) -> tuple[int, int]:
    waiting = running = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_waiting{") or line.startswith(
            "vllm:num_requests_waiting "
        ):
            waiting += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:num_requests_running{") or line.startswith(
            "vllm:num_requests_running "
        ):
            running += float(line.rsplit(" ", 1)[1])
    return int(waiting), int(running)


class DpProxy:
    """ASGI app: relays completions to the engine `DpLoadBalancer` picks, streaming."""

    def __init__(self, workers: Sequence[str], interval_s: float) -> None:
        self.workers = list(workers)
        self.interval_s = interval_s
        self.balancer = DpLoadBalancer(len(workers))
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self.scrape_failures = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in RELAYED_PATHS and scope["method"] == "POST":
            await self._relay(scope, receive, send, path)
        elif path in ("/health", "/ready"):
            await _respond(send, 200, b"{}")
        elif path == "/stats":
            stats = {
                "chosen": self.balancer.chosen,
                "counts": self.balancer.counts,
                "snapshots": self.balancer.snapshots,
                "scrape_failures": self.scrape_failures,
            }
            await _respond(send, 200, orjson.dumps(stats))
        elif path == "/v1/models":
            assert self.session is not None
            async with self.session.get(self.workers[0] + path) as response:
                await _respond(send, response.status, await response.read())
        else:
            await _respond(send, 404, b'{"error": "not found"}')

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                connector = aiohttp.TCPConnector(limit=0)
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
                self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
                self._poller = asyncio.get_running_loop().create_task(self._poll_forever())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._poller is not None:
                    self._poller.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._poller
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _poll_forever(self) -> None:
        while True:
            started = time.monotonic()
            counts = await asyncio.gather(*(self._scrape(url) for url in self.workers))
            self.balancer.publish(counts)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _scrape(self, url: str) -> tuple[int, int] | None:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, 5 * self.interval_s))
            async with self.session.get(url + "/metrics", timeout=timeout) as response:
                return parse_counts((await response.read()).decode())
        except (aiohttp.ClientError, TimeoutError):
            self.scrape_failures += 1
            return None

    async def _relay(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        engine = self.balancer.choose()
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k not in _HOP_HEADERS
        }
        url = self.workers[engine] + path
        relay = asyncio.ensure_future(self._forward(send, url, body, headers))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, watcher):
                task.cancel()
            await asyncio.gather(relay, watcher, return_exceptions=True)

    async def _forward(self, send: Send, url: str, body: bytes, headers: dict[str, str]) -> None:
        assert self.session is not None
        started = False
        try:
            async with self.session.post(url, data=body, headers=headers) as response:
                content_type = response.headers.get("content-type", "application/json")
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status,
                        "headers": [(b"content-type", content_type.encode("latin-1"))],
                    }
                )
                started = True
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (aiohttp.ClientError, TimeoutError) as error:
            if not started:
                await _respond(send, 502, orjson.dumps({"error": str(error)}))
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", required=True, help="comma-separated worker base URLs")
    parser.add_argument("--interval", type=float, default=0.1, help="snapshot period, seconds")
    args = parser.parse_args(argv)
    import uvicorn

    app = DpProxy([u.rstrip("/") for u in args.workers.split(",") if u], args.interval)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        lifespan="on",
    )


if __name__ == "__main__":
    main()
