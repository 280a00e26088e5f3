"""Fixtures of the fault tests: gateways in this process (tasks can be counted) or in their own
(descriptors and memory are the gateway's alone), simulated workers in their own processes (so
they can be killed or stopped), and raw workers on this test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from mineru_gateway.api.app import create_app
from mineru_gateway.config import GatewaySettings
from mineru_gateway.testing import free_port, wait_http_ok, wait_until_async
from tests.faults.harness import GatewayThread, Handler, Probe, RawWorker
from tests.support.servers import CliProcess

# Short health and probe intervals: faults are found, and recovered from, within a test's time.
FAST_HEALTH = {"health_interval_s": 0.3, "health_timeout_s": 1.0, "log_level": "warning"}


@pytest.fixture(scope="session", autouse=True)
def enough_descriptors() -> None:
    """Thousands of connections need more descriptors than the usual soft limit; children
    (gateways, workers) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


StartGatewayThread = Callable[..., Awaitable[Probe]]


@pytest.fixture
def gateway_thread(servers: ExitStack) -> StartGatewayThread:
    """`await gateway_thread([worker urls], **settings)` -> a Probe of a gateway in this
    process, once every worker is in routing. Awaited, not blocking: raw workers answer its
    probes on this test's event loop."""

    async def start(workers: list[str], **settings: Any) -> Probe:
        settings = {"port": 0, **FAST_HEALTH} | settings
        thread = GatewayThread(create_app(GatewaySettings(workers=workers, **settings)))
        url = await asyncio.to_thread(thread.start)
        servers.callback(thread.stop)
        await all_healthy(url, len(workers))
        return Probe(url, workers, thread=thread)

    return start


async def all_healthy(url: str, count: int) -> None:
    """The gateway probes its workers in the background from its start: tests begin once all
    of them are in routing, or their first requests would find none."""

    async def healthy() -> bool:
        async with httpx.AsyncClient(timeout=5) as client:
            listing = (await client.get(url + "/v1/workers")).json()["workers"]
        return [worker["state"] for worker in listing] == ["healthy"] * count

    await wait_until_async(healthy, 20, f"{count} healthy workers at {url}")


@dataclass
class Process:
    """A `mineru-gateway` command in a process group of its own."""

    url: str
    cli: CliProcess

    @property
    def pid(self) -> int:
        assert self.cli.proc is not None
        return self.cli.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.pid, sig)


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    yield started
    for process in reversed(started):
        with contextlib.suppress(ProcessLookupError):
            process.signal(signal.SIGCONT)  # a stopped worker cannot handle its SIGTERM
        process.cli.stop()


StartSimProcesses = Callable[..., list[Process]]


@pytest.fixture
def sim_processes(processes: list[Process]) -> StartSimProcesses:
    """`sim_processes(count, *sim flags)` -> simulated workers in processes of their own (so
    that they can be killed or stopped), started together, once all are ready."""

    def start(count: int, *args: str) -> list[Process]:
        started = []
        for _ in range(count):
            port = free_port()
            cli = CliProcess.mineru_gateway(
                "sim", "--port", str(port), "--log-level", "warning", *args
            )
            started.append(Process(f"http://127.0.0.1:{port}", cli))
            processes.append(started[-1])
            cli.start()
        for process in started:
            wait_http_ok(process.url + "/health", 30, process.cli.proc)
        return started

    return start


StartGatewayProcess = Callable[..., Awaitable[Process]]


@pytest.fixture
def gateway_process(processes: list[Process]) -> StartGatewayProcess:
    """`await gateway_process(workers, *serve flags, env=None)` -> `mineru-gateway serve`, once
    every worker is in routing."""

    async def start(workers: list[str], *args: str, env: dict[str, str] | None = None) -> Process:
        port = free_port()
        cli = CliProcess.mineru_gateway(
            *("serve", "--port", str(port), "--workers", ",".join(workers)),
            *("--health-interval-s", "0.3", "--log-level", "warning", *args),
            env=env,
        )
        process = Process(f"http://127.0.0.1:{port}", cli)
        processes.append(process)
        cli.start()
        await wait_until_async(lambda: answers(process), 30, f"{process.url} up")
        await all_healthy(process.url, len(workers))
        return process

    return start


async def answers(process: Process) -> bool:
    assert process.cli.proc is not None
    if process.cli.proc.poll() is not None:
        raise RuntimeError(f"{process.cli.argv} exited with {process.cli.proc.returncode}")
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.get(process.url + "/health")).status_code == 200
    except httpx.TransportError:
        return False


StartRawWorker = Callable[..., Awaitable[tuple[RawWorker, str]]]


@pytest.fixture
async def raw_worker() -> AsyncIterator[StartRawWorker]:
    """`await raw_worker(on_completion, on_metrics=None)` -> (worker, its URL), on this loop."""
    started: list[RawWorker] = []

    async def start(
        on_completion: Handler, on_metrics: Handler | None = None
    ) -> tuple[RawWorker, str]:
        worker = RawWorker(on_completion, on_metrics)
        started.append(worker)
        return worker, await worker.start()

    yield start
    for worker in started:
        await worker.stop()
