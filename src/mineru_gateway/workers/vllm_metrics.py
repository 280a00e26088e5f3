"""Reading a worker's load from its vLLM `/metrics` text. Pure, and cheap on purpose.

The gateway reads every worker's `/metrics` several times a second (issue 3). A full Prometheus
parse of vLLM's exposition (tens of kilobytes of histograms) costs milliseconds of the event loop
each time; the few series routing needs are found by a prefix scan instead.
"""

from __future__ import annotations

from dataclasses import dataclass

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")  # new name, deprecated one
ITL_SUM = (b"vllm:inter_token_latency_seconds_sum", b"vllm:time_per_output_token_seconds_sum")
ITL_COUNT = (
    b"vllm:inter_token_latency_seconds_count",
    b"vllm:time_per_output_token_seconds_count",
)


@dataclass(frozen=True, slots=True)
class VllmLoad:
    """Summed over the worker's engines and models (one engine per worker in this deployment)."""

    waiting: float
    running: float
    kv_usage: float  # 0..1, the fullest engine's
    itl_sum: float
    itl_count: float


def parse_vllm_load(text: bytes) -> VllmLoad | None:
    """The load figures in `text`, or None when it is not vLLM's exposition."""
    values: dict[bytes, list[float]] = {}
    for line in text.split(b"\n"):
        if not line.startswith(b"vllm:"):
            continue
        name_end = _name_end(line)
        name = line[:name_end]
        if name in _WANTED:
            try:
                value = float(line.rsplit(b" ", 1)[1])
            except (IndexError, ValueError):
                continue
            values.setdefault(name, []).append(value)
    if WAITING not in values or RUNNING not in values:
        return None
    return VllmLoad(
        waiting=sum(values[WAITING]),
        running=sum(values[RUNNING]),
        kv_usage=max(_first(values, KV_USAGE), default=0.0),
        itl_sum=sum(_first(values, ITL_SUM)),
        itl_count=sum(_first(values, ITL_COUNT)),
    )


_WANTED = frozenset({WAITING, RUNNING, *KV_USAGE, *ITL_SUM, *ITL_COUNT})


def _name_end(line: bytes) -> int:
    brace = line.find(b"{")
    space = line.find(b" ")
    return brace if 0 <= brace < space else space


def _first(values: dict[bytes, list[float]], names: tuple[bytes, ...]) -> list[float]:
    for name in names:
        if name in values:
            return values[name]
    return []
