"""Clients that strain the gateway: one reading a stream a chunk a second, thousands holding
idle connections, a thousand leaving at once (and two hundred on real vLLM, which must abort
them), and the gateway stopped (SIGTERM) under load.

Where memory and descriptors are measured, the gateway runs in its own process
(`mineru-gateway serve`), so that they are its alone; where request tasks are counted, it runs
in this one.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from mineru_gateway.testing import start_vllm_server, vllm_paths_from_env, wait_until_async
from tests.conftest import StartSim
from tests.faults.conftest import StartGatewayProcess, StartGatewayThread, StartRawWorker
from tests.faults.harness import (
    CHAT,
    OK,
    Firehose,
    Probe,
    Snapshot,
    address,
    chat,
    gateway_counters,
    http_request,
    lost,
    outcome,
    rss_mb,
    sim_idle,
)
from tests.test_end_to_end import metric

MIB = 1024 * 1024


async def slow_reader(url: str, reads: int, on_read: list[int]) -> None:
    """Streams a chat answer, reading at most 64 KiB once a second; `on_read` gets each read's
    size. A small receive buffer, so that the kernel holds little on this side."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, address(url))
    reader, writer = await asyncio.open_connection(sock=sock, limit=64 * 1024)
    try:
        writer.write(http_request(CHAT, orjson.dumps(chat(stream=True))))
        for _ in range(reads):
            on_read.append(len(await reader.read(64 * 1024)))
            await asyncio.sleep(1.0)
    finally:
        writer.close()


async def test_a_slow_reader_holds_the_worker_back_and_not_the_gateways_memory(
    raw_worker: StartRawWorker, gateway_process: StartGatewayProcess
) -> None:
    """A stream read at 64 KiB a second from a worker that could send gigabytes: what the
    worker got written stays within the buffers between them (the gateway reads from the
    worker only as fast as the client takes), and the gateway's memory does not grow with the
    reader's delay. The time the gateway waits on the client is not the worker's silence: with
    an idle limit shorter than the reader's pauses, the stream goes on."""
    firehose = Firehose()
    worker, worker_url = await raw_worker(firehose)
    gateway = await gateway_process([worker_url], "--idle-stream-timeout-s", "0.5")
    probe = Probe(gateway.url, [worker_url], pid=gateway.pid)
    baseline = await probe.snapshot()
    reads: list[int] = []
    reading = asyncio.create_task(slow_reader(gateway.url, reads=7, on_read=reads))
    await wait_until_async(lambda: len(reads) >= 2, 20, "the first reads")
    early = (firehose.written - sum(reads), rss_mb(gateway.pid))
    await wait_until_async(lambda: len(reads) >= 6, 20, "the last reads")
    late = (firehose.written - sum(reads), rss_mb(gateway.pid))
    assert worker.open["completion"] == 1, reads  # still streaming: the gateway did not cut it
    await reading
    assert all(reads), reads
    # Between worker and reader: socket buffers (a few MiB each way) and the two servers' own.
    assert late[0] < 32 * MIB, (early, late)
    assert late[0] - early[0] < 8 * MIB, (early, late)  # the backlog does not grow with time
    assert late[1] - early[1] < 16, (early, late)  # nor the gateway's memory
    await wait_until_async(lambda: worker.open["completion"] == 0, 10, "the worker let go")
    final = await probe.settled(baseline, concurrency=1)
    assert final.rss_mb - baseline.rss_mb < 64, (baseline, final)


async def hold_connections(url: str, count: int, half_open: bytes) -> list[asyncio.StreamWriter]:
    """`count` connections to the gateway; every other one sends `half_open` (a request head
    without its end) and stays there. Opened in batches, as the accept queue is finite."""
    writers: list[asyncio.StreamWriter] = []
    for start in range(0, count, 500):
        opened = await asyncio.gather(
            *(asyncio.open_connection(*address(url)) for _ in range(start, min(count, start + 500)))
        )
        for index, (_, writer) in enumerate(opened):
            if index % 2:
                writer.write(half_open)
            writers.append(writer)
    return writers


