"""`flood`, the issue's headline: one tenant's MinerU batch against another's interactive streams.

4 simulated workers; the gateway has two API keys, A (the batch) and B (interactive), each its own
tenant, and `--tenant-max-queued` so A's excess is answered 429 with `Retry-After`.

1. Capacity: A alone through the pass-through gateway, saturating (`concurrency` non-streaming
   requests at once, a closed loop), completions per second in a window after a warm-up. A's
   goodput during the flood is a share of this.
2. Per mode (pass-through first, then flow control), a fresh gateway:
   - phase 1, B alone: B sends `b_rate` short streamed block requests/s (Poisson) for `alone_s`;
   - phase 2, A's batch: A's closed loop of `concurrency` slots (MinerU's client: non-streaming
     page and block requests; on 429/503 it waits `Retry-After` with jitter and retries until
     it succeeds) for `batch_s`, while B keeps sending; then A's requests under way finish.
   B's TTFT in phase 2 against phase 1; A's goodput in phase 2 (after `a_warmup_s`) against the
   capacity; A's 429s and errors; the gateway's peak RSS (VmHWM).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from benchmarks.routing import fleet

from . import stand
from .client import Call, Interactive, MineruBatch, new_session
from .common import (
    Clock,
    batch_requests,
    block_requests,
    check,
    completed_in,
    fmt,
    latency_summary,
    ratio,
)

KEY_A = "flood-bench-tenant-a-batch"
KEY_B = "flood-bench-tenant-b-interactive"


@dataclass(frozen=True)
class FloodPlan:
    time_scale: float = 1.0
    workers: int = 4
    concurrency: int = 1500  # A's requests at once
    b_rate: float = 0.5  # B's streamed requests/s (engine time)
    alone_s: float = 60.0  # phase 1 (engine s)
    batch_s: float = 120.0  # phase 2: A starts requests for this long (engine s)
    a_warmup_s: float = 20.0  # A's goodput is measured after this much of phase 2
    capacity_warmup_s: float = 20.0
    capacity_window_s: float = 40.0
    tenant_max_queued: int = 512
    give_up_s: float = 400.0  # wall seconds after phase 2 before A's retries count as lost
    quiet_wait_s: float = 120.0  # longest wait for other processes to calm down before a mode
    seed: int = 1
    # Which modes run (comma-separated): a diagnostic variant of the gateway's settings may run
    # flow control alone; the capacity is measured either way.
    modes: str = ",".join(stand.MODES)


@dataclass
class Workers:
    """What the flood needs of the workers: simulated (`fleet.SimWorkers`) or real vLLM."""

    urls: list[str]
    pids: Callable[[], list[int]]
    idle: Callable[[aiohttp.ClientSession], Awaitable[object]]
    simulated: bool = True

    @classmethod
    def simulators(cls, sims: fleet.SimWorkers) -> Workers:
        return cls(sims.urls, lambda: list(sims.pids), lambda s: fleet.wait_idle(s, sims.urls))


async def run(plan: FloodPlan, gateway_extra: list[str], procs: fleet.Processes) -> dict[str, Any]:
    a_requests = batch_requests(plan.seed, 6000)
    b_requests = block_requests(plan.seed + 1, 2000)
    extra = [
        *("--api-keys", f"{KEY_A},{KEY_B}"),
        *("--tenant-max-queued", str(plan.tenant_max_queued)),
        *gateway_extra,
    ]
    with stand.sim_workers(procs, plan.time_scale, plan.workers) as sims:
        return await run_on(plan, Workers.simulators(sims), procs, a_requests, b_requests, extra)


async def run_on(
    plan: FloodPlan,
    workers: Workers,
    procs: fleet.Processes,
    a_requests: list[Any],
    b_requests: list[Any],
    extra: list[str],
) -> dict[str, Any]:
    """Capacity, then both modes, on running workers."""
    clock = Clock(plan.time_scale)
    document: dict[str, Any] = {
        "plan": asdict(plan),
        "gateway_args": extra,
        "tenants": {"A": stand.tenant_label(KEY_A), "B": stand.tenant_label(KEY_B)},
        "modes": {},
    }
    document["capacity"] = await capacity(plan, clock, procs, workers, a_requests, extra)
    print(f"capacity: {document['capacity']['requests_per_s']:.1f} requests/s", flush=True)
    for mode in [m for m in stand.MODES if m in plan.modes.split(",")]:
        result = await one_mode(plan, clock, procs, workers, mode, a_requests, b_requests, extra)
        document["modes"][mode] = result
        print(format_mode(mode, result), flush=True)
    document["figures"] = figures(document)
    document["checks"] = checks(document)
    return document


async def capacity(
    plan: FloodPlan,
    clock: Clock,
    procs: fleet.Processes,
    workers: Workers,
    a_requests: list[Any],
    extra: list[str],
) -> dict[str, Any]:
    """A alone through the pass-through gateway, saturating; cancelled at the window's end."""
    gateway = await stand.start_gateway(procs, workers.urls, "pass_through", extra)
    parts = {"gateway": stand.process_tree(gateway.pid), "workers": workers.pids()}
    try:
        async with new_session() as session:
            meter = stand.CpuMeter(parts)
            meter.start()
            start = time.perf_counter()
            window_start = start + clock.wall(plan.capacity_warmup_s)
            stop = window_start + clock.wall(plan.capacity_window_s)
            batch = MineruBatch(
                session,
                gateway.url,
                KEY_A,
                "A",
                a_requests,
                plan.seed,
                concurrency=plan.concurrency,
            )
            calls = await batch.run(stop, stop, drain=False)
            cpu = meter.stop()
            await workers.idle(session)
    finally:
        gateway.stop()
    done, tokens = completed_in(calls, window_start, stop)
    window = stop - window_start
    return {
        "requests_per_s": round(clock.rate(done, window), 2),
        "output_tokens_per_s": round(clock.rate(tokens, window), 1),
        "completed_in_window": done,
        "errors": sum(c.error is not None for c in calls),
        "rejected": sum(c.rejected for c in calls),
        "cpu": cpu,
    }


