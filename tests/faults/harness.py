"""What every fault test checks (issue 14, "Prove"), and the raw servers and clients it takes.

For each fault: no request is lost, the gateway's counters come back to zero, and nothing is
left behind. "Lost" has one meaning throughout: a request that neither completed nor got an
explicit error (an OpenAI-shaped JSON error, or an SSE error event followed by `data: [DONE]`).

- `outcome()` classifies one chat exchange as its client saw it; `run_load()` runs many.
- `GatewayThread` is the gateway on uvicorn in a thread of this process, so that the tasks on its
  event loop can be listed and what it reports unhandled is seen; `Probe` snapshots what a leak
  would show (in-flight and queue counters, connections and other file descriptors, request
  tasks, RSS) and waits for it to settle.
- `RawWorker` is a worker on a bare asyncio server, for faults no HTTP framework lets a handler
  commit (garbage instead of a status line, a body cut short, a request never answered).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from mineru_gateway.testing import wait_until_async
from tests.support.servers import ServerThread

CHAT = "/v1/chat/completions"
OK = "ok"
# The gateway's own gauges that must be back to zero once no request is left.
ZEROED_SERIES = (
    "mineru_gateway_requests_in_flight",
    "mineru_gateway_queue_requests",
    "mineru_gateway_queue_bytes",
    "mineru_gateway_tenant_requests_in_flight",
)
# What `gateway_counters` reads that is zero when the gateway holds nothing.
HELD = (*ZEROED_SERIES, "workers_in_flight", "workers_estimated_cost")


def chat(stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "\nText Recognition:"}],
        "max_tokens": 16,
        "stream": stream,
        **extra,
    }


# -- what a client got ------------------------------------------------------------------------


def openai_error(body: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI-shaped error body, or None when `body` is not one."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
        return None
    return error if isinstance(error["message"], str) else None


def error_kind(status: int, body: bytes) -> str:
    """`error:<status>:<code>` for an explicit error; `lost: ...` when the body is not one."""
    error = openai_error(body)
    if error is None:
        return f"lost: {status} not in OpenAI's shape: {body[:200]!r}"
    return f"error:{status}:{error['code']}"


def stream_kind(events: Sequence[str]) -> str:
    """`ok`, `stream_error:<code>` (one error event just before [DONE]), or `lost: ...`."""
    if not events or events[-1] != "[DONE]":
        return f"lost: a stream ended without [DONE] after {len(events)} events"
    errors = [(index, openai_error(event.encode())) for index, event in enumerate(events[:-1])]
    found = [(index, error) for index, error in errors if error is not None]
    if not found:
        return OK
    index, error = found[-1]
    if len(found) == 1 and index == len(events) - 2:
        return f"stream_error:{error['code']}"
    return f"lost: error events in the middle of a stream: {events[:6]}"


async def outcome(client: httpx.AsyncClient, url: str, body: Mapping[str, Any]) -> str:
    """What one chat request through the gateway at `url` got."""
    try:
        if body.get("stream"):
            return await _streamed(client, url, body)
        response = await client.post(url + CHAT, json=body)
    except httpx.HTTPError as error:
        return f"lost: {type(error).__name__}: {error}"
    if response.status_code != 200:
        return error_kind(response.status_code, response.content)
    try:
        answered = orjson.loads(response.content).get("choices")
    except (orjson.JSONDecodeError, AttributeError):
        answered = None
    return OK if answered else f"lost: a 200 without choices: {response.content[:200]!r}"


async def _streamed(client: httpx.AsyncClient, url: str, body: Mapping[str, Any]) -> str:
    async with client.stream("POST", url + CHAT, json=body) as response:
        if response.status_code != 200:
            return error_kind(response.status_code, await response.aread())
        events = [
            line.removeprefix("data: ")
            async for line in response.aiter_lines()
            if line.startswith("data: ")
        ]
    return stream_kind(events)


def lost(outcomes: Counter[str]) -> dict[str, int]:
    return {kind: count for kind, count in outcomes.items() if kind.startswith("lost")}


async def run_load(
    url: str,
    bodies: Sequence[Mapping[str, Any]],
    clients: int,
    seconds: float,
    timeout_s: float = 60.0,
) -> Counter[str]:
    """`clients` concurrent loops, each sending `bodies` in turn for `seconds`: the outcomes.

    One connection per client (`max_connections=clients`), as many MinerU processes would."""
    outcomes: Counter[str] = Counter()
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients)

    async def client_loop(client: httpx.AsyncClient, offset: int) -> None:
        turn = offset
        while time.monotonic() < stop_at:
            outcomes[await outcome(client, url, bodies[turn % len(bodies)])] += 1
            turn += 1

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client, index) for index in range(clients)))
    return outcomes


# -- what a leak would show -------------------------------------------------------------------


def fd_count(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or 'self'}/fd"))


def rss_mb(pid: int | None = None) -> float:
    for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def gateway_counters(url: str) -> dict[str, float]:
    """The gateway's in-flight and queue gauges (each summed over its labels), the requests it
    finished (`finished`), and what its `/v1/workers` says is in flight and costed on the
    workers."""
    # A connection each: a loaded gateway's keep-alive deadline (5 s) may close a kept
    # connection just as the second request goes out on it (a ReadError in a full test run).
    # No CA bundle loaded per call (plain HTTP on loopback; loading it is CPU this process may
    # not get for seconds while vLLM's CPU engine runs), and a limit well above the 10-30 s
    # this process has gone without a core beside real vLLM on 2 cores (a CI read timed out).
    no_keepalive = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=url, timeout=120, limits=no_keepalive, verify=False
    ) as client:
        text = (await client.get("/metrics")).text
        workers = (await client.get("/v1/workers")).json()["workers"]
    totals = dict.fromkeys((*ZEROED_SERIES, "finished"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = "finished" if sample.name == "mineru_gateway_requests_total" else sample.name
            if name in totals:
                totals[name] += sample.value
    totals["workers_in_flight"] = sum(worker["in_flight"] for worker in workers)
    totals["workers_estimated_cost"] = sum(worker["estimated_cost"] for worker in workers)
    return totals


async def sim_idle(url: str) -> bool:
    """Nothing open on a simulated worker: whatever the gateway gave up on, it closed (and the
    worker aborted)."""
    async with httpx.AsyncClient(timeout=5) as client:
        state = (await client.get(url + "/sim/state")).json()
    return bool(state["in_flight"] == 0 and state["running"] == 0 and state["waiting"] == 0)


class GatewayThread(ServerThread):
    """The gateway on uvicorn in a daemon thread, with its event loop at hand for task counts,
    and what that loop reported as unhandled (an exception nobody retrieved, a callback that
    raised): `loop_errors`, which must stay empty."""

    def __init__(self, app: Any) -> None:
        super().__init__(app)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_errors: list[str] = []

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=self.config.get_loop_factory()) as runner:
            self.loop = runner.get_loop()
            self.loop.set_exception_handler(self._unhandled)
            runner.run(self.server.serve())

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")
        loop.default_exception_handler(context)

    async def request_tasks(self) -> list[str]:
        """Tasks on the gateway's loop that serve a request (uvicorn's cycle, the relay's
        own): none may outlive their request."""
        assert self.loop is not None
        future = asyncio.run_coroutine_threadsafe(_request_tasks(), self.loop)
        return await asyncio.wrap_future(future)


REQUEST_CODE = ("/mineru_gateway/api/", "/uvicorn/protocols/", "/aiohttp/")


async def _request_tasks() -> list[str]:
    current = asyncio.current_task()
    found = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        if task is not current and code and any(p in code.co_filename for p in REQUEST_CODE):
            found.append(code.co_qualname)
    return sorted(found)


def tcp_ports(pid: int | None = None) -> list[tuple[int, int]]:
    """(local port, remote port) of each TCP socket the process holds (IPv4, from /proc)."""
    base = f"/proc/{pid or 'self'}"
    inodes = set()
    for fd in os.listdir(f"{base}/fd"):
        try:
            target = os.readlink(f"{base}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for line in Path(f"{base}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes:
            ports.append(
                (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16))
            )
    return ports


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


@dataclass(frozen=True)
class Snapshot:
    counters: dict[str, float]
    fds: int
    client_connections: int  # TCP connections with an end at the gateway's port
    worker_connections: int  # TCP connections with an end at a worker's port
    rss_mb: float
    request_tasks: list[str]
    loop_errors: list[str]

    @property
    def other_fds(self) -> int:
        return self.fds - self.client_connections - self.worker_connections


@dataclass(frozen=True)
class Probe:
    """Where the leak checks look: the gateway's URL, its workers' URLs, the process that holds
    its descriptors and memory (None: this one), and its thread when it runs in this one."""

    url: str
    workers: Sequence[str]
    pid: int | None = None
    thread: GatewayThread | None = None

    async def snapshot(self) -> Snapshot:
        tasks = await self.thread.request_tasks() if self.thread else []
        counters = await gateway_counters(self.url)
        gateway, workers = port_of(self.url), {port_of(url) for url in self.workers}
        connections = [ports for ports in tcp_ports(self.pid) if ports[1] != 0]  # not LISTEN
        return Snapshot(
            counters,
            fd_count(self.pid),
            sum(gateway in ports for ports in connections),
            sum(bool(workers.intersection(ports)) for ports in connections),
            rss_mb(self.pid),
            tasks,
            list(self.thread.loop_errors) if self.thread else [],
        )

    async def settled(
        self, baseline: Snapshot, concurrency: int, within_s: float = 30.0
    ) -> Snapshot:
        """Waits until every counter is zero, no request task and no client connection is
        left, the connections to workers are within what `concurrency` clients can have opened,
        and every other descriptor is back to `baseline` (a margin of 2 for a probe under way);
        returns that snapshot, or fails saying what did not settle.

        The bound on connections to workers: aiohttp's pool keeps idle connections as long as
        probes and scrapes reuse them in turn (it takes the oldest first), up to the most a
        worker ever had open at once: each client's request plus a probe and a scrape, counted
        at both ends when the worker runs in this process. A connection lost per request
        would pass it within a few hundred requests."""
        pool_limit = 2 * len(self.workers) * (concurrency + 2)
        last: list[Snapshot] = []

        async def clean() -> bool:
            last[:] = [now := await self.snapshot()]
            idle = not any(now.counters[name] for name in HELD) and not now.request_tasks
            assert not now.loop_errors, now.loop_errors
            connections = now.client_connections == 0 and now.worker_connections <= pool_limit
            return idle and connections and now.other_fds <= baseline.other_fds + 2

        try:
            await wait_until_async(clean, within_s, "the gateway to settle", poll=0.25)
        except TimeoutError:
            raise AssertionError(f"not settled: {last[0]} (baseline {baseline})") from None
        return last[0]


# -- a worker on raw sockets --------------------------------------------------------------------


@dataclass(frozen=True)
class RawRequest:
    path: bytes
    body: bytes

    @property
    def stream(self) -> bool:
        return orjson.loads(self.body).get("stream") is True


Writer = asyncio.StreamWriter
# Answers one request whose head and body have been read. True keeps the connection for the
# next request; False closes it.
Handler = Callable[[RawRequest, asyncio.StreamReader, Writer], Awaitable[bool]]


def response(status: int, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 %d Scripted\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
    return head % (status, content_type, len(body)) + body


def answer(status: int, body: bytes, content_type: bytes = b"application/json") -> Handler:
    """A whole answer on a keep-alive connection (a worker's 5xx, say)."""
    data = response(status, body, content_type)

    async def handle(request: RawRequest, reader: asyncio.StreamReader, writer: Writer) -> bool:
        writer.write(data)
        await writer.drain()
        return True

    return handle


def send_and_close(*parts: bytes) -> Handler:
    """Writes `parts` (garbage, or an answer cut short) a moment apart, so that the gateway
    reads each on its own, then closes the connection."""

    async def handle(request: RawRequest, reader: asyncio.StreamReader, writer: Writer) -> bool:
        for index, part in enumerate(parts):
            if index:
                await asyncio.sleep(0.05)
            writer.write(part)
            await writer.drain()
        return False

    return handle


async def answer_then_reset(
    request: RawRequest, reader: asyncio.StreamReader, writer: Writer
) -> bool:
    """A whole, good stream (its head first, the rest a moment later, as a worker streams),
    then a reset (RST) of the connection the gateway would reuse: a worker killed with data
    unread, or a middlebox dropping idle connections."""
    for part in (STREAM_HEAD, chunk(SSE_ANSWER) + b"0\r\n\r\n"):
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.05)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    return False


