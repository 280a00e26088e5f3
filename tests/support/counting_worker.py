"""A worker that counts what it holds: how many requests are on it at once, and the most ever.

Each completion is held `hold_s` and then answered (an OpenAI-shaped chat completion), so a
load drains; `peak` is the figure a limit on requests in flight is checked against, counted
where it matters, at the worker. A small real ASGI app, like tests/support/workers.py's.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ANSWER = {
    "id": "chatcmpl-counted",
    "object": "chat.completion",
    "model": "counting-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


@dataclass
class Counts:
    hold_s: float = 0.2
    model: str = "counting-model"
    now: int = 0
    peak: int = 0
    served: int = 0

    def reset_peak(self) -> None:
        self.peak = self.now


def counting_worker(counts: Counts) -> Starlette:
    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        card = {"id": counts.model, "object": "model", "owned_by": "vllm", "root": counts.model}
        return JSONResponse({"object": "list", "data": [card]})

    async def completion(request: Request) -> Response:
        await request.body()
        counts.now += 1
        counts.peak = max(counts.peak, counts.now)
        try:
            await asyncio.sleep(counts.hold_s)
        finally:
            counts.now -= 1
        counts.served += 1
        return JSONResponse(ANSWER | {"model": counts.model})

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/chat/completions", completion, methods=["POST"]),
    ]
    return Starlette(routes=routes)