async def test_five_thousand_idle_connections(
    start_sim: StartSim, gateway_process: StartGatewayProcess
) -> None:
    """They cost the gateway descriptors and a little memory each, it keeps serving meanwhile,
    and every one of them is released once its client closes it."""
    worker = start_sim()
    gateway = await gateway_process([worker])
    probe = Probe(gateway.url, [worker], pid=gateway.pid)
    baseline = await probe.snapshot()
    half_open = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    writers = await hold_connections(gateway.url, 5000, half_open)
    try:
        held: Snapshot = await wait_until_async(
            lambda: holding(probe, 5000), 30, "5,000 connections"
        )
        async with httpx.AsyncClient(timeout=30) as client:
            answers = [await outcome(client, gateway.url, chat(stream=s)) for s in (False, True)]
        assert answers == [OK, OK]
        assert held.rss_mb - baseline.rss_mb < 100, (baseline, held)  # 20 KiB a connection
    finally:
        for writer in writers:
            writer.close()
    final = await probe.settled(baseline, concurrency=2)
    assert final.rss_mb - baseline.rss_mb < 100, (baseline, final)


async def holding(probe: Probe, count: int) -> Snapshot | None:
    snapshot = await probe.snapshot()
    return snapshot if snapshot.client_connections >= count else None


async def start_requests(url: str, count: int, **extra: Any) -> list[asyncio.StreamWriter]:
    """`count` long chat requests (every other one streamed), each on its own connection."""
    writers = []
    for start in range(0, count, 250):
        opened = await asyncio.gather(
            *(asyncio.open_connection(*address(url)) for _ in range(start, min(count, start + 250)))
        )
        for index, (_, writer) in enumerate(opened, start):
            body = chat(stream=index % 2 == 0, max_tokens=2000, ignore_eos=True, **extra)
            writer.write(http_request(CHAT, orjson.dumps(body)))
            writers.append(writer)
    return writers


async def test_a_thousand_clients_leaving_at_once(
    start_sim: StartSim, gateway_thread: StartGatewayThread
) -> None:
    """A thousand long requests, some on the worker and most queued in the gateway, whose
    clients all go away in the same instant (half with a reset): every one is taken out of the
    queue or cancelled on the worker, and nothing of them is left."""
    worker = start_sim(max_num_seqs=64, time_scale=1.0)
    probe = await gateway_thread([worker], batch_limit=64)
    baseline = await probe.snapshot()
    writers = await start_requests(probe.url, 1000)
    try:
        await wait_until_async(lambda: all_admitted(probe.url, 1000), 60, "1,000 admitted")
    finally:
        leave(writers)
    final = await probe.settled(baseline, concurrency=70)
    await wait_until_async(lambda: sim_idle(worker), 20, "the worker idle")
    assert final.rss_mb - baseline.rss_mb < 100, (baseline, final)


def leave(writers: list[asyncio.StreamWriter]) -> None:
    """Every client goes away in the same instant, half of them with a reset."""
    for index, writer in enumerate(writers):
        writer.transport.abort() if index % 2 else writer.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)  # a real vLLM start takes minutes on a loaded machine