async def one_mode(
    plan: FloodPlan,
    clock: Clock,
    procs: fleet.Processes,
    workers: Workers,
    mode: str,
    a_requests: list[Any],
    b_requests: list[Any],
    extra: list[str],
) -> dict[str, Any]:
    gateway = await stand.start_gateway(procs, workers.urls, mode, extra)
    parts = {"gateway": stand.process_tree(gateway.pid), "workers": workers.pids()}
    try:
        async with new_session() as a_session, new_session() as b_session:
            foreign_before = await stand.wait_quiet(parts, plan.quiet_wait_s)
            before = await stand.gateway_metrics(b_session, gateway.url)
            origin = time.perf_counter()
            a_start = origin + clock.wall(plan.alone_s)
            a_stop = a_start + clock.wall(plan.batch_s)
            sampler = stand.Sampler(
                b_session, gateway.url, workers.urls, 1.0, a_start, workers.simulated
            )
            sampler.start()
            b = Interactive(
                b_session,
                gateway.url,
                KEY_B,
                "B",
                b_requests,
                plan.seed + 7,
                rate=plan.b_rate / plan.time_scale,
            )
            b_task = asyncio.create_task(b.run(until=a_stop, settle_s=max(120.0, clock.wall(60))))
            meter = stand.CpuMeter(parts)
            meter.start()
            await asyncio.sleep(max(0.0, a_start - time.perf_counter()))
            cpu_alone = meter.stop()
            meter.start()
            batch = MineruBatch(
                a_session,
                gateway.url,
                KEY_A,
                "A",
                a_requests,
                plan.seed + 3,
                concurrency=plan.concurrency,
            )
            a_calls = await batch.run(a_stop, a_stop + plan.give_up_s)
            cpu_batch = meter.stop()
            b_calls = await b_task
            samples = await sampler.stop()
            after = await stand.gateway_metrics(b_session, gateway.url)
            peak = stand.peak_rss_mb(gateway.pid)
            await workers.idle(b_session)
    finally:
        gateway.stop()
    return summarise_mode(
        plan,
        clock,
        a_calls,
        b_calls,
        origin,
        a_start,
        a_stop,
        samples,
        {
            "gateway_peak_rss_mb": peak,
            "foreign_cores_before": foreign_before,
            "retry_after_s": _retry_after_summary(batch.retry_afters),
            "cpu_b_alone": cpu_alone,
            "cpu_batch": cpu_batch,
            "gateway_metrics": stand.metrics_delta(before, after),
            "gateway_args": list(gateway.args),
        },
    )


