"""`/metrics` of the simulator: vLLM's metric names, labels and buckets (fixtures/vllm/metrics.txt),
read from the engine when scraped, so steps and tokens cost no Prometheus calls."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from mineru_gateway.sim.engine import Scheduler
from mineru_gateway.sim.stats import Histogram
from mineru_gateway.vllm_contract import DIALECTS, NEWEST_VERSION, Dialect

LABELS = ["engine", "model_name"]

_HISTOGRAMS = (
    ("request_prompt_tokens", "prompt_len", "Number of prefill tokens processed."),
    ("request_generation_tokens", "generation_len", "Number of generation tokens processed."),
    (
        "iteration_tokens_total",
        "iteration_tokens",
        "Histogram of number of tokens per engine_step.",
    ),
    (
        "request_max_num_generation_tokens",
        "max_generation",
        "Histogram of maximum number of requested generation tokens.",
    ),
    ("request_params_n", "n_param", "Histogram of the n request parameter."),
    (
        "request_params_max_tokens",
        "max_tokens_param",
        "Histogram of the max_tokens request parameter.",
    ),
    ("time_to_first_token_seconds", "ttft", "Histogram of time to first token in seconds."),
    ("inter_token_latency_seconds", "itl", "Histogram of inter-token latency in seconds."),
    (
        "request_time_per_output_token_seconds",
        "tpot",
        "Histogram of time_per_output_token_seconds per request.",
    ),
    ("e2e_request_latency_seconds", "e2e", "Histogram of e2e request latency in seconds."),
    (
        "request_queue_time_seconds",
        "queue",
        "Histogram of time spent in WAITING phase for request.",
    ),
    (
        "request_inference_time_seconds",
        "inference",
        "Histogram of time spent in RUNNING phase for request.",
    ),
    (
        "request_prefill_time_seconds",
        "prefill",
        "Histogram of time spent in PREFILL phase for request.",
    ),
    (
        "request_decode_time_seconds",
        "decode",
        "Histogram of time spent in DECODE phase for request.",
    ),
    (
        "request_num_preemptions",
        "request_preemptions",
        "Histogram of the number of times a request was preempted.",
    ),
    (
        "request_prefill_kv_computed_tokens",
        "prefill_computed",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
    ),
)


class EngineCollector(Collector):
    """vLLM's `vllm:` series, computed from one scheduler at scrape time, named as the vLLM
    version of `dialect` names them (vllm_contract.py)."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_name: str,
        engine: str,
        dialect: Dialect = DIALECTS[NEWEST_VERSION],
        rejections: Mapping[str, int] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.labels = [engine, model_name]
        self.created = time.time()
        self.dialect = dialect
        self.rejections = rejections if rejections is not None else {}

    def collect(self) -> Iterator[Metric]:
        missing = self.dialect.missing_metrics
        for family in self._families():
            if family.name not in missing:
                yield family

    def _families(self) -> Iterator[Metric]:
        yield from self._gauges()
        yield from self._counters()
        stats = self.scheduler.stats
        for name, attribute, documentation in _HISTOGRAMS:
            yield self._histogram(name, documentation, getattr(stats, attribute))
        if "vllm:time_per_output_token_seconds" in self.dialect.extra_metrics:
            yield self._histogram(
                "time_per_output_token_seconds",
                "Histogram of time per output token in seconds."
                "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                stats.itl,
            )
        if self.dialect.admission_metric:
            yield self._admission_rejections()
        yield self._cache_config()

    def _admission_rejections(self) -> Metric:
        family = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=["model_name", "reason"],
        )
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            family.add_metric(
                [self.labels[1], reason], self.rejections.get(reason, 0), created=self.created
            )
        return family

    def _gauges(self) -> Iterator[Metric]:
        scheduler = self.scheduler
        yield self._gauge(
            "num_requests_running",
            "Number of requests in model execution batches.",
            len(scheduler.running),
        )
        yield self._gauge(
            "num_requests_waiting",
            "Number of requests waiting to be processed.",
            len(scheduler.waiting),
        )
        yield self._gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", scheduler.kv_usage
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason.",
            labels=[*LABELS, "reason"],
        )
        by_reason.add_metric([*self.labels, "capacity"], len(scheduler.waiting))
        by_reason.add_metric([*self.labels, "deferred"], 0)
        yield by_reason
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state", "Engine sleep state.", labels=[*LABELS, "sleep_state"]
        )
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.add_metric([*self.labels, state], value)
        yield sleep

    def _counters(self) -> Iterator[Metric]:
        stats = self.scheduler.stats
        yield self._counter(
            "prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield self._counter(
            "generation_tokens", "Number of generation tokens processed.", stats.generation_tokens
        )
        yield self._counter(
            "num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions
        )
        yield self._counter(
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prompt_tokens,
        )
        yield self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", 0
        )
        yield self._counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external).", 0
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*LABELS[:1], "finished_reason", LABELS[1]],
        )
        for reason, count in stats.finished.items():
            success.add_metric(
                [self.labels[0], reason, self.labels[1]], count, created=self.created
            )
        yield success
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=[*LABELS, "source"],
        )
        for source, count in (
            ("local_compute", stats.prompt_tokens),
            ("local_cache_hit", 0),
            ("external_kv_transfer", 0),
        ):
            by_source.add_metric([*self.labels, source], count, created=self.created)
        yield by_source

    def _gauge(self, name: str, documentation: str, value: float) -> Metric:
        family = GaugeMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> Metric:
        family = CounterMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
        family.add_metric(self.labels, value, created=self.created)
        return family

    def _histogram(self, name: str, documentation: str, histogram: Histogram) -> Metric:
        family = HistogramMetricFamily(f"vllm:{name}", documentation, labels=LABELS)
        bounds = [repr(float(bound)) for bound in histogram.bounds] + ["+Inf"]
        buckets = list(zip(bounds, histogram.cumulative(), strict=True))
        family.add_metric(self.labels, [(b, float(c)) for b, c in buckets], histogram.total)
        label_map = dict(zip(LABELS, self.labels, strict=True))
        family.samples.append(Sample(f"vllm:{name}_created", label_map, self.created))
        return family

    def _cache_config(self) -> Metric:
        config = self.scheduler.config
        info = {
            "block_size": str(config.block_size),
            "enable_prefix_caching": "False",
            "engine": self.labels[0],
            "kv_cache_size_tokens": str(config.kv_cache_tokens),
            "num_gpu_blocks": str(config.kv_cache_blocks),
        }
        family = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        family.add_metric(list(info.values()), 1.0)
        return family


def build_registry(
    scheduler: Scheduler,
    model_name: str,
    engine: str,
    dialect: Dialect = DIALECTS[NEWEST_VERSION],
    rejections: Mapping[str, int] | None = None,
) -> CollectorRegistry:
    """A registry of this simulator's own, never the process-global one. It learns each
    collector's names when it is registered (`auto_describe`), so that a read filtered by name
    (`/metrics/?name[]=...`) finds them, as it finds vLLM's own metrics."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(EngineCollector(scheduler, model_name, engine, dialect, rejections))
    return registry