async def test_two_hundred_clients_leaving_real_vllm_at_once(
    gateway_process: StartGatewayProcess, tmp_path: Path
) -> None:
    """Where real vLLM matters: it is vLLM that must abort each request whose connection the
    gateway closes, and free its batch slot and KV cache. 200 long requests on a vLLM that runs
    16 at a time (the rest wait in its queue), all left at once: none is left running or
    waiting, and no token is generated after.

    The gateway runs in a process of its own, as users run it: with vLLM's CPU engine on both
    cores, this process has gone 10-30 s without running (seen from a watchdog thread), and a
    gateway thread in it would have stalled with it."""
    python, model = vllm_paths_from_env()
    server = start_vllm_server(python, model, log_path=str(tmp_path / "vllm.log"))
    try:
        await asyncio.to_thread(server.wait_ready, 300)
        # vLLM's CPU engine can hold other processes still for seconds on 2 cores (stop 19's
        # note): a 5 s connect limit failed 30 of the 200 connections in a clean-clone .ci/run
        # here, which says nothing about aborts.
        gateway = await gateway_process([server.url], "--connect-timeout-s", "60")
        probe = Probe(gateway.url, [server.url], pid=gateway.pid)
        baseline = await probe.snapshot()
        writers = await start_requests(probe.url, 200, model=server.served_name)
        try:
            # Alone on vLLM, a first request can run its 2000 tokens out before the last of the
            # 200 is admitted on a loaded machine (4 s here): count what finished as admitted.
            await wait_until_async(
                lambda: all_admitted(probe.url, 200, finished_too=True), 180, "200 admitted"
            )
            await wait_until_async(lambda: vllm_busy(server.url), 120, "vLLM generating")
        finally:
            leave(writers)
        await probe.settled(baseline, concurrency=200, within_s=120)
        await wait_until_async(lambda: vllm_idle(server.url), 90, "vLLM idle")
        generated = await vllm_metric(server.url, "vllm:generation_tokens_total")
        await asyncio.sleep(1.0)
        assert await vllm_metric(server.url, "vllm:generation_tokens_total") == generated
    finally:
        await asyncio.to_thread(server.stop)


async def vllm_metric(url: str, name: str) -> float:
    return await asyncio.to_thread(metric, url, name)


async def vllm_busy(url: str) -> bool:
    return await vllm_metric(url, "vllm:num_requests_running") > 0


async def vllm_idle(url: str) -> bool:
    running = await vllm_metric(url, "vllm:num_requests_running")
    return running + await vllm_metric(url, "vllm:num_requests_waiting") == 0


async def all_admitted(url: str, count: int, *, finished_too: bool = False) -> bool:
    """`count` requests on the workers or in the gateway's queue (or, `finished_too`, answered
    already), at least one of them on a worker."""
    counters = await gateway_counters(url)
    on_workers = counters["workers_in_flight"]
    held = on_workers + counters["mineru_gateway_queue_requests"]
    if finished_too:
        held += counters["finished"]
    return on_workers > 0 and held == count


def sigterm_mix() -> Iterator[dict[str, object]]:
    """Short requests first (served during the drain), then long ones that cannot finish
    before its deadline: streams on the worker, and others still queued."""
    for index in range(16):
        yield chat(stream=index % 2 == 0)
    for index in range(8):
        yield chat(stream=index % 2 == 0, max_tokens=3000, ignore_eos=True)


async def test_sigterm_under_load(
    start_sim: StartSim, gateway_process: StartGatewayProcess
) -> None:
    """Every request the gateway holds when SIGTERM comes completes, or ends with an explicit
    `shutting_down` error (JSON before the answer started, an SSE error event after), within
    the drain deadline; the gateway exits 0 and the worker is left with nothing."""
    worker = start_sim(max_num_seqs=4, time_scale=1.0)
    gateway = await gateway_process([worker], "--batch-limit", "4", "--drain-timeout-s", "3")
    bodies = list(sigterm_mix())
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        requests = [asyncio.create_task(outcome(client, gateway.url, body)) for body in bodies]

        async def all_held() -> bool:  # every request not yet answered is on the worker or queued
            pending = sum(not request.done() for request in requests)
            return pending >= 8 and await all_admitted(gateway.url, pending)

        await wait_until_async(all_held, 30, "every request in the gateway")
        gateway.signal(signal.SIGTERM)
        outcomes = Counter(await asyncio.gather(*requests))
    assert not lost(outcomes), outcomes
    assert set(outcomes) <= {OK, "error:503:shutting_down", "stream_error:shutting_down"}
    assert outcomes[OK] >= 1 and outcomes["stream_error:shutting_down"] >= 1, outcomes
    assert gateway.cli.proc is not None
    assert await asyncio.to_thread(gateway.cli.proc.wait, 20) == 0
    await wait_until_async(lambda: sim_idle(worker), 20, "the worker idle")
