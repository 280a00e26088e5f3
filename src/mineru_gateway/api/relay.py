"""The relay: `POST /v1/chat/completions` and `POST /v1/completions`, as a lean ASGI endpoint.

It sits below FastAPI's request/response machinery on purpose: every streamed token crosses this
code, and a raw ASGI relay costs less per event than a framework route with StreamingResponse
(DESIGN.md section 9). It also gives exact control over the two things users of other gateways
complain about most: a client that goes away cancels the upstream request at once (streaming or
not, before or after the first token), and every counter is released in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

import structlog

from mineru_gateway.api.context import GatewayContext
from mineru_gateway.api.requests import (
    ClientDisconnected,
    Endpoint,
    ParsedRequest,
    Receive,
    parse_request,
    read_body,
)
from mineru_gateway.errors import GatewayError, UpstreamConnectError
from mineru_gateway.workers.upstream import UpstreamResponse

Scope = MutableMapping[str, Any]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

log = structlog.get_logger("mineru_gateway.access")

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class Exchange:
    """One client exchange: what has been sent, to whom, and when (for errors, logs, metrics)."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id
        self.status: int | None = None
        self.streaming = False
        self.complete = False
        self.worker: str | None = None
        self.attempts = 0
        self.received = time.perf_counter()
        self.first_chunk: float | None = None

    async def start(self, status: int, content_type: str) -> None:
        self.status = status
        self.streaming = content_type.startswith("text/event-stream")
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"x-request-id", self.request_id.encode("latin-1")),
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        if self.first_chunk is None:
            self.first_chunk = time.perf_counter()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": False})
        self.complete = True

    async def respond(self, status: int, content_type: str, body: bytes) -> None:
        await self.start(status, content_type)
        await self.finish(body)

    async def fail(self, error: GatewayError) -> None:
        """Reports `error` the only way still open: a JSON error before the headers went out, an
        SSE error event (vLLM's own mid-stream form) after them."""
        if self.complete:
            return
        if self.status is None:
            await self.respond(error.status, "application/json", error.body_bytes())
        elif self.streaming:
            event = b"data: " + error.body_bytes() + b"\n\ndata: [DONE]\n\n"
            await self.finish(event)
        else:
            await self.finish()


class Relay:
    """ASGI endpoint relaying one OpenAI endpoint to a chosen worker."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.path = PATHS[endpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context: GatewayContext = scope["state"]["gateway"]
        headers = dict(scope["headers"])
        exchange = Exchange(send, _request_id(headers))
        request: ParsedRequest | None = None
        outcome = "ok"
        try:
            body = await read_body(
                receive, _content_length(headers), context.settings.max_body_bytes
            )
            request = parse_request(self.endpoint, body)
            upstream_headers = _upstream_headers(headers, exchange.request_id)
            await _until_done_or_disconnect(
                self._proxy(context, request, upstream_headers, exchange), receive, exchange
            )
        except ClientDisconnected:
            outcome = "client_disconnected"
        except GatewayError as error:
            outcome = error.code
            await exchange.fail(error)
        finally:
            _log_exchange(exchange, request, outcome)

    async def _proxy(
        self,
        context: GatewayContext,
        request: ParsedRequest,
        headers: dict[str, str],
        exchange: Exchange,
    ) -> None:
        tried: list[str] = []
        while True:
            worker = context.registry.choose(request.model, exclude=tried)
            tried.append(worker.url)
            exchange.attempts = len(tried)
            with context.registry.lease(worker):
                try:
                    upstream = await context.client.post(
                        worker.url + self.path, request.body, headers
                    )
                except UpstreamConnectError as error:
                    context.registry.mark_unreachable(worker, error)
                    if len(tried) > context.settings.connect_retries:
                        raise
                    continue
                exchange.worker = worker.url
                try:
                    await _relay_response(upstream, exchange)
                finally:
                    upstream.close()
                return


async def _relay_response(upstream: UpstreamResponse, exchange: Exchange) -> None:
    if upstream.status == 200 and upstream.is_event_stream:
        await exchange.start(200, upstream.content_type)
        async for chunk in upstream.iter_chunks():
            await exchange.chunk(chunk)
        await exchange.finish()
    else:
        # Non-streaming answers and worker errors (a vLLM 400 for a too-long prompt, say) are
        # passed back with the worker's own status and body.
        body = await upstream.read()
        await exchange.respond(upstream.status, upstream.content_type, body)


async def _until_done_or_disconnect(
    work: Coroutine[Any, Any, None], receive: Receive, exchange: Exchange
) -> None:
    """Runs `work`, cancelling it the moment the client disconnects.

    Cancelling closes the upstream connection (in `_proxy`'s `finally`), which is what makes vLLM
    abort the generation and free its KV cache.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((work_task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done() and not exchange.complete:
            work_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    try:
        await work_task
    except asyncio.CancelledError:
        raise ClientDisconnected from None


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _request_id(headers: dict[bytes, bytes]) -> str:
    given = headers.get(b"x-request-id")
    if given and len(given) <= 128:
        return given.decode("latin-1")
    return uuid.uuid4().hex


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    return int(value) if value and value.isdigit() else None


def _upstream_headers(headers: dict[bytes, bytes], request_id: str) -> dict[str, str]:
    forwarded = {"Content-Type": "application/json", "X-Request-Id": request_id}
    authorization = headers.get(b"authorization")
    if authorization:
        forwarded["Authorization"] = authorization.decode("latin-1")
    return forwarded


def _log_exchange(exchange: Exchange, request: ParsedRequest | None, outcome: str) -> None:
    now = time.perf_counter()
    ttft = exchange.first_chunk - exchange.received if exchange.first_chunk else None
    log.info(
        "request",
        request_id=exchange.request_id,
        model=request.model if request else None,
        stream=request.stream if request else None,
        worker=exchange.worker,
        attempts=exchange.attempts,
        status=exchange.status,
        outcome=outcome,
        latency_ms=round((now - exchange.received) * 1000, 2),
        ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
    )
