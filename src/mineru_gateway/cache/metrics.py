"""The cache's Prometheus series, `mineru_gateway_cache_*`, by tenant (docs/cache.md).

Kept like the gateway's own (metrics.py): plain numbers on the event loop's thread, turned into
families at scrape time. Tenant names are bounded by the configuration (api/tenants.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mineru_gateway.metrics import Counter

ERROR_REASONS = ("timeout", "unavailable", "corrupt")


def _counter(name: str, doc: str, *labels: str) -> Callable[[], Counter]:
    return lambda: Counter(f"mineru_gateway_cache_{name}", doc, labels)


@dataclass
class CacheMetrics:
    hits: Counter = field(
        default_factory=_counter("hits", "Requests answered from the cache.", "tenant")
    )
    misses: Counter = field(
        default_factory=_counter(
            "misses", "Cacheable requests that went to a worker (a new generation).", "tenant"
        )
    )
    coalesced: Counter = field(
        default_factory=_counter(
            "coalesced", "Requests that shared an identical request's generation.", "tenant"
        )
    )
    stored_bytes: Counter = field(
        default_factory=_counter("stored_bytes", "Bytes of answers written to the cache.", "tenant")
    )
    evictions: Counter = field(
        default_factory=_counter(
            "evictions", "Answers the in-process cache dropped for room.", "tenant"
        )
    )
    errors: Counter = field(
        default_factory=_counter(
            "errors",
            "Cache reads and writes that failed (timeout, error, corrupt); each read a miss.",
            "reason",
        )
    )
    npu_seconds_saved: Counter = field(
        default_factory=_counter(
            "npu_seconds_saved",
            "Worker time not spent: the original answer's, for each hit and coalesced request.",
            "tenant",
        )
    )

    def __post_init__(self) -> None:
        # Every reason from the start, at zero: a rate over them is 0, not "no data".
        for reason in ERROR_REASONS:
            self.errors.inc(reason, amount=0.0)

    def all(self) -> tuple[Counter, ...]:
        return (
            self.hits,
            self.misses,
            self.coalesced,
            self.stored_bytes,
            self.evictions,
            self.errors,
            self.npu_seconds_saved,
        )


class CacheCollector(Collector):
    """Exports `CacheMetrics`, and the bytes each tenant holds in the in-process cache."""

    def __init__(
        self, metrics: CacheMetrics, held: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self._metrics = metrics
        self._held = held

    def collect(self) -> Iterator[Metric]:
        for counter in self._metrics.all():
            yield counter.collect()
        if self._held is not None:
            held = GaugeMetricFamily(
                "mineru_gateway_cache_bytes",
                "Bytes of answers each tenant holds in the in-process cache.",
                labels=["tenant"],
            )
            for tenant, size in sorted(self._held().items()):
                held.add_metric([tenant], size)
            yield held
