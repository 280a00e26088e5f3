"""The gateway's Prometheus metrics, on the app's own registry.

Names follow Prometheus conventions under `mineru_gateway_` and never reuse vLLM's `vllm:` names,
so gateway and worker series cannot collide (docs/architecture.md, peer complaints, item 6).
Latencies follow `vllm bench serve`'s definitions (docs/vllm.md), measured at the gateway: TTFT is
send to the first streamed chunk, ITL every gap between chunks, E2E send to the last byte.

A large fleet must not make `/metrics` large (docs/operate/fleet-scale.md): per worker, the
gateway always exports what operators watch per worker (health, in-flight, queue, ejections);
the request, latency, token and routing series carry the worker's URL only while the fleet is
small or `per_worker_metrics` says so (`WorkerLabels`), and otherwise `worker=""`, one series
for all workers.

Recording must cost the hot path nothing measurable: every token of every stream crosses the relay.
So counters and histograms here are plain Python numbers updated without locks (everything runs on
the one event loop thread) and turned into metric families only when `/metrics` is scraped; gauges
that describe workers are read from the registry at scrape time rather than kept up to date.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from mineru_gateway import __version__

# 5 ms to 10 minutes: TTFT ranges from milliseconds to a full queue, E2E to MinerU's 600 s timeout.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
    7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 450.0, 600.0,
)  # fmt: skip
# Inter-token gaps are short: resolve the single milliseconds too.
ITL_BUCKETS = (0.001, 0.0025, *LATENCY_BUCKETS)
# The gateway's own share: sub-millisecond when healthy.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *LATENCY_BUCKETS)

Labels = tuple[str, ...]
# Up to this many workers, a fleet's request and latency series are per worker by default.
PER_WORKER_UP_TO = 64
USAGE_LABELS = ("tenant", "model", "task")
TASKS = ("layout", "block", "other")  # queue metrics' task label (flow.task_of)


class WorkerLabels:
    """Whether series with a `worker` label carry each worker's URL, or fold every worker
    into one series (`worker=""`, which Prometheus reads as no label): `per_worker()` is asked
    when a series is looked up (once per request and metric)."""

    def __init__(self, per_worker: Callable[[], bool] = lambda: True) -> None:
        self.per_worker = per_worker

    def fold(self, values: Labels, at: int) -> Labels:
        if at < 0 or self.per_worker():
            return values
        return (*values[:at], "", *values[at + 1 :])


class _Labelled:
    """A metric whose `worker` label (if it has one) `WorkerLabels` may fold."""

    name: str
    labels: Labels
    workers: WorkerLabels | None = None

    def _key(self, values: Labels) -> Labels:
        workers = self.workers
        if workers is None:
            return values
        return workers.fold(values, self.labels.index("worker") if "worker" in self.labels else -1)


class Histogram(_Labelled):
    """A labelled histogram kept as plain lists: `observe` is a short scan and two additions."""

    def __init__(self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]):
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.buckets = tuple(buckets)
        self._series: dict[Labels, Series] = {}

    def series(self, *values: str) -> Series:
        """The series for these label values; callers keep it for a request's lifetime."""
        values = self._key(values)
        found = self._series.get(values)
        if found is None:
            found = self._series[values] = Series(self.buckets)
        return found

    def collect(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for values, series in self._series.items():
            cumulative, running = [], 0
            for bound, count in zip((*self.buckets, float("inf")), series.counts, strict=True):
                running += count
                cumulative.append((_bound(bound), running))
            family.add_metric(list(values), cumulative, series.total)
        return family


class Series:
    __slots__ = ("buckets", "counts", "total")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


class Counter(_Labelled):
    """A labelled counter: each series' total in a one-item list (its cell), which a caller
    counting the same series again and again may hold (`cell`) rather than look up."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self._cells: dict[Labels, list[float]] = {}

    def inc(self, *values: str, amount: float = 1.0) -> None:
        values = self._key(values)
        cell = self._cells.get(values)
        if cell is None:
            self._cells[values] = [amount]
        else:
            cell[0] += amount

    def cell(self, *values: str) -> list[float]:
        """The series' cell, `[total]`; the series is exported from now on, at 0 until counted."""
        values = self._key(values)
        found = self._cells.get(values)
        if found is None:
            found = self._cells[values] = [0.0]
        return found

    def collect(self) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for values, (total,) in self._cells.items():
            family.add_metric(list(values), total)
        return family


class ExpositionCache:
    """The last `/metrics` rendered, served again while it is young next to what it cost.

    Rendering runs in the event loop and its cost grows with the series: a scrape of a large
    fleet must not stall requests each time (docs/operate/fleet-scale.md). A text that cost
    `c` seconds of CPU, at least KEEP_FROM_S, is served again for `KEEP_FACTOR * c` seconds, at
    most KEEP_MAX_S: a cheap one (a small fleet) is rendered afresh for every scrape.
    """

    KEEP_FROM_S = 0.01
    KEEP_FACTOR = 10.0
    KEEP_MAX_S = 1.0

    def __init__(self) -> None:
        self._body = b""
        self._until = -float("inf")

    def get(self, now: float) -> bytes | None:
        return self._body if now < self._until else None

    def put(self, body: bytes, now: float, cost_s: float) -> None:
        if cost_s >= self.KEEP_FROM_S:
            self._body = body
            self._until = now + min(self.KEEP_MAX_S, self.KEEP_FACTOR * cost_s)


@dataclass(frozen=True, slots=True)
class WorkerGauges:
    """What the registry knows of one worker at scrape time."""

    worker: str
    healthy: bool
    in_flight: int
    waiting: float | None
    running: float | None
    kv_usage: float | None
    scrape_age_s: float | None


@dataclass
class GatewayMetrics:
    """Every metric the gateway records itself; built per app, exported by `GatewayCollector`."""

    requests: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_requests",
            "Requests finished, by endpoint, model, worker, HTTP status and outcome.",
            ("endpoint", "model", "worker", "status", "outcome"),
        )
    )
    ttft: Histogram = field(
        default_factory=lambda: Histogram(
            "mineru_gateway_time_to_first_token_seconds",
            "From receiving a streaming request to relaying its first chunk.",
            ("model", "worker"),
            LATENCY_BUCKETS,
        )
    )
    itl: Histogram = field(
        default_factory=lambda: Histogram(
            "mineru_gateway_inter_token_latency_seconds",
            "Every gap between two relayed chunks of a stream.",
            ("model", "worker"),
            ITL_BUCKETS,
        )
    )
    e2e: Histogram = field(
        default_factory=lambda: Histogram(
            "mineru_gateway_e2e_request_latency_seconds",
            "From receiving a request to sending its last byte.",
            ("model", "worker"),
            LATENCY_BUCKETS,
        )
    )
    time_to_upstream: Histogram = field(
        default_factory=lambda: Histogram(
            "mineru_gateway_time_to_upstream_seconds",
            "Time spent in the gateway before the request was sent to a worker.",
            ("model",),
            OVERHEAD_BUCKETS,
        )
    )
    prompt_tokens: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_prompt_tokens",
            "Prompt tokens of finished requests (from usage).",
            ("model", "worker"),
        )
    )
    completion_tokens: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_completion_tokens",
            "Completion tokens (from usage, or counted from the stream without it).",
            ("model", "worker"),
        )
    )
    routing_decisions: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_routing_decisions",
            "Workers chosen, by routing policy.",
            ("policy", "worker"),
        )
    )
    retries: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_retries",
            "Requests sent again to another worker, by reason.",
            ("reason",),
        )
    )
    ejections: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_worker_ejections",
            "Workers taken out of routing by passive health checks, by reason.",
            ("worker", "reason"),
        )
    )
    worker_queue_full: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_worker_queue_full",
            "Requests a worker refused because its own vLLM queue was full (503); each went to "
            "another worker or back to the gateway's queue.",
            ("worker",),
        )
    )
    queue_wait: Histogram = field(
        default_factory=lambda: Histogram(
            "mineru_gateway_queue_wait_seconds",
            "Time admitted requests waited in the gateway's queue for room on a worker.",
            ("tenant",),
            OVERHEAD_BUCKETS,
        )
    )
    task_queue_wait: Histogram = field(
        default_factory=lambda: Histogram(
            "mineru_gateway_queue_task_wait_seconds",
            "Time admitted requests waited in the gateway's queue, by MinerU task (layout, "
            "block, other).",
            ("task",),
            OVERHEAD_BUCKETS,
        )
    )
    rejections: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_rejections",
            "Requests flow control refused (429) or could not place (503), by tenant and reason.",
            ("tenant", "reason"),
        )
    )
    tenant_requests: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_tenant_requests",
            "Requests finished, by tenant and HTTP status.",
            ("tenant", "status"),
        )
    )
    tenant_tokens: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_tenant_tokens",
            "Prompt and completion tokens of finished requests, by tenant.",
            ("tenant", "kind"),
        )
    )
    # Usage in MinerU's units, by tenant, model and MinerU task (prompts.PromptKind): requests
    # that reached a worker (docs/usage.md). Every label is bounded by the configuration.
    usage_requests: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_usage_requests",
            "Requests that reached a worker, by tenant, model and MinerU task.",
            USAGE_LABELS,
        )
    )
    usage_pages: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_usage_pages",
            "Pages: layout requests that reached a worker (one per page MinerU parses).",
            USAGE_LABELS,
        )
    )
    usage_images: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_usage_images",
            "Images in requests that reached a worker, by tenant, model and MinerU task.",
            USAGE_LABELS,
        )
    )
    usage_tokens: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_usage_tokens",
            "Prompt and completion tokens, by tenant, model, MinerU task and kind.",
            (*USAGE_LABELS, "kind"),
        )
    )
    usage_npu_seconds: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_usage_npu_seconds",
            "Seconds workers held the requests (sent to answered), by tenant, model and task.",
            USAGE_LABELS,
        )
    )
    config_reloads: Counter = field(
        default_factory=lambda: Counter(
            "mineru_gateway_config_reload",
            "Changes of the key files or the tenants file acted on: applied or refused.",
            ("result",),
        )
    )

    # Whether the request, latency, token and routing series are per worker (module docstring).
    worker_labels: WorkerLabels = field(default_factory=WorkerLabels)
    exposition: ExpositionCache = field(default_factory=ExpositionCache)

    def __post_init__(self) -> None:
        for metric in self.own():
            if "worker" in metric.labels and metric not in (self.ejections, self.worker_queue_full):
                metric.workers = self.worker_labels

    def own(self) -> Iterable[Counter | Histogram]:
        return (
            self.requests,
            self.ttft,
            self.itl,
            self.e2e,
            self.time_to_upstream,
            self.prompt_tokens,
            self.completion_tokens,
            self.routing_decisions,
            self.retries,
            self.ejections,
            self.worker_queue_full,
            self.queue_wait,
            self.task_queue_wait,
            self.rejections,
            self.tenant_requests,
            self.tenant_tokens,
            self.usage_requests,
            self.usage_pages,
            self.usage_images,
            self.usage_tokens,
            self.usage_npu_seconds,
            self.config_reloads,
        )


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """The gateway's queue at scrape time, per (tenant, priority label)."""

    queued: dict[tuple[str, str], tuple[int, int]]  # -> (requests, bytes)
    in_flight: dict[str, int]  # tenant -> requests on workers
    flows: dict[str, int] = field(default_factory=dict)  # tenant -> documents queued or running
    by_task: dict[str, int] = field(default_factory=dict)  # layout/block/other -> queued


