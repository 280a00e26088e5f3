"""The streaming overhead benchmark's accounting (benchmarks/gateway_overhead.py), on a
simulated worker: CPU read over a whole run is divided by what the whole run relayed; and what
a proxy costs idle."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
from benchmarks.gateway_overhead import Fleet, closed_loop, idle_cost, summarise

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
