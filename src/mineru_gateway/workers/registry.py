"""The live set of workers, as one object for the rest of the gateway.

`WorkerRegistry` puts together the registry's parts, each with one job:

- `Membership` (membership.py): the workers, their drains, and who hears of a change;
- `Health` (health.py): passive outcomes (ejection) and active probes;
- `LoadReader` (loads.py): the workers' reported queues, corrected, learnt from and shared;
- `RoutingViews` (views.py): what routing and flow control see, and the policy's choice;

and runs the probes and reads every `interval_s` / `load_interval_s`. `Worker` and `Lease`
(worker.py) are one worker's state and a request's place on it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable
from typing import Any

from mineru_gateway.cost import Cost
from mineru_gateway.errors import GatewayError
from mineru_gateway.metrics import GatewayMetrics, WorkerGauges
from mineru_gateway.periodic import Periodic, stop_all
from mineru_gateway.routing import LoadModel, RoutingPolicy, WorkerView
from mineru_gateway.workers.group_load import GroupLoad
from mineru_gateway.workers.health import SUCCESS, Health, HealthPolicy, Outcome
from mineru_gateway.workers.loads import LoadReader, SharedReadings, learn_batch
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.upstream import UpstreamClient
from mineru_gateway.workers.views import RoutingViews
from mineru_gateway.workers.worker import Lease, Reading, Scrape, Worker

__all__ = [
    "SUCCESS",
    "HealthPolicy",
    "Lease",
    "Outcome",
    "Reading",
    "Scrape",
    "Worker",
    "WorkerRegistry",
    "learn_batch",
]


class WorkerRegistry:
    def __init__(
        self,
        urls: Iterable[str],
        client: UpstreamClient,
        policy: RoutingPolicy,
        health: HealthPolicy | None = None,
        *,
        load_interval_s: float = 0.2,
        pace_weighting: bool = False,
        batch_limit: int | None = None,
        metrics: GatewayMetrics | None = None,
        rng: random.Random | None = None,
        shared_readings: SharedReadings | None = None,
        load: LoadModel | None = None,
        group: GroupLoad | None = None,
    ) -> None:
        """With `shared_readings`, the workers' load figures come from another gateway
        process's readings (loads.py). With `group`, routing and flow control count every
        process's requests (group_load.py)."""
        metrics = metrics or GatewayMetrics()
        self.health = health or HealthPolicy()
        self.membership = Membership(urls, group)
        self.checks = Health(self.membership, client, self.health, metrics)
        self.loads = LoadReader(self.membership, client, load_interval_s, shared_readings)
        self.routing = RoutingViews(
            self.membership,
            policy,
            load=load or LoadModel(),
            metrics=metrics,
            rng=rng or random.Random(),
            retry_after_s=self.health.interval_s,
            pace_weighting=pace_weighting,
            batch_limit=batch_limit,
        )
        self._loops: list[Periodic] = []

    @property
    def policy(self) -> RoutingPolicy:
        return self.routing.policy

    # -- membership ------------------------------------------------------------------------
    def on_change(self, listener: Callable[[], None]) -> None:
        self.membership.on_change(listener)

    @property
    def workers(self) -> list[Worker]:
        return self.membership.workers

    def worker(self, url: str) -> Worker:
        return self.membership.worker(url)

    def add(self, url: str) -> Worker:
        return self.membership.add(url)

    def remove(self, url: str) -> None:
        self.membership.remove(url)

    def drain(self, url: str) -> Worker:
        return self.membership.drain(url)

    def undrain(self, url: str) -> Worker:
        return self.membership.undrain(url)

    async def wait_idle(self, worker: Worker, timeout_s: float, poll_s: float = 0.05) -> bool:
        return await self.membership.wait_idle(worker, timeout_s, poll_s)

    def models(self) -> list[dict[str, Any]]:
        return self.membership.models()

    def any_healthy(self) -> bool:
        return self.membership.any_healthy()

    def gauges(self) -> list[WorkerGauges]:
        return self.membership.gauges()

    # -- routing ---------------------------------------------------------------------------
    def views(self) -> list[WorkerView]:
        return self.routing.views()

    def choose(self, model: str | None, exclude: Iterable[str] = ()) -> Worker:
        return self.routing.choose(model, exclude)

    def choose_among(self, candidates: list[WorkerView]) -> Worker:
        return self.routing.choose_among(candidates)

    def why_no_candidate(self, views: list[WorkerView], model: str | None) -> GatewayError:
        return self.routing.why_no_candidate(views, model)

    def acquire(self, worker: Worker, cost: Cost) -> Lease:
        return self.routing.acquire(worker, cost)

    def lease(self, worker: Worker, cost: Cost) -> contextlib.AbstractContextManager[Lease]:
        return self.routing.lease(worker, cost)

    # -- health ----------------------------------------------------------------------------
    def report(self, worker: Worker, outcome: Outcome) -> None:
        self.checks.report(worker, outcome)

    async def check(self, worker: Worker) -> None:
        await self.checks.check(worker)

    async def check_all(self) -> None:
        await self.checks.check_all()

    # -- load ------------------------------------------------------------------------------
    async def read_load(self, worker: Worker) -> None:
        await self.loads.read(worker)

    async def read_all_loads(self) -> None:
        await self.loads.read_all()

    def readings(self, max_age_s: float) -> dict[str, Scrape]:
        return self.loads.readings(max_age_s)

    # -- the loops -------------------------------------------------------------------------
    async def start(self) -> None:
        """Probes every worker once (so the first requests find them), then keeps probing."""
        await self.check_all()
        self._loops = [
            Periodic("worker-health", self.health.interval_s, self.check_all),
            Periodic("load", self.loads.interval_s, self.read_all_loads),
        ]
        for loop in self._loops:
            loop.start()

    async def stop(self) -> None:
        await stop_all(self._loops)
        self._loops = []
