"""What happens once an exchange is over: metrics, cost learning and the access log.

The relay hands each finished exchange over as an immutable `ExchangeRecord`; the three consumers
below read nothing else, so each is testable without servers.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import structlog

from mineru_gateway.cost import CostInputs, CostModel
from mineru_gateway.flow import task_of
from mineru_gateway.metrics import GatewayMetrics, Series
from mineru_gateway.prompts import PromptKind
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
    upstream_sent: float | None = None  # first sent to a worker
    trace_id: str | None = None  # when tracing is on (docs/tracing.md)
    document: str | None = None  # the client's document id (docs/flow-control.md)
    # The document's requests queued, on workers and done as this one ended; None when the
    # queue keeps no flow for it (docs/flow-control.md, "Documents").
    document_counts: tuple[int, int, int] | None = None

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


LedgerKey = tuple[str, str, str | None, int | None, str, str]


class Accounting:
    """What finished exchanges leave behind: metrics, counted through a ledger per kind of
    exchange, the cost model's lesson, and the access log. One per app (`GatewayContext`)."""

    __slots__ = ("_ledgers", "cost_model", "metrics", "usage")

    def __init__(self, metrics: GatewayMetrics, cost_model: CostModel) -> None:
        self.metrics = metrics
        self.cost_model = cost_model
        self._ledgers: dict[LedgerKey, Ledger] = {}
        self.usage = UsageMeter(metrics)

    def account(self, record: ExchangeRecord) -> None:
        ledger = self.record_metrics(record)
        if record.worker is not None and record.tenant and record.cost is not None:
            self.metrics.task_queue_wait.series(task_of(record.cost.prompt.kind)).observe(
                record.queued_s
            )
        self.usage.count(record, ledger.model)
        learn_cost(self.cost_model, record)
        log_exchange(record)

    def record_metrics(self, record: ExchangeRecord) -> Ledger:
        """Counts `record` in its kind's ledger; the ledger."""
        model = record.model_label
        key = (record.endpoint, model, record.worker, record.status, record.outcome, record.tenant)
        ledger = self._ledgers.get(key)
        if ledger is None:
            ledger = self._ledgers[key] = Ledger(self.metrics, record)
        ledger.count(record)
        return ledger

    @property
    def kinds(self) -> int:
        """Kinds of exchange met so far (one ledger each)."""
        return len(self._ledgers)


class Ledger:
    """The series one kind of finished exchange counts in: its endpoint, model, worker, status,
    outcome and tenant. Found once per kind (`Accounting`), each exchange then adds to
    them without building their label tuples or looking them up, about ten per exchange (what
    that saves: docs/proxy-costs.md). Series that only some exchanges of a kind count in (latencies,
    tokens) are found at the first that does: a series appears in /metrics at its first count."""

    __slots__ = (
        "_metrics",
        "_tenant",
        "_worker",
        "completion",
        "e2e",
        "model",
        "prompt",
        "queue_wait",
        "rejections",
        "requests",
        "tenant_completion",
        "tenant_prompt",
        "tenant_requests",
        "ttft",
    )

    def __init__(self, metrics: GatewayMetrics, record: ExchangeRecord) -> None:
        self._metrics = metrics
        self.model, self._worker, tenant = record.model_label, record.worker or "", record.tenant
        self._tenant = tenant
        self.requests = metrics.requests.cell(
            record.endpoint, self.model, self._worker, record.status_label, record.outcome
        )
        # Per-tenant series; tenant names are bounded by the configuration (api/tenants.py). A
        # request refused before it was known whose it was (a bad key, say) has none.
        self.tenant_requests = (
            metrics.tenant_requests.cell(tenant, record.status_label) if tenant else None
        )
        rejected = tenant and record.outcome in FLOW_REJECTIONS
        self.rejections = metrics.rejections.cell(tenant, record.outcome) if rejected else None
        waited = tenant and record.worker is not None
        self.queue_wait = metrics.queue_wait.series(tenant) if waited else None
        self.e2e: Series | None = None
        self.ttft: Series | None = None
        self.prompt: list[float] | None = None
        self.completion: list[float] | None = None
        self.tenant_prompt: list[float] | None = None
        self.tenant_completion: list[float] | None = None

    def count(self, record: ExchangeRecord) -> None:
        self.requests[0] += 1.0
        if self.tenant_requests is not None:
            self.tenant_requests[0] += 1.0
        if self.rejections is not None:
            self.rejections[0] += 1.0
        if self.queue_wait is not None:
            self.queue_wait.observe(record.queued_s)
        metrics, model, worker, tenant = self._metrics, self.model, self._worker, self._tenant
        if record.finished is not None and record.ok:
            if self.e2e is None:
                self.e2e = metrics.e2e.series(model, worker)
            self.e2e.observe(record.finished - record.received)
        if record.streaming and record.first_chunk is not None:
            if self.ttft is None:
                self.ttft = metrics.ttft.series(model, worker)
            self.ttft.observe(record.first_chunk - record.received)
        prompt = record.prompt_tokens
        if prompt is not None:
            if self.prompt is None:
                self.prompt = metrics.prompt_tokens.cell(model, worker)
            self.prompt[0] += prompt
            if tenant:
                if self.tenant_prompt is None:
                    self.tenant_prompt = metrics.tenant_tokens.cell(tenant, "prompt")
                self.tenant_prompt[0] += prompt
        completion = record.completion_tokens
        if completion:
            if self.completion is None:
                self.completion = metrics.completion_tokens.cell(model, worker)
            self.completion[0] += completion
            if tenant:
                if self.tenant_completion is None:
                    self.tenant_completion = metrics.tenant_tokens.cell(tenant, "completion")
                self.tenant_completion[0] += completion


