"""A scriptable worker for fault and pass-through tests: a small real ASGI app, not a mock.

It speaks enough of vLLM's protocol for the gateway (`/health`, `/v1/models`, the completion
endpoints) and can be told how to misbehave. The simulator covers realistic behaviour; this covers
what a simulator should never do (hang, die mid-stream, echo what it received).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Script:
    """What the worker does with the next completion request (tests change it between calls)."""

    mode: str = "echo"  # echo | hang | stream_then_hang | stream_then_die | status
    status: int = 500
    model: str = "echo-model"
    seen: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    healthy: bool = True
    health_delay_s: float = 0.0  # /health answers this late (a worker busy with a full batch)


def scripted_worker(script: Script) -> Starlette:
    async def health(request: Request) -> Response:
        await asyncio.sleep(script.health_delay_s)
        return Response(status_code=200 if script.healthy else 503)

    async def models(request: Request) -> Response:
        card = {"id": script.model, "object": "model", "owned_by": "vllm", "root": script.model}
        return JSONResponse({"object": "list", "data": [card]})

    async def completion(request: Request) -> Response:
        body = await request.body()
        script.seen.append(
            {
                "sha256": hashlib.sha256(body).hexdigest(),
                "size": len(body),
                "headers": dict(request.headers),
            }
        )
        if script.mode == "hang":
            return await _hang(request, script)
        if script.mode == "status":
            error = {"error": {"message": "scripted", "type": "X", "param": None, "code": 1}}
            return JSONResponse(error, status_code=script.status)
        if script.mode in ("stream_then_hang", "stream_then_die"):
            return StreamingResponse(_stream(script), media_type="text/event-stream")
        payload = orjson.loads(body)
        echo = {"received": payload, "sha256": script.seen[-1]["sha256"]}
        return Response(orjson.dumps(echo), media_type="application/json")

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", completion, methods=["POST"]),
        Route("/v1/completions", completion, methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def _hang(request: Request, script: Script) -> Response:
    # Like vLLM's `with_cancellation`: a non-streaming handler notices its client leaving.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    script.cancelled += 1
    return Response()


async def _stream(script: Script) -> Any:
    yield b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    if script.mode == "stream_then_die":
        raise RuntimeError("worker died mid-stream")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        script.cancelled += 1
        raise


class DroppingWorker:
    """A worker that passes health checks but drops every completion request unanswered.

    A raw asyncio server, because an ASGI app cannot close a connection without answering: it
    stands for a worker that dies after accepting a request (a crash, a kill -9, an OOM).
    """

    def __init__(self, model: str = "echo-model") -> None:
        self.model = model
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None
        self.url = ""

    def start(self) -> str:
        self._thread.start()
        self._ready.wait(10)
        return self.url

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        # One turn first: a connection accepted just before the stop has a handler task that has
        # not started yet, and a task cancelled before it starts never reaches its `finally`, so
        # its socket would be left open (a ResourceWarning, which the tests treat as an error).
        self._loop.run_until_complete(asyncio.sleep(0))
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._server.wait_closed())
        self._loop.run_until_complete(asyncio.sleep(0))  # the closed transports' last callbacks
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                length = _content_length(head)
                if length:
                    await reader.readexactly(length)
                if path.startswith(b"/v1/completions") or path.startswith(b"/v1/chat"):
                    self.dropped += 1
                    return
                payload = b""
                if path == b"/v1/models":
                    card = {"id": self.model, "object": "model", "owned_by": "vllm"}
                    payload = orjson.dumps({"object": "list", "data": [card]})
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + b"content-length: %d\r\n\r\n" % len(payload)
                    + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0
