"""Reading a worker's load from its vLLM `/metrics` text. Pure, and cheap on purpose.

The gateway reads every worker's load several times a second. A full Prometheus
parse of vLLM's exposition (tens of kilobytes of histograms) costs milliseconds of the event loop
each time; the few series routing needs are found by a prefix scan instead.

It asks for those series only (`LOAD_PATH`): vLLM renders its whole page on every read, several
times the API server's CPU of the filtered one (docs/vllm.md).
vLLM applies the filter on `/metrics/` only, and not at all with several API servers; the
registry then falls back to `FULL_PATH` (docs/vllm.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from urllib.parse import urlencode

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")  # new name, deprecated one
ITL_SUM = (b"vllm:inter_token_latency_seconds_sum", b"vllm:time_per_output_token_seconds_sum")
ITL_COUNT = (
    b"vllm:inter_token_latency_seconds_count",
    b"vllm:time_per_output_token_seconds_count",
)
# Every sample name the load is read from, new names and old.
LOAD_SERIES: tuple[bytes, ...] = (WAITING, RUNNING, *KV_USAGE, *ITL_SUM, *ITL_COUNT)
# prometheus_client's ASGI app, which vLLM mounts at `/metrics/`, answers only the samples named.
LOAD_PATH = "/metrics/?" + urlencode([("name[]", name.decode()) for name in LOAD_SERIES])
FULL_PATH = "/metrics"


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
    text = b"\n" + text
    waiting, running = _samples(text, WAITING), _samples(text, RUNNING)
    if not waiting or not running:
        return None
    return VllmLoad(
        waiting=sum(waiting),
        running=sum(running),
        kv_usage=max(_first(text, KV_USAGE), default=0.0),
        itl_sum=sum(_first(text, ITL_SUM)),
        itl_count=sum(_first(text, ITL_COUNT)),
    )


def _samples(text: bytes, name: bytes) -> list[float]:
    """The values of every sample of `name` (one per engine and model) in `text`, which starts
    with a newline. `bytes.find` skips the hundreds of histogram lines in C: a line-by-line
    scan in Python cost a tenth of the gateway's CPU when it relayed streams (issue 16)."""
    values = []
    needle = b"\n" + name
    start = text.find(needle)
    while start >= 0:
        start += len(needle)
        end = text.find(b"\n", start)
        line = text[start:] if end < 0 else text[start:end]
        if line[:1] in (b"{", b" "):  # not a longer name that begins with this one
            with contextlib.suppress(IndexError, ValueError):
                values.append(float(line.rsplit(b" ", 1)[1]))
        start = text.find(needle, start)
    return values


def _first(text: bytes, names: tuple[bytes, ...]) -> list[float]:
    """The samples of the first of `names` that `text` has (a new name, then its old one)."""
    for name in names:
        if values := _samples(text, name):
            return values
    return []
