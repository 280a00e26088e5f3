"""`sweep`: offered load from 0.5x to 3x the fleet's capacity, pass-through against flow control.

4 simulated workers, one tenant (no API keys: the gateway's `default` tenant) with
`--tenant-max-queued`, open-loop Poisson arrivals of the MinerU mix, streamed (`loadgen.py`, the
routing benchmark's generator: warm-up, a measured window, a tail at the same rate until the
measured requests have their first token or the tail cap, then everything open is cancelled).

The capacity is measured first in the same run (a saturating closed loop through the
pass-through gateway); offered rates are fractions of it. Per load and mode: goodput (requests
completed in the window per second, against the capacity), TTFT p50/p99 of admitted requests
(not answered 429; those still waiting at the cut count as slowest, and the figure is then a
lower bound), and the share rejected.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import aiohttp
from benchmarks.routing import fleet, workload

from . import stand
from .client import new_session
from .common import Clock, batch_requests, check, fmt, latency_summary, ratio, saturate


@dataclass(frozen=True)
class SweepPlan:
    # 2: at time scale 1 the load generator and the gateway's accept path on this 2-core
    # machine cannot deliver much over 150 streamed requests/s (the workers then never fill).
    time_scale: float = 2.0
    workers: int = 4
    fractions: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0)
    warmup_s: float = 6.0
    window_s: float = 10.0
    tail_cap_s: float = 4.0
    tenant_max_queued: int = 512
    capacity_concurrency: int = 1000
    capacity_warmup_s: float = 15.0
    capacity_window_s: float = 20.0
    quiet_wait_s: float = 60.0
    seed: int = 2


async def run(plan: SweepPlan, gateway_extra: list[str], procs: fleet.Processes) -> dict[str, Any]:
    clock = Clock(plan.time_scale)
    extra = ["--tenant-max-queued", str(plan.tenant_max_queued), *gateway_extra]
    mix = workload.Mix(model=fleet.MODEL)
    document: dict[str, Any] = {
        "plan": asdict(plan),
        "gateway_args": extra,
        "mix_per_page": workload.describe(mix),
        "runs": [],
    }
    with stand.sim_workers(procs, plan.time_scale, plan.workers) as workers:
        async with new_session() as session:
            cap = await capacity(plan, clock, procs, workers, session, extra)
            document["capacity"] = cap
            print(f"capacity: {cap['requests_per_s']:.1f} requests/s", flush=True)
            for mode in stand.MODES:
                gateway = await stand.start_gateway(procs, workers.urls, mode, extra)
                try:
                    for fraction in plan.fractions:
                        load = partial(
                            one_load, plan, clock, session, gateway, workers, mix, fraction, cap
                        )
                        result = await stand.guarded(load)
                        document["runs"].append(result)
                        print(format_run(result), flush=True)
                finally:
                    gateway.stop()
    document["figures"] = figures(document)
    document["checks"] = checks(document)
    return document


async def capacity(
    plan: SweepPlan,
    clock: Clock,
    procs: fleet.Processes,
    workers: fleet.SimWorkers,
    session: aiohttp.ClientSession,
    extra: list[str],
) -> dict[str, Any]:
    """Completions per second of a saturating closed loop through the pass-through gateway."""
    gateway = await stand.start_gateway(procs, workers.urls, "pass_through", extra)
    try:
        requests = batch_requests(plan.seed + 40, 4000)
        figures, _calls = await saturate(
            session,
            gateway.url,
            requests,
            plan.capacity_concurrency,
            plan.seed,
            clock,
            plan.capacity_warmup_s,
            plan.capacity_window_s,
        )
        await fleet.wait_idle(session, workers.urls)
    finally:
        gateway.stop()
    return figures


async def one_load(
    plan: SweepPlan,
    clock: Clock,
    session: aiohttp.ClientSession,
    gateway: stand.Gateway,
    workers: fleet.SimWorkers,
    mix: workload.Mix,
    fraction: float,
    cap: dict[str, Any],
) -> dict[str, Any]:
    rate = fraction * cap["requests_per_s"] / plan.time_scale  # wall requests/s
    phases = stand.first_token_phases(clock, plan.warmup_s, plan.window_s, plan.tail_cap_s)
    seed = plan.seed * 10_000 + round(fraction * 1000)  # the same requests for both modes
    arrivals = workload.arrivals(mix, seed, rate, phases.total + 1)
    load = await stand.open_loop(
        session, gateway, workers.pids, arrivals, phases, plan.quiet_wait_s
    )
    outcome, cut = load.outcome, load.cut
    await fleet.wait_idle(session, workers.urls)
    await asyncio.sleep(1.0)  # the gateway counts the cancelled requests (499)
    after = await stand.gateway_metrics(session, gateway.url)
    delta = stand.metrics_delta(load.metrics_before, after)
    seen = sum(delta["mineru_gateway_tenant_requests_total"].values())
    measured = [r for r in outcome.records if r.measured]
    rejected = [r for r in measured if r.error == "status 429"]
    admitted = [r for r in measured if r.error is None]
    failed = [r for r in measured if r.error is not None and r.error != "status 429"]
    ttfts = [None if r.first_token is None else r.first_token - r.sent for r in admitted]
    # Lower bounds for requests cut before their first token: they had waited this long.
    bounded = [(r.first_token if r.first_token is not None else cut) - r.sent for r in admitted]
    goodput = clock.rate(outcome.window_done, phases.window_s)
    lags = sorted(outcome.lags or [0.0])
    return {
        "mode": gateway.mode,
        "fraction": fraction,
        "offered_requests_per_s": round(rate * plan.time_scale, 2),
        "measured": len(measured),
        "admitted": len(admitted),
        "rejected": len(rejected),
        "rejected_share": round(len(rejected) / max(1, len(measured)), 4),
        "errors": len(failed),
        "error_kinds": _kinds(r.error for r in failed),
        "goodput_requests_per_s": round(goodput, 2),
        "goodput_over_capacity": ratio(goodput, cap["requests_per_s"]),
        "tokens_per_s": round(clock.rate(outcome.window_tokens, phases.window_s), 1),
        "ttft_admitted_ms": latency_summary(ttfts, clock),
        "ttft_admitted_lower_bound_ms": latency_summary(bounded, clock),
        "cut_before_first_token": sum(t is None for t in ttfts),
        "tail_s": round(outcome.tail_s / plan.time_scale, 2),
        "capped": outcome.capped,
        "lag_ms_p99": round(lags[min(len(lags) - 1, int(0.99 * len(lags)))] * 1000, 2),
        "cpu": load.cpu,
        "foreign_cores_before": load.foreign_cores_before,
        "sent": len(outcome.records),
        # Requests the gateway accounted for (any status): short of `sent` when the load
        # generator or the gateway's accept path fell behind (a limit of this machine).
        "gateway_saw_share": round(seen / max(1, len(outcome.records)), 4),
        "gateway_metrics": delta,
    }


def _kinds(errors: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for error in errors:
        out[str(error)] = out.get(str(error), 0) + 1
    return out


def _find(document: dict[str, Any], mode: str, fraction: float) -> dict[str, Any] | None:
    for run in document["runs"]:
        if run["mode"] == mode and abs(run["fraction"] - fraction) < 1e-9:
            return dict(run)
    return None


def figures(document: dict[str, Any]) -> dict[str, Any]:
    """Per load: flow control's goodput and admitted TTFT p99 against pass-through's."""
    out = {}
    for fraction in document["plan"]["fractions"]:
        fc = _find(document, "flow_control", fraction)
        pt = _find(document, "pass_through", fraction)
        if fc is None or pt is None:
            continue
        out[f"{fraction:g}x"] = {
            "goodput_flow_control_over_pass_through": ratio(
                fc["goodput_requests_per_s"], pt["goodput_requests_per_s"]
            ),
            "ttft_p99_flow_control_over_pass_through": ratio(
                fc["ttft_admitted_lower_bound_ms"]["p99"], pt["ttft_admitted_lower_bound_ms"]["p99"]
            ),
            "pass_through_ttft_p99_is_lower_bound": pt["cut_before_first_token"] > 0,
            "rejected_share_flow_control": fc["rejected_share"],
            "goodput_over_capacity": {
                "pass_through": pt["goodput_over_capacity"],
                "flow_control": fc["goodput_over_capacity"],
            },
        }
    return out


def checks(document: dict[str, Any]) -> list[dict[str, str]]:
    """No target was set for the sweep; these record what overload should look like."""
    out = []
    for fraction in document["plan"]["fractions"]:
        fc = _find(document, "flow_control", fraction)
        if fc is None or fraction <= 1.0:
            continue
        g = fc["goodput_over_capacity"]
        out.append(
            check(
                f"{fraction:g}x offered: flow control keeps goodput near capacity",
                ">= 0.9x capacity (no issue target; informative)",
                fmt(g, "x", 3),
                None if g is None else g >= 0.9,
            )
        )
    return out


def format_run(run: dict[str, Any]) -> str:
    ttft = run["ttft_admitted_lower_bound_ms"]
    bound = ">=" if run["cut_before_first_token"] else ""
    return (
        f"{run['mode']:12s} {run['fraction']:.1f}x ({run['offered_requests_per_s']:.0f} req/s): "
        f"goodput {run['goodput_requests_per_s']:.1f} req/s "
        f"({fmt(run['goodput_over_capacity'], 'x', 2)}), "
        f"TTFT admitted p50/p99 {fmt(ttft['p50'], ' ms')}/{bound}{fmt(ttft['p99'], ' ms')}, "
        f"rejected {run['rejected_share']:.1%}, errors {run['errors']}, cpu {run['cpu']}"
    )
