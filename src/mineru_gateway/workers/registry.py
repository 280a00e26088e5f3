"""The live set of workers: its parts, built together, and the loops that keep them current.

`WorkerRegistry` builds the registry's parts, each with one job, which the rest of the gateway
uses directly (`registry.membership`, `registry.checks`, `registry.loads`, `registry.routing`):

- `Membership` (membership.py): the workers, their drains, and who hears of a change;
- `Health` (health.py): passive outcomes (ejection) and active probes;
- `LoadReader` (loads.py): the workers' reported queues, corrected and learnt from;
- `RoutingViews` (views.py): what routing and flow control see, and the policy's choice
  among a few workers drawn from the index of those with room (fleet_index.py);

and runs the probes and reads: round the workers, each at its own phase, every `interval_s` /
`load_interval_s` or less often, as the budget of GETs allows (sweep.py).
`Worker` and `Lease` (worker.py) are one worker's state and a request's place on it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable

from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.routing import LoadModel, RoutingPolicy
from mineru_gateway.workers.fleet_index import Offer
from mineru_gateway.workers.health import MODELS_EVERY_S, SUCCESS, Health, HealthPolicy, Outcome
from mineru_gateway.workers.loads import LoadReader, learn_batch
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.sweep import Budget, Sweep
from mineru_gateway.workers.upstream import UpstreamClient
from mineru_gateway.workers.views import SAMPLE, RoutingViews
from mineru_gateway.workers.worker import Lease, Reading, Scrape, Worker

__all__ = [
    "SUCCESS",
    "HealthPolicy",
    "Lease",
    "Offer",
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
        load: LoadModel | None = None,
        sample: int = SAMPLE,
        budget: Budget | None = None,
    ) -> None:
        """`budget`: the GETs this replica may send the workers (sweep.py); none, no limit."""
        metrics = metrics or GatewayMetrics()
        self.health = health or HealthPolicy()
        self.budget = budget or Budget()
        # The gateway's replicas that share the per-worker budget (fleet state counts them:
        # fleet/tenants.py); without fleet state this replica takes it all.
        self.replicas: Callable[[], int] = _alone
        self.membership = Membership(urls)
        self.checks = Health(self.membership, client, self.health, metrics)
        self.loads = LoadReader(self.membership, client, load_interval_s)
        self.routing = RoutingViews(
            self.membership,
            policy,
            load=load or LoadModel(),
            metrics=metrics,
            rng=rng or random.Random(),
            retry_after_s=self.health.interval_s,
            pace_weighting=pace_weighting,
            batch_limit=batch_limit,
            sample=sample,
        )
        self._sweeps: list[Sweep] = []

    # -- load ------------------------------------------------------------------------------
    async def read_load(self, worker: Worker) -> None:
        if await self.loads.read(worker):
            self.membership.changed()

    async def read_all_loads(self) -> None:
        """Every healthy worker's load now."""
        await self.loads.read_all()
        self.membership.changed()

    # -- the budget ------------------------------------------------------------------------
    def probe_period(self, workers: int) -> float:
        """Seconds between two probes of each worker: a GET of /health, and of /v1/models
        every MODELS_EVERY_S; half of this replica's share of each worker's budget, and half
        the fleet's, at most."""
        gets = 1.0 + self.health.interval_s / MODELS_EVERY_S
        per_worker = self._per_worker()
        fleet = None if self.budget.fleet is None else self.budget.fleet / 2
        per_worker = None if per_worker is None else per_worker / 2
        return Budget(per_worker, fleet).period(self.health.interval_s, workers, gets)

    def _per_worker(self) -> float | None:
        """This replica's share of the GETs each worker answers the whole deployment."""
        per_worker = self.budget.per_worker
        return None if per_worker is None else per_worker / max(1, self.replicas())

    def read_period(self, workers: int) -> float:
        """Seconds between two load reads of each worker: what this replica's share of the
        budget leaves after the probes; the readings stay fresh for routing over two such
        periods (views.py)."""
        budget = self.budget
        per_worker = self._per_worker()
        if per_worker is not None:
            probes = (1.0 + self.health.interval_s / MODELS_EVERY_S) / self.probe_period(workers)
            per_worker = max(per_worker / 4, per_worker - probes)
        fleet = None if budget.fleet is None else budget.fleet / 2
        period = Budget(per_worker, fleet).period(self.loads.interval_s, workers)
        self.routing.read_every(period)
        return period

    # -- the loops -------------------------------------------------------------------------
    async def start(self) -> None:
        """Probes every worker once (so the first requests find them), then keeps probing and
        reading, each worker at its own phase."""
        await self.checks.check_all()
        self._sweeps = [
            Sweep("workers", self.membership.workers_list, self._visit_period, self._visit)
        ]
        for sweep in self._sweeps:
            sweep.start()

    def visit_plan(self, workers: int) -> tuple[float, int]:
        """Seconds between two visits of each worker, and every how many visits it is probed:
        the reads no more often than `read_period`, the probes than `probe_period`."""
        reads, probes = self.read_period(workers), self.probe_period(workers)
        every = max(1, round(probes / reads))
        return max(reads, probes / every), every

    def _visit_period(self, workers: int) -> float:
        return self.visit_plan(workers)[0]

    async def _visit(self, worker: Worker) -> None:
        """A worker's turn: its probe when due, then its load read, one after the other on
        the same connection (a connection made costs the gateway more than the GET: with a
        large fleet a worker's turn comes after its keep-alive has lapsed)."""
        period, every = self.visit_plan(len(self.membership.by_url))
        probed = worker.last_checked
        if probed is None or time.time() - probed >= (every - 0.5) * period:
            await self.checks.probe(worker, time.monotonic())
        if worker.healthy:
            await self.read_load(worker)

    async def stop(self) -> None:
        for sweep in self._sweeps:
            await sweep.stop()
        self._sweeps = []


def _alone() -> int:
    return 1
