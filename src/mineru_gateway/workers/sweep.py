"""A periodic action on every worker, each at its own phase, within a budget of requests.

Reading or probing every worker at the same instant makes the event loop handle the whole
fleet's answers at once: requests arriving then wait behind them (docs/operate/fleet-scale.md).
A `Sweep` goes round the workers instead, a few per tick, so that each is visited once per
period and the visits are spread over it. The period is asked for at every tick, so it follows
the fleet's size (`Budget`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from mineru_gateway.workers.worker import Worker

log = structlog.get_logger("mineru_gateway.registry")

TICK_S = 0.05  # at most this long between two ticks of a sweep (one timer, not one per worker)


@dataclass(frozen=True, slots=True)
class Budget:
    """How many GETs one gateway replica may send: to each worker, and to the whole fleet, per
    second. A worker's period is the longest of its configured interval and what the budgets
    allow (docs/operate/fleet-scale.md).
    """

    per_worker: float | None = None  # GETs per second to one worker; None: no limit
    fleet: float | None = None  # GETs per second to all the workers together; None: no limit

    def period(self, interval_s: float, workers: int, gets: float = 1.0) -> float:
        """Seconds between two visits of each of `workers` workers, each visit `gets` GETs:
        at least `interval_s`."""
        period = interval_s
        if self.per_worker:
            period = max(period, gets / self.per_worker)
        if self.fleet and workers:
            period = max(period, gets * workers / self.fleet)
        return period


class Sweep:
    """Runs `action(worker)` on each of `workers()` once every `period(count)` seconds, a
    share of them at each tick; a worker whose last visit has not ended is passed over."""

    def __init__(
        self,
        name: str,
        workers: Callable[[], list[Worker]],
        period: Callable[[int], float],
        action: Callable[[Worker], Awaitable[None]],
    ) -> None:
        self.name = name
        self._workers = workers
        self._period = period
        self._action = action
        self._cursor = 0
        self._credit = 0.0
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        tasks = [*self._tasks, *([self._task] if self._task else [])]
        self._task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        next_tick = TICK_S
        while True:
            await asyncio.sleep(next_tick)
            next_tick = self.tick()

    def tick(self) -> float:
        """Starts this tick's visits; the time to the next tick."""
        workers = self._workers()
        count = len(workers)
        if not count:
            return TICK_S
        period = self._period(count)
        tick = min(TICK_S, period / count)
        self._credit += count * tick / period
        due = min(count, math.floor(self._credit))
        self._credit -= due
        for step in range(due):
            self._visit(workers[(self._cursor + step) % count])
        self._cursor = (self._cursor + due) % count
        return tick

    def _visit(self, worker: Worker) -> None:
        if worker.url in self._busy:
            return  # still at its last visit (a slow worker): its turn comes again
        self._busy.add(worker.url)
        task = asyncio.create_task(self._visited(worker))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _visited(self, worker: Worker) -> None:
        try:
            await self._action(worker)
        except Exception:
            log.exception("sweep_visit_failed", sweep=self.name, worker=worker.url)
        finally:
            self._busy.discard(worker.url)