class GatewayCollector(Collector):
    """Exports `GatewayMetrics` plus worker and queue gauges read at scrape time."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        workers: Callable[[], Iterable[WorkerGauges]],
        policy: str,
        queue: Callable[[], QueueGauges] | None = None,
    ) -> None:
        self._metrics = metrics
        self._workers = workers
        self._policy = policy
        self._queue = queue
        self._started = time.time()

    def collect(self) -> Iterator[Metric]:
        doc = "Gateway version and routing policy."
        info = GaugeMetricFamily("mineru_gateway_info", doc, labels=["version", "policy"])
        info.add_metric([__version__, self._policy], 1)
        yield info
        start = GaugeMetricFamily(
            "mineru_gateway_start_time_seconds", "When this gateway process started (Unix time)."
        )
        start.add_metric([], self._started)
        yield start
        for metric in self._metrics.own():
            yield metric.collect()
        yield from _worker_families(list(self._workers()))
        if self._queue is not None:
            yield from _queue_families(self._queue())


_WORKER_GAUGES: tuple[tuple[str, str, Callable[[WorkerGauges], float | None]], ...] = (
    ("healthy", "1 when the worker takes traffic.", lambda w: float(w.healthy)),
    ("requests_in_flight", "Requests this gateway has on the worker.", lambda w: w.in_flight),
    ("waiting_requests", "vllm:num_requests_waiting as last scraped.", lambda w: w.waiting),
    ("running_requests", "vllm:num_requests_running as last scraped.", lambda w: w.running),
    ("kv_cache_usage_ratio", "vllm:kv_cache_usage_perc as last scraped.", lambda w: w.kv_usage),
    ("load_scrape_age_seconds", "Age of the load figures above.", lambda w: w.scrape_age_s),
)


def _worker_families(workers: list[WorkerGauges]) -> Iterator[Metric]:
    for suffix, doc, read in _WORKER_GAUGES:
        name = (
            "mineru_gateway_requests_in_flight"
            if suffix == "requests_in_flight"
            else f"mineru_gateway_worker_{suffix}"
        )
        family = GaugeMetricFamily(name, doc, labels=["worker"])
        for worker in workers:
            value = read(worker)
            if value is not None:
                family.add_metric([worker.worker], value)
        yield family


def _queue_families(queue: QueueGauges) -> Iterator[Metric]:
    labels = ["tenant", "priority"]
    requests = GaugeMetricFamily(
        "mineru_gateway_queue_requests", "Requests waiting in the gateway's queue.", labels=labels
    )
    size = GaugeMetricFamily(
        "mineru_gateway_queue_bytes", "Request bytes waiting in the gateway's queue.", labels=labels
    )
    for (tenant, priority), (count, queued_bytes) in sorted(queue.queued.items()):
        requests.add_metric([tenant, priority], count)
        size.add_metric([tenant, priority], queued_bytes)
    in_flight = GaugeMetricFamily(
        "mineru_gateway_tenant_requests_in_flight",
        "Requests of each tenant on workers.",
        labels=["tenant"],
    )
    for tenant, count in sorted(queue.in_flight.items()):
        in_flight.add_metric([tenant], count)
    flows = GaugeMetricFamily(
        "mineru_gateway_tenant_flows",
        "Flows (documents, and the requests without a document id) of each tenant with "
        "requests queued or on workers.",
        labels=["tenant"],
    )
    for tenant, count in sorted(queue.flows.items()):
        flows.add_metric([tenant], count)
    by_task = GaugeMetricFamily(
        "mineru_gateway_queue_task_requests",
        "Requests waiting in the gateway's queue, by MinerU task: layout (a page's first "
        "step), block (its second) or other.",
        labels=["task"],
    )
    for task in TASKS:
        by_task.add_metric([task], queue.by_task.get(task, 0))
    yield from (requests, size, in_flight, flows, by_task)
