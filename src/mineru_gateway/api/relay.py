"""The relay: `POST /v1/chat/completions` and `POST /v1/completions`, as a lean ASGI endpoint.

It sits below FastAPI's request/response machinery on purpose: every streamed token crosses this
code, and a raw ASGI relay costs less per event than a framework route with StreamingResponse
(DESIGN.md section 9). It also gives exact control over what users of other gateways complain
about most: a client that goes away cancels the upstream request at once (streaming or not,
before or after the first token), and every counter is released in `finally`.

Retries: a request is sent to another worker only while nothing of it has reached the client (no
status line yet): when the worker cannot be connected to, or drops the connection before its first
byte of answer. Inference has no side effects, so that is always safe; after the first byte, a
failure ends the stream with an SSE error event instead. Response headers of a stream are held
until its first chunk, so a worker dying while the request waits in its queue is still retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any

import orjson
import structlog

from mineru_gateway.api.auth import check_api_key, upstream_authorization
from mineru_gateway.api.context import GatewayContext
from mineru_gateway.api.requests import (
    ClientDisconnected,
    Endpoint,
    ParsedRequest,
    Receive,
    parse_request,
    read_body,
)
from mineru_gateway.errors import (
    GatewayError,
    ShuttingDown,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from mineru_gateway.metrics import GatewayMetrics, Series
from mineru_gateway.workers.registry import Lease
from mineru_gateway.workers.upstream import UpstreamResponse

Scope = MutableMapping[str, Any]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

log = structlog.get_logger("mineru_gateway.access")

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# One streamed token, as vLLM writes it: a chat delta with content, or a completion's text.
TOKEN_MARKERS: dict[Endpoint, bytes] = {"chat": b'{"content":', "completions": b'"text":'}
USAGE_MARKER = b'"usage":{'


class Exchange:
    """One client exchange: what has been sent, to whom and when (for errors, logs, metrics)."""

    def __init__(self, send: Send, request_id: str, endpoint: Endpoint) -> None:
        self._send = send
        self.request_id = request_id
        self.endpoint = endpoint
        self.status: int | None = None
        self.streaming = False
        self.complete = False
        self.worker: str | None = None
        self.attempts = 0
        self.received = time.perf_counter()
        self.upstream_sent: float | None = None
        self.first_chunk: float | None = None
        self.last_chunk = 0.0
        self.finished: float | None = None
        self.tokens = 0  # counted from the stream
        self.usage: dict[str, Any] | None = None
        self._itl: Series | None = None

    async def start(self, status: int, content_type: str) -> None:
        self.status = status
        self.streaming = content_type.startswith("text/event-stream")
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"x-request-id", self.request_id.encode("latin-1")),
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.first_chunk is None:
            self.first_chunk = now
        elif self._itl is not None:
            self._itl.observe(now - self.last_chunk)
        self.last_chunk = now
        self.tokens += data.count(TOKEN_MARKERS[self.endpoint])
        if USAGE_MARKER in data:
            self.usage = _stream_usage(data) or self.usage
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def measure_gaps(self, series: Series) -> None:
        """From now on, every gap between chunks goes to `series` (inter-token latency)."""
        self._itl = series

    async def finish(self, data: bytes = b"") -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": False})
        self.complete = True
        self.finished = time.perf_counter()

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


class _Retry(Exception):
    """The attempt failed before any byte reached the client: another worker may take it."""

    def __init__(self, reason: str, error: UpstreamError, *, eject_now: bool) -> None:
        super().__init__(str(error))
        self.reason = reason
        self.error = error
        self.eject_now = eject_now


class Relay:
    """ASGI endpoint relaying one OpenAI endpoint to a chosen worker."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.path = PATHS[endpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context: GatewayContext = scope["state"]["gateway"]
        headers = dict(scope["headers"])
        exchange = Exchange(send, _request_id(headers), self.endpoint)
        request: ParsedRequest | None = None
        outcome = "ok"
        try:
            if context.lifecycle.draining:
                raise ShuttingDown("the gateway is shutting down; retry on another replica")
            check_api_key(context.settings, headers.get(b"authorization"))
            body = await read_body(
                receive, _content_length(headers), context.settings.max_body_bytes
            )
            request = parse_request(self.endpoint, body)
            upstream_headers = _upstream_headers(context, headers, exchange.request_id)
            await _until_done_or_disconnect(
                self._proxy(context, request, upstream_headers, exchange), receive, exchange
            )
        except ClientDisconnected:
            outcome = "client_disconnected"
        except GatewayError as error:
            outcome = error.code
            await exchange.fail(error)
        except Exception:
            # The relay's top-level handler (it runs outside FastAPI's): a bug becomes an
            # OpenAI-style 500 (or an SSE error event mid-stream), logged with its traceback.
            outcome = "internal_error"
            log.exception("unhandled_error", request_id=exchange.request_id, path=self.path)
            await exchange.fail(GatewayError("internal gateway error"))
        finally:
            _record(context, exchange, request, outcome)

    async def _proxy(
        self,
        context: GatewayContext,
        request: ParsedRequest,
        headers: dict[str, str],
        exchange: Exchange,
    ) -> None:
        registry = context.registry
        cost = registry.cost_model.estimate(request.cost)
        tried: list[str] = []
        while True:
            worker = registry.choose(request.model, exclude=tried)
            tried.append(worker.url)
            exchange.worker, exchange.attempts = worker.url, len(tried)
            with registry.lease(worker, cost) as lease:
                try:
                    await self._attempt(context, lease, request, headers, exchange)
                except _Retry as failure:
                    registry.record_failure(
                        worker, failure.reason, str(failure), at_once=failure.eject_now
                    )
                    if len(tried) > context.settings.max_retries:
                        raise failure.error from None
                    context.metrics.retries.inc(failure.reason)
                    continue
            return

    async def _attempt(
        self,
        context: GatewayContext,
        lease: Lease,
        request: ParsedRequest,
        headers: dict[str, str],
        exchange: Exchange,
    ) -> None:
        worker = lease.worker
        if exchange.upstream_sent is None:
            exchange.upstream_sent = time.perf_counter()
            context.metrics.time_to_upstream.series(request.model or "").observe(
                exchange.upstream_sent - exchange.received
            )
        upstream: UpstreamResponse | None = None
        try:
            upstream = await context.client.post(worker.url + self.path, request.body, headers)
            await _relay_response(upstream, exchange, context.metrics, request, lease)
        except UpstreamTimeout:
            raise  # the worker is alive but slow: another would not be faster
        except UpstreamConnectError as error:
            raise _Retry("connect_error", error, eject_now=True) from None
        except UpstreamError as error:
            if exchange.status is None:
                # A dropped connection before any answer: a dead worker, or a keep-alive
                # connection it had closed. Nothing reached the client; try another worker.
                raise _Retry("upstream_disconnect", error, eject_now=False) from None
            context.registry.record_failure(worker, "stream_broken", str(error), at_once=False)
            raise
        finally:
            if upstream is not None:
                upstream.close()
        if upstream.status >= 500:
            context.registry.record_failure(
                worker, "status_5xx", f"answered {upstream.status}", at_once=False
            )
        else:
            context.registry.record_success(worker)


