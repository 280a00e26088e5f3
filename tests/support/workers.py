"""A scriptable worker for fault and pass-through tests: a small real ASGI app, not a mock.

It speaks enough of vLLM's protocol for the gateway (`/health`, `/v1/models`, the completion
endpoints) and can be told how to misbehave. The simulator covers realistic behaviour; this covers
what a simulator should never do (hang, die mid-stream, echo what it received).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import socketserver
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

    mode: str = "echo"  # echo | hang | stream_then_hang | stream_then_die | flood | status
    status: int = 500
    events: int = 1000  # flood: this many numbered SSE events, as fast as they can be written
    model: str = "echo-model"
    seen: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    healthy: bool = True
    health_delay_s: float = 0.0  # /health answers this late (a worker busy with a full batch)
    metrics: bytes | None = None  # what /metrics answers (404 when None); no `/metrics/` mount


def scripted_worker(script: Script) -> Starlette:
    async def health(request: Request) -> Response:
        await asyncio.sleep(script.health_delay_s)
        return Response(status_code=200 if script.healthy else 503)

    async def models(request: Request) -> Response:
        card = {"id": script.model, "object": "model", "owned_by": "vllm", "root": script.model}
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        if script.metrics is None:
            return Response(status_code=404)
        return Response(script.metrics, media_type="text/plain; version=0.0.4")

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
        if script.mode == "flood":
            return StreamingResponse(_flood(script.events), media_type="text/event-stream")
        payload = orjson.loads(body)
        echo = {"received": payload, "sha256": script.seen[-1]["sha256"]}
        return Response(orjson.dumps(echo), media_type="application/json")

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
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


def flood_event(number: int) -> bytes:
    """Event `number` of a flood: a chat delta naming its number, padded to about 150 bytes."""
    delta = {"content": f"{number:08d}" + "x" * 64}
    return b"data: " + orjson.dumps({"n": number, "choices": [{"delta": delta}]}) + b"\n\n"


async def _flood(events: int) -> Any:
    for number in range(events):
        yield flood_event(number)
    yield b"data: [DONE]\n\n"


class DroppingWorker:
    """A worker that passes health checks but drops every completion request unanswered.

    A plain threaded TCP server, because an ASGI app cannot close a connection without answering:
    it stands for a worker that dies after accepting a request (a crash, a kill -9, an OOM).
    Threads, not asyncio, on purpose: socketserver closes every accepted socket itself, while an
    asyncio server stopped right after an accept leaks that socket (Python 3.11: the accept's
    task finds the server closed), a ResourceWarning the tests treat as an error (seen in CI).
    """

    def __init__(self, model: str = "echo-model") -> None:
        self.model = model
        self.dropped = 0
        self.url = ""
        self.stopping = threading.Event()
        self._lock = threading.Lock()  # connections run in threads of their own
        self._server = _ThreadingServer(("127.0.0.1", 0), _dropping_handler(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> str:
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread.start()
        return self.url

    def stop(self) -> None:
        self.stopping.set()  # open keep-alive connections end within one read timeout
        self._server.shutdown()
        self._server.server_close()  # joins the connections' threads
        self._thread.join(10)

    def answer(self, head: bytes) -> bytes | None:
        """The response to a request whose head is `head`; None drops the connection."""
        path = head.split(b" ", 2)[1]
        if path.startswith(b"/v1/completions") or path.startswith(b"/v1/chat"):
            with self._lock:
                self.dropped += 1
            return None
        payload = b""
        if path == b"/v1/models":
            card = {"id": self.model, "object": "model", "owned_by": "vllm"}
            payload = orjson.dumps({"object": "list", "data": [card]})
        return (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + b"content-length: %d\r\n\r\n" % len(payload)
            + payload
        )


class _ThreadingServer(socketserver.ThreadingTCPServer):
    daemon_threads = False
    block_on_close = True  # server_close() waits for every connection's thread
    allow_reuse_address = True


def _dropping_handler(worker: DroppingWorker) -> type[socketserver.BaseRequestHandler]:
    class Connection(socketserver.BaseRequestHandler):
        """Keep-alive HTTP/1.1 requests, one at a time; returning closes the socket."""

        def handle(self) -> None:
            sock: socket.socket = self.request
            sock.settimeout(0.05)
            buffer = b""
            while not worker.stopping.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return
                buffer += data
                while (end := buffer.find(b"\r\n\r\n")) >= 0:
                    head = buffer[:end]
                    request_end = end + 4 + _content_length(head)
                    if len(buffer) < request_end:
                        break  # the body is still coming
                    buffer = buffer[request_end:]
                    response = worker.answer(head)
                    if response is None:
                        return
                    sock.sendall(response)

    return Connection


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0