def summarise_mode(
    plan: FloodPlan,
    clock: Clock,
    a_calls: list[Call],
    b_calls: list[Call],
    origin: float,
    a_start: float,
    a_stop: float,
    samples: list[dict[str, Any]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    alone = [c for c in b_calls if c.sent < a_start]
    during = [c for c in b_calls if a_start <= c.sent <= a_stop]
    steady = [c for c in during if c.sent >= a_start + clock.wall(plan.a_warmup_s)]
    window_start = a_start + clock.wall(plan.a_warmup_s)
    done, tokens = completed_in(a_calls, window_start, a_stop)
    finished = [c.done for c in a_calls if c.done is not None]
    last = max(finished) if finished else a_stop
    return {
        "b_alone": b_summary(alone, clock),
        "b_during_batch": b_summary(during, clock),
        "b_during_batch_after_warmup": b_summary(steady, clock),
        "a": {
            "requests": len(a_calls),
            "completed": sum(c.ok for c in a_calls),
            "errors": sum(c.error is not None and not c.lost for c in a_calls),
            "error_kinds": _kinds(c.error for c in a_calls if c.error),
            "lost": sum(c.lost for c in a_calls),
            "cancelled": sum(c.cancelled for c in a_calls),
            "rejected_429": sum(c.rejected for c in a_calls),
            "unavailable_503": sum(c.unavailable for c in a_calls),
            "requests_rejected_at_least_once": sum(c.rejected > 0 for c in a_calls),
            "reject_codes": _sum_codes(a_calls),
            "window_requests_per_s": round(clock.rate(done, a_stop - window_start), 2),
            "window_output_tokens_per_s": round(clock.rate(tokens, a_stop - window_start), 1),
            "batch_requests_per_s": round(clock.rate(len(finished), last - a_start), 2),
            "batch_duration_s": round((last - a_start) / plan.time_scale, 1),
            "drain_after_stop_s": round((last - a_stop) / plan.time_scale, 1),
            "e2e_ms": latency_summary([c.e2e for c in a_calls if not c.cancelled], clock),
            "attempts_max": max((c.attempts for c in a_calls), default=0),
        },
        "b_series": [
            [round((c.sent - a_start) / plan.time_scale, 2), clock.ms(c.ttft)] for c in b_calls
        ],
        "a_completions_per_s": _per_second(finished, a_start, plan.time_scale),
        "samples": samples,
        **extra,
    }


def _retry_after_summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {
        "n": len(values),
        "p50": ordered[len(ordered) // 2],
        "max": ordered[-1],
        "min": ordered[0],
    }


def b_summary(calls: list[Call], clock: Clock) -> dict[str, Any]:
    return {
        "ttft_ms": latency_summary([c.ttft for c in calls], clock),
        "e2e_ms": latency_summary([c.e2e for c in calls], clock),
        "errors": sum(c.error is not None for c in calls),
        "error_kinds": _kinds(c.error for c in calls if c.error),
        "cancelled": sum(c.cancelled for c in calls),
    }


def _kinds(errors: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for error in errors:
        out[error] = out.get(error, 0) + 1
    return out


def _sum_codes(calls: list[Call]) -> dict[str, int]:
    out: dict[str, int] = {}
    for call in calls:
        for code, count in call.codes.items():
            out[code] = out.get(code, 0) + count
    return out


def _per_second(times: list[float], origin: float, time_scale: float) -> list[int]:
    """Completions in each engine second after `origin`."""
    if not times:
        return []
    bins = [0] * (int((max(times) - origin) / time_scale) + 1)
    for t in times:
        if t >= origin:
            bins[int((t - origin) / time_scale)] += 1
    return bins


def figures(document: dict[str, Any]) -> dict[str, Any]:
    modes, cap = document["modes"], document["capacity"]
    base_alone = modes.get("pass_through", {}).get("b_alone", {}).get("ttft_ms", {}).get("p99")
    out: dict[str, Any] = {"capacity_requests_per_s": cap["requests_per_s"]}
    for mode, result in modes.items():
        alone = result["b_alone"]["ttft_ms"]["p99"]
        during = result["b_during_batch"]["ttft_ms"]["p99"]
        steady = result["b_during_batch_after_warmup"]["ttft_ms"]["p99"]
        a = result["a"]
        out[mode] = {
            "b_ttft_p99_alone_ms": alone,
            "b_ttft_p99_during_ms": during,
            "b_ttft_p99_during_over_alone": ratio(during, alone),
            "b_ttft_p99_during_over_pass_through_alone": ratio(during, base_alone),
            "b_ttft_p99_after_warmup_ms": steady,
            "b_ttft_p99_after_warmup_over_alone": ratio(steady, alone),
            "a_goodput_over_capacity": ratio(a["window_requests_per_s"], cap["requests_per_s"]),
            "a_token_goodput_over_capacity": ratio(
                a["window_output_tokens_per_s"], cap["output_tokens_per_s"]
            ),
            "a_rejected_429": a["rejected_429"],
            "a_errors": a["errors"] + a["lost"],
            "b_errors": result["b_alone"]["errors"] + result["b_during_batch"]["errors"],
            "a_e2e_p50_s": _s(a["e2e_ms"]["p50"]),
            "a_e2e_p99_s": _s(a["e2e_ms"]["p99"]),
            "gateway_peak_rss_mb": result["gateway_peak_rss_mb"],
        }
    fc, pt = out.get("flow_control", {}), out.get("pass_through", {})
    out["b_ttft_p99_during_flow_control_over_pass_through"] = ratio(
        fc.get("b_ttft_p99_during_ms"), pt.get("b_ttft_p99_during_ms")
    )
    return out


def _s(ms: float | None) -> float | None:
    return None if ms is None else round(ms / 1000, 2)


def checks(document: dict[str, Any]) -> list[dict[str, str]]:
    fc = document["figures"]["flow_control"]
    ttft = fc["b_ttft_p99_during_over_alone"]
    goodput = fc["a_goodput_over_capacity"]
    errors = fc["a_errors"] + fc["b_errors"]
    return [
        check(
            "B's TTFT p99 during A's batch, flow control, against B alone",
            "<= 2x",
            f"{fmt(ttft, 'x', 2)} ({fmt(fc['b_ttft_p99_during_ms'], ' ms')} vs "
            f"{fmt(fc['b_ttft_p99_alone_ms'], ' ms')})",
            None if ttft is None else ttft <= 2.0,
        ),
        check(
            "A's goodput during the batch, flow control, against the fleet's capacity",
            ">= 0.95x",
            fmt(goodput, "x", 3),
            None if goodput is None else goodput >= 0.95,
        ),
        check("errors with flow control (A and B; A retries 429s)", "0", str(errors), errors == 0),
    ]


def format_mode(mode: str, result: dict[str, Any]) -> str:
    a, alone, during = (
        result["a"],
        result["b_alone"]["ttft_ms"],
        result["b_during_batch"]["ttft_ms"],
    )
    return (
        f"{mode:12s} B TTFT p99 alone {fmt(alone['p99'], ' ms')} (n={alone['n']}), during A's "
        f"batch {fmt(during['p99'], ' ms')} (n={during['n']}, p50 {fmt(during['p50'], ' ms')}); "
        f"A {a['window_requests_per_s']:.1f} req/s in window, {a['completed']}/{a['requests']} "
        f"done, 429s {a['rejected_429']}, errors {a['errors']}, lost {a['lost']}, "
        f"E2E p50/p99 {fmt(_s(a['e2e_ms']['p50']), ' s')}/{fmt(_s(a['e2e_ms']['p99']), ' s')}; "
        f"gateway peak RSS {result['gateway_peak_rss_mb']} MB; "
        f"cpu during batch {result['cpu_batch']}"
    )