UsageKey = tuple[str, str, str]  # tenant, model, MinerU task


class UsageMeter:
    """Usage in MinerU's units (docs/usage.md): what reached a worker, by tenant, model and
    MinerU task. Each kind's cells are found once, as the ledgers' are."""

    __slots__ = ("_cells", "_metrics", "started")

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._cells: dict[UsageKey, tuple[list[float], ...]] = {}
        self.started = time.time()  # usage counts from here (the process's start)

    def count(self, record: ExchangeRecord, model: str) -> None:
        """`model`: the record's model label, as its ledger has it."""
        sent, tenant = record.upstream_sent, record.tenant
        if sent is None or record.worker is None or not tenant:
            return  # refused, queued out, or a cache hit: no worker time spent
        cost = record.cost
        prompt = None if cost is None else cost.prompt
        # The kind is its task's label itself (a StrEnum, hashed and compared as its str):
        # reading `.value` is a Python-level property call.
        task = PromptKind.OTHER if prompt is None else prompt.kind
        cells = self._cells.get((tenant, model, task))
        if cells is None:
            key = (tenant, model, task.value)  # kept with a plain str, as `rows` gives it
            cells = self._cells[key] = self._find(key)
        requests, pages, images, prompt_tokens, completion_tokens, npu_seconds = cells
        requests[0] += 1.0
        if task == PromptKind.LAYOUT:
            pages[0] += 1.0
        if prompt is not None and prompt.images:
            images[0] += prompt.images
        prompt_tokens[0] += record.prompt_tokens or 0
        completion_tokens[0] += record.completion_tokens
        # The time the worker held the request, first send to last byte (or the end).
        held = (record.finished if record.finished is not None else record.ended) - sent
        if held > 0:
            npu_seconds[0] += held

    def _find(self, key: UsageKey) -> tuple[list[float], ...]:
        metrics = self._metrics
        return (
            metrics.usage_requests.cell(*key),
            metrics.usage_pages.cell(*key),
            metrics.usage_images.cell(*key),
            metrics.usage_tokens.cell(*key, "prompt"),
            metrics.usage_tokens.cell(*key, "completion"),
            metrics.usage_npu_seconds.cell(*key),
        )

    def rows(self) -> list[dict[str, Any]]:
        """This process's usage since it started, one row per (tenant, model, task)."""
        rows = []
        for (tenant, model, task), cells in sorted(self._cells.items()):
            requests, pages, images, prompt_tokens, completion_tokens, npu_seconds = (
                cell[0] for cell in cells
            )
            rows.append(
                {
                    "tenant": tenant,
                    "model": model,
                    "task": task,
                    "requests": int(requests),
                    "pages": int(pages),
                    "images": int(images),
                    "prompt_tokens": int(prompt_tokens),
                    "completion_tokens": int(completion_tokens),
                    "npu_seconds": round(npu_seconds, 6),
                }
            )
        return rows


def learn_cost(cost_model: CostModel, record: ExchangeRecord) -> None:
    """A complete answer teaches the cost model how long answers of its class are."""
    if record.cost is not None and record.ok and record.status == 200:
        cost_model.learn(record.cost, record.completion_tokens)


def log_exchange(record: ExchangeRecord) -> None:
    # The configured logger, as structlog's proxy hands it to `log.<method>`: reached through
    # a failed attribute lookup and `__getattr__` that way, several times the cost per call.
    logger = log.bind()
    if not logger.is_enabled_for(logging.INFO):
        # `--log-level warning` drops the access log; building the event anyway (thirteen
        # fields, three roundings) is a visible share of a small request's CPU.
        return
    ttft = record.ttft_s
    logger.info(
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
        trace_id=record.trace_id,
        **_document_fields(record),
    )


def _document_fields(record: ExchangeRecord) -> dict[str, Any]:
    """The document's id and its requests waiting, on workers and done (not in metrics)."""
    if record.document is None:
        return {}
    fields: dict[str, Any] = {"document": record.document}
    if record.document_counts is not None:
        queued, in_flight, done = record.document_counts
        fields |= {"document_queued": queued, "document_running": in_flight, "document_done": done}
    return fields
