"""A scriptable worker for fault and pass-through tests: a small real ASGI app, not a mock.

It speaks enough of vLLM's protocol for the gateway (`/health`, `/v1/models`, the completion
endpoints) and can be told how to misbehave. The simulator covers realistic behaviour; this covers
what a simulator should never do (hang, die mid-stream, echo what it received).
"""

from __future__ import annotations

import asyncio
import hashlib
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


def scripted_worker(script: Script) -> Starlette:
    async def health(request: Request) -> Response:
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
