"""Workers that fail under load: killed, frozen, silent, speaking garbage, cutting answers short,
answering 5xx to everything, or hanging on `/metrics`.

Each test runs the gateway in this process (so that its request tasks can be listed; one runs
it in a process of its own, for an environment of its own) against real servers on 127.0.0.1,
and checks the same four things: no request is lost (every outcome is one of the explicit ones
the fault may cause), the fault was really hit, the gateway's counters are back to zero, and no
connection, task or file descriptor is left behind (`Probe.settled`).
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from typing import Any

import httpx
import orjson
import pytest

from mineru_gateway.testing import wait_until_async
from tests.conftest import StartSim
from tests.faults.conftest import (
    Process,
    StartGatewayThread,
    StartRawWorker,
    StartSimProcesses,
)
from tests.faults.harness import (
    CHAT,
    OK,
    STREAM_HEAD,
    Handler,
    Probe,
    Snapshot,
    answer,
    answer_then_reset,
    chat,
    chunk,
    never_answer,
    run_load,
    send_and_close,
    serve_ok,
    sim_idle,
)

WHOLE = [chat(), chat(max_tokens=4)]
STREAMED = [chat(stream=True), chat(stream=True, max_tokens=4)]
# What the process may grow by during one fault test (a few MB seen): a leak per request of a
# few hundred would show far more.
RSS_GROWTH_MB = 100


async def warm_baseline(probe: Probe) -> Snapshot:
    """A snapshot once a few requests have gone through (pooled connections, lazy imports)."""
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(client.post(probe.url + CHAT, json=b) for b in (*WHOLE, *STREAMED)))
    return await probe.snapshot()


async def mixed_load(probe: Probe, clients: int, seconds: float) -> tuple[Counter[str], ...]:
    """Outcomes of non-streaming and of streaming requests, each from `clients` loops."""
    whole, streamed = await asyncio.gather(
        run_load(probe.url, WHOLE, clients, seconds),
        run_load(probe.url, STREAMED, clients, seconds),
    )
    return whole, streamed


async def workers(probe: Probe) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as client:
        listing = (await client.get(probe.url + "/v1/workers")).json()["workers"]
    return {worker["url"]: worker for worker in listing}


async def signal_when_busy(probe: Probe, victim: Process, sig: signal.Signals) -> None:
    """Sends `sig` to the victim once the gateway has requests in flight on it."""

    async def busy() -> bool:
        return bool((await workers(probe))[victim.url]["in_flight"] > 0)

    await wait_until_async(busy, 20, "requests in flight on the victim")
    victim.signal(sig)


async def metric_total(probe: Probe, prefix: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(probe.url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def assert_settled(probe: Probe, baseline: Snapshot, concurrency: int) -> None:
    final = await probe.settled(baseline, concurrency)
    assert final.rss_mb - baseline.rss_mb < RSS_GROWTH_MB, (baseline, final)


async def test_a_worker_killed_with_sigkill_under_load(
    sim_processes: StartSimProcesses, start_sim: StartSim, gateway_thread: StartGatewayThread
) -> None:
    """kill -9 while requests are on the worker: whole answers are retried elsewhere, streams
    that had started end with an error event, and the dead worker leaves routing. (Only the
    victim needs a process of its own.)"""
    [victim] = sim_processes(1, "--time-scale", "3")
    others = [start_sim(time_scale=3.0) for _ in range(2)]
    # The default probe timeout: a busy machine must not make the living workers look dead.
    probe = await gateway_thread(
        [others[0], victim.url, others[1]], routing_policy="round_robin", health_timeout_s=2.0
    )
    baseline = await warm_baseline(probe)
    killer = asyncio.create_task(signal_when_busy(probe, victim, signal.SIGKILL))
    whole, streamed = await mixed_load(probe, clients=6, seconds=4)
    await killer
    # A whole answer is sent at its end: its dropped connection is retried on another worker.
    assert set(whole) == {OK}, whole
    # Only streams that had started on the victim may end with an error event.
    assert set(streamed) <= {OK, "stream_error:upstream_error"}, streamed
    assert whole[OK] >= 6 and streamed[OK] >= 6
    assert (await workers(probe))[victim.url]["state"] == "unhealthy"
    await assert_settled(probe, baseline, concurrency=12)


async def test_a_frozen_worker_sigstop_under_load(
    sim_processes: StartSimProcesses, start_sim: StartSim, gateway_thread: StartGatewayThread
) -> None:
    """A stopped process still accepts connections (the kernel does) but never answers: the
    worker that hangs. Its requests time out, its slow probes take it out of routing, and once
    it runs again it finds every one of its connections closed by the gateway."""
    [victim] = sim_processes(1, "--time-scale", "3")
    probe = await gateway_thread(
        [victim.url, start_sim(time_scale=3.0)],
        routing_policy="round_robin",
        first_byte_timeout_s=1.5,
        idle_stream_timeout_s=1.5,
        slow_probes_to_eject=2,
    )
    baseline = await warm_baseline(probe)
    stopper = asyncio.create_task(signal_when_busy(probe, victim, signal.SIGSTOP))
    whole, streamed = await mixed_load(probe, clients=6, seconds=5)
    await stopper
    timed_out = "error:504:upstream_timeout"
    assert set(whole) <= {OK, timed_out}, whole
    assert set(streamed) <= {OK, timed_out, "stream_error:upstream_timeout"}, streamed
    assert whole[timed_out] + streamed[timed_out] + streamed["stream_error:upstream_timeout"] >= 1
    assert whole[OK] >= 6 and streamed[OK] >= 6
    assert (await workers(probe))[victim.url]["state"] == "unhealthy"
    victim.signal(signal.SIGCONT)
    await wait_until_async(lambda: sim_idle(victim.url), 20, "the thawed worker idle")
    await assert_settled(probe, baseline, concurrency=12)


async def test_a_worker_that_accepts_and_never_answers(
    raw_worker: StartRawWorker, start_sim: StartSim, gateway_thread: StartGatewayThread
) -> None:
    silent, silent_url = await raw_worker(never_answer)
    probe = await gateway_thread(
        [silent_url, start_sim(model_name="raw-model")],
        routing_policy="round_robin",
        first_byte_timeout_s=1.0,
    )
    baseline = await warm_baseline(probe)
    whole, streamed = await mixed_load(probe, clients=4, seconds=3)
    timed_out = "error:504:upstream_timeout"
    assert set(whole) <= {OK, timed_out} and set(streamed) <= {OK, timed_out}, (whole, streamed)
    assert whole[timed_out] >= 1 and streamed[timed_out] >= 1
    assert whole[OK] >= 1 and streamed[OK] >= 1
    # Each request given up on had its connection closed: none is left open on the worker.
    await wait_until_async(lambda: silent.open["completion"] == 0, 10, "connections closed")
    assert silent.most_open["completion"] <= 8  # at most one per client at a time
    await assert_settled(probe, baseline, concurrency=8)


LONG_HEADER = b"HTTP/1.1 200 OK\r\nx-filler: " + b"a" * 100_000 + b"\r\n\r\n"
CUT_JSON = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"
SSE_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'

# Each answer, and whether a client can see it break: a fault before anything reached the
# client is retried on the good worker (every request ends well); after the first chunk went
# out, the stream ends with an error event.
GARBAGE: dict[str, tuple[tuple[bytes, ...], bool, bool]] = {
    "not http": ((b"hello, this is not HTTP\r\n\r\n",), False, False),
    "binary": ((bytes(range(256)) * 8,), True, False),
    "bad status line": ((b"HTTP/1.1 OK 200\r\n\r\n",), False, False),
    "bad content length": ((b"HTTP/1.1 200 OK\r\ncontent-length: many\r\n\r\n{}",), False, False),
    "header too long": ((LONG_HEADER,), True, False),
    "closed before any answer": ((b"",), False, False),
    "closed mid-head": ((b"HTTP/1.1 200 OK\r\ncontent-ty",), True, False),
    "closed mid-body": ((CUT_JSON,), False, False),
    "bad first chunk": ((STREAM_HEAD, b"zz\r\nnot a chunk\r\n"), True, False),
    "closed mid-stream": ((STREAM_HEAD, chunk(SSE_EVENT)), True, True),
    "bad chunk mid-stream": ((STREAM_HEAD, chunk(SSE_EVENT), b"zz\r\nno\r\n"), True, True),
    "reset after answering": ((), True, False),
}
BROKEN = "stream_error:upstream_error"


async def test_workers_answering_garbage_or_closing_mid_answer(
    raw_worker: StartRawWorker, gateway_thread: StartGatewayThread
) -> None:
    """Each answer of GARBAGE in turn from one worker, with a good one beside it."""
    bad, bad_url = await raw_worker(serve_ok)
    _, good_url = await raw_worker(serve_ok)
    # Never ejected, so that every other request goes to the bad worker.
    probe = await gateway_thread(
        [bad_url, good_url], routing_policy="round_robin", eject_after=10**6, max_retries=1
    )
    baseline = await warm_baseline(probe)
    wrong = {}
    for case, (parts, stream, visible) in GARBAGE.items():
        bad.on_completion = (
            answer_then_reset if case == "reset after answering" else send_and_close(*parts)
        )
        hit_before = bad.completions
        outcomes = await run_load(probe.url, [chat(stream=stream)], clients=4, seconds=0.6)
        hits = bad.completions - hit_before
        if set(outcomes) != ({OK, BROKEN} if visible else {OK}) or hits < 2:
            wrong[case] = (outcomes, hits)
    assert not wrong, wrong
    await assert_settled(probe, baseline, concurrency=4)


VLLM_503 = orjson.dumps(
    {"error": {"message": "engine dead", "type": "EngineDeadError", "param": None, "code": 503}}
)


@pytest.mark.parametrize("with_a_good_worker", [True, False])
async def test_a_5xx_storm(
    with_a_good_worker: bool,
    raw_worker: StartRawWorker,
    start_sim: StartSim,
    gateway_thread: StartGatewayThread,
) -> None:
    """Workers that answer every completion 503 while passing their health checks: their own
    errors come back as they are, they are ejected after 3 in a row, and come back on their
    next good probe (and fail again)."""
    storm: Handler = answer(503, VLLM_503)
    urls = [(await raw_worker(storm))[1] for _ in range(2)]
    good = [start_sim(model_name="raw-model")] if with_a_good_worker else []
    probe = await gateway_thread([*urls, *good])
    baseline = await probe.snapshot()
    whole, streamed = await mixed_load(probe, clients=4, seconds=3)
    allowed = {OK, "error:503:503", "error:503:no_healthy_worker"}
    assert set(whole) <= allowed and set(streamed) <= allowed, (whole, streamed)
    assert whole["error:503:503"] >= 1 and streamed["error:503:503"] >= 1
    assert (whole[OK] >= 1 and streamed[OK] >= 1) is with_a_good_worker
    ejections = 'mineru_gateway_worker_ejections_total{reason="status_5xx"'
    assert await metric_total(probe, ejections) >= 2
    await assert_settled(probe, baseline, concurrency=8)


async def test_a_worker_whose_metrics_hang(
    raw_worker: StartRawWorker, start_sim: StartSim, gateway_thread: StartGatewayThread
) -> None:
    """Its load figures go stale and are ignored (routing on the gateway's own counts), its
    requests are served all the same, and every scrape given up on is closed."""
    hanging, hanging_url = await raw_worker(serve_ok, on_metrics=never_answer)
    sim = start_sim(model_name="raw-model")
    probe = await gateway_thread([hanging_url, sim], load_interval_s=0.2)
    baseline = await warm_baseline(probe)
    whole, streamed = await mixed_load(probe, clients=4, seconds=3)
    assert set(whole) == {OK} and set(streamed) == {OK}, (whole, streamed)
    assert hanging.completions >= 1
    assert hanging.most_open["metrics"] >= 1  # scraped, and hung
    assert hanging.most_open["metrics"] <= 2  # each given-up scrape closed before the next
    listing = await workers(probe)
    assert listing[hanging_url]["reported"] is None
    assert listing[sim]["reported"] is not None
    await assert_settled(probe, baseline, concurrency=8)
