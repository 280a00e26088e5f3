"""The relay: `POST /v1/chat/completions` and `POST /v1/completions`, as a lean ASGI endpoint.

It sits below FastAPI's request/response machinery on purpose: every streamed token crosses this
code, and a raw ASGI relay costs less per event than a framework route with StreamingResponse
(docs/proxy-costs.md). It also gives exact control over what users of other gateways complain
about most: a client that goes away cancels the upstream request at once (streaming or not,
before or after the first token), and every counter is released in `finally`.

Retries: another worker is tried only while nothing of the answer has reached the client (no
status line sent yet). Inference has no side effects, so until then any failure of the worker is
retried: a refused connection, a connection dropped before or after the answer's head, bytes that
are not HTTP, a status no client may be given (`UpstreamBadStatus`), a non-streamed answer cut
short. Once something has reached the client, a failure ends the answer instead (a stream with an
SSE error event on an event boundary). A worker's own answer, a 4xx or a 5xx, is passed back as
it came and never retried; a timeout is not retried either (another worker would not be faster).
vLLM sends a stream's head at once, before the request leaves its queue: the client's head is
held until the stream's first whole event, so a worker dying with the request in its queue is
still retried.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import TYPE_CHECKING, Any

import structlog

from mineru_gateway import tracing
from mineru_gateway.api.accounting import ExchangeRecord
from mineru_gateway.api.answer import AnswerClock, ClientAnswer, body_usage
from mineru_gateway.api.answer import Send as Send
from mineru_gateway.api.auth import upstream_authorization
from mineru_gateway.api.connection import ClientLink
from mineru_gateway.api.context import GatewayContext, gateway_context
from mineru_gateway.api.requests import (
    ClientDisconnected,
    Receive,
    forward_priority,
    header_document,
    header_priority,
    parse_request,
    read_body,
)
from mineru_gateway.cache.service import Sink
from mineru_gateway.errors import (
    GatewayError,
    NoHealthyWorker,
    ShuttingDown,
    UpstreamBadStatus,
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTimeout,
)
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.request import Endpoint, ParsedRequest
from mineru_gateway.vllm_contract import is_queue_full, upstream_request_id
from mineru_gateway.workers.dispatcher import Admission
from mineru_gateway.workers.health import BUSY
from mineru_gateway.workers.registry import SUCCESS, Lease, Outcome
from mineru_gateway.workers.upstream import UpstreamResponse

if TYPE_CHECKING:
    from mineru_gateway.tracing.spans import RequestTrace

Scope = MutableMapping[str, Any]

log = structlog.get_logger("mineru_gateway.access")

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# The start of an event held back for its end is sent as it is past this (no event of vLLM's is
# near it): what a worker that never ends an event can make the relay hold.
MAX_HELD_EVENT = 1024 * 1024


class Exchange:
    """One client exchange as accounting sees it: who asked, how it was queued and routed, and
    the answer's writer and clock (api/answer.py), read into a record when it is over."""

    __slots__ = (
        "answer",
        "attempts",
        "clock",
        "document",
        "document_counts",
        "endpoint",
        "priority",
        "queued_s",
        "request_id",
        "tenant",
        "trace",
        "worker",
    )

    def __init__(
        self, send: Send, request_id: str, endpoint: Endpoint, link: ClientLink | None = None
    ) -> None:
        self.request_id = request_id
        self.endpoint = endpoint
        self.clock = AnswerClock(endpoint)
        self.answer = ClientAnswer(send, request_id, self.clock, link)
        self.worker: str | None = None
        self.attempts = 0
        self.tenant = ""
        self.priority = 0
        self.document: str | None = None  # the client's document id (flow.py)
        # The document's requests (queued, on workers, done) as the exchange ends.
        self.document_counts: tuple[int, int, int] | None = None
        self.queued_s = 0.0
        self.trace: RequestTrace | None = None  # when tracing is on (docs/tracing.md)

    def record(self, request: ParsedRequest | None, outcome: str) -> ExchangeRecord:
        """The finished exchange, for accounting."""
        clock, answer = self.clock, self.answer
        usage = clock.answer_usage() or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        # Positional, which builds the record for a fraction of the keyword form's cost
        # (docs/proxy-costs.md); tests/api/test_relay.py checks the fields.
        return ExchangeRecord(
            self.request_id,
            self.endpoint,
            outcome,
            clock.received,
            time.perf_counter(),
            request.model if request else None,
            request.stream if request else None,
            request.cost if request else None,
            self.worker,
            self.attempts,
            answer.status,
            answer.streaming,
            clock.first_chunk,
            clock.finished,
            completion if isinstance(completion, int) else clock.tokens,
            prompt if isinstance(prompt, int) else None,
            self.tenant,
            self.priority,
            self.queued_s,
            clock.upstream_sent,
            self.trace.trace_id if self.trace is not None else None,
            self.document,
            self.document_counts,
        )


