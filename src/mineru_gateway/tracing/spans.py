"""One request's spans, as the relay opens and closes them (docs/tracing.md):

    POST /v1/chat/completions    server span; parent: the client's traceparent, if any
    ├── admission                authentication, the body read and checked
    ├── queue wait               the gateway's fair queue, until a worker has room
    └── upstream attempt         one per worker tried; its id is the worker's traceparent
        └── relay                the worker's answer passed on to the client

Imported only once tracing is on (setup.start_tracing); the relay holds a `RequestTrace` only
then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace as api
from opentelemetry.trace import Span, SpanKind, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from mineru_gateway.api.accounting import ExchangeRecord
    from mineru_gateway.request import ParsedRequest
    from mineru_gateway.workers.registry import Outcome

_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = (b"traceparent", b"tracestate")
_tracer: Tracer = api.NoOpTracer()


def use(tracer: Tracer) -> None:
    """The tracer every RequestTrace from now on starts its spans with."""
    global _tracer
    _tracer = tracer


class RequestTrace:
    """The spans of one client request; every span still open at `finish` ends there."""

    __slots__ = ("_admission", "_attempt", "_context", "_queue", "_relay", "server", "trace_id")

    def __init__(self, headers: Mapping[bytes, bytes], path: str) -> None:
        carrier = {
            name.decode(): value.decode("latin-1")
            for name in TRACE_HEADERS
            if (value := headers.get(name)) is not None
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        self.server = _tracer.start_span(
            f"POST {path}",
            parent,
            SpanKind.SERVER,
            {"http.request.method": "POST", "url.path": path},
        )
        self._context = api.set_span_in_context(self.server)
        self.trace_id = api.format_trace_id(self.server.get_span_context().trace_id)
        self._admission: Span | None = _tracer.start_span("admission", self._context)
        self._queue: Span | None = None
        self._attempt: Span | None = None
        self._relay: Span | None = None

    def admitted(self, tenant: str, request: ParsedRequest, document: str | None = None) -> None:
        prompt = request.cost.prompt
        attributes: dict[str, AttributeValue] = {
            "mineru.tenant": tenant,
            "gen_ai.request.model": request.model or "",
            "mineru.task": prompt.kind.value,
            "mineru.images": prompt.images,
            "mineru.stream": request.stream,
        }
        if document is not None:
            attributes["mineru.document.id"] = document
        self.server.set_attributes(attributes)
        self._admission = _ended(self._admission)

    def queue_started(self) -> None:
        self._queue = _tracer.start_span("queue wait", self._context)

    def queue_ended(self, worker: str) -> None:
        if self._queue is not None:
            self._queue.set_attribute("mineru.worker", worker)
        self._queue = _ended(self._queue)

    def attempt_started(self, worker: str, number: int, headers: dict[str, str]) -> dict[str, str]:
        """`headers` for the worker with this attempt's span as their traceparent."""
        attributes: dict[str, AttributeValue] = {
            "mineru.worker": worker,
            "mineru.attempt": number,
            # The id the worker knows this attempt by (vLLM's logs), the client's with a suffix.
            "mineru.upstream_request_id": headers.get("X-Request-Id", ""),
        }
        span = _tracer.start_span("upstream attempt", self._context, SpanKind.CLIENT, attributes)
        self._attempt = span
        forwarded = dict(headers)
        _PROPAGATOR.inject(forwarded, api.set_span_in_context(span))
        return forwarded

    def relay_started(self, status: int) -> None:
        if self._attempt is None:
            return
        self._attempt.set_attribute("http.response.status_code", status)
        self._relay = _tracer.start_span("relay", api.set_span_in_context(self._attempt))

    def attempt_ended(self, outcome: Outcome | None) -> None:
        """`outcome` as the worker registry takes it; None: a timeout or the client leaving."""
        label = "interrupted" if outcome is None else outcome.failure or "ok"
        self._relay = _ended(self._relay)
        if self._attempt is not None:
            self._attempt.set_attribute("mineru.outcome", label)
            if label != "ok":
                self._attempt.set_status(StatusCode.ERROR, label)
        self._attempt = _ended(self._attempt)

    def finish(self, record: ExchangeRecord) -> None:
        for open_span in (self._admission, self._queue, self._relay, self._attempt):
            if open_span is not None:
                open_span.set_status(StatusCode.ERROR, record.outcome)
                open_span.end()
        self._admission = self._queue = self._relay = self._attempt = None
        server = self.server
        status = int(record.status_label)  # 499: the client went away
        server.set_attributes(
            {
                "mineru.request_id": record.request_id,
                "mineru.outcome": record.outcome,
                "mineru.attempts": record.attempts,
                "mineru.worker": record.worker or "",
                "http.response.status_code": status,
            }
        )
        if record.document_counts is not None:
            queued, in_flight, done = record.document_counts
            server.set_attributes(
                {
                    "mineru.document.queued": queued,
                    "mineru.document.running": in_flight,
                    "mineru.document.done": done,
                }
            )
        if status >= 500:
            server.set_status(StatusCode.ERROR, record.outcome)
        server.end()


def _ended(span: Span | None) -> Span | None:
    """Ends `span` if it is open; None, for the slot that held it."""
    if span is not None:
        span.end()
    return None
