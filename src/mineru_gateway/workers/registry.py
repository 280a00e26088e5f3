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
`load_interval_s`. `views()` hands both to the routing policy, and to flow control (issue 13),
which asks whether a worker has room in its running batch. A worker's batch size is configured
(`batch_limit`) or learnt (`learn_batch`).

Whoever sends a request reports the attempt's outcome with one call, `report(worker, outcome)`;
the registry alone decides what that means for the worker's health.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import structlog

from mineru_gateway.cost import Cost
from mineru_gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyWorker,
    UpstreamStatusError,
    UpstreamTimeout,
)
from mineru_gateway.metrics import GatewayMetrics, WorkerGauges
from mineru_gateway.periodic import Periodic, stop_all
from mineru_gateway.routing import (
    LoadModel,
    ReportedLoad,
    RoutingPolicy,
    WorkerView,
    candidates_for,
)
from mineru_gateway.workers.group_load import GroupFull, GroupLoad, WorkerColumn
from mineru_gateway.workers.upstream import UpstreamClient
from mineru_gateway.workers.vllm_metrics import FULL_PATH, LOAD_PATH, VllmLoad, parse_vllm_load

log = structlog.get_logger("mineru_gateway.registry")

SLOWNESS_BOUNDS = (0.25, 8.0)
ITL_SMOOTHING = 0.3


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How the registry probes workers and when it takes one out of routing."""

    interval_s: float = 2.0  # between two active probes
    timeout_s: float = 2.0  # one probe: /health, then /v1/models
    eject_after: int = 3  # consecutive passive failures (5xx, dropped connections)
    slow_probes_to_eject: int = 3  # consecutive probes that only timed out


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt on a worker showed about the worker's health."""

    failure: str | None = None  # a reason label (connect_error, status_5xx, ...); None: fine
    detail: str = ""
    eject_now: bool = False  # a refused connection: no need to count

    @classmethod
    def failed(cls, reason: str, detail: str, *, eject_now: bool = False) -> Outcome:
        return cls(reason, detail, eject_now)


SUCCESS = Outcome()


@dataclass(frozen=True, slots=True)
class Reading:
    """A worker's load figures and when they were read (time.monotonic())."""

    load: VllmLoad
    at: float


@dataclass(frozen=True, slots=True)
class Scrape(Reading):
    """A reading taken into this gateway's view, with its own count at that moment (all its
    processes' where they share a `GroupLoad`)."""

    own_in_flight: int


class _BuiltView(NamedTuple):
    """A worker's last view, the reading and models it was built from (compared by identity)
    and until when its reading's freshness holds."""

    view: WorkerView
    scrape: Scrape | None
    models: dict[str, dict[str, Any]]
    until: float


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
    batch_seen: int = 0  # most requests seen running while others waited: its batch size
    draining: bool = False  # takes no new requests (a rolling restart, an operator's drain)
    load_path: str = LOAD_PATH  # FULL_PATH from a failed filtered read until an outage ends
    leased: int = 0  # leases ever given on it (read_load: the requests sent during a read)
    # With `serve --processes N`: the worker's column of every process's counts (group_load.py).
    shared: WorkerColumn | None = field(default=None, repr=False, compare=False)
    _view: _BuiltView | None = field(default=None, repr=False, compare=False)

    def publish(self) -> None:
        """This process's count and cost on the worker, for its sibling processes to see."""
        if self.shared is not None:
            self.shared.publish(self.in_flight, self.own_cost)

    def siblings_load(self) -> tuple[int, float]:
        """The sibling processes' requests on the worker and their cost (group_load.py)."""
        return (0, 0.0) if self.shared is None else self.shared.others()

    def gateway_load(self) -> tuple[int, float]:
        """The gateway's requests on the worker and their cost: this process's and its
        siblings'. Asked for every worker on every request (`view`): one call, with no
        siblings to add for a gateway of one process."""
        if self.shared is None:
            return self.in_flight, self.own_cost
        count, cost = self.shared.others()
        return self.in_flight + count, self.own_cost + cost

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def reported(self, now: float) -> ReportedLoad | None:
        if self.scrape is None:
            return None
        scrape, load = self.scrape, self.scrape.load
        age = now - scrape.at
        return ReportedLoad(load.waiting, load.running, load.kv_usage, age, scrape.own_in_flight)

    def view(
        self, now: float, slowness: float, batch_limit: int | None, load: LoadModel
    ) -> WorkerView:
        """What routing and flow control see of this worker now: its reading only while
        `load` judges it fresh (`WorkerView.reported`).

        Built once and kept while nothing it shows has changed: routing asks for every worker's
        view on every request, and building them was 3 us per worker per request (24 us with
        8 workers). The view is rebuilt when its reading crosses `load.stale_after_s` (the
        threshold routing and flow control apply, config.py): until then the reading goes in,
        from then on none.
        """
        scrape, built, routable = self.scrape, self._view, self.routable
        in_flight, cost = self.gateway_load()
        if built is not None and now < built.until and built.scrape is scrape:
            view, until = built.view, built.until
            same_models = built.models is self.models
            if (
                same_models
                and view.in_flight == in_flight
                and view.own_cost == cost
                and view.healthy == routable
                and view.slowness == slowness
                and view.batch_limit == batch_limit
            ):
                return view
            # Under load only the counts change, on every request: the same reading (its age
            # as of the last build, as above) goes into the new view.
            reported = view.reported
            models = view.models if same_models else frozenset(self.models)
        else:
            reported = load.fresh(self.reported(now))
            models = frozenset(self.models)
            until = math.inf  # no reading, or a stale one: nothing to cross
            if scrape is not None and reported is not None:
                until = scrape.at + load.stale_after_s
        view = WorkerView(
            name=self.url,
            healthy=routable,
            in_flight=in_flight,
            models=models,
            own_cost=cost,
            reported=reported,
            slowness=slowness,
            batch_limit=batch_limit,
        )
        self._view = _BuiltView(view, scrape, self.models, until)
        return view

    def describe(self, now: float) -> dict[str, Any]:
        reported = self.reported(now)
        return {
            "url": self.url,
            "state": "draining" if self.draining else "healthy" if self.healthy else "unhealthy",
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
            "batch_seen": self.batch_seen or None,
            # "filtered": the few series routing needs; "whole": the whole page (read_load)
            "load_read": "whole" if self.load_path == FULL_PATH else "filtered",
            "last_error": self.last_error,
            "last_checked": self.last_checked,
        }


