"""The live set of workers: their health, the models they serve, and this gateway's load on them.

Health is learnt two ways: an active probe (`GET /health`, then `GET /v1/models`) every
`health_interval_s`, and passively: a worker that cannot be connected to is taken out of routing at
once and comes back on its next good probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from mineru_gateway.errors import GatewayError, ModelNotFound, NoHealthyWorker
from mineru_gateway.routing import RoutingPolicy, WorkerView, candidates_for
from mineru_gateway.workers.upstream import UpstreamClient

log = structlog.get_logger("mineru_gateway.registry")


@dataclass(slots=True)
class Worker:
    """Mutable state of one worker, owned by the registry (one event loop, no locks needed)."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_error: str | None = None
    last_checked: float | None = None

    def view(self) -> WorkerView:
        return WorkerView(self.url, self.healthy, self.in_flight, frozenset(self.models))

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "state": "healthy" if self.healthy else "unhealthy",
            "in_flight": self.in_flight,
            "models": sorted(self.models),
            "last_error": self.last_error,
            "last_checked": self.last_checked,
        }


class WorkerRegistry:
    def __init__(
        self,
        urls: Iterable[str],
        client: UpstreamClient,
        policy: RoutingPolicy,
        *,
        health_interval_s: float,
        health_timeout_s: float,
        rng: random.Random | None = None,
    ) -> None:
        self._workers = {url: Worker(url) for url in urls}
        self._client = client
        self.policy = policy
        self._interval = health_interval_s
        self._timeout = health_timeout_s
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None

    # -- membership -------------------------------------------------------------------------
    @property
    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def add(self, url: str) -> Worker:
        """Adds a worker; it takes traffic after its first good probe."""
        return self._workers.setdefault(url, Worker(url))

    def remove(self, url: str) -> None:
        """Stops routing to `url`; requests already there finish normally."""
        self._workers.pop(url, None)

    # -- routing --------------------------------------------------------------------------
    def choose(self, model: str | None, exclude: Iterable[str] = ()) -> Worker:
        views = [worker.view() for worker in self._workers.values()]
        candidates = candidates_for(views, model, exclude)
        if not candidates:
            raise self._why_no_candidate(views, model)
        return self._workers[self.policy.choose(candidates, self._rng).name]

    def _why_no_candidate(self, views: list[WorkerView], model: str | None) -> GatewayError:
        healthy = [view for view in views if view.healthy]
        if healthy and not any(view.serves(model) for view in healthy):
            served = sorted({m for view in healthy for m in view.models})
            return ModelNotFound(
                f"The model `{model}` does not exist. Served models: {', '.join(served)}.",
                param="model",
            )
        return NoHealthyWorker("no healthy worker is available for this request; retry later")

    @contextlib.contextmanager
    def lease(self, worker: Worker) -> Iterator[Worker]:
        """Counts a request in flight on `worker` for the block's duration, whatever happens."""
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1

    def mark_unreachable(self, worker: Worker, error: BaseException) -> None:
        """Passive ejection: no new work until the next good probe."""
        if worker.healthy:
            log.warning("worker_ejected", worker=worker.url, error=str(error))
        worker.healthy = False
        worker.last_error = str(error)

    def models(self) -> list[dict[str, Any]]:
        """The union of healthy workers' model cards, one per model id."""
        union: dict[str, dict[str, Any]] = {}
        for worker in self._workers.values():
            if worker.healthy:
                for model_id, card in worker.models.items():
                    union.setdefault(model_id, card)
        return list(union.values())

    def any_healthy(self) -> bool:
        return any(worker.healthy for worker in self._workers.values())

    # -- health ---------------------------------------------------------------------------
    async def check(self, worker: Worker) -> None:
        try:
            await self._client.get_ok(f"{worker.url}/health", self._timeout)
            listing = await self._client.get_json(f"{worker.url}/v1/models", self._timeout)
            models = {card["id"]: card for card in listing["data"]}
        except GatewayError as exc:
            self._set_health(worker, False, str(exc))
        except (KeyError, TypeError) as exc:
            self._set_health(worker, False, f"unexpected /v1/models answer: {exc!r}")
        else:
            worker.models = models
            self._set_health(worker, True, None)
        worker.last_checked = time.time()

    def _set_health(self, worker: Worker, healthy: bool, error: str | None) -> None:
        if healthy != worker.healthy:
            event = "worker_healthy" if healthy else "worker_unhealthy"
            log.info(event, worker=worker.url, error=error)
        worker.healthy = healthy
        if error is not None:
            worker.last_error = error

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(worker) for worker in self.workers))

    async def start(self) -> None:
        """Probes every worker once (so the first requests find them), then keeps probing."""
        await self.check_all()
        self._task = asyncio.create_task(self._probe_forever(), name="worker-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check_all()
