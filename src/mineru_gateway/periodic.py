"""Background loops that run an action every so often and stop cleanly: one implementation for
the registry's probes, DNS discovery and NPU telemetry."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class Periodic:
    """Runs `action` in a task, `interval_s` after the end of its previous run, until `stop()`.

    Measured end to start, so a slow action (a worker answering `/metrics` late under load)
    spaces the runs out instead of running back to back. `immediately`: the first run starts at
    once rather than after one interval.
    """

    def __init__(
        self,
        name: str,
        interval_s: float,
        action: Callable[[], Awaitable[object]],
        *,
        immediately: bool = False,
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self._action = action
        self._immediately = immediately
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        if not self._immediately:
            await asyncio.sleep(self.interval_s)
        while True:
            await self._action()
            await asyncio.sleep(self.interval_s)


async def stop_all(loops: list[Periodic]) -> None:
    for loop in loops:
        await loop.stop()
