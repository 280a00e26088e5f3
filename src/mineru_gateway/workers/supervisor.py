"""Starting, watching and stopping worker processes (uvicorn's supervisor split, STYLE.md).

Each worker runs in its own process group, so stopping it reaches every process it spawned (vLLM
starts an engine-core child), and asks the kernel to signal it if the supervisor itself dies, so
no worker outlives its supervisor even after a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import structlog

log = structlog.get_logger("mineru_gateway.supervisor")

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """How to start one worker, and where it answers once it is up."""

    name: str
    argv: Sequence[str]
    url: str
    env: Mapping[str, str] = field(default_factory=dict)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class ManagedWorker:
    spec: WorkerSpec
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class Supervisor:
    """Runs a group of workers: start, wait until healthy, restart on exit, stop the groups."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 10.0,
        backoff_s: float = 1.0,
        backoff_cap_s: float = 30.0,
    ) -> None:
        self.workers = [ManagedWorker(spec) for spec in specs]
        self._start_timeout = start_timeout_s
        self._stop_timeout = stop_timeout_s
        self._backoff = backoff_s
        self._backoff_cap = backoff_cap_s
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Starts every worker and waits until each answers `/health`."""
        for worker in self.workers:
            await self._spawn(worker)
        await asyncio.gather(*(self._wait_healthy(worker) for worker in self.workers))
        self._watch = asyncio.create_task(self._restart_exited(), name="supervisor-watch")

    async def _spawn(self, worker: ManagedWorker) -> None:
        spec = worker.spec
        worker.process = await asyncio.create_subprocess_exec(
            *spec.argv,
            env={**os.environ, **spec.env},
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        worker.started_at = time.monotonic()
        log.info("worker_started", worker=spec.name, pid=worker.process.pid, url=spec.url)

    async def _wait_healthy(self, worker: ManagedWorker) -> None:
        deadline = time.monotonic() + self._start_timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if not worker.running:
                    raise RuntimeError(f"worker {worker.spec.name} exited while starting")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(
                        f"{worker.spec.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as response:
                        if response.status == 200:
                            log.info("worker_ready", worker=worker.spec.name)
                            return
                await asyncio.sleep(0.1)
        raise TimeoutError(f"worker {worker.spec.name} not healthy after {self._start_timeout} s")

    async def _restart_exited(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.2)
            for worker in self.workers:
                if not worker.running and not self._stopping:
                    await self._restart(worker)

    async def _restart(self, worker: ManagedWorker) -> None:
        code = worker.process.returncode if worker.process else None
        delay = min(self._backoff * 2**worker.restarts, self._backoff_cap)
        if time.monotonic() - worker.started_at > 5 * self._backoff_cap:
            delay = self._backoff  # it ran well for a while: this is a fresh failure
            worker.restarts = 0
        log.warning("worker_exited", worker=worker.spec.name, code=code, restart_in_s=delay)
        await asyncio.sleep(delay)
        if not self._stopping:
            worker.restarts += 1
            await self._spawn(worker)

    async def stop(self) -> None:
        """TERM each worker's process group, then KILL what is left after the grace period."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await asyncio.gather(*(self._stop_one(worker) for worker in self.workers))

    async def _stop_one(self, worker: ManagedWorker) -> None:
        process = worker.process
        if process is None:
            return
        _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), self._stop_timeout)
        except TimeoutError:
            log.warning("worker_killed", worker=worker.spec.name)
        # The group may hold children that outlived the leader: end them too.
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()
        log.info("worker_stopped", worker=worker.spec.name, code=process.returncode)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
