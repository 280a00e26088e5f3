"""Shared by the scenarios: engine-time figures from calls, the requests, the results document.

Units: like `benchmarks/routing`, figures are in engine time (the simulator at time scale s runs
s times slower than the NPU it stands for): wall durations / s, rates x s. CPU shares and
`Retry-After` stay in wall time (they are properties of this machine and of the gateway).
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from benchmarks.routing import workload
from benchmarks.routing.runs import git_commit
from benchmarks.routing.stats import percentile

from .client import Call, MineruBatch, non_streaming

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK_KINDS = ("text", "formula")  # short MinerU block requests (tables answer at length)


@dataclass(frozen=True)
class Clock:
    """Converts wall seconds to engine seconds and back."""

    time_scale: float

    def wall(self, engine_s: float) -> float:
        return engine_s * self.time_scale

    def ms(self, wall_s: float | None) -> float | None:
        return None if wall_s is None else round(wall_s * 1000 / self.time_scale, 1)

    def rate(self, count: float, wall_s: float) -> float:
        return count / max(wall_s, 1e-9) * self.time_scale


def latency_summary(values: Sequence[float | None], clock: Clock) -> dict[str, Any]:
    """Percentiles (engine ms) of wall-second latencies; None (no answer) ranks slowest."""
    finite = [v for v in values if v is not None]
    ranked = [math.inf if v is None else v for v in values]

    def pick(q: float) -> float | None:
        if not ranked:
            return None
        value = percentile(ranked, q)
        return None if math.isinf(value) else clock.ms(value)

    return {
        "n": len(values),
        "missing": len(values) - len(finite),
        "p50": pick(50),
        "p90": pick(90),
        "p99": pick(99),
        "max": clock.ms(max(finite)) if finite else None,
    }


def ratio(value: float | None, base: float | None, digits: int = 3) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return round(value / base, digits)


def completed_in(calls: Iterable[Call], start: float, stop: float) -> tuple[int, int]:
    """(requests, output tokens) of calls that succeeded inside [start, stop] (wall)."""
    requests = tokens = 0
    for call in calls:
        if call.done is not None and call.error is None and start <= call.done <= stop:
            requests += 1
            tokens += call.output_tokens
    return requests, tokens


def block_requests(
    seed: int, count: int, mix: workload.Mix | None = None
) -> list[workload.Request]:
    """Short MinerU block requests (text and formula crops), streamed."""
    builder = workload.StreamBuilder(mix or workload.Mix(), seed)
    out: list[workload.Request] = []
    while len(out) < count:
        out += [r for r in builder.page() if r.kind in BLOCK_KINDS]
    return out[:count]


def batch_requests(
    seed: int, count: int, mix: workload.Mix | None = None
) -> list[workload.Request]:
    """MinerU's page and block requests in page order (workload.py's mix), not streamed."""
    builder = workload.StreamBuilder(mix or workload.Mix(), seed)
    out: list[workload.Request] = []
    while len(out) < count:
        out += [non_streaming(r) for r in builder.page()]
    return out[:count]


def header(scenario: str, argv: Sequence[str], started: float) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "command": "python -m benchmarks.flow " + " ".join(argv),
        "git_commit": git_commit(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def check(name: str, target: str, measured: str, ok: bool | None) -> dict[str, str]:
    result = "n/a" if ok is None else ("PASS" if ok else "MISS")
    return {"check": name, "target": target, "measured": measured, "result": result}


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}{unit}"


async def saturate(
    session: aiohttp.ClientSession,
    url: str,
    requests: Sequence[workload.Request],
    concurrency: int,
    seed: int,
    clock: Clock,
    warmup_s: float,
    window_s: float,
) -> tuple[dict[str, Any], list[Call]]:
    """A saturating closed loop of MinerU slots through `url` (one tenant, no key): completed
    requests and output tokens per engine second inside the window after `warmup_s`, and the
    calls."""
    window_start = time.perf_counter() + clock.wall(warmup_s)
    stop = window_start + clock.wall(window_s)
    batch = MineruBatch(session, url, None, "default", requests, seed, concurrency=concurrency)
    calls = await batch.run(stop, stop, drain=False)
    done, tokens = completed_in(calls, window_start, stop)
    figures = {
        "requests_per_s": round(clock.rate(done, stop - window_start), 2),
        "output_tokens_per_s": round(clock.rate(tokens, stop - window_start), 1),
        "errors": sum(c.error is not None for c in calls),
    }
    return figures, calls
