"""The soak's faults. Each runs for one window while the load goes on, and undoes itself.

Worker processes are faulted with signals (`SimFleet`); misbehaving workers are lent to the
gateway for the window through its admin API (`FaultWorker`, `lend`); misbehaving clients are
made here on raw sockets (`slow_readers`, `disconnect_burst`, `idle_connections`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from benchmarks.routing import fleet
from benchmarks.routing.loadgen import CHAT

from mineru_gateway.testing import free_port, free_port_block, wait_http_ok

FIREHOSE_MODEL = "soak-firehose"  # only slow readers ask for it, so only they reach the firehose


# -- simulated workers that can be killed, frozen and restarted ------------------------------


class SimFleet:
    """Simulated workers on ports of their own, below the ephemeral range so that a restarted
    worker gets its port back."""

    def __init__(self, procs: fleet.Processes, count: int, time_scale: float) -> None:
        self.procs = procs
        self.time_scale = time_scale
        base = free_port_block(count)
        self.urls = [f"http://127.0.0.1:{base + index}" for index in range(count)]
        self.handles: list[Any] = [None] * count

    def start(self, index: int) -> None:
        port = self.urls[index].rsplit(":", 1)[1]
        argv = [
            sys.executable,
            *("-m", "mineru_gateway", "sim", "--port", port, "--model-name", fleet.MODEL),
            *("--time-scale", str(self.time_scale), "--seed", str(index), "--log-level", "warning"),
        ]
        self.handles[index] = self.procs.spawn(f"sim-{index}", argv)

    async def ready(self, index: int) -> None:
        url, handle = self.urls[index] + "/health", self.handles[index]
        await asyncio.to_thread(wait_http_ok, url, fleet.READY_TIMEOUT_S, handle)

    def signal(self, index: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.handles[index].pid, sig)

    def stop_all(self) -> None:
        for index in range(len(self.urls)):
            self.signal(index, signal.SIGCONT)  # a frozen worker would not handle its SIGTERM
            self.procs.stop(self.handles[index])


async def kill_and_restart(sims: SimFleet, index: int, seconds: float) -> dict[str, Any]:
    """kill -9 under load; the worker comes back on its port after half the window."""
    sims.signal(index, signal.SIGKILL)
    await asyncio.to_thread(sims.handles[index].wait)
    await asyncio.sleep(seconds / 2)
    sims.start(index)
    await sims.ready(index)
    await asyncio.sleep(seconds / 2)
    return {"worker": sims.urls[index]}


async def freeze(sims: SimFleet, index: int, seconds: float) -> dict[str, Any]:
    """SIGSTOP: the worker's connections are accepted (by the kernel) and never answered."""
    sims.signal(index, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        sims.signal(index, signal.SIGCONT)
    return {"worker": sims.urls[index]}


# -- a misbehaving worker lent to the gateway ------------------------------------------------

VLLM_503 = orjson.dumps(
    {"error": {"message": "engine dead", "type": "EngineDeadError", "param": None, "code": 503}}
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
ANSWER = orjson.dumps(
    {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)
LENGTH = re.compile(rb"(?im)^content-length:\s*(\d+)")


def _answer(status: int, body: bytes, kind: bytes = b"application/json") -> bytes:
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {kind.decode()}\r\ncontent-length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class FaultWorker:
    """A worker on a bare asyncio server that passes health checks and, on completions (or
    its /metrics), does what `mode` says: `storm` (503 in vLLM's shape), `garbage` (bytes that
    are not HTTP, then a close), `cut` (a stream closed after its first event), `silent`
    (reads the request, never answers), `metrics_hang` (answers completions, never /metrics),
    `firehose` (an endless fast stream, for FIREHOSE_MODEL only)."""

    mode: str = "storm"
    window_s: float = 20.0  # nothing here hangs for longer than a window
    url: str = ""
    served: int = 0
    _server: asyncio.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> str:
        port = free_port()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the gateway went away, as it should when it gives up
        except asyncio.CancelledError:
            pass  # stopped: the connection just closes
        finally:
            writer.close()
            self._handlers.discard(task)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        length = LENGTH.search(head)
        if length:
            await reader.readexactly(int(length[1]))
        path = head.split(b" ", 2)[1]
        act = self._completion if path.endswith(b"completions") else self._control
        return await act(path, writer)

    async def _control(self, path: bytes, writer: asyncio.StreamWriter) -> bool:
        if path == b"/metrics" and self.mode == "metrics_hang":
            await asyncio.sleep(self.window_s)
            return False
        body = b""
        if path == b"/v1/models":
            model = FIREHOSE_MODEL if self.mode == "firehose" else fleet.MODEL
            body = orjson.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})
        writer.write(
            _answer(200, body, b"text/plain" if path == b"/metrics" else b"application/json")
        )
        await writer.drain()
        return True

    async def _completion(self, path: bytes, writer: asyncio.StreamWriter) -> bool:
        self.served += 1
        act = COMPLETION_MODES[self.mode]
        return await act(self, writer)


async def _storm(worker: FaultWorker, writer: asyncio.StreamWriter) -> bool:
    writer.write(_answer(503, VLLM_503))
    await writer.drain()
    return True


async def _garbage(worker: FaultWorker, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"\x00\xffnot HTTP at all\r\n\r\n")
    await writer.drain()
    return False


async def _cut(worker: FaultWorker, writer: asyncio.StreamWriter) -> bool:
    writer.write(SSE_HEAD + _chunked(EVENT))
    await writer.drain()
    await asyncio.sleep(0.05)
    return False


async def _silent(worker: FaultWorker, writer: asyncio.StreamWriter) -> bool:
    await asyncio.sleep(worker.window_s)
    return False


async def _serve_ok(worker: FaultWorker, writer: asyncio.StreamWriter) -> bool:
    writer.write(_answer(200, ANSWER))
    await writer.drain()
    return True


async def _firehose(worker: FaultWorker, writer: asyncio.StreamWriter) -> bool:
    writer.write(SSE_HEAD)
    event = _chunked(b"data: " + b"x" * 16_000 + b"\n\n")
    ends = time.monotonic() + worker.window_s
    while time.monotonic() < ends:
        writer.write(event)
        await writer.drain()
    return False


COMPLETION_MODES: dict[str, Callable[[FaultWorker, asyncio.StreamWriter], Awaitable[bool]]] = {
    "storm": _storm,
    "garbage": _garbage,
    "cut": _cut,
    "silent": _silent,
    "metrics_hang": _serve_ok,
    "firehose": _firehose,
}


@asynccontextmanager
async def lend(gateway: str, admin_key: str, worker: FaultWorker, mode: str) -> AsyncIterator[None]:
    """`worker`, in `mode`, in the gateway's routing for the block (POST then DELETE
    /v1/workers with the admin key)."""
    worker.mode = mode
    headers = {"Authorization": f"Bearer {admin_key}"}
    body = {"url": worker.url}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.post(gateway + "/v1/workers", json=body) as response:
            response.raise_for_status()
        try:
            yield
        finally:
            async with session.delete(gateway + "/v1/workers", json=body) as response:
                response.raise_for_status()


async def lent_for(
    gateway: str, admin_key: str, worker: FaultWorker, mode: str, seconds: float
) -> dict[str, Any]:
    async with lend(gateway, admin_key, worker, mode):
        served = worker.served
        await asyncio.sleep(seconds)
    return {"worker": worker.url, "completions_it_got": worker.served - served}


# -- misbehaving clients ----------------------------------------------------------------------


def _request(body: dict[str, Any]) -> bytes:
    data = orjson.dumps(body)
    head = f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    return head.encode() + b"content-length: %d\r\n\r\n" % len(data) + data


def _address(url: str) -> tuple[str, int]:
    return "127.0.0.1", int(url.rsplit(":", 1)[1])


LONG = {
    "messages": [{"role": "user", "content": "\nText Recognition:"}],
    "max_tokens": 4000,
    "ignore_eos": True,
    "stream": True,
}


async def slow_readers(gateway: str, count: int, seconds: float) -> dict[str, Any]:
    """`count` clients reading an endless fast stream 4 KiB a second."""

    async def one() -> int:
        reader, writer = await asyncio.open_connection(*_address(gateway), limit=4096)
        writer.write(_request({**LONG, "model": FIREHOSE_MODEL}))
        got = 0
        ends = time.monotonic() + seconds
        while time.monotonic() < ends and (data := await reader.read(4096)):
            got += len(data)
            await asyncio.sleep(1.0)
        writer.close()
        return got

    read = await asyncio.gather(*(one() for _ in range(count)))
    return {"clients": count, "bytes_read": sum(read)}


async def disconnect_burst(gateway: str, count: int, hold_s: float) -> dict[str, Any]:
    """`count` long requests, all abandoned in the same instant `hold_s` later (half reset)."""
    writers = await _open(gateway, count)
    for writer in writers:
        writer.write(_request(LONG))
    await asyncio.sleep(hold_s)
    for index, writer in enumerate(writers):
        writer.transport.abort() if index % 2 else writer.close()
    return {"clients": count}


async def idle_connections(gateway: str, count: int, seconds: float) -> dict[str, Any]:
    """`count` connections that send nothing (or half a request head) for the window."""
    writers = await _open(gateway, count)
    for writer in writers[::2]:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
    await asyncio.sleep(seconds)
    for writer in writers:
        writer.close()
    return {"connections": count}


async def _open(gateway: str, count: int) -> list[asyncio.StreamWriter]:
    """Connections in batches: the gateway's accept queue is finite."""
    writers: list[asyncio.StreamWriter] = []
    for start in range(0, count, 250):
        batch = min(count, start + 250) - start
        opened = await asyncio.gather(
            *(asyncio.open_connection(*_address(gateway)) for _ in range(batch))
        )
        writers += [writer for _, writer in opened]
    return writers
