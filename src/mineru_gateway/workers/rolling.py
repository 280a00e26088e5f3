"""Rolling restarts: one worker at a time, with no failed request.

For each worker in turn: drain it (no new requests; queued ones are bound to the others, since
the gateway binds a request to a worker only when it is served), wait until what it runs has
finished, restart it, wait until the gateway's own health check passes on the new process, take
it back, next. One worker is out at a time, so the fleet keeps (N-1)/N of its capacity; with one
worker, its queued requests get 503 while it restarts.

If a worker does not drain within the drain timeout it is restarted anyway (what still ran on it
ends with an error, which the log names); if it does not come back healthy the restart stops
there, so a bad image or model path takes down one worker, not all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import structlog

from mineru_gateway.errors import Conflict
from mineru_gateway.workers.registry import WorkerRegistry

log = structlog.get_logger("mineru_gateway.rolling")

Restart = Callable[[str], Awaitable[None]]  # restarts the worker at a URL; returns once it is up
Phase = Literal["waiting", "draining", "restarting", "warming", "done", "failed"]


@dataclass(slots=True)
class Step:
    url: str
    phase: Phase = "waiting"
    drained: bool | None = None  # False: the drain timeout passed with requests still on it
    drain_s: float | None = None
    restart_s: float | None = None
    error: str | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "phase": self.phase,
            "drained": self.drained,
            "drain_s": _rounded(self.drain_s),
            "restart_s": _rounded(self.restart_s),
            "error": self.error,
        }


class RollingRestart:
    """At most one rolling restart at a time; `describe()` says how the last one went."""

    def __init__(
        self,
        registry: WorkerRegistry,
        restart: Restart,
        *,
        drain_timeout_s: float,
        ready_timeout_s: float,
        probe_interval_s: float = 0.2,
    ) -> None:
        self.registry = registry
        self._restart = restart
        self.drain_timeout_s = drain_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.probe_interval_s = probe_interval_s
        self.steps: list[Step] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def state(self) -> str:
        if not self.steps:
            return "idle"
        if self.running:
            return "running"
        return "failed" if any(step.phase == "failed" for step in self.steps) else "done"

    def start(self, urls: Sequence[str] | None = None) -> None:
        """Starts restarting `urls` (default: every worker) in the background. Raises Conflict
        while one is running, or for a URL the gateway does not know."""
        if self.running:
            raise Conflict("a rolling restart is already running", code="restart_in_progress")
        known = [worker.url for worker in self.registry.membership.workers]
        chosen = list(urls) if urls else known
        unknown = [url for url in chosen if url not in known]
        if unknown:
            raise Conflict(f"unknown worker: {', '.join(unknown)}", code="unknown_worker")
        self.steps = [Step(url) for url in chosen]
        self._task = asyncio.create_task(self._run(), name="rolling-restart")

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def describe(self) -> dict[str, Any]:
        return {"state": self.state, "workers": [step.describe() for step in self.steps]}

    async def _run(self) -> None:
        log.info("rolling_restart_started", workers=[step.url for step in self.steps])
        for step in self.steps:
            try:
                await self._one(step)
            except (TimeoutError, OSError, KeyError) as error:
                step.phase, step.error = "failed", str(error) or type(error).__name__
                log.error("rolling_restart_failed", worker=step.url, error=step.error)
                return
            finally:
                if step.url in {worker.url for worker in self.registry.membership.workers}:
                    self.registry.membership.undrain(step.url)
        log.info("rolling_restart_done", workers=len(self.steps))

    async def _one(self, step: Step) -> None:
        worker = self.registry.membership.drain(step.url)
        step.phase = "draining"
        began = time.monotonic()
        step.drained = await self.registry.membership.wait_idle(worker, self.drain_timeout_s)
        step.drain_s = time.monotonic() - began
        if not step.drained:
            log.warning(
                "worker_not_drained",
                worker=step.url,
                in_flight=worker.in_flight,
                after_s=step.drain_s,
            )
        step.phase = "restarting"
        began = time.monotonic()
        async with asyncio.timeout(self.ready_timeout_s):
            await self._restart(step.url)
            step.phase = "warming"
            await self.registry.checks.check(worker)
            while not worker.healthy:
                await asyncio.sleep(self.probe_interval_s)
                await self.registry.checks.check(worker)
        step.restart_s = time.monotonic() - began
        step.phase = "done"
        log.info(
            "worker_restarted", worker=step.url, drain_s=step.drain_s, restart_s=step.restart_s
        )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
