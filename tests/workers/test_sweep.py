"""Reads and probes go round the workers, each at its own phase, within a budget of GETs
(workers/sweep.py, workers/registry.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from mineru_gateway.config import GatewaySettings
from mineru_gateway.routing import RoundRobin
from mineru_gateway.vllm_contract import VllmLoad
from mineru_gateway.workers.health import MODELS_EVERY_S
from mineru_gateway.workers.registry import HealthPolicy, Scrape, WorkerRegistry
from mineru_gateway.workers.sweep import Budget, Sweep
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient
from mineru_gateway.workers.worker import Worker

pytestmark = pytest.mark.unit


def test_a_budget_stretches_the_period_per_worker_and_with_the_fleet() -> None:
    assert Budget().period(0.2, 1000) == 0.2
    assert Budget(per_worker=1.0).period(0.2, 8) == 1.0
    assert Budget(per_worker=1.0, fleet=100).period(0.2, 1000) == 10.0
    assert Budget(fleet=100).period(0.2, 1000, gets=2) == 20.0


async def test_each_worker_is_visited_once_a_period_at_its_own_phase() -> None:
    workers = [Worker(f"http://w{n}:1") for n in range(8)]
    visits: dict[str, list[float]] = {worker.url: [] for worker in workers}

    async def visit(worker: Worker) -> None:
        visits[worker.url].append(time.monotonic())

    sweep = Sweep("test", lambda: workers, lambda count: 0.4, visit)
    sweep.start()
    await asyncio.sleep(1.3)
    await sweep.stop()
    counts = [len(times) for times in visits.values()]
    assert min(counts) >= 2 and max(counts) <= 4  # about 3 each in 1.3 s: one per 0.4 s
    firsts = sorted(times[0] for times in visits.values())
    assert firsts[-1] - firsts[0] > 0.2  # spread over the period, not all at once


async def test_a_slow_worker_is_passed_over_until_its_visit_ends() -> None:
    workers = [Worker("http://slow:1")]
    started: list[float] = []

    async def visit(worker: Worker) -> None:
        started.append(time.monotonic())
        await asyncio.sleep(0.5)

    sweep = Sweep("test", lambda: workers, lambda count: 0.05, visit)
    sweep.start()
    await asyncio.sleep(0.8)
    await sweep.stop()
    assert len(started) == 2  # not one per 0.05 s piled up behind the slow one


def registry_of(workers: int, budget: Budget) -> WorkerRegistry:
    urls = [f"http://w{n}:1" for n in range(workers)]
    return WorkerRegistry(
        urls,
        UpstreamClient(Timeouts(1, 1, 1)),
        RoundRobin(),
        HealthPolicy(interval_s=2.0),
        load_interval_s=0.2,
        budget=budget,
    )


@pytest.mark.parametrize("workers", [4, 8, 128, 1024])
def test_the_default_budget_keeps_each_worker_under_its_gets(workers: int) -> None:
    """Probes (a /health per period, the model listing every MODELS_EVERY_S) and reads
    together: within the per-worker budget and the fleet's; a small fleet is still read every
    load_interval_s (routing sees outside traffic at once), and at 1,024 workers 4 replicas make
    each worker answer under 6 GETs/s."""
    defaults = GatewaySettings()
    budget = Budget(defaults.max_worker_gets_per_s, defaults.max_fleet_gets_per_s)
    registry = registry_of(workers, budget)
    period, every = registry.visit_plan(workers)  # a read each visit, a probe each `every`
    probes = (1 + 2.0 / MODELS_EVERY_S) / (every * period)
    reads = 1 / period
    assert probes + reads <= defaults.max_worker_gets_per_s + 1e-9
    assert workers * (probes + reads) <= defaults.max_fleet_gets_per_s + 1e-9
    if workers <= 8:
        assert period == pytest.approx(0.2)
    if workers >= 1024:
        assert 4 * (probes + reads) < 6


@pytest.mark.parametrize("workers", [4, 8, 128, 1024])
@pytest.mark.parametrize("replicas", [2, 4, 32])
def test_replicas_that_fleet_state_counts_share_each_workers_budget(
    workers: int, replicas: int
) -> None:
    """The per-worker budget is the whole deployment's: each of the replicas fleet state
    counts takes its share, so together they stay within it at any fleet size."""
    defaults = GatewaySettings()
    budget = Budget(defaults.max_worker_gets_per_s, defaults.max_fleet_gets_per_s)
    registry = registry_of(workers, budget)
    alone = registry.visit_plan(workers)
    registry.replicas = lambda: replicas
    period, every = registry.visit_plan(workers)
    probes = (1 + 2.0 / MODELS_EVERY_S) / (every * period)
    assert replicas * (probes + 1 / period) <= defaults.max_worker_gets_per_s + 1e-9
    assert period >= alone[0]


@pytest.mark.parametrize(("budget", "fresh"), [(Budget(1.25, 200), True), (Budget(), False)])
def test_readings_stay_fresh_for_two_read_periods(budget: Budget, fresh: bool) -> None:
    """At 1,024 workers the budget reads each every few seconds: a reading that old still
    counts (older than `stale_after_s`, within two periods); without a budget it does not."""
    registry = registry_of(1024, budget)
    assert (registry.read_period(1024) > 2) == fresh
    worker = registry.membership.workers[0]
    worker.healthy = True
    worker.scrape = Scrape(VllmLoad(2, 3, 0.1, 0.0, 0.0), time.monotonic() - 3.0, 0)
    assert (registry.routing.views()[0].reported is not None) == fresh
