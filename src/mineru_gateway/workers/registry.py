"""The live set of workers: their health, the models they serve, and the load on them.

Health is learnt two ways: an active probe (`GET /health`, then `GET /v1/models`) every
`health_interval_s`, and passively: a worker that cannot be connected to, or answers 5xx or drops
connections `eject_after` times in a row, is taken out of routing and comes back on its next good
probe. A probe that is refused or answered with an error takes a worker out at once; one that
merely times out does so only `slow_probes_to_eject` times in a row: a worker busy with a full
batch (or sharing a few cores) answers `/health` late, and taking every such worker out would turn
load into a "no healthy worker" outage.

Load is learnt two ways too (issue 3): the gateway's own in-flight requests and their estimated
cost, updated instantly by `lease`, and the worker's own queue read from its `/metrics` every
`load_interval_s`. `views()` hands both to the routing policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from mineru_gateway.cost import Cost, CostModel
from mineru_gateway.errors import GatewayError, ModelNotFound, NoHealthyWorker, UpstreamTimeout
from mineru_gateway.metrics import GatewayMetrics, WorkerGauges
from mineru_gateway.routing import ReportedLoad, RoutingPolicy, WorkerView, candidates_for
from mineru_gateway.workers.upstream import UpstreamClient
from mineru_gateway.workers.vllm_metrics import VllmLoad, parse_vllm_load

log = structlog.get_logger("mineru_gateway.registry")

SLOWNESS_BOUNDS = (0.25, 8.0)
ITL_SMOOTHING = 0.3


@dataclass(slots=True)
class Scrape:
    """One reading of a worker's `/metrics`, with this gateway's own count at that moment."""

    load: VllmLoad
    at: float  # time.monotonic()
    own_in_flight: int


@dataclass(slots=True)
class Worker:
    """Mutable state of one worker, owned by the registry (one event loop, no locks needed)."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    own_cost: float = 0.0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_error: str | None = None
    last_checked: float | None = None
    failures: int = 0  # consecutive passive failures
    slow_probes: int = 0  # consecutive health probes that timed out
    scrape: Scrape | None = None
    itl_s: float | None = None  # smoothed mean inter-token latency the worker reports

    def reported(self, now: float) -> ReportedLoad | None:
        if self.scrape is None:
            return None
        scrape, load = self.scrape, self.scrape.load
        age = now - scrape.at
        return ReportedLoad(load.waiting, load.running, load.kv_usage, age, scrape.own_in_flight)

    def describe(self, now: float) -> dict[str, Any]:
        reported = self.reported(now)
        return {
            "url": self.url,
            "state": "healthy" if self.healthy else "unhealthy",
            "in_flight": self.in_flight,
            "estimated_cost": round(self.own_cost, 1),
            "models": sorted(self.models),
            "reported": None
            if reported is None
            else {
                "waiting": reported.waiting,
                "running": reported.running,
                "kv_cache_usage": reported.kv_usage,
                "age_s": round(reported.age_s, 3),
            },
            "inter_token_latency_s": self.itl_s,
            "last_error": self.last_error,
            "last_checked": self.last_checked,
        }


class Lease:
    """A request's place on a worker; `prefilled()` releases the prefill part of its cost."""

    __slots__ = ("cost", "prefill_done", "worker")

    def __init__(self, worker: Worker, cost: Cost) -> None:
        self.worker = worker
        self.cost = cost
        self.prefill_done = False

    def prefilled(self) -> None:
        """The worker sent the first byte of the answer: the prompt is no longer queued work."""
        if not self.prefill_done:
            self.prefill_done = True
            worker = self.worker
            worker.own_cost = max(0.0, worker.own_cost - self.cost.prefill)