class _Retry(Exception):
    """The attempt failed before any byte reached the client: another worker may take it."""

    def __init__(self, reason: str, error: UpstreamError) -> None:
        super().__init__(str(error))
        self.reason = reason
        self.error = error


class _QueueFull(Exception):
    """The worker refused the request because its own queue is full (vllm_contract.py): not a
    failure of the worker; the request goes elsewhere or waits (Dispatcher.bounce)."""


class Relay:
    """ASGI endpoint relaying one OpenAI endpoint to a chosen worker."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.path = PATHS[endpoint]
        self._ids = RequestIds()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        context = gateway_context(scope)
        headers = dict(scope["headers"])
        link = ClientLink.of(scope)
        exchange = Exchange(send, self._ids.take(headers), self.endpoint, link)
        if tracing.ENABLED:
            from mineru_gateway.tracing.spans import RequestTrace

            exchange.trace = RequestTrace(headers, self.path)
        request: ParsedRequest | None = None
        outcome = "ok"
        try:
            if context.lifecycle.draining:
                raise ShuttingDown("the gateway is shutting down; retry on another replica")
            tenant = context.tenants.authenticate(headers.get(b"authorization"))
            exchange.tenant = tenant.name
            body = await read_body(
                receive, _content_length(headers), context.settings.max_body_bytes
            )
            results = context.results
            key_scope = None if results is None else results.scope(tenant.name)
            request = parse_request(self.endpoint, body, context.media, context.limits, key_scope)
            asked = request.priority
            if asked is None:
                asked = header_priority(headers.get(context.priority_header))
            exchange.priority = tenant.effective_priority(asked)
            exchange.document = header_document(headers.get(context.document_header))
            request = forward_priority(request, exchange.priority, context.settings.pass_priority)
            admission = Admission(
                tenant,
                exchange.priority,
                context.cost_model.estimate(request.cost),
                len(request.body),
                request.model,
                exchange.document,
                request.cost.prompt.kind,
                None if request.cache_tag is None else request.cache_tag.digest,
            )
            if exchange.trace is not None:
                exchange.trace.admitted(tenant.name, request, exchange.document)
            upstream_headers = _upstream_headers(context, headers, exchange.request_id)
            run = functools.partial(
                self._proxy, context, request, admission, upstream_headers, exchange
            )
            if results is not None and request.cache_tag is not None:
                # Before `acquire`: a hit or a join takes no room (docs/cache.md).
                visit = results.visit(request, tenant.name)
                work = visit.serve(exchange.answer, exchange.clock, run)
                stays: Callable[[], bool] | None = visit.stays
            else:
                work, stays = run(exchange.answer), None
            await _until_done_or_disconnect(work, receive, exchange.answer, link, stays)
        except ClientDisconnected:
            outcome = "client_disconnected"
        except asyncio.CancelledError:
            # Only the server cancels a request (a client leaving is ClientDisconnected): it
            # does so at its drain deadline after SIGTERM. An answer not yet started would become
            # a plain-text 500 and a stream would be cut without its end (the SIGTERM fault
            # test); it ends as an explicit 503 or SSE error event instead. The
            # cancellation has done its work: the upstream request is being closed.
            outcome = ShuttingDown.code
            await exchange.answer.fail(
                ShuttingDown("the gateway stopped before the answer was complete")
            )
        except GatewayError as error:
            outcome = error.reason
            await exchange.answer.fail(error)
        except Exception:
            # The relay's top-level handler (it runs outside FastAPI's): a bug becomes an
            # OpenAI-style 500 (or an SSE error event mid-stream), logged with its traceback.
            outcome = "internal_error"
            log.exception("unhandled_error", request_id=exchange.request_id, path=self.path)
            await exchange.answer.fail(GatewayError("internal gateway error"))
        finally:
            record = exchange.record(request, outcome)
            context.accounting.account(record)
            if exchange.trace is not None:
                exchange.trace.finish(record)

    async def _proxy(
        self,
        context: GatewayContext,
        request: ParsedRequest,
        admission: Admission,
        headers: dict[str, str],
        exchange: Exchange,
        sink: Sink,
    ) -> None:
        """Queues, routes and relays the request, writing the answer to `sink`."""
        if exchange.trace is not None:
            exchange.trace.queue_started()
        grant = await context.dispatcher.acquire(admission)
        exchange.queued_s = grant.queued_s
        if exchange.trace is not None:
            exchange.trace.queue_ended(grant.lease.worker.url)
        tried: list[str] = []
        attempts = 0
        try:
            while True:
                attempts += 1
                tried.append(grant.lease.worker.url)
                exchange.worker, exchange.attempts = tried[-1], attempts
                headers["X-Request-Id"] = self._ids.attempt(exchange.request_id)
                try:
                    await self._attempt(context, grant.lease, request, headers, exchange, sink)
                    return
                except _QueueFull:
                    # Busy, not failed: neither a retry nor a tried worker; held back a moment.
                    tried.pop()
                    grant = await context.dispatcher.bounce(grant, admission)
                except _Retry as failure:
                    if len(tried) > context.settings.max_retries:
                        raise failure.error from None
                    try:
                        grant = context.dispatcher.retry(grant, admission, exclude=tried)
                    except NoHealthyWorker:
                        raise failure.error from None  # no other worker: what this one did
                    context.metrics.retries.inc(failure.reason)
        finally:
            grant.release()
            exchange.document_counts = grant.document_counts

    async def _attempt(
        self,
        context: GatewayContext,
        lease: Lease,
        request: ParsedRequest,
        headers: dict[str, str],
        exchange: Exchange,
        sink: Sink,
    ) -> None:
        worker = lease.worker
        clock = exchange.clock
        if clock.upstream_sent is None:
            clock.upstream_sent = time.perf_counter()
            context.metrics.time_to_upstream.series(request.model or "").observe(
                clock.upstream_sent - clock.received
            )
        outcome: Outcome | None = SUCCESS  # None: the attempt says nothing about the worker
        trace = exchange.trace
        if trace is not None:
            headers = trace.attempt_started(worker.url, exchange.attempts, headers)
        try:
            upstream = await context.client.post(worker.url + self.path, request.body, headers)
            if trace is not None:
                trace.relay_started(upstream.status)
            try:
                await _relay_response(upstream, sink, exchange, context.metrics, request, lease)
            finally:
                upstream.close()
            if upstream.status >= 500:
                outcome = Outcome.failed("status_5xx", f"answered {upstream.status}")
        except _QueueFull:
            outcome = BUSY
            raise
        except (UpstreamTimeout, asyncio.CancelledError):
            # A slow worker is alive (another would not be faster); a client that went away
            # says nothing about the worker.
            outcome = None
            raise
        except UpstreamConnectError as error:
            refused = not isinstance(error, UpstreamConnectTimeout)
            outcome = Outcome.failed("connect_error", str(error), eject_now=refused)
            raise _Retry("connect_error", error) from None
        except UpstreamError as broken:
            if sink.status is None:
                # Nothing reached the client: a dead worker, a keep-alive connection it had
                # closed, an answer broken before it was relayed. Try another worker.
                reason = "upstream_disconnect"
                if isinstance(broken, UpstreamBadStatus):
                    reason = UpstreamBadStatus.code
                outcome = Outcome.failed(reason, str(broken))
                raise _Retry(reason, broken) from None
            outcome = Outcome.failed("stream_broken", str(broken))
            raise
        finally:
            if outcome is not None:
                context.registry.checks.report(worker, outcome)
            if trace is not None:
                trace.attempt_ended(outcome)


async def _relay_response(
    upstream: UpstreamResponse,
    sink: Sink,
    exchange: Exchange,
    metrics: GatewayMetrics,
    request: ParsedRequest,
    lease: Lease,
) -> None:
    clock = exchange.clock
    if upstream.status == 200 and upstream.is_event_stream:
        # Only whole events go out: an event cut by a failing worker is never half-sent, and a
        # worker that fails before its first whole event is retried (the module docstring).
        held = b""
        async for chunk in upstream.iter_chunks():
            if held or not chunk.endswith(b"\n\n"):
                chunk, held = _whole_events(held + chunk)
                if not chunk:
                    continue
            if sink.status is None:
                lease.prefilled()
                await sink.start(200, upstream.content_type)
                clock.measure_gaps(metrics.itl.series(request.model or "", exchange.worker or ""))
            clock.note(chunk)
            await sink.chunk(chunk)
        if sink.status is None:
            await sink.start(200, upstream.content_type)
        await sink.finish(held)  # a stream that ended cleanly ends as the worker wrote it
    else:
        # Non-streaming answers and worker errors (a vLLM 400 for a too-long prompt, say) are
        # passed back with the worker's own status and body.
        body = await upstream.read()
        if upstream.status == 200:
            clock.usage = body_usage(body)
        elif is_queue_full(upstream.status, body):
            raise _QueueFull
        await sink.respond(upstream.status, upstream.content_type, body)


async def _until_done_or_disconnect(
    work: Coroutine[Any, Any, None],
    receive: Receive,
    answer: ClientAnswer,
    link: ClientLink | None,
    stays: Callable[[], bool] | None,
) -> None:
    """Runs `work` in this task, cancelling it the moment the client disconnects, unless
    `stays()` says the work goes on for others (a generation they share: cache/service.py).

    Cancelling closes the upstream connection (in `_attempt`'s `finally`), which is what makes
    vLLM abort the generation and free its KV cache. The gateway's own server protocol reports
    the loss through the client's link (api/connection.py); under any other server, a task
    parked in `receive` watches for it.
    """
    # The link's loop where there is one: on Python 3.11 each lookup of the running loop is a
    # getpid() system call.
    task = asyncio.current_task(link.loop if link is not None else None)
    assert task is not None
    left = kept = False

    def on_disconnect(_: object = None) -> None:
        nonlocal left, kept
        if not answer.complete:  # the whole answer went out: nothing to stop
            left = True
            if stays is not None and stays():
                kept = True  # others wait on what it does: it ends, its answer to no one
            else:
                task.cancel()

    watcher: asyncio.Future[None] | None = None
    if link is not None:
        link.on_lost(on_disconnect)
    else:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(on_disconnect)
    try:
        await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:
            raise ClientDisconnected from None
        raise
    finally:
        if link is not None:
            link.on_lost(None)
        elif watcher is not None:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
    if kept:
        raise ClientDisconnected


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _whole_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` cut after its last whole SSE event (a blank line ends one, in LF or CRLF lines):
    what may go out, and the start of an event to hold for its end (sent as it is past
    MAX_HELD_EVENT)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
    if not end and len(data) > MAX_HELD_EVENT:
        end = len(data)
    return data[:end], data[end:]


class RequestIds:
    """Request ids for requests that bring none: 32 hex digits, a random half per process and a
    counter, unique among the gateway's replicas (vLLM requires in-flight ids to be unique) at
    a fraction of uuid4's cost (docs/proxy-costs.md)."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def take(self, headers: dict[bytes, bytes]) -> str:
        """The client's X-Request-Id if it gave a usable one, else a new id."""
        given = headers.get(b"x-request-id")
        if given and len(given) <= 128:
            return given.decode("latin-1")
        return f"{self._prefix}{next(self._count):016x}"

    def attempt(self, request_id: str) -> str:
        """The id one attempt sends a worker: unique even when clients reuse ids, or the same
        request goes to a worker twice (vllm_contract.py, `upstream_request_id`)."""
        return upstream_request_id(request_id, f"{self._prefix[:8]}{next(self._count):x}")


def _content_length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    return int(value) if value and value.isdigit() else None


def _upstream_headers(
    context: GatewayContext, headers: dict[bytes, bytes], request_id: str
) -> dict[str, str]:
    forwarded = {"Content-Type": "application/json", "X-Request-Id": request_id}
    # W3C trace context passes through as the client sent it, so a worker's spans (vLLM's
    # --otlp-traces-endpoint) join the client's trace; with tracing on, each attempt's span
    # replaces `traceparent` (docs/tracing.md). Two lookups, not a loop: per request.
    traceparent, tracestate = headers.get(b"traceparent"), headers.get(b"tracestate")
    if traceparent is not None:
        forwarded["traceparent"] = traceparent.decode("latin-1")
    if tracestate is not None:
        forwarded["tracestate"] = tracestate.decode("latin-1")
    authorization = upstream_authorization(
        context.settings, headers.get(b"authorization"), context.tenants.keys_required
    )
    if authorization:
        forwarded["Authorization"] = authorization
    return forwarded
