"""The baseline the gateway's relay is chosen against: FastAPI + httpx, `client.send(stream=True)`.

The plain relay most Python LLM routers start from (docs/proxy-costs.md), round-robin over the
workers, run on the same uvicorn/uvloop/httptools stack as the gateway. Benchmark use only.

    python benchmarks/naive_relay.py --port 31000 --workers http://127.0.0.1:30001,...
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask


def create_app(workers: list[str]) -> FastAPI:
    cycle = itertools.cycle(workers)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        app.state.client = httpx.AsyncClient(timeout=600, limits=limits)
        yield
        await app.state.client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        client: httpx.AsyncClient = request.app.state.client
        upstream_request = client.build_request(
            "POST",
            next(cycle) + "/v1/chat/completions",
            content=await request.body(),
            headers={"content-type": "application/json"},
        )
        upstream = await client.send(upstream_request, stream=True)
        return StreamingResponse(
            upstream.aiter_raw(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type"),
            background=BackgroundTask(upstream.aclose),
        )

    @app.get("/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", required=True)
    args = parser.parse_args()
    app = create_app(args.workers.split(","))
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, loop="uvloop", http="httptools", log_level="warning"
    )


if __name__ == "__main__":
    main()
