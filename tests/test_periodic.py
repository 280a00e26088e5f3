"""Background loops: when they run, and that they stop."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from mineru_gateway.periodic import Periodic, stop_all

pytestmark = pytest.mark.unit


async def test_a_loop_runs_after_each_interval_and_stops() -> None:
    runs: list[float] = []
    loop = asyncio.get_running_loop()

    async def action() -> None:
        runs.append(loop.time())
        await asyncio.sleep(0.02)  # a slow action: the next run waits a full interval after it

    periodic = Periodic("test", 0.01, action)
    periodic.start()
    await asyncio.sleep(0.005)
    assert runs == [] and periodic.running  # not immediately: first after one interval
    await asyncio.sleep(0.2)
    await periodic.stop()
    count = len(runs)
    assert count >= 3
    assert all(later - earlier >= 0.029 for earlier, later in itertools.pairwise(runs))
    await asyncio.sleep(0.05)
    assert len(runs) == count and not periodic.running


async def test_immediately_runs_at_once_and_stop_all_stops_every_loop() -> None:
    started = asyncio.Event()

    async def action() -> None:
        started.set()

    loops = [Periodic("a", 60, action, immediately=True), Periodic("b", 60, action)]
    for loop in loops:
        loop.start()
    await asyncio.wait_for(started.wait(), 1)
    await stop_all(loops)
    assert not any(loop.running for loop in loops)
    await loops[0].stop()  # stopping twice is harmless
