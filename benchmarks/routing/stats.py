"""Per-run figures from load generator records, and goodput from a sweep. Pure."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .loadgen import Record, RunOutcome

INF = math.inf


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); inf values count as the slowest."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def finite_or_none(value: float) -> float | None:
    return None if math.isinf(value) or math.isnan(value) else value


@dataclass
class RunResult:
    scenario: str
    router: str
    fraction: float  # of the scenario's capacity
    rate: float  # requests/s offered through the router (engine time, as all figures here)
    wait_for: str
    measured: int
    completed: int
    errors: int
    no_first_token: int  # measured requests cancelled before their first token (censored TTFT)
    unfinished: int  # measured requests cancelled before their end (censored E2E)
    ttft_ms: dict[str, float | None]
    ttft_p99_by_kind_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    requests_per_s: float  # requests completed inside the measured window, per second
    tokens_per_s: float  # streamed events received inside the measured window, per second
    lag_ms: dict[str, float]
    worker_requests: list[int]  # requests the router sent to each worker during the run
    background_sent: int
    cpu: dict[str, float]
    tail_s: float
    capped: bool
    wall_s: float
    idle_wait_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def ttft_values(records: Iterable[Record]) -> list[float]:
    """Seconds; a request that failed or never got its first token counts as inf."""
    out = []
    for r in records:
        if r.first_token is not None and r.error is None:
            out.append(r.first_token - r.sent)
        else:
            out.append(INF)
    return out


def e2e_values(records: Iterable[Record]) -> list[float]:
    return [r.done - r.sent if r.done is not None and r.error is None else INF for r in records]


def summarise(
    outcome: RunOutcome,
    *,
    scenario: str,
    router: str,
    fraction: float,
    rate: float,
    window_s: float,
    wait_for: str,
    time_scale: float = 1.0,
) -> RunResult:
    """Figures of one run in engine time: wall durations / `time_scale`, rates x `time_scale`
    (a simulator at time scale 2 runs twice as slowly as the NPU it stands for). The load
    generator's lag stays in wall milliseconds: it is a property of this machine."""
    measured = [r for r in outcome.records if r.measured]
    ttfts = ttft_values(measured)
    kinds: dict[str, list[float]] = {}
    for record, value in zip(measured, ttfts, strict=True):
        kinds.setdefault(record.kind, []).append(value)
    e2e = e2e_values(measured) if wait_for == "done" else []
    lags = outcome.lags or [0.0]

    def ms(values: list[float], q: float) -> float | None:
        value = finite_or_none(percentile(values, q))
        return None if value is None else round(value * 1000 / time_scale, 2)

    return RunResult(
        scenario=scenario,
        router=router,
        fraction=fraction,
        rate=rate * time_scale,
        wait_for=wait_for,
        measured=len(measured),
        completed=sum(r.done is not None and r.error is None for r in measured),
        errors=sum(r.error is not None for r in measured),
        no_first_token=sum(r.first_token is None and r.error is None for r in measured),
        unfinished=sum(r.done is None and r.error is None for r in measured),
        ttft_ms={"p50": ms(ttfts, 50), "p90": ms(ttfts, 90), "p99": ms(ttfts, 99)},
        ttft_p99_by_kind_ms={kind: ms(values, 99) for kind, values in sorted(kinds.items())},
        e2e_ms={"p50": ms(e2e, 50), "p99": ms(e2e, 99)} if e2e else {"p50": None, "p99": None},
        requests_per_s=outcome.window_done / window_s * time_scale,
        tokens_per_s=outcome.window_tokens / window_s * time_scale,
        lag_ms={
            "p50": round(percentile(lags, 50) * 1000, 3),
            "p99": round(percentile(lags, 99) * 1000, 3),
            "max": round(max(lags) * 1000, 3),
        },
        worker_requests=[],
        background_sent=0,
        cpu={},
        tail_s=round(outcome.tail_s, 2),
        capped=outcome.capped,
        wall_s=0.0,
    )


def passes(run: RunResult, slo_ms: float) -> bool:
    p99 = run.ttft_ms["p99"]
    return p99 is not None and p99 <= slo_ms and run.errors <= 0.01 * max(1, run.measured)


@dataclass(frozen=True)
class Goodput:
    """Highest offered rate whose TTFT p99 met the SLO, every lower rate meeting it too.

    `grid` is the highest such rate of the sweep; `interpolated` places the crossing between it
    and the next (failing) rate by interpolating log(p99) linearly in the rate; `bounded` is False
    when even the highest rate swept met the SLO (the goodput is at least that)."""

    grid: float
    interpolated: float
    bounded: bool


def goodput(runs: Sequence[RunResult], slo_ms: float) -> Goodput:
    ordered = sorted(runs, key=lambda r: r.rate)
    best: RunResult | None = None
    for run in ordered:
        if not passes(run, slo_ms):
            if best is None:
                return Goodput(0.0, 0.0, True)
            return Goodput(best.rate, _crossing(best, run, slo_ms), True)
        best = run
    top = ordered[-1].rate if ordered else 0.0
    return Goodput(top, top, False)


def _crossing(ok: RunResult, bad: RunResult, slo_ms: float) -> float:
    low, high = ok.ttft_ms["p99"], bad.ttft_ms["p99"]
    if low is None or high is None or high <= low or bad.errors > 0.01 * max(1, bad.measured):
        return ok.rate
    share = (math.log(slo_ms) - math.log(max(low, 1e-3))) / (math.log(high) - math.log(low))
    return ok.rate + (bad.rate - ok.rate) * min(1.0, max(0.0, share))
