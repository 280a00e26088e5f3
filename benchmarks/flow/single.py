"""`single`: flow control costs a single user nothing.

4 identical simulated workers, one tenant (no API keys), the gateway with flow control on and off:
- saturation: a closed loop of `concurrency` non-streaming MinerU requests (more than the workers'
  batches hold, so flow control queues the excess in the gateway), completions per second in a
  window after a warm-up; flow control against pass-through (target >= 0.98x);
- latency at `load` x capacity (the pass-through saturation figure of this run): open-loop
  Poisson, streamed, the same seeded requests for both modes; TTFT p50 and p99 (target: flow
  control within 5% of pass-through).
Runs go pass-through, flow control, flow control, pass-through (ABBA) when `repeats` is 2, so a
drift of the shared machine hits both modes alike; figures are then the means of the repeats.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import aiohttp
from benchmarks.routing import fleet, loadgen, workload
from benchmarks.routing.runs import MACHINE_BUSY_LIMIT, least_disturbed

from . import stand
from .client import new_session
from .common import Clock, batch_requests, check, fmt, latency_summary, ratio, saturate


@dataclass(frozen=True)
class SinglePlan:
    time_scale: float = 1.0
    workers: int = 4
    load: float = 0.85
    warmup_s: float = 30.0
    window_s: float = 30.0
    tail_cap_s: float = 5.0
    concurrency: int = 1000
    saturation_warmup_s: float = 30.0
    saturation_window_s: float = 30.0
    repeats: int = 1
    quiet_wait_s: float = 120.0
    seed: int = 3


async def guarded(attempt: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """A run, repeated (at most twice) when other processes took over half a core or the machine
    was nearly saturated (`runs.least_disturbed`): this machine is shared."""
    best, attempts = await least_disturbed(attempt, lambda r: r["cpu"], MACHINE_BUSY_LIMIT)
    best["attempts"] = attempts
    return best


def order(repeats: int) -> list[str]:
    """pass-through first; ABBA for two repeats, alternating beyond."""
    out: list[str] = []
    for index in range(repeats):
        pair = list(stand.MODES) if index % 2 == 0 else list(reversed(stand.MODES))
        out += pair
    return out


async def run(plan: SinglePlan, gateway_extra: list[str], procs: fleet.Processes) -> dict[str, Any]:
    clock = Clock(plan.time_scale)
    mix = workload.Mix(model=fleet.MODEL)
    workers = fleet.SimWorkers(procs, plan.time_scale, [1.0] * plan.workers)
    workers.start()
    document: dict[str, Any] = {"plan": asdict(plan), "gateway_args": gateway_extra, "runs": []}
    requests = batch_requests(plan.seed + 40, 4000)
    try:
        async with new_session() as session:
            for mode in order(plan.repeats):
                result = await guarded(
                    partial(
                        saturation,
                        plan,
                        clock,
                        procs,
                        workers,
                        session,
                        mode,
                        requests,
                        gateway_extra,
                    )
                )
                result |= {"kind": "saturation", "mode": mode}
                document["runs"].append(result)
                print(format_run(result), flush=True)
            capacity = _mean(
                r["requests_per_s"]
                for r in document["runs"]
                if r["kind"] == "saturation" and r["mode"] == "pass_through"
            )
            document["capacity_requests_per_s"] = capacity
            for mode in order(plan.repeats):
                result = await guarded(
                    partial(
                        latency,
                        plan,
                        clock,
                        procs,
                        workers,
                        session,
                        mode,
                        mix,
                        capacity,
                        gateway_extra,
                    )
                )
                result |= {"kind": "latency", "mode": mode}
                document["runs"].append(result)
                print(format_run(result), flush=True)
    finally:
        workers.stop()
    document["figures"] = figures(document)
    document["checks"] = checks(document)
    return document


async def saturation(
    plan: SinglePlan,
    clock: Clock,
    procs: fleet.Processes,
    workers: fleet.SimWorkers,
    session: aiohttp.ClientSession,
    mode: str,
    requests: list[Any],
    extra: list[str],
) -> dict[str, Any]:
    gateway = await stand.start_gateway(procs, workers.urls, mode, extra)
    try:
        parts = {"gateway": stand.process_tree(gateway.pid), "workers": workers.pids}
        foreign = await stand.wait_quiet(parts, plan.quiet_wait_s)
        meter = stand.CpuMeter(parts)
        meter.start()
        figures, calls = await saturate(
            session,
            gateway.url,
            requests,
            plan.concurrency,
            plan.seed,
            clock,
            plan.saturation_warmup_s,
            plan.saturation_window_s,
        )
        cpu = meter.stop()
        await fleet.wait_idle(session, workers.urls)
    finally:
        gateway.stop()
    return figures | {
        "rejected": sum(c.rejected for c in calls),
        "cpu": cpu,
        "foreign_cores_before": foreign,
    }


async def latency(
    plan: SinglePlan,
    clock: Clock,
    procs: fleet.Processes,
    workers: fleet.SimWorkers,
    session: aiohttp.ClientSession,
    mode: str,
    mix: workload.Mix,
    capacity: float,
    extra: list[str],
) -> dict[str, Any]:
    rate = plan.load * capacity / plan.time_scale
    phases = loadgen.Phases(
        warmup_s=clock.wall(plan.warmup_s),
        window_s=clock.wall(plan.window_s),
        tail_cap_s=clock.wall(plan.tail_cap_s),
        wait_for="first_token",
    )
    arrivals = workload.arrivals(mix, plan.seed * 1000 + 7, rate, phases.total + 1)
    gateway = await stand.start_gateway(procs, workers.urls, mode, extra)
    try:
        parts = {"gateway": stand.process_tree(gateway.pid), "workers": workers.pids}
        foreign = await stand.wait_quiet(parts, plan.quiet_wait_s)
        meter = stand.CpuMeter(parts)
        before = await stand.gateway_metrics(session, gateway.url)
        meter.start()
        outcome = await loadgen.run_open_loop(session, gateway.url, arrivals, phases)
        cpu = meter.stop()
        after = await stand.gateway_metrics(session, gateway.url)
        await fleet.wait_idle(session, workers.urls)
    finally:
        gateway.stop()
    measured = [r for r in outcome.records if r.measured]
    ttfts = [None if r.first_token is None or r.error else r.first_token - r.sent for r in measured]
    queued = stand.metrics_delta(before, after)
    return {
        "offered_requests_per_s": round(rate * plan.time_scale, 2),
        "ttft_ms": latency_summary(ttfts, clock),
        "errors": sum(r.error is not None for r in measured),
        "goodput_requests_per_s": round(clock.rate(outcome.window_done, phases.window_s), 2),
        "cpu": cpu,
        "foreign_cores_before": foreign,
        "queue_wait": {
            "count": queued["mineru_gateway_queue_wait_seconds_count"],
            "sum_s": queued["mineru_gateway_queue_wait_seconds_sum"],
        },
    }


def _mean(values: Any) -> float:
    items = [v for v in values if v is not None]
    return round(sum(items) / len(items), 2) if items else 0.0


def figures(document: dict[str, Any]) -> dict[str, Any]:
    runs = document["runs"]

    def mean(kind: str, mode: str, pick: Any) -> float:
        return _mean(pick(r) for r in runs if r["kind"] == kind and r["mode"] == mode)

    out: dict[str, Any] = {}
    for mode in stand.MODES:
        out[mode] = {
            "saturation_requests_per_s": mean("saturation", mode, lambda r: r["requests_per_s"]),
            "ttft_p50_ms": mean("latency", mode, lambda r: r["ttft_ms"]["p50"]),
            "ttft_p99_ms": mean("latency", mode, lambda r: r["ttft_ms"]["p99"]),
        }
    fc, pt = out["flow_control"], out["pass_through"]
    out["saturation_flow_control_over_pass_through"] = ratio(
        fc["saturation_requests_per_s"], pt["saturation_requests_per_s"]
    )
    out["ttft_p50_flow_control_over_pass_through"] = ratio(fc["ttft_p50_ms"], pt["ttft_p50_ms"])
    out["ttft_p99_flow_control_over_pass_through"] = ratio(fc["ttft_p99_ms"], pt["ttft_p99_ms"])
    return out


def checks(document: dict[str, Any]) -> list[dict[str, str]]:
    f = document["figures"]
    p50, p99 = (
        f["ttft_p50_flow_control_over_pass_through"],
        f["ttft_p99_flow_control_over_pass_through"],
    )
    sat = f["saturation_flow_control_over_pass_through"]
    load = document["plan"]["load"]
    return [
        check(
            f"TTFT p50 at {load:g}x capacity, flow control against pass-through",
            "<= 1.05x",
            fmt(p50, "x", 3),
            None if p50 is None else p50 <= 1.05,
        ),
        check(
            f"TTFT p99 at {load:g}x capacity, flow control against pass-through",
            "<= 1.05x",
            fmt(p99, "x", 3),
            None if p99 is None else p99 <= 1.05,
        ),
        check(
            "saturation throughput, flow control against pass-through",
            ">= 0.98x",
            fmt(sat, "x", 3),
            None if sat is None else sat >= 0.98,
        ),
    ]


def format_run(run: dict[str, Any]) -> str:
    if run["kind"] == "saturation":
        return (
            f"saturation {run['mode']:12s} {run['requests_per_s']:.1f} req/s, "
            f"errors {run['errors']}, cpu {run['cpu']}"
        )
    ttft = run["ttft_ms"]
    return (
        f"latency    {run['mode']:12s} {run['offered_requests_per_s']:.1f} req/s offered: TTFT "
        f"p50/p99 {fmt(ttft['p50'], ' ms')}/{fmt(ttft['p99'], ' ms')} (n={ttft['n']}), "
        f"errors {run['errors']}, queued {run['queue_wait']['count']}, cpu {run['cpu']}"
    )
