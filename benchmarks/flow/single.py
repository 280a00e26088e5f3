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
from benchmarks.routing import fleet, workload

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
    document: dict[str, Any] = {"plan": asdict(plan), "gateway_args": gateway_extra, "runs": []}
    requests = batch_requests(plan.seed + 40, 4000)
    with stand.sim_workers(procs, plan.time_scale, plan.workers) as workers:
        async with new_session() as session:
            on_stand = (plan, clock, procs, workers, session)
            measure = partial(saturation, *on_stand, requests=requests, extra=gateway_extra)
            await each_mode(document, plan.repeats, "saturation", measure)
            capacity = _mean(
                r["requests_per_s"]
                for r in document["runs"]
                if r["kind"] == "saturation" and r["mode"] == "pass_through"
            )
            document["capacity_requests_per_s"] = capacity
            measure = partial(latency, *on_stand, mix=mix, capacity=capacity, extra=gateway_extra)
            await each_mode(document, plan.repeats, "latency", measure)
    document["figures"] = figures(document)
    document["checks"] = checks(document)
    return document


async def each_mode(
    document: dict[str, Any],
    repeats: int,
    kind: str,
    measure: Callable[[str], Awaitable[dict[str, Any]]],
) -> None:
    """`measure` of each mode in `order`, repeated if the machine was disturbed, into the runs."""
    for mode in order(repeats):
        result = await stand.guarded(partial(measure, mode))
        result |= {"kind": kind, "mode": mode}
        document["runs"].append(result)
        print(format_run(result), flush=True)


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
    phases = stand.first_token_phases(clock, plan.warmup_s, plan.window_s, plan.tail_cap_s)
    arrivals = workload.arrivals(mix, plan.seed * 1000 + 7, rate, phases.total + 1)
    gateway = await stand.start_gateway(procs, workers.urls, mode, extra)
    try:
        load = await stand.open_loop(
            session, gateway, workers.pids, arrivals, phases, plan.quiet_wait_s
        )
        after = await stand.gateway_metrics(session, gateway.url)
        await fleet.wait_idle(session, workers.urls)
    finally:
        gateway.stop()
    measured = [r for r in load.outcome.records if r.measured]
    ttfts = [None if r.first_token is None or r.error else r.first_token - r.sent for r in measured]
    queued = stand.metrics_delta(load.metrics_before, after)
    return {
        "offered_requests_per_s": round(rate * plan.time_scale, 2),
        "ttft_ms": latency_summary(ttfts, clock),
        "errors": sum(r.error is not None for r in measured),
        "goodput_requests_per_s": round(clock.rate(load.outcome.window_done, phases.window_s), 2),
        "cpu": load.cpu,
        "foreign_cores_before": load.foreign_cores_before,
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
