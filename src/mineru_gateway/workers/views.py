"""What routing and flow control see of the workers, and the routing policy's choice among them.

A worker's view hands the routing policy (routing.py) and flow control (docs/flow-control.md)
its counts (the gateway's own requests and their estimated cost), its reported queue while
fresh, its pace against its peers and its batch size (configured, or learnt: loads.py).

A decision looks at a few workers, not all: `offer` draws them from the index of workers with
room (fleet_index.py), so its cost does not grow with the fleet (docs/operate/fleet-scale.md).
`views()`, every worker's view, is for what needs them all (an error's reason, tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time
from collections.abc import Iterable, Iterator

from mineru_gateway.cost import Cost
from mineru_gateway.errors import GatewayError, ModelNotFound, NoHealthyWorker
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.routing import LoadModel, RoutingPolicy, WorkerView
from mineru_gateway.workers.fleet_index import ANY_ROOM, FleetIndex, Offer, RoomCheck
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.worker import Lease, Worker

SLOWNESS_BOUNDS = (0.25, 8.0)
SAMPLE = 8  # workers a decision looks at, by default (config.py: routing_sample)
PACE_EVERY_S = 0.5  # the peers' median pace is worked out again at most this often
# A reading stays fresh for at least this many read periods: one late read must not drop it.
FRESH_PERIODS = 2.0


class RoutingViews:
    def __init__(
        self,
        membership: Membership,
        policy: RoutingPolicy,
        *,
        load: LoadModel,
        metrics: GatewayMetrics,
        rng: random.Random,
        retry_after_s: float,
        pace_weighting: bool = False,
        batch_limit: int | None = None,
        sample: int = SAMPLE,
    ) -> None:
        """`load` is the model routing and flow control judge the figures by (the one object
        given to both): a worker's view is kept while its figures are as fresh as that model
        says. `retry_after_s`: when to come back when no healthy worker can serve. `sample`:
        the workers with room a decision draws and the policy chooses among."""
        self._membership = membership
        self.policy = policy
        self._configured = self._load = load
        self._metrics = metrics
        self._rng = rng
        self._retry_after_s = retry_after_s
        self._pace_weighting = pace_weighting
        self._batch_limit = batch_limit
        self._slowness: dict[str, float] = {}
        self._paced_at = -float("inf")
        self.index = FleetIndex(membership, self._view, rng, sample)

    def read_every(self, period_s: float) -> None:
        """Readings come every `period_s` (the budget stretches it with the fleet's size,
        registry.py): each stays fresh for FRESH_PERIODS of them, or the configured
        `stale_after_s` if longer, so that routing does not drop readings it will not get
        more often (docs/operate/fleet-scale.md)."""
        stale_after_s = max(self._configured.stale_after_s, FRESH_PERIODS * period_s)
        if stale_after_s != self._load.stale_after_s:
            self._load = dataclasses.replace(self._configured, stale_after_s=stale_after_s)

    def views(self) -> list[WorkerView]:
        now = time.monotonic()
        return [self._view(worker, now) for worker in self._membership.by_url.values()]

    def _view(self, worker: Worker, now: float) -> WorkerView:
        if self._pace_weighting and now - self._paced_at >= PACE_EVERY_S:
            self._paced_at = now
            self._slowness = self._paces()
        return worker.view(
            now,
            self._slowness.get(worker.url, 1.0),
            self._batch_limit or worker.batch_seen or None,
            self._load,
        )

    def _paces(self) -> dict[str, float]:
        """Each worker's reported inter-token latency against the median of its healthy peers:
        worked out every PACE_EVERY_S, not per decision (paces change with readings)."""
        workers = self._membership.by_url.values()
        paces = {w.url: w.itl_s for w in workers if w.healthy and w.itl_s}
        if len(paces) < 2:
            return {}
        median = statistics.median(paces.values())
        low, high = SLOWNESS_BOUNDS
        return {url: min(high, max(low, pace / median)) for url, pace in paces.items() if pace}

    def offer(
        self, model: str | None, room: RoomCheck = ANY_ROOM, exclude: Iterable[str] = ()
    ) -> Offer:
        """A few routable workers that serve `model` (fleet_index.py): with room by `room` if
        any has; raises ModelNotFound / NoHealthyWorker when none is routable."""
        offer = self.index.offer(model, room, exclude)
        if not offer.views:
            raise self.why_no_candidate(model)
        return offer

    def choose(
        self, model: str | None, exclude: Iterable[str] = (), room: RoomCheck = ANY_ROOM
    ) -> Worker:
        return self.choose_among(self.offer(model, room, exclude).views)

    def choose_among(self, candidates: list[WorkerView]) -> Worker:
        """The routing policy's pick of `candidates` (non-empty views from `offer`)."""
        chosen = self._membership.by_url[self.policy.choose(candidates, self._rng).name]
        self._metrics.routing_decisions.inc(self.policy.name, chosen.url)
        return chosen

    def why_no_candidate(self, model: str | None) -> GatewayError:
        """404 for a model no member has ever been seen serving; 503 with `Retry-After` when
        members serve it but none can take it now (ejected, unhealthy, draining), or when no
        worker is healthy at all (nothing to tell a model from). Walks every worker: asked
        only when no worker can take a request."""
        views = self.views()
        healthy = [view for view in views if view.healthy]
        if healthy and not any(view.serves(model) for view in healthy):
            if any(view.serves(model) for view in views):
                return NoHealthyWorker(
                    f"no healthy worker serves the model `{model}` now; retry later",
                    retry_after_s=self._retry_after_s,
                )
            served = sorted({m for view in healthy for m in view.models})
            return ModelNotFound(
                f"The model `{model}` does not exist. Served models: {', '.join(served)}.",
                param="model",
            )
        return NoHealthyWorker(
            "no healthy worker is available for this request; retry later",
            retry_after_s=self._retry_after_s,
        )

    def acquire(self, worker: Worker, cost: Cost) -> Lease:
        """Counts a request and its cost on `worker` until the lease is released."""
        return Lease(worker, cost, self._membership.changed)  # counts tell the index (publish)

    @contextlib.contextmanager
    def lease(self, worker: Worker, cost: Cost) -> Iterator[Lease]:
        """`acquire` for the block's duration, released whatever happens."""
        lease = self.acquire(worker, cost)
        try:
            yield lease
        finally:
            lease.release()
