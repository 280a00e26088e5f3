"""What routing and flow control see of the workers, and the routing policy's choice among them.

`views()` hands the routing policy (routing.py) and flow control (docs/flow-control.md) each
worker's counts (the gateway's own requests and their estimated cost), its reported queue while
fresh, its pace against its peers and its batch size (configured, or learnt: loads.py).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Iterable, Iterator

from mineru_gateway.cost import Cost
from mineru_gateway.errors import GatewayError, ModelNotFound, NoHealthyWorker
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.routing import LoadModel, RoutingPolicy, WorkerView, candidates_for
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.worker import Lease, Worker

SLOWNESS_BOUNDS = (0.25, 8.0)


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
    ) -> None:
        """`load` is the model routing and flow control judge the figures by (the one object
        given to both): a worker's view is kept while its figures are as fresh as that model
        says. `retry_after_s`: when to come back when no healthy worker can serve."""
        self._membership = membership
        self.policy = policy
        self._load = load
        self._metrics = metrics
        self._rng = rng
        self._retry_after_s = retry_after_s
        self._pace_weighting = pace_weighting
        self._batch_limit = batch_limit

    def views(self) -> list[WorkerView]:
        now = time.monotonic()
        slowness = self._slowness()
        load, batch_limit = self._load, self._batch_limit
        return [
            worker.view(
                now,
                slowness.get(worker.url, 1.0) if slowness else 1.0,
                batch_limit or worker.batch_seen or None,
                load,
            )
            for worker in self._membership.by_url.values()
        ]

    def _slowness(self) -> dict[str, float]:
        """Each worker's reported inter-token latency against the median of its healthy peers."""
        if not self._pace_weighting:
            return {}
        workers = self._membership.by_url.values()
        paces = {w.url: w.itl_s for w in workers if w.healthy and w.itl_s}
        if len(paces) < 2:
            return {}
        median = statistics.median(paces.values())
        low, high = SLOWNESS_BOUNDS
        return {url: min(high, max(low, pace / median)) for url, pace in paces.items() if pace}

    def choose(self, model: str | None, exclude: Iterable[str] = ()) -> Worker:
        views = self.views()
        candidates = candidates_for(views, model, exclude)
        if not candidates:
            raise self.why_no_candidate(views, model)
        return self.choose_among(candidates)

    def choose_among(self, candidates: list[WorkerView]) -> Worker:
        """The routing policy's pick of `candidates` (non-empty views from `views()`)."""
        chosen = self._membership.by_url[self.policy.choose(candidates, self._rng).name]
        self._metrics.routing_decisions.inc(self.policy.name, chosen.url)
        return chosen

    def why_no_candidate(self, views: list[WorkerView], model: str | None) -> GatewayError:
        """404 for a model no member has ever been seen serving; 503 with `Retry-After` when
        members serve it but none can take it now (ejected, unhealthy, draining), or when no
        worker is healthy at all (nothing to tell a model from)."""
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
        return Lease(worker, cost, self._membership.changed)

    @contextlib.contextmanager
    def lease(self, worker: Worker, cost: Cost) -> Iterator[Lease]:
        """`acquire` for the block's duration, released whatever happens."""
        lease = self.acquire(worker, cost)
        try:
            yield lease
        finally:
            lease.release()