class WorkerRegistry:
    def __init__(
        self,
        urls: Iterable[str],
        client: UpstreamClient,
        policy: RoutingPolicy,
        *,
        health_interval_s: float,
        health_timeout_s: float,
        load_interval_s: float = 0.2,
        pace_weighting: bool = False,
        eject_after: int = 3,
        slow_probes_to_eject: int = 3,
        cost_model: CostModel | None = None,
        metrics: GatewayMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._workers = {url: Worker(url) for url in urls}
        self._client = client
        self.policy = policy
        self.cost_model = cost_model or CostModel()
        self.metrics = metrics or GatewayMetrics()
        self._interval = health_interval_s
        self._timeout = health_timeout_s
        self._load_interval = load_interval_s
        self._pace_weighting = pace_weighting
        self._eject_after = eject_after
        self._slow_probes_to_eject = slow_probes_to_eject
        self._rng = rng or random.Random()
        self._tasks: list[asyncio.Task[None]] = []

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
    def views(self) -> list[WorkerView]:
        now = time.monotonic()
        slowness = self._slowness()
        return [
            WorkerView(
                name=worker.url,
                healthy=worker.healthy,
                in_flight=worker.in_flight,
                models=frozenset(worker.models),
                own_cost=worker.own_cost,
                reported=worker.reported(now),
                slowness=slowness.get(worker.url, 1.0),
            )
            for worker in self._workers.values()
        ]

    def _slowness(self) -> dict[str, float]:
        """Each worker's reported inter-token latency against the median of its healthy peers."""
        if not self._pace_weighting:
            return {}
        paces = {w.url: w.itl_s for w in self._workers.values() if w.healthy and w.itl_s}
        if len(paces) < 2:
            return {}
        median = statistics.median(paces.values())
        low, high = SLOWNESS_BOUNDS
        return {url: min(high, max(low, pace / median)) for url, pace in paces.items() if pace}

    def choose(self, model: str | None, exclude: Iterable[str] = ()) -> Worker:
        views = self.views()
        candidates = candidates_for(views, model, exclude)
        if not candidates:
            raise self._why_no_candidate(views, model)
        chosen = self._workers[self.policy.choose(candidates, self._rng).name]
        self.metrics.routing_decisions.inc(self.policy.name, chosen.url)
        return chosen

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
    def lease(self, worker: Worker, cost: Cost) -> Iterator[Lease]:
        """Counts a request and its cost on `worker` for the block's duration, whatever happens."""
        lease = Lease(worker, cost)
        worker.in_flight += 1
        worker.own_cost += cost.total
        try:
            yield lease
        finally:
            worker.in_flight -= 1
            held = cost.hold if lease.prefill_done else cost.total
            worker.own_cost = max(0.0, worker.own_cost - held) if worker.in_flight else 0.0

    # -- passive health -------------------------------------------------------------------
    def record_failure(self, worker: Worker, reason: str, error: str, *, at_once: bool) -> None:
        """A connection failure, a 5xx or a dropped stream; `at_once` ejects without counting."""
        worker.failures += 1
        worker.last_error = error
        if worker.healthy and (at_once or worker.failures >= self._eject_after):
            worker.healthy = False
            self.metrics.ejections.inc(worker.url, reason)
            log.warning("worker_ejected", worker=worker.url, reason=reason, error=error)

    def record_success(self, worker: Worker) -> None:
        worker.failures = 0

    # -- what the rest of the gateway reads ----------------------------------------------
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

    def gauges(self) -> list[WorkerGauges]:
        now = time.monotonic()
        gauges = []
        for worker in self._workers.values():
            reported = worker.reported(now)
            gauges.append(
                WorkerGauges(
                    worker=worker.url,
                    healthy=worker.healthy,
                    in_flight=worker.in_flight,
                    waiting=reported.waiting if reported else None,
                    running=reported.running if reported else None,
                    kv_usage=reported.kv_usage if reported else None,
                    scrape_age_s=reported.age_s if reported else None,
                )
            )
        return gauges

    # -- active probes --------------------------------------------------------------------
    async def check(self, worker: Worker) -> None:
        try:
            await self._client.get_ok(f"{worker.url}/health", self._timeout)
            listing = await self._client.get_json(f"{worker.url}/v1/models", self._timeout)
            models = {card["id"]: card for card in listing["data"]}
        except UpstreamTimeout as exc:
            worker.slow_probes += 1
            if worker.healthy and worker.slow_probes < self._slow_probes_to_eject:
                worker.last_error = str(exc)
                log.info("worker_probe_slow", worker=worker.url, error=str(exc))
            else:
                self._set_health(worker, False, str(exc))
        except GatewayError as exc:
            self._set_health(worker, False, str(exc))
        except (KeyError, TypeError) as exc:
            self._set_health(worker, False, f"unexpected /v1/models answer: {exc!r}")
        else:
            worker.models = models
            worker.failures = 0
            worker.slow_probes = 0
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

    async def read_load(self, worker: Worker) -> None:
        own = worker.in_flight
        try:
            text = await self._client.get_ok(f"{worker.url}/metrics", self._load_timeout)
        except GatewayError:
            return  # the figures age; past `stale_after_s` routing ignores them
        load = parse_vllm_load(text)
        if load is None:
            return
        self._learn_pace(worker, load)
        worker.scrape = Scrape(load, time.monotonic(), own)

    @property
    def _load_timeout(self) -> float:
        return max(1.0, 4 * self._load_interval)

    def _learn_pace(self, worker: Worker, load: VllmLoad) -> None:
        previous = worker.scrape
        if previous is None:
            return
        tokens = load.itl_count - previous.load.itl_count
        if tokens <= 0:
            return  # idle, or the worker restarted: keep what was learnt
        itl = (load.itl_sum - previous.load.itl_sum) / tokens
        if worker.itl_s is None:
            worker.itl_s = itl
        else:
            worker.itl_s += ITL_SMOOTHING * (itl - worker.itl_s)

    async def read_all_loads(self) -> None:
        await asyncio.gather(*(self.read_load(w) for w in self.workers if w.healthy))

    async def start(self) -> None:
        """Probes every worker once (so the first requests find them), then keeps probing."""
        await self.check_all()
        self._tasks = [
            asyncio.create_task(_every(self._interval, self.check_all), name="worker-health"),
            asyncio.create_task(_every(self._load_interval, self.read_all_loads), name="load"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []


async def _every(interval_s: float, action: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        await action()
