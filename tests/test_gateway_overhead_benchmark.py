"""The streaming overhead benchmark's accounting (benchmarks/gateway_overhead.py), on a
simulated worker: CPU read over a whole run is divided by what the whole run relayed."""

from __future__ import annotations

import orjson
from benchmarks.gateway_overhead import closed_loop, summarise

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
