"""The engine's counters and histograms as plain numbers; `metrics.py` exposes them to Prometheus.

Histograms here take a count with each observation: in one engine step every sequence that decoded
in the previous step sees the same inter-token gap, so a step costs one observation, not one per
sequence. Bucket bounds are vLLM's (fixtures/vllm/metrics.txt).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

TOKEN_COUNT_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
ITERATION_TOKEN_BUCKETS: tuple[float, ...] = (
    *(1, 8, 16, 32, 64, 128, 256, 512),
    *(1024, 2048, 4096, 8192, 16384),
)
N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)
TTFT_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS: tuple[float, ...] = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
REQUEST_TIME_BUCKETS: tuple[float, ...] = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0),
    *(30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass(slots=True)
class Histogram:
    """Counts per bucket (the last one is +Inf), not cumulative."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times

    def cumulative(self) -> list[int]:
        running, out = 0, []
        for count in self.counts:
            running += count
            out.append(running)
        return out


def _histogram(bounds: tuple[float, ...]) -> Histogram:
    return Histogram(bounds)


@dataclass(slots=True)
class EngineStats:
    """Everything the engine has counted since it started."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    arrived: int = 0
    aborted: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))
    ttft: Histogram = field(default_factory=lambda: _histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: _histogram(ITL_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: _histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: _histogram(REQUEST_TIME_BUCKETS))
    queue: Histogram = field(default_factory=lambda: _histogram(REQUEST_TIME_BUCKETS))
    inference: Histogram = field(default_factory=lambda: _histogram(REQUEST_TIME_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: _histogram(REQUEST_TIME_BUCKETS))
    decode: Histogram = field(default_factory=lambda: _histogram(REQUEST_TIME_BUCKETS))
    prompt_len: Histogram = field(default_factory=lambda: _histogram(TOKEN_COUNT_BUCKETS))
    generation_len: Histogram = field(default_factory=lambda: _histogram(TOKEN_COUNT_BUCKETS))
    max_tokens_param: Histogram = field(default_factory=lambda: _histogram(TOKEN_COUNT_BUCKETS))
    max_generation: Histogram = field(default_factory=lambda: _histogram(TOKEN_COUNT_BUCKETS))
    n_param: Histogram = field(default_factory=lambda: _histogram(N_BUCKETS))
    request_preemptions: Histogram = field(default_factory=lambda: _histogram(PREEMPTION_BUCKETS))
    prefill_computed: Histogram = field(default_factory=lambda: _histogram(TOKEN_COUNT_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: _histogram(ITERATION_TOKEN_BUCKETS))

    @property
    def completed(self) -> int:
        return sum(self.finished.values())
