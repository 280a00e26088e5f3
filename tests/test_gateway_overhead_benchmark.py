"""The streaming overhead benchmark's accounting (benchmarks/gateway_overhead.py), on a
simulated worker: CPU read over a whole run is divided by what the whole run relayed; and what
a proxy costs idle."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest
from benchmarks.gateway_overhead import (
    Fleet,
    RunResult,
    closed_loop,
    compare,
    idle_cost,
    summarise,
)

from mineru_gateway.sim.config import DEFAULT_MODEL_NAME
from tests.conftest import StartSim


async def test_every_event_of_a_run_is_counted_and_the_window_only_for_throughput(
    start_sim: StartSim,
) -> None:
    worker = start_sim(time_scale=0.2)  # 16 tokens take a few hundred ms: answers straddle
    body = orjson.dumps(
        {
            "model": DEFAULT_MODEL_NAME,
            "messages": [{"role": "user", "content": "Text Recognition:"}],
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
        }
    )
    samples, errors, window = await closed_loop([worker], 4, body, warmup_s=0.5, duration_s=1.0)
    assert errors == 0 and samples
    per_answer = {sample.events for sample in samples}
    assert len(per_answer) == 1  # every answer is the same number of events
    assert window.relayed_events == per_answer.pop() * window.relayed_requests
    # Answers under way in the warm-up and at the window's end are relayed, not in the window.
    assert 0 < window.events < window.relayed_events
    result = summarise("gateway", 4, samples, errors, window)
    assert (result.events, result.relayed_events) == (window.events, window.relayed_events)
    assert result.relayed_requests == window.relayed_requests


def test_idle_cost_is_each_proxys_cpu_milliseconds_a_second() -> None:
    spin = "while True: pass"  # a whole core while it gets one
    busy = subprocess.Popen([sys.executable, "-c", spin])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fleet = Fleet(0, [], [])
        fleet.gateway_pid, fleet.router_pid = busy.pid, idle.pid
        costs = asyncio.run(idle_cost(fleet, ["direct", "gateway", "vllm-router"], 1.0))
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert set(costs) == {"gateway", "vllm-router"}  # direct is no proxy
    assert costs["vllm-router"] < 50 < 300 < costs["gateway"] <= 1100


def _run(mode: str, cpu_s: float | None, wall_s: float | None, events: int) -> RunResult:
    return RunResult(
        mode, 64, 10.0, 10, events, 1.0, 100.0, 1.0, 2.0, 3.0, 0, events, 10, cpu_s, wall_s
    )


def test_cpu_per_event_net_of_idle_takes_the_idle_rate_off_each_runs_whole_time() -> None:
    runs = [
        _run("direct", None, None, 1000),
        _run("gateway", 0.05, 20.0, 1000),  # 50 ms over 20 s, 10 of them idle cost
        _run("gateway", 0.07, 20.0, 2000),
    ]
    [row] = compare(runs, "gateway", {"gateway": 0.5})
    assert row["gateway_cpu_us_per_event_net_of_idle"] == pytest.approx((0.12 - 0.02) / 3000 * 1e6)
    [without] = compare(runs, "gateway")
    assert without["gateway_cpu_us_per_event_net_of_idle"] is None