class Lease:
    """A request's place on a worker, counted from `acquire` until `release()` (idempotent).

    `prefilled()` releases the prefill part of its cost at the answer's first byte.
    """

    __slots__ = ("_on_release", "cost", "prefill_done", "released", "worker")

    def __init__(self, worker: Worker, cost: Cost, on_release: Callable[[], None]) -> None:
        self.worker = worker
        self.cost = cost
        self.prefill_done = False
        self.released = False
        self._on_release = on_release
        worker.in_flight += 1
        worker.leased += 1
        worker.own_cost += cost.total
        worker.publish()

    def prefilled(self) -> None:
        """The worker sent the first byte of the answer: the prompt is no longer queued work."""
        if not self.prefill_done:
            self.prefill_done = True
            worker = self.worker
            worker.own_cost = max(0.0, worker.own_cost - self.cost.prefill)
            worker.publish()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        worker = self.worker
        worker.in_flight -= 1
        held = self.cost.hold if self.prefill_done else self.cost.total
        worker.own_cost = max(0.0, worker.own_cost - held) if worker.in_flight else 0.0
        worker.publish()
        self._on_release()


_ALONE = contextlib.nullcontext()  # `deciding` for a gateway of one process: nothing to hold


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
        shared_readings: Callable[[], Awaitable[Mapping[str, Scrape]]] | None = None,
        load: LoadModel | None = None,
        group: GroupLoad | None = None,
    ) -> None:
        """With `shared_readings`, the workers' load figures come from that (another gateway
        process's readings, siblings.py) instead of each worker's `/metrics`. `load` is the
        model routing and flow control judge the figures by (the one object given to both):
        a worker's view is kept while its figures are as fresh as that model says. With
        `group`, routing and flow control count every process's requests (group_load.py)."""
        self._load = load or LoadModel()
        self._group = group
        self._workers = {url: self._new_worker(url) for url in urls}
        self._shared_readings = shared_readings
        self._client = client
        self.policy = policy
        self.health = health or HealthPolicy()
        self._metrics = metrics or GatewayMetrics()
        self._load_interval = load_interval_s
        self._pace_weighting = pace_weighting
        self._batch_limit = batch_limit
        self._rng = rng or random.Random()
        self._loops: list[Periodic] = []
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """`listener()` runs whenever a worker may have gained room: a request ended, fresh load
        figures arrived, a worker's health or membership changed (flow control pumps on it)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # -- membership -------------------------------------------------------------------------
    @property
    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def add(self, url: str) -> Worker:
        """Adds a worker; it takes traffic after its first good probe."""
        worker = self._workers.get(url)
        if worker is None:
            worker = self._workers[url] = self._new_worker(url)
        return worker

    def _new_worker(self, url: str) -> Worker:
        if self._group is None:
            return Worker(url)
        try:
            return Worker(url, shared=self._group.worker(url))
        except GroupFull as full:
            # Routed on this process's own count plus the readings, as before the table.
            log.warning("worker_counts_not_shared", worker=url, reason=str(full))
            return Worker(url)

    def remove(self, url: str) -> None:
        """Stops routing to `url`; requests already there finish normally."""
        self._workers.pop(url, None)
        self._changed()

    def worker(self, url: str) -> Worker:
        return self._workers[url]

    def drain(self, url: str) -> Worker:
        """No new requests go to `url` (queued ones go elsewhere); those on it finish."""
        return self._set_draining(url, True)

    def undrain(self, url: str) -> Worker:
        """`url` takes requests again (once healthy)."""
        return self._set_draining(url, False)

    def _set_draining(self, url: str, draining: bool) -> Worker:
        worker = self._workers[url]
        worker.draining = draining
        log.info(
            "worker_draining" if draining else "worker_undrained",
            worker=url,
            in_flight=worker.in_flight,
            healthy=worker.healthy,
        )
        self._changed()
        return worker

    async def wait_idle(self, worker: Worker, timeout_s: float, poll_s: float = 0.05) -> bool:
        """True once nothing of this gateway's is in flight on `worker`, False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while worker.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    # -- routing --------------------------------------------------------------------------
    @property
    def shares_counts(self) -> bool:
        """Sibling processes' requests count here too (group_load.py)."""
        return self._group is not None

    def deciding(self) -> contextlib.AbstractContextManager[None]:
        """To be held from reading the views to taking the lease, so that with sibling
        processes two decisions never take the same last slot (group_load.py)."""
        return self._group.locked() if self._group is not None else _ALONE

    def views(self) -> list[WorkerView]:
        now = time.monotonic()
        slowness = self._slowness()
        load = self._load
        return [
            worker.view(
                now,
                slowness.get(worker.url, 1.0) if slowness else 1.0,
                self._batch_limit or worker.batch_seen or None,
                load,
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
            raise self.why_no_candidate(views, model)
        return self.choose_among(candidates)

    def choose_among(self, candidates: list[WorkerView]) -> Worker:
        """The routing policy's pick of `candidates` (non-empty views from `views()`)."""
        chosen = self._workers[self.policy.choose(candidates, self._rng).name]
        self._metrics.routing_decisions.inc(self.policy.name, chosen.url)
        return chosen

    def why_no_candidate(self, views: list[WorkerView], model: str | None) -> GatewayError:
        healthy = [view for view in views if view.healthy]
        if healthy and not any(view.serves(model) for view in healthy):
            served = sorted({m for view in healthy for m in view.models})
            return ModelNotFound(
                f"The model `{model}` does not exist. Served models: {', '.join(served)}.",
                param="model",
            )
        return NoHealthyWorker(
            "no healthy worker is available for this request; retry later",
            retry_after_s=self.health.interval_s,
        )

    def acquire(self, worker: Worker, cost: Cost) -> Lease:
        """Counts a request and its cost on `worker` until the lease is released."""
        return Lease(worker, cost, self._changed)

    @contextlib.contextmanager
    def lease(self, worker: Worker, cost: Cost) -> Iterator[Lease]:
        """`acquire` for the block's duration, released whatever happens."""
        lease = self.acquire(worker, cost)
        try:
            yield lease
        finally:
            lease.release()

    # -- passive health -------------------------------------------------------------------
    def report(self, worker: Worker, outcome: Outcome) -> None:
        """How an attempt on `worker` went. A failure (a refused connection, a 5xx, a dropped
        stream) counts towards ejection; `eject_now` ejects without counting."""
        if outcome.failure is None:
            worker.failures = 0
            return
        worker.failures += 1
        worker.last_error = outcome.detail
        if worker.healthy and (outcome.eject_now or worker.failures >= self.health.eject_after):
            worker.healthy = False
            self._metrics.ejections.inc(worker.url, outcome.failure)
            log.warning(
                "worker_ejected", worker=worker.url, reason=outcome.failure, error=outcome.detail
            )

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
        timeout = self.health.timeout_s
        try:
            await self._client.get_ok(f"{worker.url}/health", timeout)
            listing = await self._client.get_json(f"{worker.url}/v1/models", timeout)
            models = {card["id"]: card for card in listing["data"]}
        except UpstreamTimeout as exc:
            worker.slow_probes += 1
            if worker.healthy and worker.slow_probes < self.health.slow_probes_to_eject:
                worker.last_error = str(exc)
                log.info("worker_probe_slow", worker=worker.url, error=str(exc))
            else:
                self._set_health(worker, False, str(exc))
        except GatewayError as failed:
            self._set_health(worker, False, str(failed))
        except (KeyError, TypeError) as bad:
            self._set_health(worker, False, f"unexpected /v1/models answer: {bad!r}")
        else:
            worker.models = models
            worker.failures = 0
            worker.slow_probes = 0
            self._set_health(worker, True, None)
        worker.last_checked = time.time()

    def _set_health(self, worker: Worker, healthy: bool, error: str | None) -> None:
        changed = healthy != worker.healthy
        if changed:
            event = "worker_healthy" if healthy else "worker_unhealthy"
            log.info(event, worker=worker.url, error=error)
            if healthy:
                # Back after an outage: maybe another vLLM (a restart with one API server
                # where there were several), so its filtered read is tried again.
                worker.load_path = LOAD_PATH
        worker.healthy = healthy
        if error is not None:
            worker.last_error = error
        elif changed:  # healthy again: the error from before (a start-up refusal) is past
            worker.last_error = None
        if changed:
            self._changed()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(worker) for worker in self.workers))

    async def read_load(self, worker: Worker) -> None:
        own, leased, path = worker.in_flight, worker.leased, worker.load_path
        siblings = worker.siblings_load()[0]
        why = "the filtered read has no load series"
        try:
            text = await self._client.get_ok(worker.url + path, self._load_timeout)
        except UpstreamStatusError as error:
            if path == FULL_PATH:
                return
            text, why = b"", str(error)
        except GatewayError:
            return  # the figures age; past `stale_after_s` routing ignores them
        load = parse_vllm_load(text)
        if load is not None:
            # The worker may have counted the requests sent while the read was under way: they
            # are ours too. Counted as someone else's, each would stand as a phantom request on
            # the worker until the next read, and could send a request to a worker whose batch
            # is full (benchmarks/results/stream_events.md). Ours that ended meanwhile stay
            # counted: that can only hide someone else's request, never make up one.
            own += worker.leased - leased
            # The same for the sibling processes' (whose sends during the read are not known
            # one by one): the larger of their counts before and after it.
            own += max(siblings, worker.siblings_load()[0])
            self._take(worker, Reading(load, time.monotonic()), own)
        elif path != FULL_PATH:
            # vLLM with several API servers (a multiprocess registry knows no names), or a
            # server without vLLM's `/metrics/` mount: the whole page from now on.
            worker.load_path = FULL_PATH
            log.info("worker_load_unfiltered", worker=worker.url, reason=why)
            await self.read_load(worker)

    def _take(self, worker: Worker, reading: Reading, own: int) -> None:
        if worker.scrape is not None and worker.scrape.at >= reading.at:
            return  # a reading already taken (shared readings are fetched more than once)
        self._learn_pace(worker, reading.load)
        learn_batch(worker, reading.load)
        worker.scrape = Scrape(reading.load, reading.at, own)

    def readings(self, max_age_s: float) -> dict[str, Scrape]:
        """The latest load figures of each worker read within `max_age_s`, with the gateway's
        count when they were read, for the gateway's other processes (time.monotonic() is one
        clock for every process of a host)."""
        oldest = time.monotonic() - max_age_s
        return {
            worker.url: worker.scrape
            for worker in self.workers
            if worker.scrape is not None and worker.scrape.at >= oldest
        }

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
        if self._shared_readings is not None:
            readings = await self._shared_readings()
            for worker in self.workers:
                if worker.healthy and (reading := readings.get(worker.url)) is not None:
                    # The reader's count at its read is the whole gateway's where the worker's
                    # counts are shared (a full table leaves a worker out: then this process's
                    # own count is the best there is, as the reader's is for the reader).
                    shared = worker.shared is not None
                    self._take(
                        worker, reading, reading.own_in_flight if shared else worker.in_flight
                    )
        else:
            await asyncio.gather(*(self.read_load(w) for w in self.workers if w.healthy))
        self._changed()

    async def start(self) -> None:
        """Probes every worker once (so the first requests find them), then keeps probing."""
        await self.check_all()
        self._loops = [
            Periodic("worker-health", self.health.interval_s, self.check_all),
            Periodic("load", self._load_interval, self.read_all_loads),
        ]
        for loop in self._loops:
            loop.start()

    async def stop(self) -> None:
        await stop_all(self._loops)
        self._loops = []


def learn_batch(worker: Worker, load: VllmLoad) -> None:
    """A worker's batch size from its own figures (before `worker.scrape` becomes `load`).

    A snapshot's `waiting` proves nothing by itself: new requests wait for the next engine step
    at any load, and a burst of long prompts waits on the step's token budget while the batch
    fills. A plateau does: the same number running in two readings in a row, with requests
    waiting in both, is the batch's limit (its `max_num_seqs`, or what its KV cache holds). The
    most seen is kept; a worker seen running more than that had been caught short of it, and
    since flow control lets a headroom more through, the estimate grows until requests wait.
    """
    running = round(load.running)
    previous = worker.scrape.load if worker.scrape is not None else None
    plateau = (
        previous is not None
        and load.waiting > 0
        and previous.waiting > 0
        and round(previous.running) == running
    )
    if plateau or (worker.batch_seen and running > worker.batch_seen):
        worker.batch_seen = max(worker.batch_seen, running)