async def _relay_response(
    upstream: UpstreamResponse,
    exchange: Exchange,
    metrics: GatewayMetrics,
    request: ParsedRequest,
    lease: Lease,
) -> None:
    if upstream.status == 200 and upstream.is_event_stream:
        async for chunk in upstream.iter_chunks():
            if exchange.status is None:
                lease.prefilled()
                await exchange.start(200, upstream.content_type)
                exchange.measure_gaps(
                    metrics.itl.series(request.model or "", exchange.worker or "")
                )
            await exchange.chunk(chunk)
        if exchange.status is None:
            await exchange.start(200, upstream.content_type)
        await exchange.finish()
    else:
        # Non-streaming answers and worker errors (a vLLM 400 for a too-long prompt, say) are
        # passed back with the worker's own status and body.
        body = await upstream.read()
        if upstream.status == 200:
            exchange.usage = _body_usage(body)
        await exchange.respond(upstream.status, upstream.content_type, body)


async def _until_done_or_disconnect(
    work: Coroutine[Any, Any, None], receive: Receive, exchange: Exchange
) -> None:
    """Runs `work`, cancelling it the moment the client disconnects.

    Cancelling closes the upstream connection (in `_attempt`'s `finally`), which is what makes
    vLLM abort the generation and free its KV cache.
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


def _body_usage(body: bytes) -> dict[str, Any] | None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


def _stream_usage(data: bytes) -> dict[str, Any] | None:
    """The usage object of the SSE event in `data` that carries one (vLLM's last chunk)."""
    for event in data.split(b"\n\n"):
        if USAGE_MARKER in event and event.startswith(b"data: "):
            usage = _body_usage(event[6:])
            if usage is not None:
                return usage
    return None


def _record(
    context: GatewayContext, exchange: Exchange, request: ParsedRequest | None, outcome: str
) -> None:
    metrics = context.metrics
    # Unknown model names stay out of the labels: clients must not be able to grow the series.
    model = (request.model or "") if request and outcome != "model_not_found" else ""
    worker = exchange.worker or ""
    status = str(exchange.status) if exchange.status is not None else "499"
    metrics.requests.inc(exchange.endpoint, model, worker, status, outcome)
    if exchange.finished is not None and outcome == "ok":
        metrics.e2e.series(model, worker).observe(exchange.finished - exchange.received)
    if exchange.streaming and exchange.first_chunk is not None:
        metrics.ttft.series(model, worker).observe(exchange.first_chunk - exchange.received)
    completion = _completion_tokens(exchange)
    if exchange.usage is not None:
        prompt = exchange.usage.get("prompt_tokens")
        if isinstance(prompt, int):
            metrics.prompt_tokens.inc(model, worker, amount=prompt)
    if completion:
        metrics.completion_tokens.inc(model, worker, amount=completion)
    if request is not None and outcome == "ok" and exchange.status == 200:
        context.registry.cost_model.learn(request.cost, completion)
    _log_exchange(exchange, request, outcome)


def _completion_tokens(exchange: Exchange) -> int:
    if exchange.usage is not None:
        tokens = exchange.usage.get("completion_tokens")
        if isinstance(tokens, int):
            return tokens
    return exchange.tokens


def _request_id(headers: dict[bytes, bytes]) -> str:
    given = headers.get(b"x-request-id")
    if given and len(given) <= 128:
        return given.decode("latin-1")
    return uuid.uuid4().hex


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    return int(value) if value and value.isdigit() else None


def _upstream_headers(
    context: GatewayContext, headers: dict[bytes, bytes], request_id: str
) -> dict[str, str]:
    forwarded = {"Content-Type": "application/json", "X-Request-Id": request_id}
    authorization = upstream_authorization(context.settings, headers.get(b"authorization"))
    if authorization:
        forwarded["Authorization"] = authorization
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