async def never_answer(request: RawRequest, reader: asyncio.StreamReader, writer: Writer) -> bool:
    """Accepts the request and says nothing until the gateway gives up and closes."""
    await reader.read()
    return False


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
CHAT_ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "model": "raw-model",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }
)
SSE_ANSWER = b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve_ok(request: RawRequest, reader: asyncio.StreamReader, writer: Writer) -> bool:
    """A well-formed chat answer, streamed or whole, as the request asked."""
    if request.stream:
        writer.write(STREAM_HEAD + chunk(SSE_ANSWER) + b"0\r\n\r\n")
    else:
        writer.write(response(200, CHAT_ANSWER))
    await writer.drain()
    return True


class RawWorker:
    """A worker on a bare asyncio server: `/health` and `/v1/models` as vLLM answers them,
    completions by `on_completion`, `/metrics` by `on_metrics` (an empty 200 by default).

    `open` counts the connections still open by the kind of request they last carried
    (`completion`, `metrics`, `other`), `most_open` the most seen at once: a gateway that gives
    up on an answer must close its connection, or they pile up here."""

    def __init__(
        self, on_completion: Handler, on_metrics: Handler | None = None, model: str = "raw-model"
    ) -> None:
        self.on_completion = on_completion
        self.on_metrics = on_metrics or answer(200, b"", b"text/plain")
        self.model = model
        self.completions = 0
        self.open: Counter[str] = Counter()
        self.most_open: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], Writer] = {}

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for writer in self._connections.values():
            writer.transport.abort()  # a handler blocked on a read then sees the connection end
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: Writer) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        kind: str | None = None
        try:
            while (request := await _read_request(reader)) is not None:
                kind = self._count(kind, _kind(request.path))
                if not await self._handle(request, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the gateway closed the connection: what is being tested
        finally:
            self._count(kind, None)
            writer.close()
            self._connections.pop(task, None)

    def _count(self, before: str | None, now: str | None) -> str | None:
        if before is not None:
            self.open[before] -= 1
        if now is not None:
            self.open[now] += 1
            self.most_open[now] = max(self.most_open[now], self.open[now])
        return now

    async def _handle(
        self, request: RawRequest, reader: asyncio.StreamReader, writer: Writer
    ) -> bool:
        if request.path in (b"/v1/chat/completions", b"/v1/completions"):
            self.completions += 1
            return await self.on_completion(request, reader, writer)
        if request.path == b"/metrics":
            return await self.on_metrics(request, reader, writer)
        body = b""
        if request.path == b"/v1/models":
            body = orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
        writer.write(response(200, body))
        await writer.drain()
        return True


def _kind(path: bytes) -> str:
    if path.startswith(b"/v1/") and path.endswith(b"completions"):
        return "completion"
    return "metrics" if path == b"/metrics" else "other"


CONTENT_LENGTH = re.compile(rb"(?im)^content-length:\s*(\d+)\s*$")


async def _read_request(reader: asyncio.StreamReader) -> RawRequest | None:
    """The next request on a connection (aiohttp frames its bodies by length), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = CONTENT_LENGTH.search(head)
    body = await reader.readexactly(int(length[1])) if length else b""
    return RawRequest(head.split(b" ", 2)[1], body)


class Firehose:
    """A completion handler that streams large SSE events as fast as the gateway takes them,
    for ever, and counts the bytes it got written: how far a slow reader's backpressure
    reaches."""

    EVENT = chunk(b"data: " + b"x" * 65_000 + b"\n\n")

    def __init__(self) -> None:
        self.written = 0

    async def __call__(
        self, request: RawRequest, reader: asyncio.StreamReader, writer: Writer
    ) -> bool:
        writer.write(STREAM_HEAD)
        while True:
            writer.write(self.EVENT)
            await writer.drain()  # returns once the kernel took it: the gateway is reading
            self.written += len(self.EVENT)


# -- clients on raw sockets -------------------------------------------------------------------


def http_request(path: str, body: bytes = b"", method: str = "POST") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    return head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body


def address(url: str) -> tuple[str, int]:
    return "127.0.0.1", port_of(url)
