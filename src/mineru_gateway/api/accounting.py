"""What happens once an exchange is over: metrics, cost learning and the access log.

The relay hands each finished exchange over as an immutable `ExchangeRecord`; the three consumers
below read nothing else, so each is testable without servers (issue 12).
"""

from __future__ import annotations

import logging

import structlog

from mineru_gateway.cost import CostInputs, CostModel
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.values import value

log = structlog.get_logger("mineru_gateway.access")

CLIENT_CLOSED = 499  # nginx's status for "the client went away before an answer"


@value
class ExchangeRecord:
    """One finished client exchange. Times are `time.perf_counter()` readings."""

    request_id: str
    endpoint: str
    outcome: str  # "ok", a GatewayError code, "client_disconnected" or "internal_error"
    received: float
    ended: float
    model: str | None = None
    stream: bool | None = None
    cost: CostInputs | None = None
    worker: str | None = None
    attempts: int = 0
    status: int | None = None  # None: no status line was sent
    streaming: bool = False  # the answer was an event stream
    first_chunk: float | None = None
    finished: float | None = None  # the last byte went out
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    tenant: str = ""
    priority: int = 0
    queued_s: float = 0.0  # time spent in the gateway's queue

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def model_label(self) -> str:
        # Unknown model names stay out of the labels: clients must not be able to grow the series.
        return "" if self.model is None or self.outcome == "model_not_found" else self.model

    @property
    def status_label(self) -> str:
        return str(self.status if self.status is not None else CLIENT_CLOSED)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_chunk is None else self.first_chunk - self.received


# Outcomes that are flow control's own answers (errors.py): refused, or nowhere to place it.
FLOW_REJECTIONS = frozenset(
    {
        "queue_full",
        "queue_bytes_full",
        "tenant_queue_full",
        "tenant_queue_bytes_full",
        "queue_timeout",
        "no_healthy_worker",
        "shutting_down",
    }
)


def record_metrics(metrics: GatewayMetrics, record: ExchangeRecord) -> None:
    model, worker = record.model_label, record.worker or ""
    metrics.requests.inc(record.endpoint, model, worker, record.status_label, record.outcome)
    _record_tenant(metrics, record)
    if record.finished is not None and record.ok:
        metrics.e2e.series(model, worker).observe(record.finished - record.received)
    if record.streaming and record.ttft_s is not None:
        metrics.ttft.series(model, worker).observe(record.ttft_s)
    if record.prompt_tokens is not None:
        metrics.prompt_tokens.inc(model, worker, amount=record.prompt_tokens)
    if record.completion_tokens:
        metrics.completion_tokens.inc(model, worker, amount=record.completion_tokens)


def _record_tenant(metrics: GatewayMetrics, record: ExchangeRecord) -> None:
    """Per-tenant series; tenant names are bounded by the configuration (api/tenants.py)."""
    tenant = record.tenant
    if not tenant:
        return  # refused before it was known whose it was (a bad key, say)
    metrics.tenant_requests.inc(tenant, record.status_label)
    if record.outcome in FLOW_REJECTIONS:
        metrics.rejections.inc(tenant, record.outcome)
    if record.worker is not None:
        metrics.queue_wait.series(tenant).observe(record.queued_s)
    if record.prompt_tokens is not None:
        metrics.tenant_tokens.inc(tenant, "prompt", amount=record.prompt_tokens)
    if record.completion_tokens:
        metrics.tenant_tokens.inc(tenant, "completion", amount=record.completion_tokens)


def learn_cost(cost_model: CostModel, record: ExchangeRecord) -> None:
    """A complete answer teaches the cost model how long answers of its class are."""
    if record.cost is not None and record.ok and record.status == 200:
        cost_model.learn(record.cost, record.completion_tokens)


def log_exchange(record: ExchangeRecord) -> None:
    if not log.is_enabled_for(logging.INFO):
        # `--log-level warning` drops the access log; building the event anyway (thirteen
        # fields, three roundings) cost 8% of a small request's CPU.
        return
    ttft = record.ttft_s
    log.info(
        "request",
        request_id=record.request_id,
        model=record.model,
        stream=record.stream,
        worker=record.worker,
        attempts=record.attempts,
        status=record.status,
        outcome=record.outcome,
        tenant=record.tenant or None,
        priority=record.priority,
        queued_ms=round(record.queued_s * 1000, 2),
        latency_ms=round((record.ended - record.received) * 1000, 2),
        ttft_ms=round(ttft * 1000, 2) if ttft is not None else None,
    )


def account(metrics: GatewayMetrics, cost_model: CostModel, record: ExchangeRecord) -> None:
    record_metrics(metrics, record)
    learn_cost(cost_model, record)
    log_exchange(record)
